"""The `ctranslate2` backend: a CTranslate2 model converted from the HF checkpoint.

Build: CTranslate2's own Transformers converter writes model.bin in the chosen precision
(float32, int8_float32: int8 weights with fp32 activations, int8, int16, bfloat16).
Runtime: CTranslate2 has no public incremental-decoding API, so batching is by cohort: when no
batch is running, up to `max_batch_size` waiting requests with the same stop/sampling settings
start together as one asynchronous `generate_batch`; its per-token callback streams tokens and
ends (or cancels) each sequence on its own. Newcomers wait until the running cohort finishes
(no join mid-batch): under steady load this is static batching, documented in docs/engines.md.
Scoring and full distributions come from `forward_batch` (logits at every position).

Prompts of mixed lengths: CTranslate2 prefills the first (shortest - 1) tokens of every prompt in
one forward pass, then feeds the rest of each longer prompt one token per step as a forced
prefix. It leaves that prefix out of the callback and of max_length, except when the shortest
prompt has one token (nothing to prefill: ctranslate2 4.8.5 keeps `return_prefix` on then), where
every longer prompt's remaining tokens came back as "generated" (issue 39). The callback counts
a sequence's tokens from the step its own prefix ends, in every cohort, and max_length allows for
the longest prefix, so a cohort decodes as its prompts would alone whatever the library reports.
"""

from __future__ import annotations

import json
import queue
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from kiln.engine import full_logits
from kiln.engine.base import (BACKENDS, REBUILD, Engine, EngineBackend, EngineConfig, GenerationRequest, Score,
                              TokenEvent, check_request, keep_checkpoint_files)
from kiln.engine.openvino import eos_ids_of
from kiln.core.errors import BadInput

MODEL = "ct2"  # subfolder holding model.bin, config.json, vocabulary.json
# Architectures the pinned converter registers but cannot convert (config.json model_type: why).
# Re-check them when the ctranslate2 pin moves.
UNCONVERTIBLE = {
    "phi3": "ctranslate2 4.8.5's Phi-3 converter reads rope_scaling['type'], which transformers 5 configs no "
            "longer carry (the conversion fails with KeyError 'type')",
}


class CTranslate2Config(EngineConfig):
    backend: Literal["ctranslate2"] = "ctranslate2"
    quantization: Literal["float32", "int8_float32", "int8", "int16", "bfloat16"] = "int8_float32"
    threads: int | None = Field(None, ge=1, description="intra_threads; None: all cores")
    max_batch_size: int = Field(16, ge=1, description="sequences started together in one cohort")
    score_batch_tokens: int = Field(4096, ge=1, description="padded tokens per scoring forward pass, fewer where "
                                    "their float32 logits would pass 64 MiB")


