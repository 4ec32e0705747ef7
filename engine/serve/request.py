"""OpenAI request bodies, validated at the edge: pure functions, no I/O.

Everything a client can get wrong is refused here, naming the field, before the request reaches
the scheduler's shared batch: one bad request must never fail the batch it would have joined
(vLLM validates sampling parameters the same way, before its scheduler). Sampling fields kiln does
not implement are refused unless they hold their no-op value, never silently ignored.

Token-ID prompts are used exactly as given (no BOS added): lm-eval's `local-completions` sends
them that way, and a server that adds BOS shifts every log-likelihood by one token without any
error (FIELD.md). String prompts are tokenized the way the model's tokenizer says (usually BOS).
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import BadInput

DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default, cut to what the context leaves
MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow
MAX_SEED = 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI and vLLM sampling fields kiln does not implement, with the values that change nothing.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "best_of": (1,),
    "top_k": (-1, 0), "min_p": (0,), "logit_bias": ({},), "suffix": ("",), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "use_beam_search": (False,), "length_penalty": (1,),
}

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 2, 40, 40, 4, 4
_show = _repr.repr  # a client's value in a message: short, and safe on any nesting


class RequestError(BadInput):
    """A client mistake: the HTTP `status`, the OpenAI error `code` and the field (`param`) at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def read_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"Request body is not UTF-8 (invalid byte at offset {e.start}); send UTF-8 JSON.") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError("Request body nests too deeply to be a completion request.") from None
    except ValueError as e:  # JSONDecodeError, a 5000-digit number, NaN
        raise RequestError(f"Request body is not valid JSON: {str(e)[:200]}.") from None
    if not isinstance(body, dict):
        raise RequestError("Request body must be a JSON object.")
    return body


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def check_model(body: dict[str, Any], served: str) -> None:
    """No `model` means the one served (as vLLM does); any other name is a 404, as OpenAI answers."""
    model = body.get("model")
    if model is not None and model != served:
        shown = model[:100] if isinstance(model, str) else _show(model)
        raise RequestError(f"The model `{shown}` does not exist; this server serves `{served}` "
                           "(GET /v1/models).", "model", 404, "model_not_found")


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompts(prompt: Any, tokenizer, vocab: int) -> list[list[int]]:
    """`prompt` as a string, list of strings, token ids, or list of token-id lists; ids in [0, vocab)."""
    if isinstance(prompt, str):
        prompts = [tokenizer(prompt).input_ids]
    elif _is_ids(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer(p).input_ids for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise RequestError("prompt: expected a string, a list of strings, a list of token ids, "
                           "or a list of token-id lists (none empty).", "prompt")
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"prompt[{i}]: tokenizes to no tokens.", "prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt: token id {_show(bad)} is out of the vocabulary (0..{vocab - 1}).", "prompt")
    return prompts


