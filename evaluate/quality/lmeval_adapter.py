"""lm-eval's `LM` interface over any kiln engine, batched (`--model kiln`, or pass the object).

lm-eval gives a custom `LM` no batching: one request per forward pass was 25x slower than its own
`hf` backend (FIELD.md). This adapter hands the engine whole batches instead: log-likelihood
requests sorted longest-first (as the `hf` backend does, so padding stays small) go to
`Engine.score` in chunks of `batch_size`; rolling windows of every document are pooled and
scored the same way; generation requests all join the engine's continuous batch at once.

Tokenization mirrors the `hf` backend (`TemplateLM._encode_pair`: trailing context spaces move to
the continuation; the tokenizer's own special-token default), so per-sample log-likelihoods can
be compared with lm-eval's `hf` and `local-completions` runs of the same checkpoint.
"""

from __future__ import annotations

from typing import Any

from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kiln.core import progress
from kiln.engine.base import Engine, GenerationRequest
from kiln.evaluate.quality.lmeval_config import DEFAULT_BATCH_SIZE
from kiln.core.errors import BadInput

DEFAULT_MAX_LENGTH = 2048  # when neither the caller nor the engine says


@register_model("kiln")
class KilnLM(TemplateLM):
    """`engine`: a loaded kiln Engine; or `engine_dir`: a built engine folder (CLI `--model_args`)."""

    def __init__(self, engine: Engine | None = None, engine_dir: str | None = None,
                 batch_size: int | str = DEFAULT_BATCH_SIZE, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None, **kwargs: Any) -> None:
        super().__init__()
        if (engine is None) == (engine_dir is None):
            raise BadInput("lm-eval model 'kiln': pass exactly one of engine= (a loaded engine) "
                           "or engine_dir= (a built engine folder).")
        if engine is None:
            from kiln.engine.loader import load_engine

            engine = load_engine(engine_dir)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # lm-eval's "auto" sizing probes GPU memory; here the engine packs by its own token budget.
        self.batch_size = DEFAULT_BATCH_SIZE if str(batch_size).startswith("auto") else int(batch_size)
        if self.batch_size < 1:
            raise BadInput(f"lm-eval model 'kiln': batch_size must be >= 1, got {batch_size}.")
        self._max_length = max_length
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self._prefix_text = self.tokenizer.decode([self.prefix_token_id])  # decoded once, not per request

    # ----- tokenization (the hf backend's rules) ----------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        limit = getattr(self.engine, "max_positions", None)
        return int(limit) if limit and limit < 1 << 30 else DEFAULT_MAX_LENGTH

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "kiln")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        flag = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        special = {} if flag is None else {"add_special_tokens": flag}
        if add_special_tokens is None and string.startswith(self._prefix_text):
            special["add_special_tokens"] = False  # the string already carries its BOS
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_request(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The token ids `loglikelihood` scores for one (context, continuation) request."""
        if context:
            return self._encode_pair(context, continuation)
        cont = self.tok_encode(continuation, add_special_tokens=False)
        return ([self.prefix_token_id], cont) if cont[:1] != [self.prefix_token_id] else (cont[:1], cont[1:])

    # ----- log-likelihood -------------------------------------------------------------------

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate to the model's length, as the hf backend does."""
        if not continuation:
            raise BadInput("A log-likelihood request's continuation is empty after tokenization (it merged "
                           "into the context's last token); lm-eval's hf backend refuses it too. Fix the task's target.")
        if len(continuation) > self.max_length:
            raise BadInput(f"A continuation of {len(continuation)} tokens exceeds max_length "
                           f"{self.max_length}; shorten the task's targets or raise max_length.")
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[: len(whole) - len(continuation)], continuation

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        # Longest first (ties by content, like hf): similar lengths share a forward pass.
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][1]) - len(requests[i][2]),
                                                            tuple(requests[i][1] + requests[i][2])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # lm-eval asks for each request type once, all tasks' requests together: OpenVINO then holds one
        # compiled model at a time (its scorer's or its pipeline's), not both
        self.engine.release_generation()
        progress.more(len(requests), "requests")
        # disable=None: tqdm draws only on a terminal, not hundreds of redraws into a CI log; never over kiln's own
        quiet = disable_tqdm or progress.shown() or None
        with tqdm(total=len(requests), disable=quiet, desc="kiln loglikelihood") as bar:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                scores = self.engine.score([self._fit(requests[i][1], requests[i][2]) for i in chunk])
                for i, s in zip(chunk, scores, strict=True):
                    results[i] = (s.logprob, s.is_greedy)
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
                bar.update(len(chunk))
                progress.advance(len(chunk))
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document cut into disjoint max-length windows; all windows scored as one pool."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for n, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[n] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ----- generation -----------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Every request joins the engine's continuous batch; each stops at its first until-string."""
        from lm_eval.models.utils import normalize_gen_kwargs

        live: dict[int, tuple[int, list[str], list[int]]] = {}  # seq id -> (request index, until, tokens)
        out = [""] * len(requests)
        self.engine.release_scoring()  # one compiled model at a time (see _loglikelihood_tokens)
        progress.more(len(requests), "requests")
        for n, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = [u for u in kwargs["until"] if u]
            budget = kwargs["max_gen_toks"]
            if budget >= self.max_length:
                raise BadInput(f"max_gen_toks {budget} must be below max_length {self.max_length}.")
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - budget)
            seq = self.engine.add(GenerationRequest(prompt, budget, temperature=float(kwargs.get("temperature") or 0.0)))
            live[seq] = (n, until, [])
        quiet = disable_tqdm or progress.shown() or None  # as in _loglikelihood_tokens
        with tqdm(total=len(requests), disable=quiet, desc="kiln generate_until") as bar:
            while self.engine.has_work():
                for event in self.engine.step():
                    if event.seq_id not in live:
                        continue
                    n, until, tokens = live[event.seq_id]
                    tokens.append(event.token_id)
                    text = self.tok_decode(tokens)
                    hit = any(u in text for u in until)
                    if hit or event.finish_reason is not None:
                        if hit and event.finish_reason is None:
                            self.engine.cancel(event.seq_id)
                        out[n] = _cut(text, until)
                        del live[event.seq_id]
                        bar.update(1)
                        progress.advance()
        for req, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


def _cut(text: str, until: list[str]) -> str:
    """Text up to the earliest until-string (lm-eval strips the stop sequence itself)."""
    for u in until:
        text = text.split(u)[0]
    return text


if __name__ == "__main__":
    # lm-eval's CLI with `--model kiln` available: it discovers no plugins, so register, then delegate.
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
