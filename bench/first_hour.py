"""A newcomer's first hour, timed (issue 54, point 8): `make demo` on a fresh clone with an empty
kiln cache, a new virtualenv and no pip cache (the install and the llama.cpp compile included),
then a user's own three-candidate recipe on a copy of the demo model, as the docs write one.

Phases, each timed from outside:
- setup: `make setup-demo` (the pip install beside the demo's part of the llama.cpp compile); the install's and the
  compile's own ends are read from the files they leave (the venv's stamp, the build's manifest);
- demo: `make demo` once setup is done (the run of recipes/demo.yaml, its verdict and exit code);
- own recipe: `kiln run` of GGUF q8_0 and q4_K_M on llama.cpp and CTranslate2 int8 against fp32
  torch (perplexity, token agreement, lm-eval's word_swap, a benchmark) on "my-finetune", a copy of
  the demo checkpoint in a folder of its own, with the kiln cache the demo left (the llama.cpp
  build and the demo data are the machine's; no stage of the demo is shared: other weights' path). Its
  candidates run on the server runtime, so kiln compiles the rest of llama.cpp (llama-server) first, once.

The machine's load is sampled every 5 s throughout (1-minute load average, and CPU pressure where
the kernel has PSI) and recorded beside each phase: a phase timed beside other work says so.
Targets: setup + demo within 15 minutes, the own recipe within 15 minutes, on 2 cores.

    flock /tmp/kiln-heavy.lock .venv/bin/python bench/first_hour.py [--keep DIR] [--pip-cache] [--skip-own]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "first_hour.json"
TARGET_S = 15 * 60
OWN_RECIPE = {
    "name": "my-finetune",
    "model": {"path": None},  # filled in: the copy's folder
    "baseline": {"engine": {"backend": "torch", "threads": 2}},
    "candidates": [
        {"name": "gguf-q8_0", "optimize": {"method": "gguf", "type": "q8_0"},
         "engine": {"backend": "llama_cpp", "threads": 2}},
        {"name": "gguf-q4_K_M", "optimize": {"method": "gguf", "type": "q4_K_M"},
         "engine": {"backend": "llama_cpp", "threads": 2}},
        {"name": "ct2-int8", "optimize": {"method": "none"},
         "engine": {"backend": "ctranslate2", "quantization": "int8", "threads": 2}},
    ],
    "evaluate": {
        "quality": {"perplexity": {"text": "demo", "max_documents": 24, "seq_len": 128}, "agreement": True,
                    "lmeval": {"tasks": ["word_swap"], "limit": 200}},
        "benchmark": {"prompts": "demo", "num_prompts": 8, "max_new_tokens": 16, "repeats": 3},
    },
    "gate": {"confidence": 0.95, "checks": [
        {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
        {"kind": "agreement", "metric": "top1_agreement", "min": 0.9},
        {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.5},
        {"kind": "quality", "metric": "word_swap_acc", "margin": 0.03},
    ]},
    "tracking": {"experiment": "my-finetune"},
}


class LoadSampler(threading.Thread):
    """The 1-minute load average and PSI's CPU "some" share, every `every_s` seconds."""

    def __init__(self, every_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()

    def run(self) -> None:
        last = _psi_total()
        while not self._stop.wait(self.every_s):
            now = _psi_total()
            pressure = (now[1] - last[1]) / 1e6 / (now[0] - last[0]) if now[1] is not None and last[1] is not None else None
            self.samples.append({"t": time.time(), "load1": os.getloadavg()[0], "cpu_pressure": pressure})
            last = now

    def between(self, start: float, end: float) -> dict:
        window = [s for s in self.samples if start <= s["t"] <= end]
        load = [s["load1"] for s in window]
        pressure = [s["cpu_pressure"] for s in window if s["cpu_pressure"] is not None]
        return {"load1_median": statistics.median(load) if load else None, "load1_max": max(load, default=None),
                "cpu_pressure_median": statistics.median(pressure) if pressure else None, "samples": len(window)}

    def stop(self) -> None:
        self._stop.set()


def _psi_total() -> tuple[float, int | None]:
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return time.monotonic(), int(some.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return time.monotonic(), None


def timed(name: str, cmd: list[str], cwd: Path, env: dict[str, str], log: Path, load: LoadSampler) -> dict:
    print(f"{name}: {' '.join(cmd)}", flush=True)
    start, t0 = time.time(), time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    print(f"{name}: exit {proc.returncode} in {wall / 60:.1f} min (log {log})", flush=True)
    return {"phase": name, "exit": proc.returncode, "wall_s": round(wall, 1), "started": start,
            "load": load.between(start, time.time()), "log": str(log)}


def verdict_line(log: Path) -> str | None:
    """The run's verdict, from the report's lineage row `| verdict | Successful | … |`."""
    rows = [ln.split("|")[2].strip() for ln in log.read_text(errors="replace").splitlines()
            if ln.startswith("| verdict |") and ln.split("|")[2].strip() != "check"]  # not the checks table's header
    return rows[-1] if rows else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    ap.add_argument("--pip-cache", action="store_true", help="let pip use its cache (a returning user)")
    ap.add_argument("--skip-own", action="store_true", help="time setup and make demo only, not the own recipe")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="kiln-first-hour-"))
    clone, cache = work / "kiln", work / "cache"
    shutil.rmtree(clone, ignore_errors=True), shutil.rmtree(cache, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "KILN_", "MLFLOW_"))}
    env.update(KILN_CACHE=str(cache), KILN_HOME=str(work / "home"), PATH=f"/usr/bin:/bin:{env.get('PATH', '')}")
    if not args.pip_cache:
        env["PIP_NO_CACHE_DIR"] = "1"
    load = LoadSampler()
    load.start()
    phases = [timed("setup", ["make", "setup-demo"], clone, env, work / "setup.log", load)]
    phases[0].update(install_s=_ended(clone / ".venv" / ".kiln-installed", phases[0]),
                     compile_s=_ended(next(iter((cache / "llama.cpp").glob("*/BUILD")), None), phases[0]))
    phases.append(timed("demo", ["make", "demo"], clone, env, work / "demo.log", load))
    phases[-1]["verdict"] = verdict_line(work / "demo.log")
    if not args.skip_own:
        own = _own_recipe(clone, work)
        phases.append(timed("own recipe", [str(clone / ".venv" / "bin" / "kiln"), "run", str(own)], work, env,
                            work / "own.log", load))
        phases[-1]["verdict"] = verdict_line(work / "own.log")
    load.stop()
    first = phases[0]["wall_s"] + phases[1]["wall_s"]
    record = {"commit": commit, "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version()},
              "pip_cache": args.pip_cache, "phases": phases,
              "make_demo_s": first, "make_demo_within_target": first <= TARGET_S,
              "own_recipe_within_target": phases[2]["wall_s"] <= TARGET_S if len(phases) > 2 else None,
              "target_s": TARGET_S}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=2))
    _table(record)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def _ended(marker: Path | None, phase: dict) -> float | None:
    """Seconds from the phase's start to when `marker` was last written (None: not there)."""
    return round(marker.stat().st_mtime - phase["started"], 1) if marker and marker.exists() else None


