"""The `llama_cpp` engine's `server` runtime (the default): kiln starts llama.cpp's `llama-server`
and drives it over HTTP.

`llama-server` runs on 127.0.0.1 at a free port, `--parallel` slots with continuous batching
(a request that arrives mid-decode takes a free slot at the server's next step), health-checked
at start and stopped on `close`. Generation streams llama-server's native `/completion` with
token-ID prompts and `return_tokens`, so token ids come back exactly; the streamed logprob of
each token is llama.cpp's (`n_probs: 1`, asked only when the request wants it). Every request
names its sampler chain (`_sampling`), so llama-server's defaults (top_k 40, min_p 0.05) never
apply. Stop token ids are applied here (the server knows only stop strings): the stream is closed
at the first one.
`step()` reads every sequence's stream on the caller's own thread (llama_cpp_stream.py): no client
thread sits between llama-server and kiln's scheduler, so a token costs kiln serve one thread
wake-up less.

Scoring (`score`, `next_token_logprobs`) runs in-process instead (llama_cpp_scoring.py):
llama-server refuses `echo` on completions ("Only no echo is supported") and returns only top-n
probabilities of generated tokens, so the engine loads the same GGUF file into llama.cpp through
its ctypes binding, from the same build, on the first scoring call.
"""

from __future__ import annotations

import itertools
import selectors
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput
from kiln.engine.base import GenerationRequest, TokenEvent, check_request
from kiln.engine.llama_cpp.config import LlamaCppConfig, SpeculativeConfig
from kiln.engine.llama_cpp.scoring import LlamaCppEngine
from kiln.engine.llama_cpp.stream import Completion
from kiln.engine.remote import free_port, stop_process, wait_healthy

_HOST = "127.0.0.1"
_SILENCE_S = 600.0  # a stream that sends nothing this long fails (the remote backend's request timeout)


def server_command(exe: Path, gguf_path: Path, port: int, config: LlamaCppConfig) -> list[str]:
    threads = config.thread_count()
    k, v = config.kv_types()
    return [str(exe), "-m", str(gguf_path), "--host", _HOST, "--port", str(port),
            "--parallel", str(config.parallel), "--ctx-size", str(config.parallel * config.ctx_per_slot),
            "--batch-size", str(config.batch_size), "--threads", str(threads), "--threads-batch", str(threads),
            "--cache-type-k", k, "--cache-type-v", v, "--flash-attn", config.flash_attn,
            *(["--cache-reuse", str(config.cache_reuse)] if config.cache_reuse else []),
            *_speculative_flags(config.speculative, threads, Path(gguf_path).parent),
            "--cont-batching", "--no-webui", "--log-disable"]


def _speculative_flags(spec: SpeculativeConfig | None, threads: int, engine_dir: Path) -> list[str]:
    """llama-server's flags for `spec`; a size left None is left to llama.cpp's default for the type."""
    if spec is None:
        return []
    if spec.type == "draft":  # the draft model decodes on the same threads, between the model's steps
        sizes = {"--spec-draft-model": spec.draft_file(engine_dir), "--spec-draft-n-max": spec.draft_max,
                 "--spec-draft-n-min": spec.draft_min, "--spec-draft-threads": threads,
                 "--spec-draft-threads-batch": threads}
        kind = "draft-simple"
    elif spec.type == "ngram-mod":
        sizes = {"--spec-ngram-mod-n-match": spec.ngram_n, "--spec-ngram-mod-n-max": spec.ngram_m,
                 "--spec-ngram-mod-n-min": spec.draft_min}
        kind = spec.type
    else:
        sizes = {f"--spec-{spec.type}-size-n": spec.ngram_n, f"--spec-{spec.type}-size-m": spec.ngram_m}
        kind = spec.type
    return ["--spec-type", kind, *(x for flag, value in sizes.items() if value is not None for x in (flag, str(value)))]


@dataclass
class _Sequence:
    seq_id: int
    request: GenerationRequest
    completion: Completion
    produced: int = 0
    generated: list[int] = field(default_factory=list)
    streamed: int = 0  # tokens the current completion has streamed (0 again after a resume)
    # The last token, held until its completion's final chunk brings the server's timings (_tokens).
    held: TokenEvent | None = None
    timings: list[dict[str, Any]] = field(default_factory=list)  # each finished completion's, in order


