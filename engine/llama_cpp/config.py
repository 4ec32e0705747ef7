"""The `llama_cpp` engine's options, read by the backend (llama_cpp.py) and both runtimes.

Each field says which runtime reads it: `server` (llama_cpp_server.py, a llama-server process),
`library` (llama_cpp_library.py, llama.cpp in kiln's process) or both. Scoring runs in-process
under either runtime (llama_cpp_scoring.py) with the same threads, batch, KV cache types and flash
attention as generation.

The levers of issue 53 (speculative decoding, KV-cache types for K and V, prompt-cache reuse) are
fields here too. Left at their defaults they stay out of the config's dump (`exclude_if`), so every
engine stage key and recipe digest made before they existed is unchanged.

A draft model (speculative type draft) is a .gguf path or another candidate of the recipe
(`DraftCandidate`): the recipe fills in how that candidate's artifact is made (Recipe.arms), the
run's optimize stage makes it once under that candidate's own stage key, the engine stage names its
bytes (`draft_sha256`, which keys the engine) and the build links it into the engine folder as
`draft.gguf` (engine/llama_cpp/backend.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kiln.engine.base import EngineConfig
from kiln.optimize.gguf import GgufConfig

# The KV cache types the pinned llama.cpp takes (llama-server -ctk/-ctv): ggml_type ids for the binding's
# context params, and bytes per element (a quantized type stores blocks of 32 with their scales).
KvType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
KV_GGML_TYPE: dict[str, int] = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
                                "iq4_nl": 20, "bf16": 30}
KV_BYTES: dict[str, float] = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
                              "q4_1": 20 / 32, "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
_FLOAT_KV = ("f32", "f16", "bf16")
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
DRAFT_GGUF = "draft.gguf"  # another candidate's GGUF in the engine folder, beside the model's model.gguf


class DraftCandidate(BaseModel):
    """A draft model given as another candidate of the same recipe (`draft_model: {candidate: NAME}`): its
    gguf artifact drafts, e.g. the checkpoint's q4_0 for its q8_0. Every candidate of a recipe quantizes
    the same checkpoint, so the draft shares the model's vocabulary (llama-server refuses one that does not)."""

    model_config = ConfigDict(extra="forbid")
    candidate: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                           description="the name of another candidate of the recipe whose optimize.method is gguf")
    optimize: GgufConfig | None = Field(
        None, exclude_if=lambda v: v is None, description="how the draft is made: the named candidate's optimize, "
        "filled in when the recipe splits into its candidates (Recipe.arms); a recipe leaves it out")
    # The artifact folder the engine stage found the draft in (its optimize stage's model/), which the build
    # links draft.gguf from: where it lies on this machine, never part of a key.
    _artifact: Path | None = PrivateAttr(None)

    @property
    def artifact(self) -> Path | None:
        return self._artifact


class SpeculativeConfig(BaseModel):
    """llama-server's speculative decoding (server runtime only): a cheap proposer drafts tokens and the
    model checks them all in one forward pass, keeping the longest prefix it agrees with. Under greedy
    sampling the text is meant to be the model's own; kiln's exactness check holds each candidate to it.
    Sizes left None take llama.cpp's default for the type (docs/engines.md, Levers)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache", "draft"] = Field(
        description="the proposer: an n-gram lookup in the sequence's own tokens (ngram-*), or a smaller draft model "
                    "(draft: llama-server --spec-type draft-simple)")
    ngram_n: int | None = Field(
        None, ge=1, le=1024, description="n-gram types: the lookup length, the tokens matched to find a draft "
        "(--spec-ngram-<type>-size-n; ngram-mod: --spec-ngram-mod-n-match)")
    ngram_m: int | None = Field(
        None, ge=1, le=1024, description="n-gram types: the draft length, tokens proposed per match "
        "(--spec-ngram-<type>-size-m; ngram-mod: --spec-ngram-mod-n-max)")
    draft_model: str | DraftCandidate | None = Field(
        None, description="type draft: the draft model (--spec-draft-model), a .gguf file with the model's vocabulary "
        "or {candidate: NAME}, the gguf artifact of another candidate of the recipe (made once, linked into the "
        "engine folder as draft.gguf)")
    draft_max: int | None = Field(None, ge=1, le=1024, description="type draft: most tokens drafted per step "
                                  "(--spec-draft-n-max)")
    draft_min: int | None = Field(
        None, ge=0, le=1024, description="type draft: fewest tokens a draft is used with (--spec-draft-n-min); "
        "ngram-mod: the fewest found tokens a draft is used with (--spec-ngram-mod-n-min, llama.cpp's default 48)")
    draft_sha256: str | None = Field(
        None, exclude_if=lambda v: v is None, pattern=r"^[0-9a-f]{64}$", description="type draft: the draft's "
        "content hash (the candidate artifact's, or the .gguf file's), filled in by the engine stage so the engine's "
        "key follows the draft's bytes; a recipe leaves it out")

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> SpeculativeConfig:
        if why := _speculative_problem(self):
            raise ValueError(why)
        return self

    def draft_file(self, beside: Path) -> str | None:
        """The GGUF llama-server drafts with: draft_model's path, or for another candidate's artifact the
        draft.gguf its build linked `beside` the model's GGUF; None for the n-gram types."""
        if isinstance(self.draft_model, DraftCandidate):
            return str(Path(beside) / DRAFT_GGUF)
        return self.draft_model