@BACKENDS.register("ctranslate2", CTranslate2Config)
class CTranslate2Backend(EngineBackend):
    libraries: ClassVar[tuple[str, ...]] = ("ctranslate2", "torch", "transformers")
    takes_quantized: ClassVar[bool] = False  # converts and compresses an unquantized checkpoint itself
    revision: ClassVar[int] = 1  # 1: a cohort with a one-token prompt no longer streams the others' prompts

    @classmethod
    def refuses(cls, config: dict[str, Any]) -> str | None:
        model_type = config.get("model_type")
        if not isinstance(model_type, str):  # transformers' own loading refuses such a config
            return None
        if model_type in UNCONVERTIBLE:
            return f"model_type '{model_type}': {UNCONVERTIBLE[model_type]}"
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        name = CONFIG_MAPPING_NAMES.get(model_type)
        registered = _converter_configs()
        if name is not None and registered and name not in registered:
            return f"model_type '{model_type}' ({name}) has no CTranslate2 converter"
        return None

    def build(self, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
        from ctranslate2 import __version__
        from ctranslate2.converters import TransformersConverter
        from transformers import AutoConfig

        from kiln.engine.hf_torch import check_checkpoint

        check_checkpoint(checkpoint)
        why = self.refuses(json.loads((checkpoint / "config.json").read_text()))
        if why:
            raise BadInput(f"{checkpoint}: CTranslate2 cannot convert it ({why}). Use the `torch` backend.")
        hf = AutoConfig.from_pretrained(checkpoint)
        if getattr(hf, "quantization_config", None):
            raise BadInput(f"{checkpoint}: already quantized; build this backend from the unquantized baseline "
                           "and choose its `quantization` option instead.")
        cfg: CTranslate2Config = self.config  # type: ignore[assignment]
        started = time.perf_counter()
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            TransformersConverter(str(checkpoint), low_cpu_mem_usage=True).convert(
                str(out_dir / MODEL), quantization=cfg.quantization, force=True)
        except (ValueError, KeyError, NotImplementedError) as e:  # "no converter for this architecture", a
            # config field its loader expects and does not find, a rope or quantization type it lacks
            raise BadInput(f"{checkpoint}: CTranslate2 cannot convert it ({type(e).__name__}: {e}). "
                           "Use the `torch` backend.") from e
        keep_checkpoint_files(checkpoint, out_dir)
        return {"format": "ctranslate2", "precision": cfg.quantization, "ctranslate2": __version__,
                "weight_bytes": (out_dir / MODEL / "model.bin").stat().st_size,
                "max_positions": getattr(hf, "max_position_embeddings", None),
                "build_seconds": round(time.perf_counter() - started, 1)}

    @classmethod
    def open(cls, engine_dir: Path, config: CTranslate2Config, manifest: dict[str, Any]) -> CTranslate2Engine:
        return CTranslate2Engine(engine_dir, config, manifest["build"].get("max_positions"))


def _converter_configs() -> frozenset[str]:
    """The config classes CTranslate2's Transformers converter registers a loader for, read from its
    source: importing ctranslate2 here would fix its GEMM library before the engine picks one
    (`_pick_gemm`). Empty when the source is not where 4.x keeps it (then the build decides)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("ctranslate2")
    source = Path(spec.origin).parent / "converters" / "transformers.py" if spec and spec.origin else None
    if source is None or not source.is_file():
        return frozenset()
    return frozenset(re.findall(r'@register_loader\("(\w+)"\)', source.read_text(encoding="utf-8")))


def _pick_gemm(quantization: str) -> None:
    """Choose CTranslate2's GEMM library before its first model loads in this process.

    On non-Intel x86 CTranslate2 skips MKL by default. Measured on an AMD EPYC (docs/engines.md):
    float32 decodes ~10x faster with MKL forced on, int8 ~10x slower. CTranslate2 reads
    CT2_USE_MKL once per process, so the first engine loaded decides; an explicit
    CT2_USE_MKL in the environment always wins.
    """
    import os

    os.environ.setdefault("CT2_USE_MKL", "0" if quantization.startswith("int8") else "1")


@dataclass
class _Seq:
    id: int
    req: GenerationRequest
    produced: int = 0
    done: bool = False
    cancelled: bool = False
    forced: int = 0  # decoding steps that feed the rest of this prompt (its forced prefix), not generate


@dataclass
class _Cohort:
    seqs: list[_Seq]
    results: list[Any] = field(default_factory=list)  # AsyncGenerationResult per sequence


class CTranslate2Engine(Engine):
    def __init__(self, engine_dir: Path, config: CTranslate2Config, max_positions: int | None = None):
        _pick_gemm(config.quantization)  # before ctranslate2 is imported: it reads the variable once
        import ctranslate2
        from transformers import AutoTokenizer

        if not (engine_dir / MODEL / "model.bin").is_file():
            raise BadInput(f"{engine_dir / MODEL / 'model.bin'} not found. {REBUILD}")
        self.config = config
        self.manifest = {"backend": "ctranslate2", "config": config.model_dump(mode="json")}
        self.tokenizer = AutoTokenizer.from_pretrained(engine_dir)
        self.eos_ids = eos_ids_of(engine_dir, self.tokenizer)
        self.max_positions = max_positions or 1 << 30
        self.vocab: list[str] = json.loads((engine_dir / MODEL / "vocabulary.json").read_text())
        self.score_budget = full_logits.token_budget(config.score_batch_tokens, len(self.vocab))
        self._gen = ctranslate2.Generator(str(engine_dir / MODEL), device="cpu", compute_type=config.quantization,
                                          inter_threads=1, intra_threads=config.threads or 0)
        self._pending: list[_Seq] = []
        self._cohort: _Cohort | None = None
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._next_id = 0

    # ----- generation -----------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        check_request(request, self.max_positions)
        seq = _Seq(self._next_id, request)
        self._next_id += 1
        self._pending.append(seq)
        return seq.id

    def has_work(self) -> bool:
        return bool(self._pending or self._cohort)

    def cancel(self, seq_id: int) -> None:
        self._pending = [s for s in self._pending if s.id != seq_id]
        for s in self._cohort.seqs if self._cohort else []:
            if s.id == seq_id:
                s.cancelled = True  # the callback returns True at the next token: decoding stops

    def _end_ids(self, r: GenerationRequest) -> list[int]:
        return sorted(set(r.stop_ids) | (set() if r.ignore_eos else set(self.eos_ids)))

    def _start_cohort(self) -> None:
        key = lambda r: (tuple(self._end_ids(r)), r.temperature, r.top_p, r.seed)  # noqa: E731
        first = key(self._pending[0].req)
        seqs = [s for s in self._pending if key(s.req) == first][: self.config.max_batch_size]
        self._pending = [s for s in self._pending if s not in seqs]
        r0 = seqs[0].req
        shortest = min(len(s.req.prompt_ids) for s in seqs)
        for s in seqs:
            s.forced = len(s.req.prompt_ids) - shortest
        # With a one-token prompt in the cohort, max_length counts the forced prefixes too.
        longest = max(s.req.max_new_tokens for s in seqs) + max(s.forced for s in seqs)
        sampling = {"sampling_topk": 1} if r0.temperature <= 0 else {
            "sampling_topk": 0, "sampling_temperature": r0.temperature, "sampling_topp": r0.top_p}
        if r0.temperature > 0:
            self._gen_seed(r0.seed)
        cohort = _Cohort(seqs)
        cohort.results = self._gen.generate_batch(
            [[self.vocab[t] for t in s.req.prompt_ids] for s in seqs], asynchronous=True, max_length=longest,
            include_prompt_in_result=False, end_token=self._end_ids(r0), return_end_token=True, return_scores=True,
            callback=lambda step: self._on_token(cohort, step), **sampling)
        self._cohort = cohort

    def _gen_seed(self, seed: int | None) -> None:
        import ctranslate2

        ctranslate2.set_random_seed(seed % 2**32 if seed is not None else random.randrange(2**31))  # an unsigned int

    def _on_token(self, cohort: _Cohort, step) -> bool:
        """CTranslate2's worker thread calls this per token; True stops that sequence."""
        s = cohort.seqs[step.batch_id]
        if s.done or s.cancelled:
            return True
        if step.step < s.forced:  # a token of the prompt's forced prefix, reported as if generated
            return False
        s.produced += 1
        finish = None
        if step.token_id in s.req.stop_ids or (step.token_id in self.eos_ids and not s.req.ignore_eos):
            finish = "stop"
        elif s.produced >= s.req.max_new_tokens or len(s.req.prompt_ids) + s.produced >= self.max_positions:
            finish = "length"
        s.done = finish is not None
        self._events.put(TokenEvent(s.id, int(step.token_id), time.perf_counter(), float(step.log_prob), finish))
        return s.done

    def step(self) -> list[TokenEvent]:
        if self._cohort is None and self._pending:
            self._start_cohort()
        events: list[TokenEvent] = []
        cohort = self._cohort
        while cohort is not None and not events:
            try:
                events.append(self._events.get(timeout=0.05))
            except queue.Empty:
                if all(r.done() for r in cohort.results) and self._events.empty():
                    for r in cohort.results:
                        r.result()  # re-raise an error from the worker thread
                    self._cohort = cohort = None
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return [e for e in events if not self._is_cancelled(e.seq_id)]

    def _is_cancelled(self, seq_id: int) -> bool:
        return any(s.id == seq_id and s.cancelled for s in (self._cohort.seqs if self._cohort else []))

    # ----- scoring --------------------------------------------------------------------------

    def _logits(self, seqs: list[list[int]]):
        import numpy as np

        out = np.asarray(self._gen.forward_batch([[self.vocab[t] for t in s] for s in seqs]))
        return [out[i, : len(s)] for i, s in enumerate(seqs)]

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        return full_logits.scores(pairs, self._logits, self.score_budget)

    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        return full_logits.next_token_logprobs(ids, self._logits, self.score_budget)

    def close(self) -> None:
        for s in self._cohort.seqs if self._cohort else []:
            s.cancelled = True
        self._pending, self._cohort = [], None