def chat_prompt(messages: Any, tokenizer) -> list[int]:
    """The token ids of `messages` rendered by the model's chat template, with the assistant turn open."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {role, content} objects.", "messages")
    clean = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("This model's tokenizer has no chat template; use /v1/completions.", "messages")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:  # the template's own raise_exception ("roles must alternate")
        raise RequestError(f"messages: the model's chat template refuses them: {e}", "messages") from None
    return tokenizer(text, add_special_tokens=False).input_ids  # the template already has BOS


def _message(m: Any, where: str) -> dict[str, str]:
    if not isinstance(m, dict):
        raise RequestError(f"{where}: expected a {{role, content}} object, got {_show(m)}.", where)
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise RequestError(f"{where}.role: expected one of {', '.join(ROLES)}; got {_show(role)}.", f"{where}.role")
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        content = "\n".join(p["text"] for p in content)  # text parts, joined as vLLM does
    if not isinstance(content, str):
        raise RequestError(f"{where}.content: expected a string or a list of text parts "
                           f"({{type: text, text}}); got {_show(content)}.", f"{where}.content")
    return {"role": role, "content": content}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: not sent (DEFAULT_MAX_TOKENS, cut to the context)
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    token_ids_as_text: bool  # vLLM's return_tokens_as_token_ids: tokens as "token_id:N"
    cache_prompt: bool = True  # llama.cpp's name: the engine may serve the prompt's prefix from its prompt cache


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise RequestError(f"{name}: expected {' or '.join(k.__name__ for k in kinds)}, got {_show(value)}.", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    raw = _get(body, name, (int, float), default)
    value = float(raw) if abs(raw) < 2**1000 else math.inf  # float() of a 400-digit integer overflows
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise RequestError(f"{name}: must be a number in {span}; got {_show(body.get(name))}.", name)
    return value


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = _get(body, name, int, default)
    if value is not None and not lo <= value <= hi:
        raise RequestError(f"{name}: must be an integer in [{lo}, {hi}]; got {_show(value)}.", name)
    return value


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, noops in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any((value == v and type(value) is type(v)) or
                                         (type(v) is int and type(value) is float and value == v) for v in noops):
            raise RequestError(f"{name}: not supported by kiln serve (only {', '.join(map(repr, noops)) or 'unset'}); "
                               f"got {_show(value)}.", name)
    if _get(body, "n", int, 1) != 1:
        raise RequestError("n: only n=1 is supported; send the prompt several times instead.", "n")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop: expected a non-empty string or a list of them; got {_show(body.get('stop'))}.",
                           "stop")
    return tuple(stop)


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options: only allowed with stream=true.", "stream_options")
    if not isinstance(options, dict) or not set(options) <= {"include_usage", "continuous_usage_stats"}:
        raise RequestError(f"stream_options: expected {{\"include_usage\": bool}}; got {_show(options)}.",
                           "stream_options")
    return bool(_get(options, "include_usage", bool, False))


def parse_sampling(body: dict[str, Any], vocab: int, chat: bool = False) -> Sampling:
    _refuse_unsupported(body)
    max_tokens = _int(body, "max_completion_tokens", None, 0, 2**62) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _int(body, "max_tokens", None, 0, 2**62)
    if chat and (body.get("logprobs") or body.get("top_logprobs")):
        raise RequestError("logprobs: not supported on chat completions; use /v1/completions.", "logprobs")
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
        raise RequestError(f"stop_token_ids: expected token ids in 0..{vocab - 1}; got {_show(stop_ids)}.",
                           "stop_token_ids")
    stream = _get(body, "stream", bool, False)
    temperature = _number(body, "temperature", 1.0, 0, 2)
    s = Sampling(max_tokens, temperature if temperature >= MIN_TEMPERATURE else 0.0,
                 _number(body, "top_p", 1.0, 0, 1, lo_open=True), _int(body, "seed", None, 0, MAX_SEED),
                 _stop(body), tuple(stop_ids), _get(body, "ignore_eos", bool, False),
                 None if chat else _int(body, "logprobs", None, 0, 20), _get(body, "echo", bool, False), stream,
                 _include_usage(body, stream), _get(body, "return_tokens_as_token_ids", bool, False),
                 _get(body, "cache_prompt", bool, True))
    if s.max_tokens == 0 and not s.echo:
        raise RequestError("max_tokens: 0 only makes sense with echo=true (prompt scoring).", "max_tokens")
    if s.stream and (s.echo or (s.logprobs or 0) > 0):
        raise RequestError("stream=true supports logprobs=0 only and no echo; use stream=false for "
                           "top_logprobs and echo (scoring).", "stream")
    return s


def budgets(prompts: list[list[int]], s: Sampling, context: int | None) -> list[int]:
    """Tokens to generate per prompt. With the prompt, max_tokens must fit the context (else a 400
    with the numbers, as vLLM answers); when not sent, the default is cut to what the context leaves."""
    out = []
    for i, ids in enumerate(prompts):
        room = context - len(ids) if context else 2**62
        want = s.max_tokens if s.max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
        if want > room or room < 0 or (want <= 0 and not s.echo):
            where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
            asks = (f"max_tokens asks for {want} more ({len(ids) + want} in all)" if s.max_tokens is not None
                    else "no room is left to generate")
            raise RequestError(f"This model's context is {context} tokens, but {where} has {len(ids)} tokens and "
                               f"{asks}; shorten the prompt or lower max_tokens.",
                               "max_tokens" if 0 < room < want else "prompt")
        out.append(want)
    return out
