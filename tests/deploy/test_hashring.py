"""The weighted consistent-hash ring: shares match weights, weight changes move few keys."""

from __future__ import annotations

import pytest

from kiln.deploy.hashring import WeightedRing

KEYS = [f"session-{i}" for i in range(20_000)]


@pytest.mark.parametrize("weight", [5, 25, 50, 90])
def test_share_of_keys_matches_weight(weight):
    ring = WeightedRing(4096, weight)
    share = sum(ring.arm_for(k) == "canary" for k in KEYS) / len(KEYS)
    # Ring share noise ~sqrt(w(1-w)/4096) plus sampling noise of 20k keys: both well under 2 points.
    assert abs(share * 100 - weight) < 2.0
    assert abs(ring.canary_share() * 100 - weight) < 1.5


def test_zero_and_full_weight_are_exact():
    assert {WeightedRing(64, 0).arm_for(k) for k in KEYS[:500]} == {"stable"}
    assert {WeightedRing(64, 100).arm_for(k) for k in KEYS[:500]} == {"canary"}


def test_raising_the_weight_moves_about_delta_and_only_towards_the_canary():
    ring = WeightedRing(4096, 25)
    before = {k: ring.arm_for(k) for k in KEYS}
    ring.set_weight(50)
    after = {k: ring.arm_for(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == "stable" and after[k] == "canary" for k in moved)  # monotone
    assert 0.22 < len(moved) / len(KEYS) < 0.28  # |delta w| = 25 points, the minimum possible


def test_lowering_the_weight_is_the_mirror_image():
    ring = WeightedRing(4096, 50)
    before = {k: ring.arm_for(k) for k in KEYS}
    ring.set_weight(5)
    moved = [k for k in KEYS if before[k] != ring.arm_for(k)]
    assert all(before[k] == "canary" for k in moved)
    assert 0.42 < len(moved) / len(KEYS) < 0.48


def test_same_key_same_arm_across_rings():
    a, b = WeightedRing(4096, 30), WeightedRing(4096, 30)
    assert all(a.arm_for(k) == b.arm_for(k) for k in KEYS[:2000])  # no process-seeded hash()


def test_bad_weight_rejected():
    with pytest.raises(ValueError, match="between 0 and 100"):
        WeightedRing(16, 101)