def _speculative_problem(s: SpeculativeConfig) -> str | None:
    """Why `s` names sizes its type does not read (llama.cpp would ignore them silently), or None."""
    if s.type == "draft":
        if s.ngram_n is not None or s.ngram_m is not None:
            return "ngram_n and ngram_m size the n-gram types; type draft is sized by draft_max and draft_min"
        if s.draft_model is None:
            return "type draft needs draft_model (a .gguf file with the model's vocabulary)"
        path = Path(s.draft_model) if isinstance(s.draft_model, str) else None  # a candidate: the recipe checks it
        if path is not None and (path.suffix != ".gguf" or not path.is_file()):
            return (f"draft_model '{s.draft_model}' is not an existing .gguf file: give the path of a GGUF of "
                    "a smaller model with the same vocabulary (e.g. a gguf optimize artifact's model.gguf)")
        if s.draft_min is not None and s.draft_min > (s.draft_max or 3):
            return f"draft_min {s.draft_min} is above draft_max {s.draft_max or 3} (llama.cpp's default 3)"
        return None
    if s.draft_model is not None or s.draft_max is not None or s.draft_sha256 is not None:
        return f"draft_model and draft_max belong to type draft; {s.type} drafts from the sequence's own n-grams"
    if s.type == "ngram-cache" and (s.ngram_n is not None or s.ngram_m is not None):
        return "llama.cpp's ngram-cache has fixed sizes (it reads no ngram_n or ngram_m); leave them out"
    if s.draft_min is not None and s.type != "ngram-mod":
        return f"draft_min belongs to types draft and ngram-mod; {s.type} reads no minimum"
    if s.type == "ngram-mod" and s.ngram_m is not None and s.ngram_m < (s.draft_min if s.draft_min is not None else 48):
        return (f"ngram-mod drafts at least draft_min tokens (llama.cpp's default 48), more than ngram_m "
                f"{s.ngram_m}: set draft_min to at most {s.ngram_m}")
    return None


