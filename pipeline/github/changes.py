"""Which recipes a pull request touches: the job matrix of kiln's GitHub workflow.

A recipe runs when
- the recipe file itself changed;
- a file or folder it points to changed: its model checkpoint, calibration text, task files — any
  string in the recipe that names an existing path inside the repository, relative to the
  repository root or to the recipe's folder;
- a file behind such a path changed: the target of a symlink at or under it (a model folder whose
  model.safetensors links to weights/v1.safetensors), or the Python files beside a task YAML that
  names `!function module.fn` (lm-eval imports them from the YAML's folder);
- a file matching one of `run_all` changed (a new pin in constraints.txt can move every number);
- there is no base commit (a manual run): then every recipe runs.

`removed_recipes` lists the recipes the change deletes (a rename is a deletion and a new recipe): a
model whose recipe is gone is no longer gated, so the workflow asks for the same approval as for a
looser policy.

The runner kind comes from the recipe: a top-level `runner: cpu|gpu` wins; otherwise an engine
that needs CUDA (`engine.backend` tensorrt_llm, vllm, sglang) or any `device: cuda…` means gpu.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kiln.core.errors import BadInput
from kiln.pipeline.github.actions import in_github_actions, output_line

GPU_BACKENDS = frozenset({"tensorrt_llm", "vllm", "sglang"})
RUNNERS = ("cpu", "gpu")


@dataclass
class ChangedRecipe:
    recipe: str  # repository-relative, POSIX
    runner: str  # "cpu" or "gpu"
    reasons: list[str]

    def as_dict(self) -> dict[str, str]:
        return {"recipe": self.recipe, "runner": self.runner, "reason": "; ".join(self.reasons)}


def changed_recipes(base_sha: str | None, head_sha: str, recipes_glob: str, repo: Path = Path("."),
                    run_all: Sequence[str] = ()) -> list[ChangedRecipe]:
    """Recipes (matching `recipes_glob` in the checkout of `head_sha`) that the change base...head touches."""
    repo = Path(repo).resolve()
    if not recipes_glob or Path(recipes_glob).is_absolute():
        raise BadInput(f"recipes glob {recipes_glob!r}: give a pattern relative to the repository root, "
                       "e.g. 'recipes/**/*.yaml'.")
    # Tracked files only: a second checkout (the workflow puts kiln's own under .kiln/) is not the PR's.
    tracked = set(_git(repo, "ls-files", "-z").split("\0"))
    recipes = sorted(r for r in (p.relative_to(repo).as_posix() for p in repo.glob(recipes_glob)) if r in tracked)
    if not base_sha or set(base_sha) == {"0"}:
        return [ChangedRecipe(r, runner_of(repo / r), ["no base commit: every recipe runs"]) for r in recipes]
    changed = _git_changed(repo, base_sha, head_sha)
    forced = next((f for f in changed if any(fnmatch.fnmatchcase(f, g) for g in run_all)), None)
    found = []
    for r in recipes:
        reasons = [f"{forced} changed"] if forced else []
        if r in changed:
            reasons.append("recipe changed")
        reasons += [f"{ref} ({key}) changed" for key, ref in referenced_paths(repo, r)
                    if any(f == ref or f.startswith(ref + "/") for f in changed)]
        if reasons:
            found.append(ChangedRecipe(r, runner_of(repo / r), reasons))
    return found


def removed_recipes(base_sha: str | None, head_sha: str, recipes_glob: str, repo: Path = Path(".")) -> list[str]:
    """Recipes (matching `recipes_glob` on the base commit) that the change base...head deletes or renames."""
    if not base_sha or set(base_sha) == {"0"}:
        return []
    pattern = _glob_regex(recipes_glob)
    gone = _git(Path(repo), "diff", "--name-only", "--no-renames", "--diff-filter=D", "-z", f"{base_sha}...{head_sha}")
    return sorted(f for f in gone.split("\0") if f and pattern.fullmatch(f))


def _glob_regex(glob: str) -> re.Pattern[str]:
    """`glob` as Path.glob reads it (`**/` is any number of folders), for paths that no longer exist."""
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(glob[i], re.escape(glob[i]))
            i += 1
    return re.compile(out)


def runner_of(recipe: Path) -> str:
    data = _load(recipe)
    if not isinstance(data, dict):
        return "cpu"  # not a mapping: `kiln validate` will say what is wrong with it
    if "runner" in data:
        if data["runner"] not in RUNNERS:
            raise BadInput(f"{recipe}: runner: {data['runner']!r} is not one of {', '.join(RUNNERS)}; "
                           "set `runner: gpu` for recipes that need a GPU runner, or remove the key.")
        return data["runner"]
    engine = data.get("engine")
    if isinstance(engine, dict) and engine.get("backend") in GPU_BACKENDS:
        return "gpu"
    if any(key.rsplit(".", 1)[-1] == "device" and value.startswith("cuda") for key, value in _strings(data)):
        return "gpu"
    return "cpu"


def referenced_paths(repo: Path, recipe: str) -> list[tuple[str, str]]:
    """(recipe key, repository-relative path) for every string in the recipe naming a path in the repo,
    and for what that path reaches: the targets of symlinks at or under it, and a task YAML's code."""
    repo = Path(repo).resolve()
    found = set()
    for key, value in _strings(_load(repo / recipe)):
        if "://" in value or "\n" in value or len(value) > 1024 or value.strip() in ("", ".", "./"):
            continue
        for base in (repo / recipe).parent, repo:
            p = Path(os.path.normpath(base / value))  # lexical: a symlink here is a path of its own
            if p != repo and p.is_relative_to(repo) and p.exists():
                found |= {(key + how, ref) for how, ref in _reached(repo, p)}
                break
    return sorted(found)


