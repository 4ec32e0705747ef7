"""`changed_recipes` on a real git repository: a pull request branch forked from main, with main
moving on after the fork, as on GitHub."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.errors import BadInput
from kiln.pipeline.github.changes import changed_recipes, referenced_paths, removed_recipes, runner_of

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
    assert lines == [f"matrix={json.dumps(matrix)}", "count=1", "removed="]
    assert "| `recipes/gpu.yaml` | gpu | recipe changed |" in summary.read_text()


def test_command_reports_bad_input_with_exit_2(repo: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kiln.pipeline.github", "changed-recipes", "--base", "nope",
                           "--glob", "recipes/*.yaml"], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 2 and "fetch-depth: 0" in proc.stderr


# --- what a change behind a referenced path reaches: symlinks and task code ----------------------


def link(repo: Path, name: str, target: str) -> None:
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / name).symlink_to(target)


def test_a_weights_file_behind_a_symlink_in_the_model_folder(repo: Path) -> None:
    """models/linked/model.safetensors links to weights/v1.safetensors: git records the link, so a pull
    request rewriting the weights changes no file under model.path, and the recipe must still run."""
    link(repo, "models/linked/model.safetensors", "../../weights/v1.safetensors")
    commit(repo, {"weights/v1.safetensors": "v1\n", "models/linked/config.json": "{}\n",
                  "recipes/linked.yaml": "name: linked\nmodel: {path: models/linked}\n"}, "linked model")
    base, head = pr(repo, {"weights/v1.safetensors": "v1, rewritten\n"})
    assert as_table(changed_recipes(base, head, "recipes/*.yaml", repo)) == {"recipes/linked.yaml": (
        "cpu", "weights/v1.safetensors (model.path via models/linked/model.safetensors) changed")}


def test_a_model_path_that_is_a_symlink_counts_the_link_and_its_target(repo: Path) -> None:
    link(repo, "models/current", "tiny")
    commit(repo, {"models/other/config.json": "{}\n",
                  "recipes/current.yaml": "name: current\nmodel: {path: models/current}\n"}, "current model")
    base, head = pr(repo, {"models/tiny/config.json": '{"layers": 3}\n'})
    found = as_table(changed_recipes(base, head, "recipes/current.yaml", repo))
    assert found == {"recipes/current.yaml": ("cpu", "models/tiny (model.path via models/current) changed")}
    # the link moved to another model that was already there: only the link itself changed
    git(repo, "checkout", "-q", "main")
    git(repo, "checkout", "-q", "-b", "retarget")
    (repo / "models" / "current").unlink()
    link(repo, "models/current", "other")
    head = commit(repo, {}, "point the model at another checkpoint")
    found = as_table(changed_recipes(base, head, "recipes/current.yaml", repo))
    assert found == {"recipes/current.yaml": ("cpu", "models/current (model.path) changed")}


def test_symlink_cycles_and_links_out_of_the_repository_end(repo: Path, tmp_path: Path) -> None:
    (tmp_path / "outside.bin").write_text("x\n")
    link(repo, "models/loop/self", ".")
    link(repo, "models/loop/outside.bin", str(tmp_path / "outside.bin"))
    commit(repo, {"models/loop/config.json": "{}\n", "recipes/loop.yaml": "model: {path: models/loop}\n"}, "loop")
    refs = referenced_paths(repo, "recipes/loop.yaml")
    assert refs == [("model.path", "models/loop")]  # the loop is walked once; /tmp is no file of the PR's


TASK = "task: mine\ndataset_path: json\nprocess_docs: !function utils.process_docs\ndoc_to_text: q\n"


def test_a_tasks_python_changes_rerun_the_recipe(repo: Path) -> None:
    """lm-eval imports `!function utils.x` from the task YAML's folder: a pull request changing only
    utils.py changes what the task measures."""
    recipe = "name: task\nevaluate: {quality: {lmeval: {tasks: [../tasks/mine/mine.yaml]}}}\n"
    commit(repo, {"tasks/mine/mine.yaml": TASK, "tasks/mine/utils.py": "def process_docs(d):\n    return d\n",
                  "tasks/mine/README.md": "notes\n", "recipes/task.yaml": recipe}, "a task of our own")
    base, head = pr(repo, {"tasks/mine/utils.py": "def process_docs(d):\n    return d.select(range(2))\n"})
    assert as_table(changed_recipes(base, head, "recipes/task.yaml", repo)) == {"recipes/task.yaml": (
        "cpu", "tasks/mine/utils.py (evaluate.quality.lmeval.tasks[0] via tasks/mine/mine.yaml's task code) changed")}
    git(repo, "checkout", "-q", "main")
    git(repo, "checkout", "-q", "-b", "docs")
    head = commit(repo, {"tasks/mine/README.md": "more notes\n"}, "docs beside the task")
    assert changed_recipes(base, head, "recipes/task.yaml", repo) == []  # not code the task runs


def test_removed_and_renamed_recipes_are_listed(repo: Path) -> None:
    """A model whose recipe is gone is no longer gated: the workflow asks for the approval label."""
    git(repo, "checkout", "-q", "-b", "pr")
    git(repo, "rm", "-q", "recipes/gpu.yaml")
    git(repo, "mv", "recipes/nested/hub.yaml", "recipes/nested/hub2.yaml")
    git(repo, "rm", "-q", "recipes/notes.txt")
    head = commit(repo, {}, "drop a recipe, rename another")
    base = git(repo, "rev-parse", "main")
    assert removed_recipes(base, head, "recipes/**/*.yaml", repo) == ["recipes/gpu.yaml", "recipes/nested/hub.yaml"]
    assert removed_recipes(base, head, "recipes/*.yaml", repo) == ["recipes/gpu.yaml"]
    assert removed_recipes("", head, "recipes/**/*.yaml", repo) == []  # a manual run: nothing to compare
    # the renamed recipe is new: judged under its own policy, so the removal is what asks for approval
    assert "recipes/nested/hub2.yaml" in as_table(changed_recipes(base, head, "recipes/**/*.yaml", repo))
