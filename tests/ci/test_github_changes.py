"""`changed_recipes` on a real git repository: a pull request branch forked from main, with main
moving on after the fork, as on GitHub."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.errors import BadInput
from kiln.pipeline.github_changes import changed_recipes, runner_of

FILES = {
    "recipes/cpu.yaml": "name: cpu\nmodel: {path: models/tiny}\nengine: {backend: torch}\n",
    "recipes/gpu.yaml": "name: gpu\nmodel: {path: ../models/big}\nengine: {backend: tensorrt_llm}\n",
    "recipes/nested/hub.yaml": "name: hub\nmodel: {path: demo}\noutput: .\n",
    "recipes/notes.txt": "not a recipe\n",
    "models/tiny/config.json": "{}\n",
    "models/big/weights.txt": "w\n",
    "constraints.txt": "torch==2.13.0\n",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(var, "kiln test")
    for var in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(var, "kiln@example.invalid")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, FILES, "base")
    return repo


def pr(repo: Path, files: dict[str, str]) -> tuple[str, str]:
    base = git(repo, "rev-parse", "main")
    git(repo, "checkout", "-q", "-b", "pr")
    return base, commit(repo, files, "pull request")


def as_table(found) -> dict[str, tuple[str, str]]:
    return {c.recipe: (c.runner, "; ".join(c.reasons)) for c in found}


def test_recipe_and_model_changes(repo: Path) -> None:
    base, head = pr(repo, {"models/tiny/config.json": '{"layers": 2}\n', "recipes/gpu.yaml": FILES["recipes/gpu.yaml"] + "# tuned\n"})
    found = as_table(changed_recipes(base, head, "recipes/**/*.yaml", repo))
    assert found == {"recipes/cpu.yaml": ("cpu", "models/tiny (model.path) changed"),
                     "recipes/gpu.yaml": ("gpu", "recipe changed")}


def test_path_relative_to_the_recipe_folder(repo: Path) -> None:
    base, head = pr(repo, {"models/big/weights.txt": "w2\n"})
    assert as_table(changed_recipes(base, head, "recipes/**/*.yaml", repo)) == {
        "recipes/gpu.yaml": ("gpu", "models/big (model.path) changed")}


def test_changes_on_main_after_the_fork_are_not_the_prs(repo: Path) -> None:
    base, head = pr(repo, {"README.md": "docs only\n"})
    git(repo, "checkout", "-q", "main")
    moved = commit(repo, {"recipes/cpu.yaml": FILES["recipes/cpu.yaml"] + "# on main\n"}, "main moves on")
    git(repo, "checkout", "-q", "pr")
    assert changed_recipes(moved, head, "recipes/**/*.yaml", repo) == []


def test_run_all_and_no_base(repo: Path) -> None:
    base, head = pr(repo, {"constraints.txt": "torch==2.14.1\n"})
    found = as_table(changed_recipes(base, head, "recipes/**/*.yaml", repo, run_all=["constraints.txt"]))
    assert set(found) == {"recipes/cpu.yaml", "recipes/gpu.yaml", "recipes/nested/hub.yaml"}
    assert found["recipes/nested/hub.yaml"] == ("cpu", "constraints.txt changed")
    assert changed_recipes(base, head, "recipes/**/*.yaml", repo) == []  # no run_all: pins alone run nothing
    everything = changed_recipes("", head, "recipes/*.yaml", repo)
    assert [c.recipe for c in everything] == ["recipes/cpu.yaml", "recipes/gpu.yaml"]
    assert changed_recipes("0" * 40, head, "recipes/*.yaml", repo)[0].reasons == ["no base commit: every recipe runs"]


def test_untracked_files_are_not_recipes(repo: Path) -> None:
    (repo / "recipes" / "scratch.yaml").write_text("name: scratch\n")
    assert "recipes/scratch.yaml" not in [c.recipe for c in changed_recipes("", "HEAD", "recipes/*.yaml", repo)]


def test_runner_hint(tmp_path: Path) -> None:
    def runner(text: str) -> str:
        (tmp_path / "r.yaml").write_text(text)
        return runner_of(tmp_path / "r.yaml")

    assert runner("runner: gpu\nengine: {backend: torch}\n") == "gpu"
    assert runner("runner: cpu\nengine: {backend: vllm}\n") == "cpu"  # explicit wins
    assert runner("engine: {backend: vllm}\n") == "gpu"
    assert runner("engine: {backend: torch, device: cuda:0}\n") == "gpu"
    assert runner("engine: {backend: torch, device: cpu}\n") == "cpu"
    assert runner("name: [unclosed\n") == "cpu"  # broken YAML: its job's `kiln validate` says why
    with pytest.raises(BadInput, match="runner: 'tpu' is not one of cpu, gpu"):
        runner("runner: tpu\n")


def test_wrong_checkout_is_bad_input(repo: Path) -> None:
    base, head = pr(repo, {"recipes/cpu.yaml": "name: cpu2\n"})
    git(repo, "checkout", "-q", "main")
    with pytest.raises(BadInput, match="check out the head commit"):
        changed_recipes(base, head, "recipes/*.yaml", repo)
    git(repo, "checkout", "-q", "pr")
    with pytest.raises(BadInput, match="fetch-depth: 0"):
        changed_recipes("1" * 40, head, "recipes/*.yaml", repo)
    with pytest.raises(BadInput, match="relative to the repository root"):
        changed_recipes(base, head, "/abs/*.yaml", repo)


def test_command_writes_the_matrix(repo: Path, tmp_path: Path) -> None:
    base, head = pr(repo, {"recipes/gpu.yaml": "name: gpu\nrunner: gpu\n"})
    out, summary = tmp_path / "out.txt", tmp_path / "summary.md"
    env = {"GITHUB_ACTIONS": "true", "GITHUB_OUTPUT": str(out), "GITHUB_STEP_SUMMARY": str(summary), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "kiln.pipeline.github", "changed-recipes", "--base", base,
                           "--head", head, "--glob", "recipes/**/*.yaml", "--run-all", "requirements/*"],
                          cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    matrix = {"include": [{"recipe": "recipes/gpu.yaml", "runner": "gpu", "reason": "recipe changed"}]}
    assert json.loads(proc.stdout) == matrix
    lines = out.read_text().splitlines()
    assert lines == [f"matrix={json.dumps(matrix)}", "count=1"]
    assert "| `recipes/gpu.yaml` | gpu | recipe changed |" in summary.read_text()


def test_command_reports_bad_input_with_exit_2(repo: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kiln.pipeline.github", "changed-recipes", "--base", "nope",
                           "--glob", "recipes/*.yaml"], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 2 and "fetch-depth: 0" in proc.stderr
