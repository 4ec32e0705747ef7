"""Load any built engine folder by its manifest, refusing one built for other hardware.

`kiln serve ENGINE_DIR` and the evaluators call `load_engine`; nothing else needs to know which
backend built the folder. The manifest (`kiln-engine.json`) names the backend and holds its
validated config, so an engine folder is self-describing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput
from kiln.engine.base import BACKENDS, REBUILD, Engine, engine_config, read_manifest
from kiln.engine.cache import hardware_fingerprint

# read_manifest and engine_config live in base.py (EngineBackend.load reads them); callers import them here.
__all__ = ["check_hardware", "engine_config", "load_engine", "read_manifest"]


def check_hardware(manifest: dict[str, Any], engine_dir: Path) -> None:
    """Refuse an engine built for other hardware: its kernels and numbers would not carry over."""
    built_for = manifest.get("hardware")
    if built_for is None:  # hardware-independent backend (a remote endpoint)
        return
    here = hardware_fingerprint()
    if built_for != here:
        diff = [f"{k}: built for {built_for.get(k)!r}, this machine has {here.get(k)!r}"
                for k in sorted(set(built_for) | set(here)) if built_for.get(k) != here.get(k)]
        raise BadInput(f"Engine {engine_dir} was built on different hardware. {REBUILD}", diff)


def load_engine(engine_dir: Path, **options: Any) -> Engine:
    """Load a built engine folder, whatever its backend. `options` are backend runtime overrides."""
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    check_hardware(manifest, engine_dir)
    return BACKENDS.get(manifest["backend"]).load(engine_dir, **options)
