"""The `openvino` backend: an OpenVINO IR served by openvino-genai's continuous-batching pipeline.

Build: the HF checkpoint is traced to a stateful IR by kiln's own exporter (openvino_export.py,
no optimum-intel), weights optionally compressed to int8 or int4 by NNCF (data-free, per-channel
int8 / group-wise int4). Runtime: `ContinuousBatchingPipeline` (paged attention, chunked prefill)
drives add/step/cancel natively; a new request joins the running batch at the next step.
Scoring and full next-token distributions run the same IR through plain OpenVINO inference
with a fresh KV state per batch (the pipeline only returns the sampled token's log-prob). Each of
the two is created on first use only (a quality stage only scores, a benchmark only generates), and
its first inference, where the CPU plugin repacks the weights it maps from the IR's `.bin`, runs
under `drop_behind` (mapped_pages.py): the mapped pages are not held beside the repacked copy (1B
int8 scorer: peak 2.72 -> 1.57 GiB, measured); the pipeline's is a one-token warm-up as it is made.
So does a scoring inference of a batch of a new shape, which reads the weights again.

Everything installs from PyPI into kiln's own environment (pins in docs/engines.md).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from kiln.engine import full_logits
from kiln.engine.base import (BACKENDS, REBUILD, Engine, EngineBackend, EngineConfig, GenerationRequest, Score,
                              TokenEvent, check_request, keep_checkpoint_files)
from kiln.core.errors import BadInput
from kiln.engine.mapped_pages import drop_behind

def decline_telemetry() -> None:
    """Turn off, for this process, the usage telemetry OpenVINO and NNCF send unless the user opted out
    (a consent file under ~/intel) or runs in CI: importing them writes a client id to ~/intel, and the
    converter and NNCF send events to Google Analytics, each from a child process. kiln runs offline
    and writes nothing outside its cache, so every later consent check declines, and one already made
    (openvino imported before kiln) is withdrawn."""
    try:
        from openvino_telemetry.main import Telemetry
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # no OpenVINO here: nothing to decline
        return
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
    made = getattr(Telemetry, "_SingletonMetaClass__single_instance", None)
    if made is not None:
        made.consent = False


decline_telemetry()  # before anything in kiln imports openvino (its import makes the telemetry object)

IR = "openvino_model.xml"
WEIGHTS = "openvino_model.bin"  # the IR's weights, which the CPU plugin maps
WARM_UP_PROMPT = 64  # tokens: a prefill of several, which the CPU plugin runs on its own kernel (see warm_up)


class OpenVINOConfig(EngineConfig):
    backend: Literal["openvino"] = "openvino"
    weights: Literal["fp32", "int8", "int4"] = Field("int8", description="weight-only compression at build")
    group_size: int = Field(64, ge=8, description="int4 group size (columns per scale)")
    threads: int | None = Field(None, ge=1, description="INFERENCE_NUM_THREADS; None: all cores")
    activations: Literal["f32", "bf16"] = Field(
        "f32", description="INFERENCE_PRECISION_HINT; bf16 is fast only with AVX512-BF16/AMX")
    kv_cache_precision: Literal["f32", "f16", "u8"] = "f32"
    kv_cache_gib: int = Field(1, ge=1, description="paged KV cache size")
    max_batch_size: int = Field(16, ge=1, description="sequences decoded together; the rest wait")
    max_batched_tokens: int = Field(2048, ge=16, description="tokens per step (long prompts are chunked)")
    score_batch_tokens: int = Field(4096, ge=1, description="padded tokens per scoring forward pass, fewer where "
                                    "their float32 logits would pass 64 MiB")

    @model_validator(mode="after")
    def _bf16_cache(self) -> OpenVINOConfig:
        # Refused by OpenVINO only when the engine loads ("Check 'key_cache_type == ov::element::bf16 ...'
        # failed"), after the build; f16 and u8 caches load with bf16 activations (measured on the demo model).
        if self.activations == "bf16" and self.kv_cache_precision == "f32":
            raise ValueError("activations: bf16 needs kv_cache_precision f16 or u8: OpenVINO's CPU plugin "
                             "refuses an f32 KV cache with bf16 inference")
        return self


def warm_up(pipeline: Any) -> None:
    """Two tokens from a 64-token prompt through `pipeline.generate`: a prefill of several tokens, then a
    decode step, each a kernel for which the CPU plugin repacks the weights as it first runs. Under
    drop_behind, as the pipeline is made, so the IR's pages do not stay resident beside the repack: with a
    two-token prefill alone, a request's first steps read the .bin again (135M int8: 102 MiB of it through
    the benchmark stage; 4 MiB now, the embedding rows read in place). Not through `step()`: openvino-genai's
    binding holds the GIL for a step and releases it for `generate`, and drop_behind's thread needs it
    (1B int8: 2.36 GiB above the start at the first step, the IR's pages resident beside the repack until
    it ended; 1.19 GiB through generate)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    config = og.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.do_sample = 2, True, False
    pipeline.generate([ov.Tensor(np.zeros((1, WARM_UP_PROMPT), dtype=np.int64))], [config])


