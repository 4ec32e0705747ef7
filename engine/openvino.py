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

Levers the pipeline has beside the weights' format (docs/engines.md, "OpenVINO levers"): prefix caching
(`prefix_caching`: the scheduler keeps finished prompts' KV blocks and serves a later prompt's shared prefix
from them) and speculative decoding (`speculative`: prompt lookup, or a draft model of the same tokenizer),
which claims greedy output unchanged, so `plain_twin()` is the same engine without it for the exactness check.

Everything installs from PyPI into kiln's own environment (pins in docs/engines.md).
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
OV_TOKENIZER = "openvino_tokenizer.xml"  # the tokenizer as an OpenVINO model, which a draft pipeline needs
DRAFT_FIELD = "engine.speculative.draft_model"
NGRAM_N, DRAFT = 3, 5  # sizes left None: openvino-genai's prompt-lookup sample's (its GenerationConfig has none)


class OpenVINOSpeculative(BaseModel):
    """openvino-genai's speculative decoding in its continuous-batching pipeline: candidate tokens that the
    model checks in one forward pass, keeping the prefix it agrees with (greedy output meant unchanged; the
    exactness check against `plain_twin()` judges it). The llama.cpp `SpeculativeConfig`'s names and meanings
    where OpenVINO's lever is the same: its one n-gram method is prompt lookup, sized by `ngram_n` (lookup) and
    `ngram_m` (draft length); a draft model by `draft_max`. Both lengths reach OpenVINO as num_assistant_tokens;
    OpenVINO has no minimum draft length (no `draft_min`) and no default size (None here: `NGRAM_N`, `DRAFT`)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["prompt-lookup", "draft"] = Field(
        description="prompt-lookup: candidates copied from the prompt and the text so far where its last n-gram "
                    "recurs (the `prompt_lookup` pipeline property); draft: a smaller model of the same tokenizer "
                    "proposes them (`og.draft_model`)")
    ngram_n: int | None = Field(None, ge=1, le=1024, description="prompt-lookup: the longest n-gram looked up "
                                "(max_ngram_size); None: 3")
    ngram_m: int | None = Field(None, ge=1, le=1024, description="prompt-lookup: tokens proposed per match "
                                "(num_assistant_tokens); None: 5")
    draft_model: str | None = Field(None, description="type draft: the draft model's folder, an OpenVINO engine (or "
                                    "IR with its tokenizer files) of a model with this one's tokenizer")
    draft_max: int | None = Field(None, ge=1, le=1024, description="type draft: tokens drafted per step "
                                  "(num_assistant_tokens); None: 5")

    @model_validator(mode="after")
    def _fields_of_type(self) -> OpenVINOSpeculative:
        if self.type == "prompt-lookup":
            if self.draft_model is not None or self.draft_max is not None:
                raise ValueError("draft_model and draft_max belong to type draft; prompt-lookup drafts from the "
                                 "sequence's own n-grams (sized by ngram_n and ngram_m)")
            return self
        if self.ngram_n is not None or self.ngram_m is not None:
            raise ValueError("ngram_n and ngram_m size prompt-lookup; type draft is sized by draft_max")
        if not self.draft_model or not (Path(self.draft_model).expanduser() / IR).is_file():
            raise ValueError(f"type draft needs draft_model, the folder of a built OpenVINO engine ({IR} and the "
                             f"model's tokenizer files: a run's engines/<key>/ folder); got {self.draft_model!r}")
        return self

    def lengths(self) -> tuple[int, int]:
        """(num_assistant_tokens, max_ngram_size) as OpenVINO reads them (0: no n-gram)."""
        if self.type == "draft":
            return self.draft_max or DRAFT, 0
        return self.ngram_m or DRAFT, self.ngram_n or NGRAM_N


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
    # Levers: left at their defaults they stay out of the dumped config, so an engine's cache key and every stage
    # key made before them are unchanged.
    prefix_caching: bool = Field(False, exclude_if=lambda v: not v,
                                 description="SchedulerConfig.enable_prefix_caching: a prompt's prefix shared with an "
                                             "earlier request's is served from its KV blocks, not computed again")
    speculative: OpenVINOSpeculative | None = Field(None, exclude_if=lambda v: v is None,
                                                    description="speculative decoding; None: none")

    @model_validator(mode="after")
    def _bf16_cache(self) -> OpenVINOConfig:
        # Refused by OpenVINO only when the engine loads ("Check 'key_cache_type == ov::element::bf16 ...'
        # failed"), after the build; f16 and u8 caches load with bf16 activations (measured on the demo model).
        if self.activations == "bf16" and self.kv_cache_precision == "f32":
            raise ValueError("activations: bf16 needs kv_cache_precision f16 or u8: OpenVINO's CPU plugin "
                             "refuses an f32 KV cache with bf16 inference")
        return self

    def plain_twin(self) -> OpenVINOConfig | None:
        """This engine without speculative decoding (the lever that claims unchanged output), None without it."""
        return self.model_copy(update={"speculative": None}) if self.speculative is not None else None

    def assisting(self, config: Any) -> Any:
        """`config` (an og.GenerationConfig) with the speculative lever's per-request fields: a prompt-lookup
        pipeline refuses a request without them."""
        if self.speculative is not None:
            config.num_assistant_tokens, ngram = self.speculative.lengths()
            if ngram:
                config.max_ngram_size = ngram
        return config


def warm_up(pipeline: Any, engine: OpenVINOConfig) -> None:
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

    config = engine.assisting(og.GenerationConfig())  # a draft's kernels too, and prompt lookup needs its fields
    config.max_new_tokens, config.ignore_eos, config.do_sample = 2, True, False
    pipeline.generate([ov.Tensor(np.zeros((1, WARM_UP_PROMPT), dtype=np.int64))], [config])


def draft_folder(config: OpenVINOConfig, tokenizer_dir: Path) -> Path | None:
    """The speculative lever's draft folder, checked against the model whose tokenizer files are in `tokenizer_dir`
    (the checkpoint at build, the engine folder at load): a BadInput naming the field unless it holds an IR and
    the same tokenizer (openvino-genai's own check encodes one sentence and compares the lengths)."""
    spec = config.speculative
    if spec is None or spec.type != "draft":
        return None
    draft = Path(spec.draft_model).expanduser().resolve()  # type: ignore[arg-type]
    if not (draft / IR).is_file():  # checked as the recipe loads too; gone since
        raise BadInput(f"{DRAFT_FIELD}: {draft / IR} not found. Name the folder of a built OpenVINO engine (a run's "
                       "engines/<key>/ folder, or an IR folder with its model's tokenizer and config files).")
    differs = tokenizer_difference(tokenizer_dir, draft)
    if differs:
        raise BadInput(f"{DRAFT_FIELD}: {draft} has another tokenizer than the model it drafts for ({differs}). "
                       "A draft proposes token ids the model checks: build the draft from a checkpoint of the same "
                       "tokenizer (a smaller model of the family, or this one compressed further).")
    return draft


def tokenizer_difference(main: Path, draft: Path) -> str | None:
    """What differs between the two folders' Hugging Face tokenizers (None: the same vocabulary, special
    tokens and end-of-sequence ids)."""
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(main)
    try:
        b = AutoTokenizer.from_pretrained(draft)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a broken tokenizer.json
        return f"its tokenizer does not load: {e}"
    if a.get_vocab() != b.get_vocab():
        return f"vocabularies of {len(a.get_vocab())} and {len(b.get_vocab())} tokens differ"
    for name in ("bos_token_id", "pad_token_id"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} {getattr(a, name)} against {getattr(b, name)}"
    if eos_ids_of(main, a) != eos_ids_of(draft, b):
        return f"end-of-sequence ids {sorted(eos_ids_of(main, a))} against {sorted(eos_ids_of(draft, b))}"
    return None


def with_ov_tokenizer(folder: Path, into: Path) -> Path:
    """`into`: links to `folder`'s IR and config files beside its tokenizer converted to an OpenVINO model
    (openvino-tokenizers). openvino-genai's draft pipeline reads each model's tokenizer as such a model from
    its folder, which kiln's build does not write (kiln tokenizes with the Hugging Face one): made here, in a
    temporary folder, rather than in the engine's own, which the cache holds as built."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    into.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.is_file() and not (into / item.name).exists():
            (into / item.name).symlink_to(item.resolve())
    if not (into / OV_TOKENIZER).is_file():
        ov.save_model(convert_tokenizer(AutoTokenizer.from_pretrained(folder)), into / OV_TOKENIZER)
    return into


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
        draft_folder(cfg, checkpoint)  # a bad draft refused before the export, not when the engine first loads
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
        self.draft = draft_folder(config, engine_dir)
        self._views: tempfile.TemporaryDirectory | None = None  # the draft pipeline's tokenizer models (made once)

    @property
    def _pipe(self) -> Any:
        if self._pipeline is None:
            import openvino_genai as og

            sched = og.SchedulerConfig()
            sched.cache_size, sched.max_num_seqs = self.config.kv_cache_gib, self.config.max_batch_size
            sched.max_num_batched_tokens, sched.dynamic_split_fuse = self.config.max_batched_tokens, True
            sched.enable_prefix_caching = self.config.prefix_caching
            pipeline = self._make_pipeline(sched)
            weights = [self.engine_dir / WEIGHTS, *([self.draft / WEIGHTS] if self.draft else [])]
            with drop_behind(*[w for w in weights if w.is_file()]):
                warm_up(pipeline, self.config)
            self._pipeline = pipeline
        return self._pipeline

    def _make_pipeline(self, sched: Any) -> Any:
        """The continuous-batching pipeline with the speculative lever: prompt lookup is a pipeline property; a
        draft model comes with both models' tokenizers as OpenVINO models (`with_ov_tokenizer`), which
        openvino-genai compares before it drafts."""
        import openvino_genai as og

        props, spec = self._properties(), self.config.speculative
        if spec is None or spec.type == "prompt-lookup":
            return og.ContinuousBatchingPipeline(str(self.engine_dir), sched, "CPU",
                                                 {**props, **({"prompt_lookup": True} if spec else {})})
        if self._views is None:
            self._views = tempfile.TemporaryDirectory(prefix="kiln-openvino-draft-")
        views = Path(self._views.name)
        main = with_ov_tokenizer(self.engine_dir, views / "main")
        draft = with_ov_tokenizer(self.draft, views / "draft")  # type: ignore[arg-type]
        return og.ContinuousBatchingPipeline(str(self.engine_dir), og.Tokenizer(str(main)), sched, "CPU",
                                             draft_model=og.draft_model(str(draft), "CPU"), **props)

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
        cfg = self.config.assisting(og.GenerationConfig())
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
        if self._views is not None:
            self._views.cleanup()
            self._views = None
