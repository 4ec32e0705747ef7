"""Capacity plans: replicas from goodput and headroom, monthly cost, clear errors."""

from __future__ import annotations

import pytest
from rich.console import Console

from kiln.evaluate.capacity import plan_capacity
from kiln.core.errors import BadInput


def test_replicas_and_cost():
    plan = plan_capacity(target_rps=100, goodput_per_replica=12, headroom=0.2, price_per_hour=3.0)
    assert plan.replicas == 11  # 100 / (12 * 0.8) = 10.4 -> 11
    assert plan.cost_per_month == pytest.approx(11 * 3.0 * 730)
    assert plan.utilization == pytest.approx(100 / (11 * 12))


def test_exact_fit_is_not_rounded_up_by_float_noise():
    assert plan_capacity(10, 5, headroom=0.2).replicas == 3  # 10 / 4 = 2.5 -> 3
    assert plan_capacity(8, 5, headroom=0.2).replicas == 2  # 8 / 4 = 2 exactly
    assert plan_capacity(0.1, 50, headroom=0).replicas == 1
    assert plan_capacity(1, 1, headroom=0).cost_per_month is None


def test_table_renders():
    plan = plan_capacity(100, 12, 0.2, 3.0)
    console = Console(record=True, width=100)
    console.print(plan.table())
    text = console.export_text()
    assert "replicas" in text and "11" in text and "$24,090" in text
    assert "cost per month" in plan.text()


def test_bad_input_names_every_problem():
    with pytest.raises(BadInput) as e:
        plan_capacity(0, 0, headroom=1.5)
    assert len(e.value.problems) == 3 and "goodput_per_replica" in str(e.value)
