"""Content-addressed engine cache and the hardware fingerprint that keys it.

An engine is a function of four things: the checkpoint's bytes (its hash), the engine config,
the versions of the libraries that build and run it, and the hardware it was built for. The
cache key hashes all four, so changing any of them builds a new engine and a machine with
different hardware never picks up an engine built elsewhere. Builds land atomically
(`atomic_dir`): an interrupted build leaves no half engine that a later run could reuse.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kiln.engine.base import BACKENDS, MANIFEST, EngineConfig
from kiln.core.files import atomic_dir, atomic_write_json, hash_of
from kiln.core.versions import library_versions

# CPU flags that change which kernels run (and so the numbers an engine produces).
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "vnni", "bf16", "asimd", "sve", "neon")


def _cpu() -> dict[str, Any]:
    model, flags = "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "CPU part") and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = {f for f in value.split() if f.startswith(_ISA_PREFIXES)}
    return {"model": model, "isa": sorted(flags)}


def _gpus() -> list[dict[str, Any]]:
    if not (shutil.which("nvidia-smi") or Path("/dev/nvidiactl").exists()):
        return []  # no NVIDIA driver: skip importing torch just to be told so
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    driver = None
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )
        driver = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"name": p.name, "sm": f"{p.major}{p.minor}", "cuda": torch.version.cuda,
                     "driver": driver, "memory_gib": round(p.total_memory / 2**30)})
    return gpus


def hardware_fingerprint() -> dict[str, Any]:
    """What an engine's numbers depend on: CPU model and ISA flags, GPU name/SM/driver."""
    return {"cpu": _cpu(), "gpus": _gpus()}


def engine_key(config: EngineConfig, checkpoint_hash: str, versions: dict, hardware: Any, revision: int = 0) -> str:
    blob = {"config": config.model_dump(mode="json"), "checkpoint": checkpoint_hash,
            "versions": versions, "hardware": hardware, **({"revision": revision} if revision else {})}
    return hash_of(blob)[:24]


def write_engine(config: EngineConfig, checkpoint_dir: Path, checkpoint_hash: str, out_dir: Path) -> dict:
    """Build an engine into `out_dir` (which must exist and be empty) and write its manifest."""
    backend = BACKENDS.create(config)
    cls = type(backend)
    versions = library_versions(getattr(cls, "libraries", ()), keep_missing=True)
    hardware = hardware_fingerprint() if getattr(cls, "hardware_bound", True) else None
    fields = backend.build(Path(checkpoint_dir).resolve(), Path(out_dir))
    manifest = {
        "backend": config.backend,
        "config": config.model_dump(mode="json"),
        "source": {"path": str(Path(checkpoint_dir).resolve()), "sha256": checkpoint_hash},
        "versions": versions,
        "hardware": hardware,
        "key": engine_key(config, checkpoint_hash, versions, hardware, cls.revision),
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "build": fields,
    }
    atomic_write_json(Path(out_dir) / MANIFEST, manifest)
    return manifest


def build_engine(config: EngineConfig, checkpoint_dir: Path, checkpoint_hash: str, cache_root: Path) -> Path:
    """Return the cached engine for these inputs on this machine, building it once if needed."""
    cls = BACKENDS.get(config.backend)
    versions = library_versions(getattr(cls, "libraries", ()), keep_missing=True)
    hardware = hardware_fingerprint() if getattr(cls, "hardware_bound", True) else None
    final = Path(cache_root) / "engines" / engine_key(config, checkpoint_hash, versions, hardware, cls.revision)
    if (final / MANIFEST).is_file():
        return final
    with atomic_dir(final) as scratch:
        write_engine(config, checkpoint_dir, checkpoint_hash, scratch)
    return final

