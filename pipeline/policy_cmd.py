"""`kiln policy`: a recipe's gate policy, its digest, and the one a registered model pins.
Registered on the one `kiln` app (cli_app.py) when `cli.py` imports it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.core.errors import ExitCode
from kiln.pipeline.cli_app import RecipeArg, SetOpt, app, console

policy_app = typer.Typer(no_args_is_help=True,
                         help="A model's gate policy: show a recipe's, compare two, pin one on a registered model.")
app.add_typer(policy_app, name="policy")


@policy_app.command("show")
def show(recipe: RecipeArg, set_: SetOpt = []) -> None:  # noqa: B006 - typer reads defaults
    """Print a recipe's policy (gate, evaluate, baseline, defaults filled in) and its digest."""
    from kiln.pipeline.policy import policy, policy_digest
    from kiln.pipeline.recipe import load_recipe

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
    from kiln.pipeline.policy import NEEDS_APPROVAL, overall, policy, policy_changes, policy_digest
    from kiln.pipeline.recipe import load_recipe

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
    from kiln.pipeline.policy import policy_digest, policy_overrides, with_policy_of
    from kiln.pipeline.recipe import load_recipe

    r = load_recipe(recipe, set_)
    if policy_from is None:
        return r
    judged = with_policy_of(r, load_recipe(policy_from, policy_overrides(set_)))
    own, used = policy_digest(r), policy_digest(judged)
    same = f", the same as {recipe}'s)" if own == used else f"); {recipe}'s own policy {own[:12]} is not used"
    console.print(f"judged under the policy of {policy_from} (policy {used[:12]}{same}", markup=False, soft_wrap=True)
    return judged
