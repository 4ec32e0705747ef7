"""ci/action.yml on a stock runner: its shell steps, taken from the file and run as GitHub runs them
(`bash --noprofile --norc -eo pipefail`), with an empty HOME and no llama.cpp build, as a fresh
GitHub-hosted runner has.

- which recipes need llama.cpp (ci/needs.py, kiln's own reading of the validated recipe) and the
  cache key of the build (llama.cpp version, kiln's patch, the CPU's flags);
- the build step: a restored cache is used as it is (no compiler runs); a miss installs the
  missing system packages with apt-get where sudo works, names them where it does not, and calls
  the build (the cmake here is a stand-in that records its arguments: compiling llama.cpp takes
  6-10 minutes on 2 cores, so the suite's own build stands in for the cache);
- the recipe's expected verdict (`expect`): resolved per recipe, and deciding the job;
- recipes/demo.yaml, unchanged, through the action's steps on an empty HOME, past its GGUF build.

What no test here runs: actions/setup-python, actions/cache and the `pip install` of kiln (the
suite's virtual environment stands in for the installed kiln), and a real compile of llama.cpp.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_github import parse_outputs
from test_workflows import ACTION, ROOT, load, run_comment_script

# ci/needs.py is a script the action runs, not part of the kiln package: loaded from its file.
_spec = importlib.util.spec_from_file_location("kiln_ci_needs", ROOT / "ci" / "needs.py")
needs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(needs)

PY = Path(sys.executable)
STOPPED = 97  # the kiln stand-in's exit code once the run is past the stage it waits for


def step(key: str) -> dict:
    """The action's step with this id (or name)."""
    return next(s for s in load(ACTION)["runs"]["steps"] if key in (s.get("id"), s.get("name")))


def sandbox_bin(tmp_path: Path, **scripts: str) -> Path:
    """A folder of commands, the only one on PATH in the system-step tests: `python` is the
    suite's (kiln installed), the others are stand-ins written here; no real cmake, compiler,
    sudo or apt-get can run."""
    bin_dir = tmp_path / "sandbox-bin"
    bin_dir.mkdir(exist_ok=True)
    scripts.setdefault("python", f'#!/bin/bash\nexec "{PY}" "$@"\n')
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


RUNNER_ENV = {"PATH", "GITHUB_WORKSPACE", "GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY"}


