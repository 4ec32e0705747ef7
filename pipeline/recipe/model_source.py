"""Resolve the recipe's model to a local checkpoint folder and its content hash."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import BadInput
from kiln.core.files import cached_tree_hash


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    sha256: str
    config: dict


def resolve_model(spec: str, cache: Path) -> ResolvedModel:
    path = demo_model_folder(prepare=True) if spec == "demo" else checkpoint_folder(spec)
    config = check_checkpoint(path)
    return ResolvedModel(path=path, sha256=cached_tree_hash(path, cache / "hashes.json"), config=config)


def demo_model_folder(prepare: bool) -> Path | None:
    """The demo checkpoint's folder; converted first when `prepare` (~1 CPU-minute), else None until it is."""
    from kiln.pipeline.demo.prepare import demo_model_dir, prepared_demo_model

    return demo_model_dir() if prepare else prepared_demo_model()


def checkpoint_folder(spec: str) -> Path:
    """The local checkpoint folder model.path names, once it holds a config and safetensors weights."""
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise BadInput(f"model.path: {path} is not a Hugging Face checkpoint folder (no config.json). "
                       "Point it at a local folder saved with save_pretrained, or use 'demo'.")
    if not any(path.glob("*.safetensors")):
        raise BadInput(f"model.path: {path} has no .safetensors weights. kiln never loads pickled "
                       "weights (.bin/.pt); convert them with save_pretrained(safe_serialization=True).")
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
# Heads kiln can score and generate with; an encoder (BertModel, …) would be loaded with a
# randomly initialised LM head and evaluated as if it were a model.
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def check_checkpoint(path: Path) -> dict:
    """What can be told about a checkpoint before any stage runs: its config parses, it is a
    causal LM, every safetensors file is whole, and it has a tokenizer. Returns the config."""
    from kiln.optimize.checkpoint import read_header, safetensors_files

    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadInput(f"model.path: {config_file} is not valid JSON ({str(e).splitlines()[0][:200]}); "
                       "re-save the checkpoint with save_pretrained.") from None
    if not isinstance(config, dict):
        raise BadInput(f"model.path: {config_file} holds a {type(config).__name__}, not a model config object.")
    archs = config.get("architectures") or []
    if archs and not any(str(a).endswith(CAUSAL_HEADS) for a in archs):
        raise BadInput(f"model.path: {path} is a {', '.join(map(str, archs))}, not a causal language model "
                       "(…ForCausalLM). kiln evaluates and serves text generation models; it has no "
                       "embedding or encoder path yet.")
    for f in safetensors_files(path):
        read_header(f)  # refuses a truncated or corrupt file, naming it
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise BadInput(f"model.path: {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save the "
                       "tokenizer beside the weights (tokenizer.save_pretrained(path)).")
    return config
