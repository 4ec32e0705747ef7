"""Resolve the recipe's model to a local checkpoint folder and its content hash."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kiln.pipeline.errors import BadInput
from kiln.pipeline.files import cached_tree_hash


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    sha256: str
    config: dict


def cache_root() -> Path:
    from kiln.pipeline.demo import cache_root as demo_cache_root

    return demo_cache_root()


def resolve_model(spec: str, cache: Path) -> ResolvedModel:
    if spec == "demo":
        from kiln.pipeline.demo import demo_model_dir

        path = demo_model_dir()
    else:
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            raise BadInput(f"model.path: {path} is not a Hugging Face checkpoint folder (no config.json). "
                           "Point it at a local folder saved with save_pretrained, or use 'demo'.")
        if not any(path.glob("*.safetensors")):
            raise BadInput(f"model.path: {path} has no .safetensors weights. kiln never loads pickled "
                           "weights (.bin/.pt); convert them with save_pretrained(safe_serialization=True).")
    config = json.loads((path / "config.json").read_text())
    return ResolvedModel(path=path, sha256=cached_tree_hash(path, cache / "hashes.json"), config=config)
