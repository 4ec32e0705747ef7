"""What shaped the numbers: library versions, interpreter, machine and git commit."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

LIBRARIES = (
    "kiln", "torch", "transformers", "gptqmodel", "torchao", "numpy", "scipy", "lm-eval", "mlflow",
    "datasets", "accelerate", "safetensors", "tokenizers", "pydantic", "aiohttp", "nvidia-modelopt",
    "tensorrt-llm", "openvino", "onnxruntime-genai",
)


def library_versions(names: tuple[str, ...] = LIBRARIES, *, keep_missing: bool = False) -> dict[str, str | None]:
    """Installed versions, read without importing the libraries. An absent library is left out,
    or kept as None with `keep_missing` (an engine's cache key must change when one appears)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            if keep_missing:
                out[name] = None
    return out


@functools.cache
def git_commit(cwd: Path | None = None) -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=cwd, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "libraries": library_versions(),
        "git_commit": git_commit(),
    }
