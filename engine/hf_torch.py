"""The `torch` backend: a Hugging Face checkpoint run by plain PyTorch, the reference for parity.

It loads every checkpoint kiln's optimize stage writes (fp32/bf16 baselines, GPTQ through
GPTQModel's transformers integration, torchao int8) and decodes with a hand-written loop over a
KV cache instead of `generate()`, which was ~10x slower on CPU (FIELD.md). Continuous batching:
a newcomer is prefilled alone, then its KV cache is left-padded and concatenated onto the running
batch; an attention mask hides the padding and explicit position ids keep RoPE exact, so every
sequence gets the tokens it would get alone.

Building records the checkpoint path (no copy): the checkpoint already is the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from kiln.engine.base import (BACKENDS, REBUILD, Engine, EngineBackend, EngineConfig, GenerationRequest, Score,
                              TokenEvent, check_request)
from kiln.core.errors import BadInput

FULL_PASS_TOKENS, MIN_FILL = 512, 0.9  # scoring passes: see TorchEngine._batches


class TorchEngineConfig(EngineConfig):
    backend: Literal["torch"] = "torch"
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    threads: int | None = Field(None, ge=1, description="torch.set_num_threads; None keeps torch's default")
    trust_remote_code: bool = False
    max_batch_size: int = Field(16, ge=1, description="sequences decoded together; the rest wait")
    score_batch_tokens: int = Field(4096, ge=1, description="padded tokens per scoring forward pass")


def slow_kernel_notice(model_config: dict[str, Any], cuda: bool) -> str | None:
    """Why this checkpoint will decode slowly here, when kiln knows: GPTQModel has a CPU kernel for
    4-bit GPTQ only (TorchAtenLinear); other widths fall back to its generic TorchLinear, which
    dequantizes every weight at every step."""
    q = model_config.get("quantization_config") or {}
    if cuda or q.get("quant_method") != "gptq" or q.get("bits") == 4:
        return None
    return (f"GPTQ {q.get('bits')}-bit on CPU runs GPTQModel's generic TorchLinear kernel, which dequantizes every "
            "weight at every step: about 1 token/s on the 135M demo model, a tenth of fp32 (bench/quantize_methods.py). "
            "For 8-bit on CPU use optimize.method int8_weight_only; GPTQ 4-bit has a CPU kernel.")


def check_checkpoint(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise BadInput(f"{path}: no config.json. Point the engine at a Hugging Face checkpoint folder.")
    if not any(path.glob("*.safetensors")):
        raise BadInput(f"{path}: no *.safetensors weights. kiln loads safetensors only (no pickle); "
                       "re-save the checkpoint with save_pretrained(safe_serialization=True).")


@BACKENDS.register("torch", TorchEngineConfig)
class TorchBackend(EngineBackend):
    libraries: ClassVar[tuple[str, ...]] = ("torch", "transformers", "gptqmodel", "optimum", "torchao")
    revision: ClassVar[int] = 1  # 1: bfloat16 products of many rows in float32 where the CPU lacks bf16 (torch_bf16)

    def build(self, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
        check_checkpoint(checkpoint)
        return {"checkpoint": str(Path(checkpoint).resolve())}

    @classmethod
    def open(cls, engine_dir: Path, config: TorchEngineConfig, manifest: dict[str, Any]) -> TorchEngine:
        checkpoint = Path(manifest["build"]["checkpoint"])
        if not checkpoint.is_dir():
            raise BadInput(f"{engine_dir}: the checkpoint it serves, {checkpoint}, does not exist. {REBUILD}")
        return TorchEngine(checkpoint, config)


@dataclass
class _Seq:
    id: int
    req: GenerationRequest
    rng: Any  # torch.Generator when sampling
    length: int = 0  # real (unpadded) tokens in the KV cache
    produced: int = 0
    last: int = -1  # the token to feed at the next decode step


def _nucleus(probs, top_p: float):
    """Top-p: keep the most likely tokens until their mass reaches top_p (at least one), zero the rest."""
    import torch

    ranked, order = torch.sort(probs, descending=True)
    drop = ranked.cumsum(-1) - ranked >= top_p  # the mass before this token already reaches top_p
    drop[..., 0] = False  # the most likely token stays, even when a tiny top_p rounds to 0 in float32
    ranked[drop] = 0
    return torch.zeros_like(probs).scatter(-1, order, ranked)


class TorchEngine(Engine):
    def __init__(self, checkpoint: Path, config: TorchEngineConfig):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kiln.engine.torch_bf16 import lacks_bf16_instructions, widen

        checkpoint = Path(checkpoint)
        check_checkpoint(checkpoint)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.manifest = {"backend": "torch", "config": config.model_dump(mode="json"),
                         "build": {"checkpoint": str(checkpoint)}}
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=config.trust_remote_code)
        dtype = config.dtype if config.dtype == "auto" else getattr(torch, config.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=dtype, use_safetensors=True, trust_remote_code=config.trust_remote_code
        ).eval()
        if lacks_bf16_instructions():
            widen(self.model)  # bfloat16 prefill and scoring in float32 (engine/torch_bf16.py)
        notice = slow_kernel_notice(self.model.config.to_dict(), torch.cuda.is_available())
        if notice:
            logging.getLogger("kiln").warning("%s: %s", checkpoint, notice)
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        self._next_id = 0
        self._pending: list[_Seq] = []
        self._batch: list[_Seq] = []
        self._cache = None  # DynamicCache over self._batch, left-padded
        self._mask = None  # [batch, cache_len] 1 = real token, 0 = padding

    # ----- generation -----------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        import torch

        check_request(request, self.max_positions)
        rng = None
        if request.temperature > 0:
            seed = request.seed if request.seed is not None else int(torch.randint(0, 2**31, ()).item())
            rng = torch.Generator().manual_seed(seed)
        seq = _Seq(self._next_id, request, rng)
        self._next_id += 1
        self._pending.append(seq)
        return seq.id

    def has_work(self) -> bool:
        return bool(self._pending or self._batch)

    def cancel(self, seq_id: int) -> None:
        self._pending = [s for s in self._pending if s.id != seq_id]
        self._keep([i for i, s in enumerate(self._batch) if s.id != seq_id])

    def step(self) -> list[TokenEvent]:
        import torch

        events: list[TokenEvent] = []
        with torch.inference_mode():
            if self._batch:
                events += self._decode()
            while self._pending and len(self._batch) < self.config.max_batch_size:
                events += self._prefill(self._pending.pop(0))
        return events

    def _decode(self) -> list[TokenEvent]:
        import torch

        ids = torch.tensor([[s.last] for s in self._batch])
        positions = torch.tensor([[s.length] for s in self._batch])
        self._mask = torch.cat([self._mask, torch.ones(len(self._batch), 1, dtype=torch.long)], dim=1)
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=positions,
                         past_key_values=self._cache, use_cache=True)
        events = self._emit(self._batch, out.logits[:, -1, :].float())
        self._keep([i for i, e in enumerate(events) if e.finish_reason is None])
        return events

    def _prefill(self, s: _Seq) -> list[TokenEvent]:
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()
        # logits_to_keep=1: only the last position's vocabulary projection is needed (as generate() does).
        out = self.model(input_ids=torch.tensor([s.req.prompt_ids]), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        s.length = len(s.req.prompt_ids) - 1  # _emit counts the position it predicts from
        (event,) = self._emit([s], out.logits[:, -1, :].float())
        if event.finish_reason is None:
            self._join(s, cache)
        return [event]

    def _emit(self, seqs: list[_Seq], logits) -> list[TokenEvent]:
        """Pick each sequence's next token from its row of `logits` [len(seqs), vocab]: one
        log_softmax, argmax and gather for the whole batch, not three small ops per sequence."""
        import time

        import torch

        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(seqs):
            if s.rng is not None:
                probs = torch.softmax(logits[i] / s.req.temperature, dim=-1)
                if s.req.top_p < 1:
                    probs = _nucleus(probs, s.req.top_p)
                tokens[i] = int(torch.multinomial(probs, 1, generator=s.rng))
        chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        now = time.perf_counter()
        events = []
        for s, token, logprob in zip(seqs, tokens, chosen, strict=True):
            s.length += 1
            s.produced += 1
            s.last = token
            finish = None
            if token in s.req.stop_ids or (token in self.eos_ids and not s.req.ignore_eos):
                finish = "stop"
            elif s.produced >= s.req.max_new_tokens or s.length + 1 >= self.max_positions:
                finish = "length"
            events.append(TokenEvent(s.id, token, now, logprob, finish))
        return events

    @property
    def vocab_size(self) -> int:
        """An id past either the tokenizer or the embedding table fails, so the smaller bound."""
        return min(len(self.tokenizer), self.model.get_input_embeddings().num_embeddings)

    def _join(self, s: _Seq, cache) -> None:
        """Append a prefilled sequence to the running batch, left-padding the shorter side."""
        import torch
        import torch.nn.functional as F

        mask = torch.ones(1, s.length, dtype=torch.long)
        if self._cache is None:
            self._cache, self._mask, self._batch = cache, mask, [s]
            return
        width = max(self._mask.shape[1], s.length)
        pad_old, pad_new = width - self._mask.shape[1], width - s.length
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([F.pad(old.keys, (0, 0, pad_old, 0)), F.pad(new.keys, (0, 0, pad_new, 0))])
            old.values = torch.cat([F.pad(old.values, (0, 0, pad_old, 0)), F.pad(new.values, (0, 0, pad_new, 0))])
        self._mask = torch.cat([F.pad(self._mask, (pad_old, 0)), F.pad(mask, (pad_new, 0))])
        self._batch.append(s)

    def _keep(self, rows: list[int]) -> None:
        """Keep only these batch rows, then drop padding columns no remaining row needs."""
        if len(rows) == len(self._batch):
            return
        if not rows:
            self._cache, self._mask, self._batch = None, None, []
            return
        import torch

        idx = torch.tensor(rows)
        self._mask = self._mask[idx]
        lead = int((self._mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # all-padding prefix
        self._mask = self._mask[:, lead:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, lead:]
            layer.values = layer.values[idx, :, lead:]
        self._batch = [self._batch[i] for i in rows]

    # ----- scoring --------------------------------------------------------------------------

    def _batches(self, seqs: Sequence[list[int]]) -> list[list[int]]:
        """Indices grouped longest-first so each forward pass stays within score_batch_tokens.

        Every padded position costs a full forward, so once a pass holds FULL_PASS_TOKENS (enough
        rows to keep the matmuls busy) a sequence shorter than MIN_FILL of the pass's longest starts
        a new pass instead: the demo's rolling documents (323-499 tokens) were 24% padding in one pass.
        """
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        groups: list[list[int]] = []
        for i in order:
            if groups:
                longest, n = len(seqs[groups[-1][0]]), len(groups[-1])
                fits = longest * (n + 1) <= self.config.score_batch_tokens
                if fits and (longest * n < FULL_PASS_TOKENS or len(seqs[i]) >= MIN_FILL * longest):
                    groups[-1].append(i)
                    continue
            groups.append([i])
        return groups

    def _logits(self, seqs: list[list[int]], keep: int):
        """Logits of the last `keep` positions of right-padded `seqs`.

        No attention mask, as lm-eval's `hf` backend: attention is causal, so a real token never
        sees the padding after it, and without a mask the attention kernel takes its causal fast path.
        """
        import torch

        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        out = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        return out.logits.float(), width

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        import torch

        if any(not ctx or not cont for ctx, cont in pairs):
            raise BadInput("score() needs a non-empty context and continuation in every pair "
                           "(lm-eval passes the EOT token as context for rolling log-likelihoods).")
        full = [list(ctx) + list(cont) for ctx, cont in pairs]
        results: list[Score | None] = [None] * len(pairs)
        with torch.inference_mode():
            for group in self._batches(full):
                inputs = [full[i][:-1] for i in group]
                # Keep only the positions that predict some continuation token.
                keep = max(map(len, inputs)) - min(len(pairs[i][0]) - 1 for i in group)
                logits, width = self._logits(inputs, keep)
                for j, i in enumerate(group):
                    ctx, cont = pairs[i]
                    start = len(ctx) - 1 - (width - keep)  # first predicting position, in kept coords
                    rows = logits[j, start : start + len(cont)]
                    target = torch.tensor(cont)
                    # log_softmax, as hf: its fused CPU kernel took ~17% less CPU than logit - logsumexp
                    # (which writes a [tokens, vocab] temporary as well) on [450, 49152] rows.
                    lps = torch.log_softmax(rows, dim=-1).gather(1, target[:, None])[:, 0]
                    greedy = bool((rows.argmax(dim=-1) == target).all())
                    results[i] = Score(float(lps.sum()), greedy, tuple(lps.tolist()))
        return results  # type: ignore[return-value]

    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        import torch

        results: list[Any] = [None] * len(ids)
        with torch.inference_mode():
            for group in self._batches(ids):
                logits, _ = self._logits([list(ids[i]) for i in group], 0)  # 0 keeps every position
                for j, i in enumerate(group):
                    results[i] = torch.log_softmax(logits[j, : len(ids[i])], dim=-1).numpy()
        return results

    def close(self) -> None:
        self._pending, self._batch, self._cache, self._mask = [], [], None, None