class LlamaCppConfig(EngineConfig):
    backend: Literal["llama_cpp"] = "llama_cpp"
    precision: Literal["f32", "f16", "bf16"] = Field(
        "f32", description="GGUF type when building from an unquantized checkpoint (a gguf artifact keeps its own)")
    runtime: Literal["server", "library"] = Field(
        "server", description="server: a llama-server process kiln streams from over HTTP; library: llama.cpp "
        "in kiln's process, batched by kiln (llama_cpp_library.py): no hop between decode and kiln serve")
    threads: int | None = Field(
        None, ge=1, description="CPU threads llama.cpp decodes with, in both runtimes and in scoring (the server "
        "runtime passes it as llama-server --threads and --threads-batch); None: all cores")
    parallel: int = Field(
        4, ge=1, description="sequences decoded together (continuous batching), in both runtimes: llama-server's "
        "slots (--parallel) or the library runtime's")
    ctx_per_slot: int = Field(2048, ge=16, description="context tokens each slot holds (prompt + output), "
                              "in both runtimes and in scoring")
    batch_size: int = Field(
        512, ge=1, description="prompt tokens per forward step, in both runtimes (llama-server --batch-size; "
        "the library runtime's prefill chunk each step) and in scoring, up to 64 (tokens per decode: each "
        "holds that many rows of logits)")
    # Numerics shared by generation (either runtime) and scoring (in-process): on the tiny f32 Llama the
    # defaults put next-token log-probs up to 1.1e-3 from torch fp32 (flash attention 1.1e-3, f16 cache
    # 3e-4); f32 + off gives 3e-6.
    cache_type: KvType = Field(
        "f16", description="KV cache type of K and V (the shorthand for both; cache_type_k and cache_type_v override "
        "it), in both runtimes and in scoring (llama-server's default: f16)")
    cache_type_k: KvType | None = Field(
        None, exclude_if=lambda v: v is None, description="KV cache type of the keys, in both runtimes and in scoring "
        "(llama-server -ctk); None: cache_type. A quantized type (q8_0 ...) holds more tokens per byte")
    cache_type_v: KvType | None = Field(
        None, exclude_if=lambda v: v is None, description="KV cache type of the values, in both runtimes and in "
        "scoring (llama-server -ctv); None: cache_type. A quantized type needs flash attention (flash_attn not off)")
    flash_attn: Literal["auto", "on", "off"] = Field(
        "auto", description="flash attention, in both runtimes and in scoring (auto: on for CPU)")
    speculative: SpeculativeConfig | None = Field(
        None, exclude_if=lambda v: v is None, description="server runtime only: speculative decoding (llama-server "
        "--spec-type ...); None: none. Judged lossless against the same engine without it (plain_twin)")
    cache_reuse: int = Field(
        0, ge=0, exclude_if=lambda v: v == 0, description="server runtime only: llama-server --cache-reuse N, the "
        "shortest chunk of a cached prompt reused at a shifted position (its KV moved, not recomputed) when a new "
        "prompt shares it after a different start; 0: only a common prefix is reused")
    startup_timeout_s: float = Field(
        120, gt=0, description="server runtime only: seconds llama-server has to answer /health after it "
        "starts (the library runtime loads in kiln's process and does not read it)")

    @model_validator(mode="after")
    def _levers_fit(self) -> LlamaCppConfig:
        if self.runtime == "library":
            if self.speculative is not None:
                raise ValueError("speculative: speculative decoding runs in llama-server only; set runtime: server "
                                 "(the default) or leave speculative out")
            if self.cache_reuse:
                raise ValueError("cache_reuse: prompt-cache reuse is llama-server's (--cache-reuse); set runtime: "
                                 "server (the default) or leave cache_reuse out")
        v = self.kv_types()[1]
        if self.flash_attn == "off" and v not in _FLOAT_KV:
            raise ValueError(f"cache_type_v: a quantized V cache ({v}, from cache_type_v or cache_type) needs flash "
                             "attention in llama.cpp: set flash_attn: auto or on, or a V cache of f16, bf16 or f32")
        return self

    def thread_count(self) -> int:
        """`threads`, or every core of this machine when it is None."""
        return self.threads or os.cpu_count() or 1

    def kv_types(self) -> tuple[str, str]:
        """The KV cache types of K and V: cache_type_k / cache_type_v, each defaulting to cache_type."""
        return self.cache_type_k or self.cache_type, self.cache_type_v or self.cache_type

    def plain_twin(self) -> LlamaCppConfig | None:
        """The same engine without speculation (the lever that claims lossless output), or None."""
        return None if self.speculative is None else self.model_copy(update={"speculative": None})

    def draft_made_by(self, optimize: GgufConfig) -> LlamaCppConfig:
        """This engine with its draft candidate told how its artifact is made (that candidate's `optimize`)."""
        spec = self.speculative
        assert spec is not None and isinstance(spec.draft_model, DraftCandidate), "draft_made_by: no draft candidate"
        draft = spec.draft_model.model_copy(update={"optimize": optimize})
        return self.model_copy(update={"speculative": spec.model_copy(update={"draft_model": draft})})

    def draft_resolved(self, sha256: str, artifact: Path | None = None) -> LlamaCppConfig:
        """This engine with its draft's bytes named (`draft_sha256`) and, for another candidate's artifact,
        the folder on this machine the build links its GGUF from."""
        spec = self.speculative
        assert spec is not None and spec.type == "draft", "draft_resolved: the engine drafts with no model"
        draft = spec.draft_model
        if isinstance(draft, DraftCandidate):
            draft = draft.model_copy()
            draft._artifact = artifact
        return self.model_copy(update={"speculative": spec.model_copy(update={"draft_sha256": sha256,
                                                                             "draft_model": draft})})


def drafting_candidate(engine: Any) -> DraftCandidate | None:
    """The candidate whose artifact drafts for `engine` (any backend's config), or None."""
    draft = getattr(getattr(engine, "speculative", None), "draft_model", None)
    return draft if isinstance(draft, DraftCandidate) else None