class LlamaServerEngine(LlamaCppEngine):
    """An engine that owns the llama-server process it talks to; `step` reads its streams."""

    process: subprocess.Popen | None = None
    server_log: Any = None
    server_url: str = ""
    gguf_path: Path

    def __init__(self, port: int, tokenizer_dir: Path, config: LlamaCppConfig):
        self._setup(tokenizer_dir, config)
        self.port, self.server_url = port, f"http://{_HOST}:{port}"
        self._ids = itertools.count()
        self._seqs: dict[int, _Sequence] = {}
        self._selector = selectors.DefaultSelector()
        self._heard = time.monotonic()  # when a stream last delivered bytes (poll)

    @classmethod
    def start(cls, gguf_path: Path, tokenizer_dir: Path, config: LlamaCppConfig) -> LlamaServerEngine:
        from kiln.core.llama_cpp_build import ensure

        exe = ensure("llama-server")  # compiled now, once, where `make demo` built only the demo's part
        if exe is None:
            raise BadInput("llama-server is not built on this machine: run `make llama-cpp` "
                           "(or `python -m kiln.core.llama_cpp_build`) to build llama.cpp once.")
        port = free_port()
        # A file, not a pipe (a full pipe would stall the server); it lives as long as the process.
        log = tempfile.TemporaryFile()  # noqa: SIM115
        process = subprocess.Popen(server_command(exe, gguf_path, port, config),
                                   stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(f"http://{_HOST}:{port}", config.startup_timeout_s, process, "llama-server", log)
            engine = cls(port, tokenizer_dir, config)
        except BaseException:
            process.kill()
            process.wait(timeout=30)
            raise
        engine.process, engine.server_log, engine.gguf_path = process, log, gguf_path
        return engine

    # ----- generation -----------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        check_request(request, self.max_positions)
        if not self._seqs:  # the silence `poll` measures starts with the first sequence
            self._heard = time.monotonic()
        seq = _Sequence(next(self._ids), request, self._completion(request, list(request.prompt_ids),
                                                                   request.max_new_tokens, request.cache_prompt))
        self._seqs[seq.seq_id] = seq
        self._selector.register(seq.completion, selectors.EVENT_READ, seq)
        return seq.seq_id

    def _completion(self, r: GenerationRequest, prompt: list[int], n: int, cache_prompt: bool) -> Completion:
        # Never llama-server's ignore_eos: it sets every end-of-generation token's logit to -inf, so
        # the greedy text differs from the reference's wherever that token would have been chosen
        # (the demo model after a finished answer: <|im_end|>). kiln's ignore_eos means "do not
        # stop", so an EOS stop is resumed from the text so far instead (_resume).
        body: dict[str, Any] = {"prompt": prompt, "n_predict": n, "stream": True, "return_tokens": True,
                                "cache_prompt": cache_prompt, **_sampling(r)}
        if r.logprobs:  # n_probs makes the server softmax the whole vocabulary for every token
            body["n_probs"] = 1
        if r.seed is not None:
            body["seed"] = r.seed
        return Completion(_HOST, self.port, body, _SILENCE_S)

    def _resume(self, seq: _Sequence) -> None:
        """Continue a sequence llama-server ended at an end-of-generation token it was asked to
        pass: the same request on prompt + tokens so far (its KV prefix is reused from the slot)."""
        self._selector.unregister(seq.completion)
        seq.completion.close()
        r = seq.request
        # Always from the slot's cache: the prompt and the tokens so far are this sequence's own, already prefilled.
        seq.completion = self._completion(r, [*r.prompt_ids, *seq.generated], r.max_new_tokens - seq.produced, True)
        seq.streamed = 0
        self._selector.register(seq.completion, selectors.EVENT_READ, seq)

    def has_work(self) -> bool:
        return bool(self._seqs)

    def cancel(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:  # closing the connection makes the server free the slot
            self._selector.unregister(seq.completion)
            seq.completion.close()

    def readiness_fd(self) -> int | None:
        """The selector's own descriptor (epoll on Linux): readable while any stream has bytes waiting."""
        fileno = getattr(self._selector, "fileno", None)  # a select()-based selector has none
        return fileno() if fileno else None

    def step(self) -> list[TokenEvent]:
        """Wait for at least one token from any sequence, then return all that arrived."""
        out: list[TokenEvent] = []
        while self._seqs and not out:
            ready = self._selector.select(_SILENCE_S)
            if not ready:
                raise self._silent()
            out = self._read(ready)
        return out

    def poll(self) -> list[TokenEvent]:
        if not self._seqs:
            return []
        ready = self._selector.select(0)
        if not ready and time.monotonic() - self._heard > _SILENCE_S:
            raise self._silent()
        return self._read(ready)

    def _silent(self) -> RuntimeError:
        return RuntimeError(f"llama-server at {self.server_url} sent nothing for {_SILENCE_S:g} s")

    def _read(self, ready: list[tuple[selectors.SelectorKey, int]]) -> list[TokenEvent]:
        out: list[TokenEvent] = []
        now = time.perf_counter()
        if ready:
            self._heard = time.monotonic()
        for key, _ in ready:
            seq = key.data
            try:
                chunks = seq.completion.feed()
            except Exception:
                self.cancel(seq.seq_id)
                raise
            if any(self._tokens(seq, chunk, now, out) for chunk in chunks):
                self.cancel(seq.seq_id)
        return out

    def _tokens(self, seq: _Sequence, chunk: dict[str, Any], now: float, out: list[TokenEvent]) -> bool:
        """Append one streamed chunk's tokens to `out`; True once the sequence has ended."""
        r, ids = seq.request, chunk.get("tokens") or []
        probs = chunk.get("completion_probabilities") or []
        done = bool(chunk.get("stop"))
        if done and "timings" in chunk:
            seq.timings.append(chunk["timings"])
        if seq.held is not None:  # the final chunk after the last token: its figures complete the event
            out.append(replace(seq.held, stats=self._stats(seq)))
            return True
        for k, token in enumerate(ids):
            seq.produced += 1
            seq.generated.append(int(token))
            seq.streamed += 1
            lp = probs[k].get("logprob") if k < len(probs) else None
            last = token in r.stop_ids or seq.produced >= r.max_new_tokens
            finish = ("stop" if token in r.stop_ids else "length") if last else (
                _finish(chunk) if done and k == len(ids) - 1 else None)
            event = TokenEvent(seq.seq_id, int(token), now, lp, finish)
            if last and token not in r.stop_ids and not done:
                # The server stops here too (n_predict) and sends its timings next, straight after:
                # held until then, with the time it arrived.
                seq.held = event
                return False
            out.append(replace(event, stats=self._stats(seq)) if last or finish else event)
            if last:
                return True
        # Resumed only when this completion streamed its tokens (the EOS among them, already in `out`):
        # an EOS that came without a token must not be re-asked for forever; it ends below instead.
        if done and chunk.get("stop_type") == "eos" and r.ignore_eos and seq.streamed:
            self._resume(seq)
            return False
        if done and not ids:  # the end came without a token (EOS is not streamed)
            eos = self.tokenizer.eos_token_id
            out.append(TokenEvent(seq.seq_id, eos if eos is not None else 0, now, None, _finish(chunk),
                                  self._stats(seq)))
        return done

    def _stats(self, seq: _Sequence) -> dict[str, int] | None:
        """The request's figures from llama-server's timings (see TokenEvent.stats); None when no
        completion of it finished (a stop id kiln applies closes the stream before the server's end).
        The prompt's figures are the first completion's, the request's own prompt (a resume's prompt
        is that prompt plus the tokens so far, from the slot's cache); the drafts sum every completion's."""
        if not seq.timings:
            return None
        first = seq.timings[0]
        stats = {"prompt_tokens": int(first.get("prompt_n", 0)) + int(first.get("cache_n", 0)),
                 "cached_tokens": int(first.get("cache_n", 0))}
        # Drafting figures come only from a request that drafted; a speculative engine reports 0 for none.
        if self.config.speculative is not None or any("draft_n" in t for t in seq.timings):
            stats["draft_tokens"] = sum(int(t.get("draft_n", 0)) for t in seq.timings)
            stats["draft_accepted"] = sum(int(t.get("draft_n_accepted", 0)) for t in seq.timings)
        return stats

    # ----- scoring (in-process: LlamaCppEngine) ---------------------------------------------

    def _scoring_model(self) -> Path:
        return self.gguf_path

    def close(self) -> None:
        for seq_id in list(self._seqs):
            self.cancel(seq_id)
        self._selector.close()
        self._close_scorer()
        stop_process(self.process, 30)
        if self.server_log is not None:
            self.server_log.close()


def _sampling(r: GenerationRequest) -> dict[str, Any]:
    """llama-server's sampler chain for kiln's sampling, named whole. Its default chain truncates to
    the top 40 tokens and to min_p 0.05 and applies top_p before the temperature; kiln's (like torch,
    OpenVINO, CTranslate2 and the OpenAI API) divides by the temperature, then keeps the nucleus, and
    truncates nothing else. Greedy is top_k 1: the argmax, without the default chain's partial sort
    of the whole vocabulary for its top 40 on every token."""
    if r.temperature == 0:
        return {"samplers": ["top_k"], "top_k": 1}
    return {"samplers": ["temperature", "top_p"], "temperature": r.temperature, "top_p": r.top_p}


def _finish(chunk: dict[str, Any]) -> str:
    return "length" if chunk.get("stop_type") == "limit" else "stop"