def _reached(repo: Path, path: Path) -> Iterator[tuple[str, str]]:
    """(how, repository-relative path) for `path` itself and what a change behind it would alter: each
    symlink's target inside the repository (git records a link, not the bytes behind it, so a PR that
    rewrites weights/v1.safetensors changes nothing under a model folder linking to it), and beside a
    task YAML whose config names `!function module.fn`, the Python files of its folder (lm-eval imports
    them from there)."""
    seen: set[Path] = set()
    todo = [(path, "")]
    while todo:
        p, how = todo.pop()
        if p in seen or not p.is_relative_to(repo):
            continue
        seen.add(p)
        yield how, p.relative_to(repo).as_posix()
        links = [p] if p.is_symlink() else [Path(d, n) for d, dirs, files in os.walk(p) for n in dirs + files
                                            if Path(d, n).is_symlink()]
        for link in links:
            todo.append((link.resolve(), f" via {link.relative_to(repo).as_posix()}"))
        if p.is_file() and p.suffix in (".yaml", ".yml") and _names_task_code(p):
            todo += [(code, f" via {p.relative_to(repo).as_posix()}'s task code") for code in p.parent.glob("*.py")]


def _names_task_code(task: Path) -> bool:
    """Whether an lm-eval task YAML refers to Python (`!function utils.process_docs`)."""
    try:
        return "!function" in task.read_text(errors="replace")
    except OSError:
        return False


def _strings(obj: Any, key: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{key}[{i}]")
    elif isinstance(obj, str):
        yield key, obj


def _load(path: Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None  # the recipe is broken; `kiln validate` reports how, in the recipe's own job


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BadInput(f"git {' '.join(args)}: {proc.stderr.strip()}. The checkout needs both commits: "
                       "use actions/checkout with `fetch-depth: 0` and `ref:` the pull request's head sha.")
    return proc.stdout


def _git_changed(repo: Path, base: str, head: str) -> set[str]:
    head_commit = _git(repo, "rev-parse", "--verify", f"{head}^{{commit}}").strip()
    checked_out = _git(repo, "rev-parse", "HEAD").strip()
    if head_commit != checked_out:
        raise BadInput(f"--head {head} is {head_commit[:12]} but the checkout is at {checked_out[:12]}: "
                       "recipes are read from the working tree, so check out the head commit first.")
    # base...head: only what the pull request changed since it forked, not what landed on base since.
    return set(filter(None, _git(repo, "diff", "--name-only", "-z", f"{base}...{head}").split("\0")))


def add_cli(sub: Any) -> None:
    p = sub.add_parser("changed-recipes", help="list recipes a change touches, as a GitHub job matrix")
    p.add_argument("--base", default="", help="base commit; empty: every recipe")
    p.add_argument("--head", default="HEAD", help="head commit (must be checked out)")
    p.add_argument("--glob", default="recipes/**/*.yaml", help="recipes, relative to the repository root")
    p.add_argument("--repo", type=Path, default=Path("."))
    p.add_argument("--run-all", action="append", default=[], metavar="GLOB",
                   help="a changed file matching this runs every recipe (repeatable; * matches /)")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    found = changed_recipes(args.base, args.head, args.glob, args.repo, args.run_all)
    removed = removed_recipes(args.base, args.head, args.glob, args.repo)
    matrix = {"include": [c.as_dict() for c in found]}
    print(json.dumps(matrix, indent=2))
    if removed:
        print(f"removed: {', '.join(removed)}", file=sys.stderr)
    if in_github_actions() and (out := os.environ.get("GITHUB_OUTPUT")):
        with open(out, "a", encoding="utf-8") as f:
            f.write(output_line("matrix", json.dumps(matrix)) + output_line("count", str(len(found)))
                    + output_line("removed", "\n".join(removed)))
    if in_github_actions() and (summary := os.environ.get("GITHUB_STEP_SUMMARY")):
        rows = [f"| `{c.recipe}` | {c.runner} | {'; '.join(c.reasons).replace('|', '/')} |" for c in found]
        text = ("### kiln: recipes to run\n\n| recipe | runner | why |\n|---|---|---|\n" + "\n".join(rows)
                if found else "### kiln: no recipe or file a recipe points to changed; nothing to run")
        if removed:
            text += ("\n\n### kiln: recipes this pull request removes (or renames)\n\n"
                     + "\n".join(f"- `{r}`: the model it gated is no longer gated by it" for r in removed))
        with open(summary, "a", encoding="utf-8") as f:
            f.write(text + "\n\n")
    return 0
