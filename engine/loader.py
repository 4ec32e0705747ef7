"""Load any built engine folder by its manifest, refusing one built for other hardware.

`kiln serve ENGINE_DIR` and the evaluators call `load_engine`; nothing else needs to know which
backend built the folder. The manifest (`kiln-engine.json`) names the backend and holds its
validated config, so an engine folder is self-describing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kiln.engine.base import BACKENDS, MANIFEST, REBUILD, Engine, EngineConfig
from kiln.engine.cache import hardware_fingerprint
from kiln.core.errors import BadInput

_REQUIRED = ("backend", "config", "source", "versions", "hardware", "build")


def read_manifest(engine_dir: Path) -> dict[str, Any]:
    """The manifest of `engine_dir`, checked for shape; BadInput names the file and the fix."""
    path = Path(engine_dir) / MANIFEST
    if not path.is_file():
        raise BadInput(f"{path} not found: {engine_dir} is not a built engine. {REBUILD}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"{path} is not valid JSON ({e}). {REBUILD}") from e
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise BadInput(f"{path} lacks {', '.join(missing)}. {REBUILD}")
    BACKENDS.get(manifest["backend"])  # unknown backend -> BadInput with "Did you mean"
    return manifest


def engine_config(manifest: dict[str, Any], where: Path | str = MANIFEST) -> EngineConfig:
    """The manifest's backend config, validated by the backend's own config class."""
    try:
        return TypeAdapter(BACKENDS.config_union()).validate_python(manifest["config"])
    except ValidationError as e:
        problems = [f"config.{'.'.join(map(str, x['loc'][1:] or x['loc']))}: {x['msg']}" for x in e.errors()]
        raise BadInput(f"{where}: invalid engine config. {REBUILD}", problems) from e


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
