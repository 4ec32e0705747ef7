"""OpenAI request parsing and response pieces for the server: pure functions, no I/O.

Token-ID prompts are used exactly as given (no BOS added): lm-eval's `local-completions` sends
them that way, and a server that adds BOS shifts every log-likelihood by one token without any
error (FIELD.md). String prompts are tokenized the way the model's tokenizer says (usually BOS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.pipeline.errors import BadInput

DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompts(prompt: Any, tokenizer) -> list[list[int]]:
    """`prompt` as a string, list of strings, token ids, or list of token-id lists."""
    if isinstance(prompt, str):
        return [tokenizer(prompt).input_ids]
    if _is_ids(prompt) and prompt:
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer(p).input_ids for p in prompt]
    if isinstance(prompt, list) and prompt and all(_is_ids(p) and p for p in prompt):
        return [list(p) for p in prompt]
    raise BadInput("prompt: expected a string, a list of strings, a list of token ids, "
                   "or a list of token-id lists (none empty).")


def chat_prompt(messages: Any, tokenizer) -> list[int]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise BadInput("messages: expected a list of {role, content} objects.")
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput("This model's tokenizer has no chat template; use /v1/completions.")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids  # the template already has BOS


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    token_ids_as_text: bool  # vLLM's return_tokens_as_token_ids: tokens as "token_id:N"


def parse_sampling(body: dict[str, Any], chat: bool = False) -> Sampling:
    def get(name, kind, default):
        value = body.get(name, default)
        if value is None:
            return default
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise BadInput(f"{name}: expected {getattr(kind, '__name__', kind)}, got {value!r}.")
        return value

    if get("n", int, 1) != 1:
        raise BadInput("n: only n=1 is supported; send the prompt several times instead.")
    max_tokens = get("max_completion_tokens", int, None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else get("max_tokens", int, DEFAULT_MAX_TOKENS)
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if chat and (body.get("logprobs") or body.get("top_logprobs")):
        raise BadInput("logprobs: not supported on chat completions; use /v1/completions.")
    logprobs = None if chat else get("logprobs", int, None)
    s = Sampling(max_tokens, float(get("temperature", (int, float), 1.0)), get("seed", int, None), stop,
                 get("ignore_eos", bool, False), logprobs, get("echo", bool, False),
                 get("stream", bool, False), bool((body.get("stream_options") or {}).get("include_usage")),
                 get("return_tokens_as_token_ids", bool, False))
    if s.max_tokens < 0 or s.temperature < 0 or (s.logprobs is not None and not 0 <= s.logprobs <= 20):
        raise BadInput("max_tokens and temperature must be >= 0; logprobs must be in 0..20.")
    if s.max_tokens == 0 and not s.echo:
        raise BadInput("max_tokens: 0 only makes sense with echo=true (prompt scoring).")
    if s.stream and (s.echo or (s.logprobs or 0) > 0):
        raise BadInput("stream=true supports logprobs=0 only and no echo; use stream=false for "
                       "top_logprobs and echo (scoring).")
    return s


def token_text(tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


Positions = list[tuple[float, list[tuple[int, float]]]]  # per token after the first: (logprob, top-k)


def position_logprobs(engine, seqs: list[list[int]], top: int, budget_tokens: int = 2048) -> list[Positions]:
    """For each sequence, the logprob of every token after the first and the top-k alternatives.

    Runs on the scheduler thread. Full [len, vocab] distributions are reduced to top-k chunk by
    chunk, so a batch of long prompts never holds all its distributions at once.
    """
    out: list[Positions] = [[] for _ in seqs]
    todo = [i for i, s in enumerate(seqs) if len(s) > 1]
    while todo:
        chunk, used = [], 0
        while todo and (not chunk or used + len(seqs[todo[0]]) <= budget_tokens):
            used += len(seqs[todo[0]])
            chunk.append(todo.pop(0))
        for i, rows in zip(chunk, engine.next_token_logprobs([seqs[i][:-1] for i in chunk]), strict=True):
            ids = seqs[i]
            best = np.argpartition(-rows, top - 1, axis=1)[:, :top] if top else None
            out[i] = [(float(rows[k, ids[k + 1]]),
                       [(int(t), float(rows[k, t])) for t in best[k]] if top else [])
                      for k in range(len(ids) - 1)]
    return out


def logprobs_block(tokenizer, ids: list[int], positions: Positions, first: int, top: int,
                   as_ids: bool) -> dict[str, Any]:
    """OpenAI completions `logprobs` for ids[first:]; position 0 has no prediction (null)."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for i, token in enumerate(ids):
        piece = tokenizer.decode([token])
        if i >= first:
            tokens.append(token_text(tokenizer, token, as_ids))
            offsets.append(offset)
            lp, best = positions[i - 1] if i > 0 else (None, None)
            lps.append(lp)
            tops.append({token_text(tokenizer, t, as_ids): v for t, v in best} if best is not None else None)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if top else None,
            "text_offset": offsets}


class TextStream:
    """Incremental detokenization with stop strings, never emitting half a character or a
    prefix of a stop string that might still complete."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted
        self.text = ""
        self.stopped = False

    def push(self, token_id: int | None, final: bool = False) -> str:
        """Add a token (None: just flush); return the new text that is safe to emit."""
        if token_id is not None:
            self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped, final = self.text[: min(hits)], True, True
        safe = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):  # a multi-byte character still incomplete
                safe -= 1
            safe -= max((len(s) - 1 for s in self.stop), default=0)
        delta = self.text[self.sent : max(safe, self.sent)]
        self.sent += len(delta)
        return delta
