"""The quality-eval registry: every eval kiln ships names the metrics it records, and each is declared
(kiln.core.metrics) with its direction and as measured by that eval's recipe section, so `kiln validate`
and the gate find it. tests/pipeline/test_quality_eval_plugin.py registers a toy eval and runs it."""

from kiln.core.metrics import METRICS
from kiln.evaluate.quality.base import QUALITY_EVALS


def test_the_shipped_evals_in_the_order_the_recipe_lists_them():
    assert QUALITY_EVALS.names() == ["perplexity", "agreement", "lmeval", "served"]


def test_every_metric_an_eval_names_is_declared_as_measured_by_its_section():
    for name in QUALITY_EVALS.names():
        plugin = QUALITY_EVALS.get(name)
        assert plugin.metrics, name
        for metric in plugin.metrics:
            assert metric in METRICS, f"{name}: {metric} is not declared in kiln.core.metrics"
            declared = METRICS[metric]
            assert declared.kind == "quality" and declared.measured_by == f"evaluate.quality.{name}", declared
