"""A model's gate policy: what is measured (`evaluate`), against what (`baseline`) and how it is
judged (`gate`), as one digest.

Two recipes with the same policy digest judge a candidate the same way, whatever they optimize or
serve. A registered model pins the digest of the policy it is judged under (kiln.pipeline.model_registry):
a run under any other policy cannot mark a version of it passed or move its aliases, and CI judges a
pull request's recipe under the base branch's policy (`kiln run --policy-from`).
"""

from __future__ import annotations

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