def _own_recipe(clone: Path, work: Path) -> Path:
    """A copy of the demo checkpoint as the user's own model, and the recipe the docs lead to."""
    py = clone / ".venv" / "bin" / "python"
    lookup = "from kiln.pipeline.demo.prepare import demo_model_dir; print(demo_model_dir())"
    demo = subprocess.run([str(py), "-c", lookup],
                          cwd=work, env={**os.environ, "KILN_CACHE": str(work / "cache")}, capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]
    model = work / "my-finetune"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(demo, model)
    recipe = json.loads(json.dumps(OWN_RECIPE))
    recipe["model"]["path"] = str(model)
    path = work / "my-finetune.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _table(record: dict) -> None:
    print(f"\nkiln {record['commit']} on {record['machine']['cpu']} ({record['machine']['cores']} cores)")
    print(f"{'phase':<12} {'exit':>4} {'minutes':>8} {'load1 med/max':>14} {'CPU pressure':>12}  verdict")
    for p in record["phases"]:
        ld, pr = p["load"], p["load"]["cpu_pressure_median"]
        print(f"{p['phase']:<12} {p['exit']:>4} {p['wall_s'] / 60:>8.1f} "
              f"{(ld['load1_median'] or 0):>6.2f}/{(ld['load1_max'] or 0):<6.2f} "
              f"{(f'{pr:.0%}' if pr is not None else '-'):>12}  {p.get('verdict') or ''}")
    s = record["phases"][0]
    print(f"setup: pip install done at {s.get('install_s')} s, llama.cpp compile at {s.get('compile_s')} s")
    own = (f"{record['phases'][2]['wall_s'] / 60:.1f} min ({'met' if record['own_recipe_within_target'] else 'NOT met'})"
           if len(record["phases"]) > 2 else "not timed (--skip-own)")
    print(f"make demo from a fresh clone: {record['make_demo_s'] / 60:.1f} min (target {TARGET_S // 60}: "
          f"{'met' if record['make_demo_within_target'] else 'NOT met'}); own three-candidate recipe: {own}")
    print(f"JSON: {OUT}")


if __name__ == "__main__":
    sys.exit(main())