def run_step(tmp_path: Path, key: str, env: dict[str, str], cwd: Path | None = None, timeout: int = 300,
             job_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Run one step's script as GitHub does: every variable of its `env:` is set (an input left
    empty is an empty string), then `env`, the values its expressions would give: only variables
    the step declares (or the runner's own), so a step that stops declaring one fails here.
    `job_env`: variables the calling job sets for every step."""
    spec = step(key)
    script = tmp_path / f"step-{key}.sh"
    script.write_text(spec["run"])
    out = tmp_path / f"output-{key}.txt"
    out.write_text("")
    full = {"HOME": str(tmp_path / "home"), "GITHUB_OUTPUT": str(out), "RUNNER_TEMP": str(tmp_path / "runner-temp"),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
            **(job_env or {}), **{name: "" for name in spec.get("env", {})}, **env}
    unknown = set(env) - set(spec.get("env", {})) - RUNNER_ENV
    assert not unknown, f"step {key} has no env {unknown}"
    proc = subprocess.run(["/bin/bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=cwd or tmp_path,
                          env=full, capture_output=True, text=True, timeout=timeout)
    return proc, parse_outputs(out.read_text())


# --- what a recipe needs -------------------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "llama"), [
    ("demo.yaml", True), ("demo-llama.yaml", True),
    ("demo-engines.yaml", False), ("demo-int8.yaml", False), ("demo-broken.yaml", False)])
def test_needs_llama_cpp_from_the_validated_recipe(recipe: str, llama: bool) -> None:
    out = needs.outputs(str(ROOT / "recipes" / recipe), [])
    assert out["llama-cpp"] == str(llama).lower()
    assert bool(out["llama-cpp-dir"]) is llama and bool(out["llama-cpp-key"]) is llama


def test_an_override_can_make_a_recipe_need_llama_cpp() -> None:
    sets = ["optimize={method: gguf, type: q8_0}", "engine={backend: llama_cpp}"]
    assert needs.outputs(str(ROOT / "recipes" / "demo-int8.yaml"), sets)["llama-cpp"] == "true"
    # the engine alone: the unquantized checkpoint is no GGUF, so kiln refuses it, and needs says no
    out = needs.outputs(str(ROOT / "recipes" / "demo-int8.yaml"), ["engine={backend: llama_cpp}"])
    assert out == {"llama-cpp": "false", "llama-cpp-dir": "", "llama-cpp-key": "", "demo-data": "false"}


def test_the_build_is_looked_for_where_kiln_cache_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.core import llama_cpp_build

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "kc"))
    out = needs.outputs(str(ROOT / "recipes" / "demo.yaml"), [])
    assert Path(out["llama-cpp-dir"]) == tmp_path / "kc" / "llama.cpp" / llama_cpp_build.install_dir().name
    assert out["llama-cpp-key"].startswith(f"{llama_cpp_build.VERSION}-{llama_cpp_build.PATCH_ID}-")


def test_cache_key_changes_with_the_patch_the_flags_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.core import llama_cpp_build as b

    base = needs.llama_cpp_key()
    assert needs.llama_cpp_key() == base
    keys = set()
    for name, value in (("PATCH_TO", b.PATCH_TO + "// changed\n"), ("CMAKE_FLAGS", (*b.CMAKE_FLAGS, "-DGGML_AVX2=OFF")),
                        ("cpu_key", lambda: "another-cpu"), ("VERSION", "0.0.1")):
        with monkeypatch.context() as m:
            m.setattr(b, name, value)
            keys.add(needs.llama_cpp_key())
    assert base not in keys and len(keys) == 4


def test_demo_data_is_needed_until_the_cache_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.pipeline.demo import data as demo_data

    recipe = str(ROOT / "recipes" / "demo-int8.yaml")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "kc"))
    assert needs.outputs(recipe, [])["demo-data"] == "true"
    manifest = tmp_path / "kc" / "data" / demo_data.DATA_VERSION / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    assert needs.outputs(recipe, [])["demo-data"] == "false"


def test_own_data_files_need_no_demo_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "kc"))
    text, prompts = tmp_path / "eval.txt", tmp_path / "prompts.jsonl"
    text.write_text("Some text.\n")
    prompts.write_text('{"prompt": "Hi"}\n')
    raw = yaml.safe_load((ROOT / "recipes" / "demo-int8.yaml").read_text())
    raw["evaluate"]["quality"]["perplexity"]["text"] = str(text)
    del raw["evaluate"]["quality"]["lmeval"]
    # its check goes with it: a gate check no stage measures is refused (issue 52, point 4)
    raw["gate"]["checks"] = [c for c in raw["gate"]["checks"] if c.get("metric") != "word_swap_acc"]
    raw["evaluate"]["benchmark"]["prompts"] = str(prompts)
    recipe = tmp_path / "own.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    from kiln.pipeline.recipe.schema import load_recipe

    load_recipe(recipe)  # valid: needs reads it, not the fallback for an invalid recipe
    assert needs.outputs(str(recipe), [])["demo-data"] == "false"
    assert needs.outputs(str(recipe), ["evaluate.benchmark.prompts=demo"])["demo-data"] == "true"
    assert needs.outputs(str(recipe), ["evaluate.quality.lmeval={tasks: [word_swap]}"])["demo-data"] == "true"


def test_needs_step_writes_the_outputs(tmp_path: Path) -> None:
    bin_dir = sandbox_bin(tmp_path)
    proc, out = run_step(tmp_path, "needs", {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECIPE": "recipes/demo.yaml",
                                             "SETS": "", "KILN_CACHE": str(tmp_path / "kc"), "KILN_SOURCE": str(ROOT)},
                         cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert out["llama-cpp"] == "true" and out["llama-cpp-dir"].startswith(str(tmp_path / "kc" / "llama.cpp"))
    assert out["demo-data"] == "true"  # an empty cache: the first run downloads the demo data


# --- the build step ------------------------------------------------------------------------------

RECORDER = '#!/bin/bash\necho "{name} $*" >> "{log}"\nexit {rc}\n'


def recorder(name: str, log: Path, rc: int = 0) -> str:
    return RECORDER.format(name=name, log=log, rc=rc)


def shared_build() -> Path:
    from kiln.core.llama_cpp_build import complete, install_dir

    path = install_dir()
    if not complete(path):
        pytest.fail(f"llama.cpp is not built at {path}: run `make llama-cpp` first", pytrace=False)
    return path


def system_env(tmp_path: Path, bin_dir: Path, llama: bool, demo: bool) -> dict[str, str]:
    return {"PATH": str(bin_dir), "LLAMA_CPP": str(llama).lower(), "DEMO_DATA": str(demo).lower(),
            "KILN_CACHE": str(tmp_path / "home" / ".cache" / "kiln")}


def test_a_restored_build_is_used_as_it_is(tmp_path: Path) -> None:
    """A cache hit, as actions/cache restores it: the suite's build copied to the runner's
    $KILN_CACHE/llama.cpp/VERSION-PATCH-CPU. Nothing is compiled, installed or downloaded."""
    log = tmp_path / "calls.log"
    tools = ("cmake", "ninja", "cc", "c++", "sudo", "apt-get")
    bin_dir = sandbox_bin(tmp_path, **{n: recorder(n, log, 1) for n in tools})
    env = system_env(tmp_path, bin_dir, llama=True, demo=False)
    from kiln.core.llama_cpp_build import install_dir

    restored = Path(env["KILN_CACHE"]) / "llama.cpp" / install_dir().name
    shutil.copytree(shared_build(), restored, symlinks=True)
    proc, _ = run_step(tmp_path, "system", env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{restored} complete" in proc.stdout
    assert not log.exists(), log.read_text()


def test_a_missing_build_tool_is_named_where_it_cannot_be_installed(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    bin_dir = sandbox_bin(tmp_path, sudo=recorder("sudo", log, 1), ninja=recorder("ninja", log))
    proc, _ = run_step(tmp_path, "system", system_env(tmp_path, bin_dir, llama=True, demo=False))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "::error title=kiln: system packages::the llama.cpp build needs cmake g++" in proc.stdout
    assert log.read_text() == "sudo -n true\n"  # asked whether sudo works; nothing else ran


def test_a_cache_miss_installs_what_is_missing_and_builds(tmp_path: Path) -> None:
    """No build in the cache: apt-get installs the missing tools (sudo works, as on GitHub's
    runners), then the build runs from the pinned sdist with kiln's flags. The cmake is a stand-in
    that records the call and stops the build there (compiling takes 6-10 minutes)."""
    from kiln.core import llama_cpp_build as b

    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "sandbox-bin"
    # apt-get "installs" cmake and a compiler: it copies a recording stand-in into the sandbox
    tool = tmp_path / "stand-in-tool"
    tool.write_text(f'#!/bin/bash\necho "${{0##*/}} $*" >> "{log}"\nexit 1\n')
    tool.chmod(0o755)
    apt = (f'#!/bin/bash\necho "apt-get $*" >> "{log}"\n'
           f'if [ "$1" = install ]; then for n in cmake cc c++; do /bin/cp "{tool}" "{bin_dir}/$n"; done; fi\n')
    sudo = (f'#!/bin/bash\necho "sudo $*" >> "{log}"\nif [ "$1" = -n ]; then exit 0; fi\n'
            'case "$1" in *=*) export "$1"; shift ;; esac\nexec "$@"\n')
    sandbox_bin(tmp_path, sudo=sudo, **{"apt-get": apt}, ninja=recorder("ninja", log))
    env = system_env(tmp_path, bin_dir, llama=True, demo=False)
    # The sdist as pip would download it (the runner reaches PyPI; this test does not).
    downloads = Path(env["KILN_CACHE"]) / "llama.cpp" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / b.SDIST).symlink_to(shared_build().parent / "downloads" / b.SDIST)

    proc, _ = run_step(tmp_path, "system", env)
    calls = log.read_text().splitlines()
    assert proc.returncode != 0, proc.stdout  # the stand-in cmake stops the build
    assert calls[:2] == ["sudo -n true", "sudo apt-get update -qq"], calls
    assert "apt-get install -y -qq --no-install-recommends cmake g++" in calls, calls
    [configure] = [c for c in calls if c.startswith("cmake -S")]
    assert configure.split()[2].endswith("/vendor/llama.cpp") and "-G Ninja -DGGML_NATIVE=ON" in configure
    assert all(flag in configure for flag in b.CMAKE_FLAGS), configure
    leftover = next(Path(env["KILN_CACHE"], "llama.cpp").glob(".build-*"), None)
    assert leftover is None  # the temporary tree is gone, and no half build carries the final name
    assert not b.complete(Path(env["KILN_CACHE"]) / "llama.cpp" / b.install_dir().name)


def test_demo_data_refreshes_apt_lists_first(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    bin_dir = sandbox_bin(tmp_path, sudo=recorder("sudo", log), dpkg=recorder("dpkg", log),
                          **{"apt-get": recorder("apt-get", log)})
    proc, _ = run_step(tmp_path, "system", system_env(tmp_path, bin_dir, llama=False, demo=True))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert log.read_text().splitlines() == ["sudo -n true", "sudo apt-get update -qq"]


def test_demo_data_without_apt_is_bad_input(tmp_path: Path) -> None:
    bin_dir = sandbox_bin(tmp_path)
    proc, _ = run_step(tmp_path, "system", system_env(tmp_path, bin_dir, llama=False, demo=True))
    assert proc.returncode == 2 and "comes from a Debian package" in proc.stdout


# --- the expected verdict ------------------------------------------------------------------------

MAPPING = """
recipes/demo.yaml: Successful
  recipes/demo-broken.yaml:   Failed
# a comment
recipes/tiny/*.yaml: Inconclusive
"""


@pytest.mark.parametrize(("recipe", "expect", "resolved"), [
    ("recipes/demo-broken.yaml", MAPPING, "Failed"),
    ("recipes/demo.yaml", MAPPING, "Successful"),
    ("recipes/tiny/a.yaml", MAPPING, "Inconclusive"),
    ("recipes/other.yaml", MAPPING, ""),
    ("recipes/other.yaml", "Failed", "Failed"),
    ("recipes/other.yaml", "", "")])
def test_prepare_resolves_the_expected_verdict(tmp_path: Path, recipe: str, expect: str, resolved: str) -> None:
    (tmp_path / recipe).parent.mkdir(parents=True)
    (tmp_path / recipe).write_text("name: x\n")
    (tmp_path / "constraints.txt").write_text("")
    proc, out = run_step(tmp_path, "prep", {"PATH": "/usr/bin:/bin", "RECIPE": recipe, "EXPECT": expect,
                                            "CONSTRAINTS": "constraints.txt", "KILN_SOURCE": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out["expect"] == resolved
    # one kiln cache for every step: $KILN_CACHE, or ~/.cache/kiln of the runner's HOME
    assert out["kiln-cache"] == str(tmp_path / "home" / ".cache" / "kiln")


def test_prepare_refuses_a_misspelt_verdict_on_any_line(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text("name: x\n")
    (tmp_path / "c.txt").write_text("")
    proc, out = run_step(tmp_path, "prep", {"PATH": "/usr/bin:/bin", "RECIPE": "r.yaml", "CONSTRAINTS": "c.txt",
                                            "EXPECT": "r.yaml: Failed\nother.yaml: Fail\n", "KILN_SOURCE": str(ROOT)})
    assert proc.returncode == 2 and "'Fail' is not a verdict" in proc.stdout, proc.stdout


def test_prepare_keeps_a_kiln_cache_the_job_set(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text("name: x\n")
    (tmp_path / "c.txt").write_text("")
    proc, out = run_step(tmp_path, "prep", {"PATH": "/usr/bin:/bin", "RECIPE": "r.yaml", "CONSTRAINTS": "c.txt",
                                            "EXPECT": "", "KILN_SOURCE": str(ROOT)},
                         job_env={"KILN_CACHE": "rel/cache"})
    assert proc.returncode == 0 and out["kiln-cache"] == str(tmp_path / "rel" / "cache")


@pytest.mark.parametrize(("expect", "rc", "code", "line"), [
    ("Failed", "1", 0, "::notice title=kiln: as expected::recipes/r.yaml ended Failed (exit 1)"),
    ("Inconclusive", "3", 0, "::notice title=kiln: as expected::"),
    ("Successful", "0", 0, "::notice title=kiln: as expected::"),
    ("Failed", "0", 1, "::error title=kiln: unexpected verdict::recipes/r.yaml was expected to end Failed (exit 1) "
                       "and ended Successful (exit 0)"),
    ("Successful", "1", 1, "::error title=kiln: unexpected verdict::"),
    ("Inconclusive", "1", 1, "::error title=kiln: unexpected verdict::"),
    ("Failed", "2", 2, "::error title=kiln: unexpected verdict::"),  # bad input is never expected
    ("Failed", "4", 4, "::error title=kiln: unexpected verdict::"),
    ("", "1", 1, "::error title=kiln: gate failed::")])
def test_conclude_judges_against_the_expected_verdict(tmp_path: Path, expect: str, rc: str, code: int,
                                                      line: str) -> None:
    verdict = {"0": "Successful", "1": "Failed", "3": "Inconclusive"}.get(rc, "Error")
    proc, _ = run_step(tmp_path, "Conclude", {"PATH": "/usr/bin:/bin", "RC": rc, "VERDICT": verdict, "EXPECT": expect,
                                              "RECIPE": "recipes/r.yaml"})
    assert proc.returncode == code and proc.stdout.startswith(line), proc.stdout


def test_comment_states_the_expected_verdict(tmp_path: Path) -> None:
    body = "<!-- kiln-report:recipes/demo-broken.yaml -->\n### ❌ Failed\n"
    met = run_comment_script(tmp_path, body, [], env={"EXPECT": "Failed", "RC": "1"})
    assert "Expected verdict: **Failed**: reached, so the check passes." in met["comments"][-1]["body"]
    missed = run_comment_script(tmp_path, body.replace("Failed", "Successful"), [], env={"EXPECT": "Failed", "RC": "0"})
    assert "(exit 1): not reached (exit 0), so the check fails" in missed["comments"][-1]["body"]
    plain = run_comment_script(tmp_path, body, [], env={"EXPECT": "", "RC": "1"})
    assert "Expected verdict" not in plain["comments"][-1]["body"]


# --- the repository's own workflow ---------------------------------------------------------------


def test_the_workflow_states_every_example_recipes_verdict() -> None:
    """In .github/kiln-expect.txt, which the workflow reads at the base commit (below), not in the
    workflow's `with:`, which a pull request edits along with its recipe."""
    kiln_pr = load(ROOT / ".github" / "workflows" / "kiln-pr.yml")["jobs"]["kiln"]["with"]
    assert "expect" not in kiln_pr and kiln_pr["expect-file"] == ".github/kiln-expect.txt"
    text = (ROOT / kiln_pr["expect-file"]).read_text()
    lines = [line.split(":") for line in text.splitlines() if line.strip() and not line.startswith("#")]
    stated = {path.strip(): verdict.strip() for path, verdict in lines}
    assert len(stated) == len(lines), "a recipe listed twice"
    recipes = {str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("**/*.yaml")}
    assert set(stated) == recipes, f"unlisted: {recipes - set(stated)}, not a recipe: {set(stated) - recipes}"
    assert set(stated.values()) <= {"Successful", "Failed", "Inconclusive"}
    # what each is kept to show (their own header comments; tests/pipeline/test_demo_cases.py)
    assert stated["recipes/demo-broken.yaml"] == "Failed"
    assert stated["recipes/demo-tiny-eval.yaml"] == "Inconclusive"
    assert stated["recipes/demo.yaml"] == stated["recipes/demo-int8.yaml"] == "Successful"


def test_the_workflow_judges_by_the_base_branchs_rules() -> None:
    """The run job checks out the base commit beside the pull request and hands it to the action:
    no `expect` the pull request's copy of a workflow file could set reaches it."""
    gate = load(ROOT / ".github" / "workflows" / "kiln-gate.yml")
    inputs = gate["on"]["workflow_call"]["inputs"]
    assert "expect" not in inputs and inputs["expect-file"]["default"] == ".github/kiln-expect.txt"
    assert inputs["policy-approval-label"]["default"] == "kiln-policy-approved"
    steps = gate["jobs"]["run"]["steps"]
    base = next(s for s in steps if s.get("name") == "Check out the base branch")
    assert base["with"]["ref"] == "${{ github.event.pull_request.base.sha }}" and base["with"]["path"] == ".kiln-base"
    action = next(s for s in steps if s.get("name") == "kiln")["with"]
    assert "expect" not in action and action["expect-file"] == "${{ inputs.expect-file }}"
    assert action["base-root"] == "${{ github.event.pull_request.base.sha && '.kiln-base' || '' }}"
    # a change to kiln's own code runs every recipe: "kiln gate" never passes as skipped on one
    kiln_pr = load(ROOT / ".github" / "workflows" / "kiln-pr.yml")
    run_all = kiln_pr["jobs"]["kiln"]["with"]["run-all-when"].split()
    for folder in ("core", "optimize", "engine", "evaluate", "deploy", "pipeline", "ci"):
        assert f"{folder}/**" in run_all
    assert "pyproject.toml" in run_all and "constraints.txt" in run_all
    assert {"labeled", "unlabeled"} <= set(kiln_pr["on"]["pull_request"]["types"])  # the label reruns the check


# --- a pull request that weakens its own recipe ----------------------------------------------------

# The tiny random Llama, int8 weight-only: its size is ~0.97x the baseline's (embeddings dominate), so a
# size check decides the verdict in seconds, the same way on every machine.
WEAKENED_BASE = {
    "name": "tiny-ci", "optimize": {"method": "int8_weight_only"}, "engine": {"backend": "torch", "threads": 2},
    "evaluate": {"quality": {"perplexity": {"text": "demo", "max_documents": 2, "seq_len": 16}, "agreement": False},
                 "benchmark": {"prompts": "demo", "num_prompts": 1, "max_new_tokens": 2, "repeats": 1}},
    "gate": {"on_inconclusive": "fail", "checks": [{"kind": "size", "max_ratio": 0.5}]},
    "tracking": {"experiment": "kiln-ci-test"}}
KILN = '#!/bin/bash\nexec "{python}" -m kiln.pipeline "$@"\n'


def checkouts(tmp_path: Path, model: Path, head_edit, expect_base: str = "", expect_head: str = "") -> Path:
    """The pull request's checkout (the job's workspace) with the base commit's at .kiln-base, as the
    workflow's two actions/checkout steps leave them."""
    workspace = tmp_path / "workspace"
    for root, edit, expect in ((workspace / ".kiln-base", lambda r: None, expect_base),
                               (workspace, head_edit, expect_head)):
        recipe = json.loads(json.dumps({**WEAKENED_BASE, "model": {"path": str(model)}}))
        edit(recipe)
        (root / "recipes").mkdir(parents=True)
        (root / "recipes" / "tiny.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        (root / ".github").mkdir()
        (root / ".github" / "kiln-expect.txt").write_text(expect)
    return workspace


def weaken(recipe: dict) -> None:
    """What issue 52's pull request did: the bar raised out of reach and undecided let through."""
    recipe["gate"] = {"on_inconclusive": "pass", "checks": [{"kind": "size", "max_ratio": 1.0}]}


def run_action(tmp_path: Path, workspace: Path, base_root: str, approved: str = "false") -> dict[str, str]:
    """Prepare, Compare the policy, Validate and run, Conclude: the action's own scripts on `workspace`."""
    bin_dir = sandbox_bin(tmp_path, kiln=KILN.format(python=PY))
    (tmp_path / "home").mkdir(exist_ok=True)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "GITHUB_WORKSPACE": str(workspace)}
    label = {"APPROVED": approved, "LABEL": "kiln-policy-approved"}
    proc, prep = run_step(tmp_path, "prep", {**base, "RECIPE": "recipes/tiny.yaml", "CONSTRAINTS": "",
                                             "KILN_SOURCE": str(ROOT), "EXPECT": "",
                                             "EXPECT_FILE": ".github/kiln-expect.txt", "BASE_ROOT": base_root},
                          cwd=workspace)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    policy: dict[str, str] = {}
    summary = str(tmp_path / "summary.md")
    if base_root:
        proc, policy = run_step(tmp_path, "policy", {
            **base, **label, "RECIPE": "recipes/tiny.yaml", "RUNS": prep["runs"], "BASE_ROOT": base_root,
            "EXPECT_BASE": prep["expect-base"], "EXPECT_HEAD": prep["expect-head"], "GITHUB_ACTIONS": "true",
            "GITHUB_STEP_SUMMARY": summary}, cwd=workspace)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc, run = run_step(tmp_path, "run", {**base, "RECIPE": "recipes/tiny.yaml", "SETS": "", "RUNS": prep["runs"],
                                           "POLICY_FROM": policy.get("policy-from", ""),
                                           "MLFLOW_TRACKING_URI": f"sqlite:///{workspace}/mlflow.db",
                                           "KILN_CACHE": os.environ["KILN_CACHE"], "GITHUB_ACTIONS": "true",
                                           "GITHUB_STEP_SUMMARY": summary}, cwd=workspace, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc, _ = run_step(tmp_path, "Conclude", {"PATH": "/usr/bin:/bin", **label, "RC": run["rc"],
                                              "VERDICT": run.get("verdict", ""), "EXPECT": prep["expect"],
                                              "RECIPE": "recipes/tiny.yaml", "POLICY": policy.get("policy", ""),
                                              "POLICY_NEEDS_APPROVAL": policy.get("needs-approval", "")})
    return {"job": str(proc.returncode), "conclude": proc.stdout, "rc": run["rc"], **policy,
            "log": Path(prep["runs"] + ".log").read_text()}


def test_a_pull_request_that_weakens_its_recipe_is_judged_by_the_base_branchs_policy(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Issue 52: the PR raises its size bound out of reach and sets `on_inconclusive: pass`. Judged by
    its own policy (the action before: no base checkout), the candidate passes and so does the job;
    judged by the base branch's, it fails, and the looser policy fails the check on its own."""
    own = run_action(tmp_path / "own", checkouts(tmp_path / "own", tiny_model_dir, weaken), base_root="")
    assert (own["rc"], own["job"]) == ("0", "0"), own["conclude"] + own["log"][-3000:]  # what the PR wanted

    workspace = checkouts(tmp_path / "pr", tiny_model_dir, weaken)
    pr = run_action(tmp_path / "pr", workspace, base_root=".kiln-base")
    assert "judged under the policy of .kiln-base/recipes/tiny.yaml" in pr["log"]
    assert pr["rc"] == "1", pr["log"][-3000:]  # the base branch's size bound: Failed
    assert pr["job"] == "1" and "::error title=kiln: gate failed::" in pr["conclude"]
    assert "::error title=kiln: policy change not approved::recipes/tiny.yaml" in pr["conclude"]
    assert pr["policy"] == "looser" and pr["needs-approval"] == "true"
    section = Path(pr["section"]).read_text()
    assert "| 🔓 looser | `gate.on_inconclusive` | `fail` | `pass` |" in section
    assert "| 🔓 looser | `gate.checks[size:size_bytes].max_ratio` | `0.5` | `1.0` |" in section
    assert section in (tmp_path / "pr" / "summary.md").read_text()
    # the comment carries the policy section after kiln's report
    comment = run_comment_script(tmp_path, "<!-- kiln-report:recipes/tiny.yaml -->\n### ❌ Failed\n", [],
                                 env={"EXPECT": "", "RC": "1", "POLICY_SECTION": pr["section"]})
    assert "Policy of `recipes/tiny.yaml`: looser than the base branch's" in comment["comments"][-1]["body"]

    # The approval label waives the policy check, never the verdict: still judged by the base's policy.
    proc, _ = run_step(tmp_path, "Conclude", {"PATH": "/usr/bin:/bin", "RC": "1", "VERDICT": "Failed", "EXPECT": "",
                                              "RECIPE": "recipes/tiny.yaml", "POLICY": "looser",
                                              "POLICY_NEEDS_APPROVAL": "true", "APPROVED": "true",
                                              "LABEL": "kiln-policy-approved"})
    assert proc.returncode == 1 and "::notice title=kiln: policy change approved::" in proc.stdout


@pytest.mark.parametrize(("approved", "code"), [("false", 1), ("true", 0)])
def test_a_passing_recipe_whose_policy_loosened_needs_the_label(tmp_path: Path, approved: str, code: int) -> None:
    env = {"PATH": "/usr/bin:/bin", "RC": "0", "VERDICT": "Successful", "EXPECT": "", "RECIPE": "recipes/r.yaml",
           "POLICY": "changed", "POLICY_NEEDS_APPROVAL": "true", "APPROVED": approved, "LABEL": "ok-policy"}
    proc, _ = run_step(tmp_path, "Conclude", env)
    assert proc.returncode == code and proc.stdout.startswith("kiln: passed (Successful)"), proc.stdout
    assert ("label ok-policy" in proc.stdout) and (("not approved" in proc.stdout) == (approved == "false"))
    proc, _ = run_step(tmp_path, "Conclude", {**env, "POLICY": "stricter", "POLICY_NEEDS_APPROVAL": "false"})
    assert proc.returncode == 0 and "policy" not in proc.stdout


def prepare(tmp_path: Path, workspace: Path, base_root: str = ".kiln-base") -> dict[str, str]:
    proc, out = run_step(tmp_path, "prep", {"PATH": "/usr/bin:/bin", "RECIPE": "recipes/tiny.yaml", "CONSTRAINTS": "",
                                            "KILN_SOURCE": str(ROOT), "EXPECT": "",
                                            "EXPECT_FILE": ".github/kiln-expect.txt", "BASE_ROOT": base_root},
                         cwd=workspace)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_the_base_branchs_expectations_decide(tmp_path: Path) -> None:
    """A pull request that adds `recipes/tiny.yaml: Failed` to the expectation file would turn its
    failing candidate into a passing job: the base branch's file decides, and the change is shown."""
    workspace = checkouts(tmp_path, tmp_path / "model", lambda r: None, expect_head="recipes/tiny.yaml: Failed\n")
    out = prepare(tmp_path, workspace)
    assert (out["expect"], out["expect-base"], out["expect-head"]) == ("", "", "Failed")
    from kiln.pipeline.github.publish import policy_report

    diff = {"old": {"sha256": "a" * 64}, "new": {"sha256": "a" * 64}, "changes": []}
    outcome, section = policy_report("recipes/tiny.yaml", diff, False, "kiln-policy-approved",
                                     (out["expect-base"], out["expect-head"]))
    assert outcome == "looser" and "| 🔓 looser | `expected verdict` | `Successful` | `Failed` |" in section
    assert "**Not approved**" in section and "`kiln-policy-approved`" in section
    # a recipe new in the pull request has no base copy: its own expectation, and a new policy
    (workspace / ".kiln-base" / "recipes" / "tiny.yaml").unlink()
    assert prepare(tmp_path, workspace)["expect"] == "Failed"
    assert policy_report("recipes/tiny.yaml", None, False, "x")[0] == "new"
    # no base checkout (a manual run of the trusted branch): the checkout's own file
    assert prepare(tmp_path, workspace, base_root="")["expect"] == "Failed"


# --- the demo recipe on a fresh runner -----------------------------------------------------------

# Stands in for the kiln command: `validate` is the real one; `run` is the real one, stopped once
# the run directory records the stage the test waits for (the rest of the demo takes 10-20 minutes).
KILN_UNTIL = r"""#!{python}
import glob, os, signal, subprocess, sys, time
args = sys.argv[1:]
cmd = [{python!r}, "-m", "kiln.pipeline", *args]
if args[0] != "run":
    os.execv(cmd[0], cmd)
runs = args[args.index("--runs") + 1]
proc = subprocess.Popen(cmd, start_new_session=True)
while proc.poll() is None:
    if glob.glob(os.path.join(runs, "*", {until!r})):
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        print("kiln stand-in: stopped the run after", {until!r})
        sys.exit({stopped})
    time.sleep(0.5)
sys.exit(proc.returncode)
"""


def test_demo_recipe_gets_past_its_gguf_build_on_a_fresh_runner(tmp_path: Path) -> None:
    """recipes/demo.yaml, as kiln-pr.yml runs it, through the action's own steps: Prepare, Find
    what the recipe needs, System packages and llama.cpp, Validate and run. The runner's HOME is
    empty and KILN_CACHE unset; its llama.cpp arrives as the cache restores it (the suite's build
    copied to where the needs step says). The demo model and data are linked from the suite's
    cache, as a restored artifact cache holds them (a first run converts and downloads them: not
    the build this checks). The run is stopped once the q4_1 candidate's GGUF is built and its
    engine loaded it through the restored libllama."""
    from kiln.core.llama_cpp_build import install_dir

    shared = shared_build()
    from kiln.pipeline.demo.prepare import demo_model_dir, prepare_demo_data

    data, model = prepare_demo_data().manifest.parent.parent, demo_model_dir().parent
    workspace, home = tmp_path / "workspace", tmp_path / "home"
    (workspace / "recipes").mkdir(parents=True)
    shutil.copy(ROOT / "recipes" / "demo.yaml", workspace / "recipes" / "demo.yaml")
    home.mkdir()
    log = tmp_path / "calls.log"
    until = os.path.join("candidates", "llama-q4_1", "stages", "engine-candidate.json")
    bin_dir = sandbox_bin(tmp_path, kiln=KILN_UNTIL.format(python=str(PY), until=until, stopped=STOPPED),
                          **{n: recorder(n, log, 1) for n in ("cmake", "sudo", "apt-get")})
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "GITHUB_WORKSPACE": str(workspace)}

    proc, prep = run_step(tmp_path, "prep", {**base, "RECIPE": "recipes/demo.yaml", "CONSTRAINTS": "",
                                             "KILN_SOURCE": str(ROOT), "EXPECT": "recipes/demo.yaml: Successful"},
                          cwd=workspace)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cache = Path(prep["kiln-cache"])
    assert cache == home / ".cache" / "kiln" and prep["expect"] == "Successful"
    # the restored artifact cache
    cache.mkdir(parents=True)
    (cache / "data").symlink_to(data, target_is_directory=True)
    (cache / "models").symlink_to(model, target_is_directory=True)

    proc, found = run_step(tmp_path, "needs", {**base, "RECIPE": "recipes/demo.yaml", "SETS": "",
                                               "KILN_CACHE": str(cache), "KILN_SOURCE": str(ROOT)}, cwd=workspace)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert found["llama-cpp"] == "true" and found["demo-data"] == "false"
    restored = Path(found["llama-cpp-dir"])
    assert restored == cache / "llama.cpp" / install_dir().name
    shutil.copytree(shared, restored, symlinks=True)  # actions/cache: a hit on llama-cpp-key

    proc, _ = run_step(tmp_path, "system", {**base, "LLAMA_CPP": "true", "DEMO_DATA": "false",
                                            "KILN_CACHE": str(cache)}, cwd=workspace)
    assert proc.returncode == 0 and f"{restored} complete" in proc.stdout, proc.stdout + proc.stderr

    runs = tmp_path / "runner-temp" / "kiln" / prep["slug"]
    proc, out = run_step(tmp_path, "run", {**base, "RECIPE": "recipes/demo.yaml", "SETS": "", "RUNS": str(runs),
                                           "KILN_CACHE": str(cache), "GITHUB_ACTIONS": "true",
                                           "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")},
                         cwd=workspace, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out["rc"] == str(STOPPED), proc.stdout[-3000:]  # stopped by the test, not by kiln (exit 2: no build)
    assert not log.exists(), log.read_text()  # nothing compiled, no sudo, no apt-get

    assert (runs / "pr-comment.md").is_file()  # the run ended before its gate: the action's fallback comment
    [run_dir] = [p for p in runs.iterdir() if p.is_dir()]
    stages = run_dir / "candidates" / "llama-q4_1" / "stages"
    gguf = json.loads((stages / "optimize-candidate.json").read_text())
    engine = json.loads((stages / "engine-candidate.json").read_text())
    for record in (gguf, engine):  # the same kiln cache as the build step's
        assert Path(record["path"]).is_relative_to(cache / "stages"), record
    files = list(Path(gguf["path"]).rglob("*.gguf"))
    assert files and files[0].stat().st_size > 50e6, files  # 135M parameters at ~5.7 bits
    engine_dir = Path(json.loads((Path(engine["path"]) / "result.json").read_text())["engine_dir"])
    manifest = json.loads((engine_dir / "kiln-engine.json").read_text())
    assert engine_dir.is_relative_to(cache) and manifest["backend"] == "llama_cpp", manifest
    assert manifest["build"]["type"] == "q4_1" and manifest["config"]["runtime"] == "library", manifest
