"""What a recipe needs from the runner beyond kiln itself, decided by kiln on the validated recipe.

ci/action.yml runs it after installing kiln, with the recipe and its overrides, and appends what it
prints to $GITHUB_OUTPUT:

    python ci/needs.py RECIPE [--set key=value]... [--policy-from BASE_RECIPE]

With `--policy-from` (a pull request's recipe judged under the base branch's policy) the recipe is
read as `kiln run --policy-from` reads it: the base's evaluate and baseline sections can need the demo
data or llama.cpp where the pull request's own do not.

- `llama-cpp`: true when an arm quantizes to GGUF (`optimize.method: gguf`) or is served by llama.cpp
  (`engine.backend: llama_cpp`, the baseline's engine included). A champion candidate is served as
  the registry recorded it, which the recipe does not say: it is not counted.
- `llama-cpp-dir`: where kiln looks for this machine's build ($KILN_CACHE/llama.cpp/VERSION-PATCH-CPU),
  the folder the action caches.
- `llama-cpp-key`: that folder's name (llama.cpp version, kiln's patch id, a hash of the CPU's flags)
  and a hash of everything else the build compiles from (the sdist's digest, the patch's text, the
  cmake flags and targets): a change to any of them is a new cache entry.
- `demo-data`: true when the recipe reads kiln's demo data ("demo" texts or prompts, a shipped
  lm-eval task) and the cache does not hold it yet: its first use downloads a Debian package
  (`apt-get download r-cran-janeaustenr`), so the action refreshes apt's package lists first.

A recipe that does not validate prints every value false: `kiln validate`, the step after, reports it.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from typing import Any

# Top-level sections whose strings are names, not data sources ("demo" is also the demo's name).
NOT_DATA = ("name", "description", "tracking", "model", "deploy", "runner")


def needs_llama_cpp(recipe: Any) -> bool:
    for _, arm in recipe.arms():
        engines = [arm.engine, arm.baseline.engine]
        if arm.optimize is not None and arm.optimize.method == "gguf":
            return True
        if any(e is not None and e.backend == "llama_cpp" for e in engines):
            return True
    return False


def uses_demo_data(recipe: Any) -> bool:
    from kiln.evaluate.tasks import SHIPPED

    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return node == "demo"

    raw = recipe.model_dump(mode="json")
    lmeval = recipe.evaluate.quality.lmeval
    return (any(walk(v) for k, v in raw.items() if k not in NOT_DATA)
            or (lmeval is not None and any(t in SHIPPED for t in lmeval.tasks)))


def demo_data_cached() -> bool:
    from kiln.pipeline.demo import data as demo_data
    from kiln.core.home import kiln_cache

    return (kiln_cache() / "data" / demo_data.DATA_VERSION / "manifest.json").is_file()


def llama_cpp_key() -> str:
    from kiln.core import llama_cpp_build as b

    recipe = "\n".join([b.SDIST_SHA256, b.PATCH_FILE, b.PATCH_FROM, b.PATCH_TO, *b.CMAKE_FLAGS, *b.TARGETS,
                        b.LIBRARY, b.BINDING, *b.CONVERTER])
    return f"{b.install_dir().name}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def outputs(recipe_path: str, overrides: list[str], policy_from: str | None = None) -> dict[str, str]:
    from kiln.core import llama_cpp_build
    from kiln.core.errors import KilnError
    from kiln.pipeline.recipe.policy import policy_overrides, with_policy_of
    from kiln.pipeline.recipe.schema import load_recipe

    try:
        recipe = load_recipe(recipe_path, overrides)
        if policy_from:
            recipe = with_policy_of(recipe, load_recipe(policy_from, policy_overrides(overrides)))
    except KilnError as e:
        print(f"kiln: {recipe_path} does not validate; `kiln validate` reports it ({type(e).__name__})",
              file=sys.stderr)
        return {"llama-cpp": "false", "llama-cpp-dir": "", "llama-cpp-key": "", "demo-data": "false"}
    llama = needs_llama_cpp(recipe)
    demo = uses_demo_data(recipe) and not demo_data_cached()
    return {"llama-cpp": str(llama).lower(),
            "llama-cpp-dir": str(llama_cpp_build.install_dir()) if llama else "",
            "llama-cpp-key": llama_cpp_key() if llama else "",
            "demo-data": str(demo).lower()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ci/needs.py", description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--policy-from", default="", metavar="BASE_RECIPE", help="judged under this recipe's policy")
    args = parser.parse_args(argv)
    for name, value in outputs(args.recipe, args.sets, args.policy_from).items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