@BACKENDS.register("openvino", OpenVINOConfig)
class OpenVINOBackend(EngineBackend):
    libraries: ClassVar[tuple[str, ...]] = ("openvino", "openvino-genai", "nncf", "torch", "transformers")
    takes_quantized: ClassVar[bool] = False  # converts and compresses an unquantized checkpoint itself

    @classmethod
    def refuses(cls, config: dict[str, Any]) -> str | None:
        from kiln.engine.openvino_export import SUPPORTED

        model_type = config.get("model_type")
        if isinstance(model_type, str) and model_type not in SUPPORTED:
            return f"model_type '{model_type}': kiln's OpenVINO export traces {', '.join(SUPPORTED)} only"
        return None

    def build(self, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
        import openvino as ov

        from kiln.engine.hf_torch import check_checkpoint
        from kiln.engine.openvino_export import export, load_hf_llama, tracing

        check_checkpoint(checkpoint)
        cfg: OpenVINOConfig = self.config  # type: ignore[assignment]
        # int8/int4 from a 16-bit checkpoint: the weights are held once, as stored (openvino_export.py)
        with tracing(load_hf_llama(checkpoint, float32=cfg.weights == "fp32")) as hf:
            max_positions = hf.config.max_position_embeddings
            started = time.perf_counter()
            # The weights torch mapped from the checkpoint are read once, as each is traced and compressed:
            # dropped behind (nothing writes them), the build holds NNCF's output and the weight in hand,
            # not the checkpoint beside them (1B int8: peak 4.15 -> 3.38 GiB, docs/engines.md).
            with drop_behind(*sorted(checkpoint.glob("*.safetensors")), private=True):
                model = export(hf, cfg.weights, cfg.group_size)
                out_dir.mkdir(parents=True, exist_ok=True)
                ov.save_model(model, out_dir / IR, compress_to_fp16=False)
                del model  # its constants point into hf's weights: gone before they are
        keep_checkpoint_files(checkpoint, out_dir)
        return {"format": "openvino-ir", "precision": cfg.weights,
                "weight_bytes": (out_dir / "openvino_model.bin").stat().st_size,
                "max_positions": max_positions,
                "build_seconds": round(time.perf_counter() - started, 1)}

    @classmethod
    def open(cls, engine_dir: Path, config: OpenVINOConfig, manifest: dict[str, Any]) -> OpenVINOEngine:
        return OpenVINOEngine(engine_dir, config, manifest["build"].get("max_positions"))


def model_vocab(engine_dir: Path, tokenizer) -> int:
    """The width of the model's logits: config.json's vocab_size (the embedding's rows, which may pass the
    tokenizer's), else the tokenizer's."""
    path = engine_dir / "config.json"
    vocab = json.loads(path.read_text()).get("vocab_size") if path.is_file() else None
    return int(vocab or len(tokenizer))


def eos_ids_of(engine_dir: Path, tokenizer) -> frozenset[int]:
    path = engine_dir / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    eos = tokenizer.eos_token_id if eos is None else eos
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


class OpenVINOEngine(Engine):
    def __init__(self, engine_dir: Path, config: OpenVINOConfig, max_positions: int | None = None):
        import openvino_genai  # noqa: F401 - missing, it fails the load, not the first request
        from transformers import AutoTokenizer

        if not (engine_dir / IR).is_file():
            raise BadInput(f"{engine_dir / IR} not found. {REBUILD}")
        self.engine_dir, self.config = engine_dir, config
        self.manifest = {"backend": "openvino", "config": config.model_dump(mode="json")}
        self.tokenizer = AutoTokenizer.from_pretrained(engine_dir)
        self.eos_ids = eos_ids_of(engine_dir, self.tokenizer)
        self.max_positions = max_positions or 1 << 30
        self._pipeline: Any = None  # the continuous-batching pipeline, made on the first request
        self._live: dict[int, tuple[Any, GenerationRequest, list[int]]] = {}  # id -> handle, request, [produced]
        self._next_id = 0
        self._scorer = None  # compiled plain IR, made on first score/next_token_logprobs
        self._scored_shapes: set[tuple[int, ...]] = set()  # batch shapes the scorer has prepared its weights for
        self.vocab = model_vocab(engine_dir, self.tokenizer)
        self.score_budget = full_logits.token_budget(config.score_batch_tokens, self.vocab)

    @property
    def _pipe(self) -> Any:
        if self._pipeline is None:
            import openvino_genai as og

            sched = og.SchedulerConfig()
            sched.cache_size, sched.max_num_seqs = self.config.kv_cache_gib, self.config.max_batch_size
            sched.max_num_batched_tokens, sched.dynamic_split_fuse = self.config.max_batched_tokens, True
            pipeline = og.ContinuousBatchingPipeline(str(self.engine_dir), sched, "CPU", self._properties())
            with drop_behind(self.engine_dir / WEIGHTS):
                warm_up(pipeline)
            self._pipeline = pipeline
        return self._pipeline

    def _properties(self) -> dict[str, Any]:
        props: dict[str, Any] = {"INFERENCE_PRECISION_HINT": self.config.activations,
                                 "KV_CACHE_PRECISION": self.config.kv_cache_precision}
        if self.config.threads:
            props["INFERENCE_NUM_THREADS"] = self.config.threads
        return props

    # ----- generation -----------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        import numpy as np
        import openvino as ov
        import openvino_genai as og

        check_request(request, self.max_positions)
        cfg = og.GenerationConfig()
        cfg.max_new_tokens = min(request.max_new_tokens, self.max_positions - len(request.prompt_ids))
        cfg.ignore_eos, cfg.logprobs = request.ignore_eos, 1
        cfg.stop_token_ids = set(request.stop_ids) | (set() if request.ignore_eos else set(self.eos_ids))
        if request.temperature > 0:
            cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p = True, request.temperature, 0, request.top_p
            cfg.rng_seed = request.seed if request.seed is not None else random.randrange(2**31)
        else:
            cfg.do_sample = False
        seq_id, self._next_id = self._next_id, self._next_id + 1
        handle = self._pipe.add_request(seq_id, ov.Tensor(np.asarray([request.prompt_ids], dtype=np.int64)), cfg)
        self._live[seq_id] = (handle, request, [0])
        return seq_id

    def has_work(self) -> bool:
        return bool(self._live)

    def cancel(self, seq_id: int) -> None:
        entry = self._live.pop(seq_id, None)
        if entry is not None:
            entry[0].cancel()

    def step(self) -> list[TokenEvent]:
        import openvino_genai as og

        self._pipe.step()
        now = time.perf_counter()
        events: list[TokenEvent] = []
        for seq_id, (handle, request, produced) in list(self._live.items()):
            status = handle.get_status()
            if status == og.GenerationStatus.IGNORED:
                self._live.pop(seq_id)
                raise BadInput(f"Request {seq_id} ({len(request.prompt_ids)} prompt tokens) does not fit the "
                               f"KV cache; raise kv_cache_gib (now {self.config.kv_cache_gib}).")
            new: list[TokenEvent] = []
            if handle.can_read():
                for out in handle.read().values():
                    new += self._events(seq_id, request, produced, out, now)
            events += new
            if new and new[-1].finish_reason is not None:
                self._live.pop(seq_id)
                if status == og.GenerationStatus.RUNNING:
                    # Ended by kiln: a stop id with ignore_eos, which OpenVINO GenAI's ignore_eos ignores too.
                    handle.cancel()
            elif status != og.GenerationStatus.RUNNING and not handle.can_read():
                self._live.pop(seq_id)
        return events

    def _events(self, seq_id, request, produced, out, now) -> list[TokenEvent]:
        events = []
        ids, lps = list(out.generated_ids), list(out.generated_log_probs)
        for k, token in enumerate(ids):
            produced[0] += 1
            finish = None
            if token in request.stop_ids or (token in self.eos_ids and not request.ignore_eos):
                finish = "stop"
            elif produced[0] >= request.max_new_tokens or k == len(ids) - 1 and out.finish_reason.name == "LENGTH":
                finish = "length"
            events.append(TokenEvent(seq_id, int(token), now, float(lps[k]) if k < len(lps) else None, finish))
            if finish:
                break
        return events

    # ----- scoring --------------------------------------------------------------------------

    def _logits(self, seqs: list[list[int]]):
        import numpy as np
        import openvino as ov

        if self._scorer is None:
            props = {k: v for k, v in self._properties().items() if k != "KV_CACHE_PRECISION"}
            self._scorer = ov.Core().compile_model(str(self.engine_dir / IR), "CPU", props).create_infer_request()
            self._scored_shapes = set()
        # A batch of one row runs other kernels in the CPU plugin, which repack the weights a second time and
        # keep both (int8: +100 MiB at 135M, +66 MiB at 1B, to the stage's end; perplexity's last batch is
        # often one document): after batches of several rows, a lone sequence is scored beside a copy of itself.
        one_row_ready = any(shape[0] == 1 for shape in self._scored_shapes)
        rows = seqs * 2 if len(seqs) == 1 and self._scored_shapes and not one_row_ready else seqs
        ids, mask = full_logits.right_padded(rows, self.tokenizer.pad_token_id or 0)
        self._scorer.reset_state()  # no KV carried over from the previous batch
        # The CPU plugin repacks the weights it maps from the .bin at the first inference, and reads them again
        # for a batch of a new shape (135M: the whole file resident again beside the repacked copy, after a
        # batch of 4 followed one of 1): those inferences drop them behind. Not every one: at 135M that made
        # 25 documents' scoring 1.38x slower (5.19 s against 3.75, five interleaved rounds).
        new_shape = ids.shape not in self._scored_shapes
        self._scored_shapes.add(ids.shape)
        with drop_behind(self.engine_dir / WEIGHTS) if new_shape else contextlib.nullcontext():
            out = self._scorer.infer({"input_ids": ids, "attention_mask": mask,
                                      "position_ids": np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy(),
                                      "beam_idx": np.arange(len(rows), dtype=np.int32)}, share_outputs=True)
        # share_outputs: a view of the infer request's own buffer, [batch, width, vocab], kept between calls. By default
        # infer() hands back a copy of it, which this generator would hold beside the buffer until its last sequence
        # is read (135M perplexity: 46 MiB of the quality stage's peak).
        logits = out["logits"]
        # a sequence's copy at a time, as the caller reads them out: not the batch's again beside the buffer
        return (np.array(logits[i, : len(s)]) for i, s in enumerate(seqs))

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        return full_logits.scores(pairs, self._logits, self.score_budget)

    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        return full_logits.next_token_logprobs(ids, self._logits, self.score_budget)

    def release_generation(self) -> None:
        """The pipeline's compiled model and KV cache, freed: a stage that generates and then scores (the
        parity check) holds one compiled model at a time, not the pipeline's beside the scorer's."""
        if not self._live:
            self._pipeline = None

    def release_scoring(self) -> None:
        """The scorer's compiled model (the weights repacked again) freed, before a caller that only generates
        from here on makes the pipeline: the decode benchmark after token agreement, lm-eval's generate_until
        after its log-likelihoods."""
        self._scorer = None

    def close(self) -> None:
        for handle, _, _ in self._live.values():
            handle.cancel()
        self._live, self._scorer, self._pipeline = {}, None, None
