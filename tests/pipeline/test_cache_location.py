"""One cache for everything (issue 35, point 4): what `make llama-cpp` builds, a user's `kiln run`
from a folder outside the checkout finds, with or without KILN_CACHE.

Each test plays a user with an empty HOME. The build `make` finds is the suite's own, linked into
that user's cache, so nothing is compiled or downloaded (a stand-in `cmake` fails and pip has no
index: a make that looked anywhere else would stop, not build). `make llama-cpp` runs for real and
says where the build is; the lookup and the stages' cache are then read from a process in another
folder; and once, the real CLI: `kiln run` on a recipe whose one candidate is a GGUF served by
llama.cpp, stopped when that candidate's engine is built (its GGUF converted and quantized by the
build's tools). Before the fix, make put the build under the checkout and kiln looked under the
current folder: that run stopped at the GGUF build with exit 2. Its runs and tracking store go to the
default home (~/.local/share/kiln), not the folder it was started in.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.llama_cpp_build import require_llama_cpp
from tests.pipeline.conftest import write_recipe

REPO = Path(__file__).resolve().parents[2]
NAME = "llama-q8_0"
CANDIDATE = {"name": NAME, "optimize": {"method": "gguf", "type": "q8_0", "threads": 1},
             "engine": {"backend": "llama_cpp", "threads": 1, "parallel": 1, "ctx_per_slot": 256}}
LOOKUP = ("import json; from kiln.core import llama_cpp_build as b; from kiln.core.home import kiln_cache; "
          "print(json.dumps({'build': str(b.install_dir()), 'converter': str(b.converter()), "
          "'cache': str(kiln_cache())}))")


def user(tmp_path: Path, with_cache: bool) -> tuple[dict, Path]:
    """A user's environment (empty HOME, KILN_CACHE set or not) and the cache kiln should use, which
    holds what `make llama-cpp` and `kiln prepare-demo` left there: the build and the demo data."""
    from kiln.core.llama_cpp_build import complete, install_dir

    require_llama_cpp()
    shared_build, shared_data = install_dir(), Path(os.environ["KILN_CACHE"]) / "data"
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text("#!/bin/sh\necho 'test: no compile here' >&2\nexit 1\n")
    (bin_dir / "cmake").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KILN_CACHE", "KILN_HOME", "XDG_DATA_HOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(HOME=str(home), PATH=f"{bin_dir}:{env['PATH']}", PIP_NO_INDEX="1")
    cache = tmp_path / "elsewhere" / "kiln-cache" if with_cache else home / ".cache" / "kiln"
    if with_cache:
        env["KILN_CACHE"] = str(cache)
    (cache / "llama.cpp").mkdir(parents=True)
    (cache / "llama.cpp" / shared_build.name).symlink_to(shared_build, target_is_directory=True)
    (cache / "data").symlink_to(shared_data, target_is_directory=True)
    assert complete(cache / "llama.cpp" / shared_build.name)
    return env, cache


def make_llama_cpp(env: dict, cwd: Path) -> str:
    proc = subprocess.run(["make", "-C", str(REPO), "--no-print-directory", f"PY={sys.executable}", "llama-cpp"],
                          cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("with_cache", [False, True], ids=["default-cache", "KILN_CACHE"])
def test_make_and_kiln_agree_on_the_cache_from_any_folder(tmp_path, with_cache):
    from kiln.core.llama_cpp_build import VERSION, install_dir

    env, cache = user(tmp_path, with_cache)
    build = cache / "llama.cpp" / install_dir().name
    assert f"llama.cpp {VERSION}: {build}\n" in make_llama_cpp(env, cwd=tmp_path)

    folder = tmp_path / "a-users-project"
    folder.mkdir()
    proc = subprocess.run([sys.executable, "-c", LOOKUP], cwd=folder, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen == {"build": str(build), "converter": str(build / "convert_hf_to_gguf.py"), "cache": str(cache)}


@pytest.mark.parametrize("with_cache", [False, True], ids=["default-cache", "KILN_CACHE"])
def test_the_build_script_runs_without_kiln_and_looks_in_kilns_cache(tmp_path, with_cache):
    """The Makefile runs `python3 core/llama_cpp_build.py` before kiln is installed. With no site-packages
    (-S) kiln cannot be imported, and the script still names the build where kiln looks: under core/home.py's
    cache, which it imports as a plain module."""
    from kiln.core.llama_cpp_build import VERSION

    env = {k: v for k, v in os.environ.items() if k not in ("KILN_CACHE", "PYTHONPATH")}
    env["HOME"] = str(tmp_path / "home")
    cache = tmp_path / "elsewhere" if with_cache else tmp_path / "home" / ".cache" / "kiln"
    if with_cache:
        env["KILN_CACHE"] = str(cache)
    bare = [sys.executable, "-S"]
    assert subprocess.run([*bare, "-c", "import kiln"], cwd=tmp_path, env=env, capture_output=True).returncode == 1
    check = subprocess.run([*bare, str(REPO / "core" / "llama_cpp_build.py"), "--check"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    seen = json.loads(subprocess.run([sys.executable, "-c", LOOKUP], cwd=tmp_path, env=env, capture_output=True,
                                     text=True, check=True).stdout)
    assert seen["cache"] == str(cache) and Path(seen["build"]).parent == cache / "llama.cpp"
    assert (check.returncode, check.stdout) == (1, f"llama.cpp {VERSION}: {seen['build']} missing or incomplete\n")


def test_kiln_run_from_another_folder_gets_past_the_gguf_build(tmp_path, tiny_model_dir):
    """The real CLI, with KILN_CACHE unset: the case that stopped with exit 2."""
    env, cache = user(tmp_path, with_cache=False)
    make_llama_cpp(env, cwd=tmp_path)
    work = tmp_path / "a-users-project"
    raw = yaml.safe_load(write_recipe(tmp_path / "base.yaml", tiny_model_dir).read_text())
    del raw["optimize"], raw["engine"]
    raw.update(name="my-model", candidates=[CANDIDATE], baseline={"engine": {"backend": "torch", "threads": 1}})
    work.mkdir()
    recipe = work / "my-recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))

    kiln = Path(sys.executable).parent / "kiln"  # the console script a user runs
    log = tmp_path / "kiln.log"
    home = Path(env["HOME"]) / ".local" / "share" / "kiln"  # kiln's home with KILN_HOME unset (kiln.core.home)
    until = str(home / "runs" / "*" / "candidates" / NAME / "stages" / "engine-candidate.json")
    with log.open("w") as out:
        proc = subprocess.Popen([str(kiln), "run", str(recipe)], cwd=work, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 900  # a hang guard, not a measurement
            while proc.poll() is None and not glob.glob(until) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    assert glob.glob(until), f"exit {proc.returncode}:\n{log.read_text()[-3000:]}"
    record = json.loads(Path(glob.glob(until)[0]).read_text())
    assert Path(record["path"]).is_relative_to(cache / "stages"), record  # the user's cache, not the folder's
    assert not (work / ".cache").exists()
    assert sorted(p.name for p in work.iterdir()) == ["my-recipe.yaml"]  # no runs/, mlflow.db, mlruns/ here
    assert (home / "mlflow.db").is_file() and any((home / "mlruns").rglob("recipe.yaml"))  # the parent run's artifact
    # ... and a command started from yet another folder finds the run there
    other = tmp_path / "another-folder"
    other.mkdir()
    run_dir = Path(glob.glob(until)[0]).parents[3]  # <home>/runs/<run>/candidates/<name>/stages/<record>
    listed = subprocess.run([str(kiln), "runs", "--json"], cwd=other, env=env, capture_output=True, text=True)
    assert [r["run"] for r in json.loads(listed.stdout)] == [run_dir.name], listed.stdout + listed.stderr
    shown = subprocess.run([str(kiln), "show", run_dir.name, "--json"], cwd=other, env=env, capture_output=True, text=True)
    assert json.loads(shown.stdout)["run_dir"] == str(run_dir), shown.stdout + shown.stderr
    assert list(other.iterdir()) == []
