"""`kiln policy`: a recipe's gate policy, its digest, and the one a registered model pins.
Registered on the one `kiln` app (cli_app.py) when `cli.py` imports it."""

from __future__ import annotations

import json

import typer

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
