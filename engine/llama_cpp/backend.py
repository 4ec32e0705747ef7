"""The `llama_cpp` backend: builds a GGUF engine folder and loads it under one of two runtimes.

`runtime: server` (the default, llama_cpp_server.py): kiln starts llama.cpp's `llama-server` and
streams from it over HTTP. `runtime: library` (llama_cpp_library.py): llama.cpp in kiln's process,
batched by kiln: the same GGUF, threads, slots and numerics, without the hop through a server
process between each decode step and kiln. Either way scoring (`score`, `next_token_logprobs`:
perplexity, token agreement, lm-eval log-likelihoods) runs in-process (llama_cpp_scoring.py), with
the same weights, threads, KV cache type and flash attention setting as generation (`cache_type`,
`flash_attn`: llama-server's defaults, f16 and auto, or f32 and off for exact parity with torch
fp32). The options, and which runtime reads each: llama_cpp_config.py.

Build: the engine folder holds one GGUF file and the HF tokenizer files. A `gguf` artifact
(optimize/gguf.py) is linked as it is; an unquantized safetensors checkpoint (the baseline) is
converted at `precision` with the same converter and tokenizer check.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

from kiln.core.errors import BadInput
from kiln.engine.base import BACKENDS, REBUILD, Engine, EngineBackend, keep_checkpoint_files
from kiln.optimize.checkpoint import link_or_copy
from kiln.engine.llama_cpp.config import DRAFT_GGUF, LlamaCppConfig, drafting_candidate
from kiln.engine.llama_cpp.library import LlamaLibraryEngine
from kiln.engine.llama_cpp.server import LlamaServerEngine

GGUF = "model.gguf"


@BACKENDS.register("llama_cpp", LlamaCppConfig)
class LlamaCppBackend(EngineBackend):
    libraries: ClassVar[tuple[str, ...]] = ("gguf", "transformers")
    artifact_formats: ClassVar[tuple[str, ...]] = ("safetensors", "gguf")
    quantized_formats: ClassVar[tuple[str, ...] | None] = ("gguf",)  # it converts only unquantized safetensors
    revision: ClassVar[int] = 1  # 1: ignore_eos resumes past an EOS instead of llama-server's -inf EOS bias

    def build(self, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
        from kiln.optimize import gguf
        from kiln.core.llama_cpp_build import VERSION

        checkpoint, out_dir = Path(checkpoint), Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        source = checkpoint / gguf.GGUF_FILE
        if source.is_file():
            link_or_copy(source, out_dir / GGUF)
            kind = _artifact_field(checkpoint, "type")
        else:
            method = _artifact_field(checkpoint, "method")
            if method not in (None, "none"):
                raise BadInput(f"{checkpoint}: a '{method}' artifact; the llama_cpp engine converts an unquantized "
                               "checkpoint or serves a gguf one: set optimize.method: gguf (with its type) or none.")
            if not any(checkpoint.glob("*.safetensors")):
                raise BadInput(f"{checkpoint}: neither {gguf.GGUF_FILE} (optimize.method: gguf) nor *.safetensors "
                               "weights: the llama_cpp engine builds from one of them.")
            kind = self.config.precision  # type: ignore[attr-defined]
            gguf.convert(checkpoint, out_dir / GGUF, kind)
            gguf.check_tokenizer(out_dir / GGUF, checkpoint, list(gguf.SAMPLE_TEXT))
        keep_checkpoint_files(checkpoint, out_dir)
        info = gguf.describe(out_dir / GGUF, kind)
        draft = _link_draft(self.config, out_dir)  # type: ignore[attr-defined]
        return {"format": "gguf", "file": GGUF, "type": kind, "llama_cpp": VERSION,
                "bits_per_weight": info["bits_per_weight"], "weight_bytes": info["file_bytes"],
                "tokenizer_model": info["tokenizer_model"], **({"draft": draft} if draft else {}),
                "build_seconds": round(time.perf_counter() - started, 1)}

    @classmethod
    def open(cls, engine_dir: Path, config: LlamaCppConfig, manifest: dict[str, Any]) -> Engine:
        path = engine_dir / manifest["build"]["file"]
        draft = manifest["build"].get("draft")
        for needed in (path, *([engine_dir / draft["file"]] if draft else [])):
            if not needed.is_file():
                raise BadInput(f"{engine_dir}: {needed.name} is missing. {REBUILD}")
        if config.runtime == "library":
            return LlamaLibraryEngine(path, engine_dir, config)
        return LlamaServerEngine.start(path, engine_dir, config)


def _link_draft(config: LlamaCppConfig, out_dir: Path) -> dict[str, Any] | None:
    """Another candidate's GGUF drafting for this engine, linked in as draft.gguf and recorded as the
    folder's own source is (the artifact's path and hash); None when no candidate drafts for it."""
    from kiln.optimize.gguf import GGUF_FILE

    draft = drafting_candidate(config)
    if draft is None:
        return None
    if draft.artifact is None:
        raise BadInput(f"engine.speculative.draft_model: candidate '{draft.candidate}''s artifact was not made "
                       "here; build this engine through `kiln run` on the recipe that lists both candidates")
    link_or_copy(draft.artifact / GGUF_FILE, out_dir / DRAFT_GGUF)
    sha256 = config.speculative.draft_sha256  # type: ignore[union-attr]
    return {"file": DRAFT_GGUF, "candidate": draft.candidate, "source": {"path": str(draft.artifact), "sha256": sha256}}


def _artifact_field(checkpoint: Path, key: str) -> str | None:
    """A field of the artifact's manifest (`type` is optimize/gguf.py's), None without one."""
    manifest = checkpoint / "kiln-artifact.json"
    if manifest.is_file():
        return json.loads(manifest.read_text()).get(key)
    return None

