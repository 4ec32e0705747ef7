"""`kiln policy`: a recipe's gate policy, its digest, and the one a registered model pins.
Registered on the one `kiln` app (cli_app.py) when `cli.py` imports it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.core.errors import ExitCode
from kiln.pipeline.cli.app import RecipeArg, SetOpt, app, console, typer_app

policy_app = typer_app(
                         help="A model's gate policy: show a recipe's, compare two, pin one on a registered model.")
app.add_typer(policy_app, name="policy")


@policy_app.command("show")
def show(recipe: RecipeArg, set_: SetOpt = []) -> None:  # noqa: B006 - typer reads defaults
    """Print a recipe's policy (gate, evaluate, baseline, defaults filled in) and its digest."""
    from kiln.pipeline.recipe.policy import policy, policy_digest
    from kiln.pipeline.recipe.schema import load_recipe

    r = load_recipe(recipe, set_)
    console.print(f"policy {policy_digest(r)}", markup=False)
    print(json.dumps(policy(r), indent=2, sort_keys=True))


# Exit code of `kiln policy diff` when the new policy is looser than the old, or changed in a way kiln
# cannot rank: the gate on a policy change failed until someone approves it (docs/ci.md).
DIFF_NEEDS_APPROVAL = ExitCode.GATE_FAILED
PolicyFromOpt = Annotated[Path | None, typer.Option(
    "--policy-from", metavar="RECIPE", help="judge under this recipe's policy (its gate, evaluate and baseline "
                                            "sections): CI passes the base branch's copy of the recipe")]


@policy_app.command("diff")
def diff(old: Annotated[Path, typer.Argument(help="the recipe before (CI: the base branch's copy)")],
         new: Annotated[Path, typer.Argument(help="the recipe after (CI: the pull request's)")],
         as_json: Annotated[bool, typer.Option("--json", help="print the differences as JSON")] = False) -> None:
    """Compare two recipes' policies field by field: each difference is stricter, looser or changed
    (unknown which way). Exit 0 when identical or only stricter, 1 when anything is looser or changed."""
    from kiln.pipeline.recipe.policy import NEEDS_APPROVAL, overall, policy, policy_changes, policy_digest
    from kiln.pipeline.recipe.schema import load_recipe

    a, b = load_recipe(old), load_recipe(new)
    changes = policy_changes(policy(a), policy(b))
    outcome = overall(changes)
    if as_json:
        print(json.dumps({"old": {"recipe": str(old), "sha256": policy_digest(a)},
                          "new": {"recipe": str(new), "sha256": policy_digest(b)}, "outcome": outcome,
                          "needs_approval": outcome in NEEDS_APPROVAL, "changes": [c.to_dict() for c in changes]},
                         indent=2))
    else:
        console.print(f"policy {policy_digest(a)[:12]} ({old}) -> {policy_digest(b)[:12]} ({new})", markup=False)
        for c in changes:
            console.print(f"  {c.direction:<8} {c.path}: {_shown(c.old)} -> {_shown(c.new)}", markup=False,
                          soft_wrap=True)
        console.print(f"{outcome}" + (": needs approval" if outcome in NEEDS_APPROVAL else ""), markup=False)
    if outcome in NEEDS_APPROVAL:
        raise typer.Exit(int(DIFF_NEEDS_APPROVAL))


def _shown(value: object) -> str:
    return "(none)" if value is None else json.dumps(value, sort_keys=True)


def judged_recipe(recipe: Path, set_: list[str], policy_from: Path | None) -> Any:
    """The recipe `kiln run` and `kiln validate` work on: RECIPE with `--set`, judged under the policy of
    `policy_from` when given. The overrides of policy fields (gate.*, evaluate.*, baseline.*) apply to
    that policy: the command line still wins over both files."""
    from kiln.core.errors import BadInput
    from kiln.pipeline.recipe.kv_cache_rule import unjudged_kv_cache
    from kiln.pipeline.recipe.policy import policy_digest, policy_overrides, with_policy_of
    from kiln.pipeline.recipe.schema import load_recipe, unguarded_speculation

    r = load_recipe(recipe, set_)
    if policy_from is None:
        return r
    judged = with_policy_of(r, load_recipe(policy_from, policy_overrides(set_)))
    # the pinned policy must hold the recipe's speculation to its claim and judge its KV cache at length
    if why := unguarded_speculation(judged) or unjudged_kv_cache(judged):
        raise BadInput(f"{recipe} judged under the policy of {policy_from}: {why} (in {policy_from})")
    own, used = policy_digest(r), policy_digest(judged)
    same = f", the same as {recipe}'s)" if own == used else f"); {recipe}'s own policy {own[:12]} is not used"
    console.print(f"judged under the policy of {policy_from} (policy {used[:12]}{same}", markup=False, soft_wrap=True)
    return judged


@policy_app.command("set")
def set_policy(name: Annotated[str, typer.Argument(help="the registered model whose policy to set")], recipe: RecipeArg, set_: SetOpt = [],  # noqa: B006
               reason: Annotated[str | None, typer.Option(help="why the model's policy changes (required; recorded)")] = None,
               tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI (default: "
                                                                      "$MLFLOW_TRACKING_URI, else mlflow.db in kiln's home)")] = None) -> None:
    """Pin RECIPE's policy on registered model NAME: from now on only runs judged under it can pass a version.

    Signed with kiln's key and recorded with who and why in the model's policy history. Versions judged
    under the old policy no longer verify (`kiln verify`): judge them again under the new one."""
    from kiln.core.errors import BadInput
    from kiln.pipeline.tracking import registry as model_registry
    from kiln.pipeline.recipe.policy import policy_digest
    from kiln.pipeline.recipe.schema import load_recipe
    from kiln.pipeline.tracking.runs import open_client

    if not (reason or "").strip():
        raise BadInput("--reason: say why the policy of a registered model changes; it is recorded with who set it.")
    digest = policy_digest(load_recipe(recipe, set_))
    client = open_client(tracking_uri)
    model_registry.ensure_model(client, name)
    before = _pinned(client, name)
    pin = model_registry.pin_policy(client, name, digest, reason.strip())
    console.print(f"{name}: policy {before[:12] if before else '(none)'} -> {digest[:12]}, set by {pin.set_by}",
                  soft_wrap=True, markup=False)


def _pinned(client: object, name: str) -> str | None:
    """The digest pinned now; a pin that does not verify is replaced, and said so."""
    from kiln.core.errors import NotVerified
    from kiln.pipeline.tracking import registry as model_registry

    try:
        pin = model_registry.pinned_policy(client, name)
    except NotVerified as e:
        console.print(f"! {e}: replacing it", soft_wrap=True, markup=False)
        return None
    return pin.policy_sha256 if pin else None
