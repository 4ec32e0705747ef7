"""A model's gate policy: what is measured (`evaluate`), against what (`baseline`) and how it is
judged (`gate`), as one digest.

Two recipes with the same policy digest judge a candidate the same way, whatever they optimize or
serve. A registered model pins the digest of the policy it is judged under (kiln.pipeline.tracking.registry):
a run under any other policy cannot mark a version of it passed or move its aliases, and CI judges a
pull request's recipe under the base branch's policy (`kiln run --policy-from`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.files import hash_of

SECTIONS = ("gate", "evaluate", "baseline")


def policy(recipe: Any) -> dict[str, Any]:
    """The recipe's policy sections, resolved (defaults filled in), as JSON-able data."""
    dumped = recipe.model_dump(mode="json")
    return {k: dumped[k] for k in SECTIONS}


def policy_digest(recipe: Any) -> str:
    return hash_of(policy(recipe))


def with_policy_of(recipe: Any, other: Any) -> Any:
    """`recipe` judged under `other`'s policy: `other`'s gate, evaluate and baseline sections in place
    of its own, everything else (model, candidates, engines, tracking) its own."""
    return recipe.model_copy(update={k: getattr(other, k) for k in SECTIONS})


def policy_overrides(overrides: list[str]) -> list[str]:
    """The `--set key=value` overrides of policy fields (gate.*, evaluate.*, baseline.*): under
    `--policy-from` they apply to the policy the recipe is judged under, so the command line still wins."""
    return [o for o in overrides if o.split("=", 1)[0].split(".", 1)[0].strip() in SECTIONS]


# --- comparing two policies (`kiln policy diff`, CI's review of a pull request's recipe) -------------
#
# Which way a change moves the bar, for the fields whose direction is known; any other change is
# "changed": kiln cannot tell which way it goes, so CI treats it like a loosening (a reviewer decides).
STRICTER, LOOSER, CHANGED = "stricter", "looser", "changed"
NEEDS_APPROVAL = (LOOSER, CHANGED)
# In gate.*: a higher value lets more through (a margin, an upper bound, a contention guard that
# turns a noisy measurement Inconclusive), or less (a lower bound, the confidence level).
_GATE_HIGHER_LOOSER = frozenset({"margin", "max", "max_ratio", "max_bytes", "max_cpu_pressure", "max_cpu_steal"})
_GATE_HIGHER_STRICTER = frozenset({"min", "min_ratio", "confidence"})
# A guard that null switches off: dropping it is looser, adding it stricter.
_GATE_NULL_IS_OFF = frozenset({"max_cpu_pressure", "max_cpu_steal"})
# In evaluate.*: how much is measured. Fewer documents, prompts, tokens, rounds or seconds is looser.
_EVALUATE_AMOUNTS = frozenset({"max_documents", "seq_len", "num_prompts", "max_new_tokens", "repeats", "limit",
                               "duration_s", "max_requests", "concurrency"})
# Amounts whose null means "all of it" (every document of a task, no cap on requests).
_EVALUATE_NULL_IS_ALL = frozenset({"limit", "max_requests"})


@dataclass(frozen=True)
class PolicyChange:
    """One difference between two policies: the field's path, both values (None: absent) and which way."""

    path: str
    old: Any
    new: Any
    direction: str  # STRICTER, LOOSER or CHANGED

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "old": self.old, "new": self.new, "direction": self.direction}


def policy_changes(old: dict[str, Any], new: dict[str, Any]) -> list[PolicyChange]:
    """Every difference between two policies (`policy()` of two recipes), field path by field path.

    Gate checks are matched by kind and metric, not by position: reordering them changes nothing, a
    check removed is looser and one added stricter."""
    return [_classify(path, a, b) for path, a, b in _differences(_keyed(old), _keyed(new), "")]


def overall(changes: list[PolicyChange]) -> str:
    """"identical", or the weakest direction among the changes: looser, then changed, then stricter."""
    directions = {c.direction for c in changes}
    return next((d for d in (LOOSER, CHANGED, STRICTER) if d in directions), "identical")


def _keyed(p: dict[str, Any]) -> dict[str, Any]:
    """The policy with gate.checks as a mapping `kind:metric` (plus #2, #3 for repeats) -> check."""
    gate = dict(p.get("gate") or {})
    checks: dict[str, Any] = {}
    for check in gate.get("checks") or []:
        base = f"{check.get('kind')}:{check.get('metric')}"
        key, n = base, 1
        while key in checks:
            n += 1
            key = f"{base}#{n}"
        checks[key] = check
    gate["checks"] = checks
    return {**p, "gate": gate}


def _differences(old: Any, new: Any, path: str) -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in [*old, *(k for k in new if k not in old)]:
            where = f"{path}[{key}]" if path == "gate.checks" else f"{path}.{key}" if path else key
            found += _differences(old.get(key), new.get(key), where)
        return found
    return [] if old == new else [(path, old, new)]


def _classify(path: str, old: Any, new: Any) -> PolicyChange:
    return PolicyChange(path, old, new, _direction(path, old, new))


def _direction(path: str, old: Any, new: Any) -> str:
    section, field = path.split(".", 1)[0], path.rsplit(".", 1)[-1]
    if path.startswith("gate.checks[") and "." not in path.split("]", 1)[1]:
        return LOOSER if new is None else STRICTER if old is None else CHANGED  # a whole check gone or added
    if section == "gate" and field == "on_inconclusive":
        return LOOSER if new == "pass" else STRICTER
    if section == "gate" and field in _GATE_HIGHER_LOOSER | _GATE_HIGHER_STRICTER:
        if old is None or new is None:  # a guard switched on or off; else another bound, same field name
            return (STRICTER if old is None else LOOSER) if field in _GATE_NULL_IS_OFF else CHANGED
        if not _numbers(old, new):
            return CHANGED
        higher = LOOSER if field in _GATE_HIGHER_LOOSER else STRICTER
        return higher if new > old else _opposite(higher)
    if section == "evaluate":
        return _evaluate_direction(field, old, new)
    return CHANGED


def _evaluate_direction(field: str, old: Any, new: Any) -> str:
    if isinstance(old, dict) != isinstance(new, dict) and None in (old, new):  # a stage added or dropped
        return STRICTER if old is None else LOOSER
    if isinstance(old, bool) and isinstance(new, bool):  # a measurement switched on or off (agreement)
        return STRICTER if new else LOOSER
    if field in _EVALUATE_AMOUNTS:
        if field in _EVALUATE_NULL_IS_ALL and None in (old, new):
            return STRICTER if new is None else LOOSER
        if _numbers(old, new):
            return STRICTER if new > old else LOOSER
    return CHANGED  # a data file, a task list, a workload shape: which way is unknown


def _opposite(direction: str) -> str:
    return LOOSER if direction == STRICTER else STRICTER


def _numbers(*values: Any) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
