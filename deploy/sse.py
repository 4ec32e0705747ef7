"""Server-sent-event plumbing for the router: split a backend's stream into whole events, note the
text and token times as they pass, and build the request that continues a broken stream elsewhere.

The router only ever writes whole events to the client, so when a backend dies mid-stream the
client has received a clean prefix, and the rest can come from the other arm: a completions
request continues with prompt + text so far and the remaining max_tokens; a chat request sends the
partial answer as a final assistant message with `continue_final_message` (vLLM's extension for
exactly this). That is how a canary killed mid-stream costs the client nothing.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

DONE = b"data: [DONE]"


# An event carries output when a text/content string is non-empty; escaped quotes inside a string
# (\\") cannot match. Counting with a regex instead of parsing JSON keeps the per-token cost low;
# the text itself is parsed only when needed (a continuation or a mirrored comparison).
_CONTENT = re.compile(rb'"(?:text|content)":\s?"(?!")')
_USAGE = re.compile(rb'"usage":\s?\{')


class SSERelay:
    """Feeds on raw bytes from a backend, returns whole events to forward.

    Counts tokens as non-empty text pieces, keeps the events that carried them (their text is
    parsed on demand), and the time of the first and last token, overall and per attempt.
    """

    def __init__(self, strip_usage: bool):
        self.strip_usage = strip_usage  # drop the usage-only event the client did not ask for
        self._buf = b""
        self._events: list[bytes] = []
        self.tokens = 0
        self.first: float | None = None
        self.last: float | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.attempt_first: float | None = None  # first token of the current backend attempt
        self.attempt_tokens = 0

    def new_attempt(self) -> None:
        """A new backend takes over: per-attempt timing restarts, the text so far stays."""
        self._buf, self.done = b"", False
        self.attempt_first, self.attempt_tokens = None, 0

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        out = []
        while (cut := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[:cut + 2], self._buf[cut + 2:]
            if self._note(event.strip()):
                out.append(event)
        return b"".join(out)

    def _note(self, event: bytes) -> bool:
        """Record what the event says; False when it must not be forwarded."""
        if event.startswith(DONE):
            self.done = True
            return True
        if not event.startswith(b"data:"):
            return True  # comments and keep-alives pass through
        if _USAGE.search(event):
            try:
                obj = json.loads(event[5:])
            except ValueError:
                return True
            self.usage = obj.get("usage") or self.usage
            if self.strip_usage and not obj.get("choices"):
                return False
        pieces = len(_CONTENT.findall(event))
        if pieces:
            now = time.perf_counter()
            self.first = self.first or now
            self.attempt_first = self.attempt_first or now
            self.last = now
            self.tokens += pieces
            self.attempt_tokens += pieces
            self._events.append(event)
        return True

    def text(self) -> str:
        """The answer so far (choice 0)."""
        out = []
        for event in self._events:
            try:
                obj = json.loads(event[5:])
            except ValueError:
                continue
            for choice in obj.get("choices") or ():
                if choice.get("index", 0) == 0:
                    piece = choice.get("text")
                    out.append(piece if piece is not None else (choice.get("delta") or {}).get("content") or "")
        return "".join(out)


def max_new_tokens(payload: dict[str, Any]) -> int | None:
    n = payload.get("max_tokens", payload.get("max_completion_tokens"))
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def continuation(payload: dict[str, Any], text: str, tokens: int) -> dict[str, Any] | None:
    """The request that produces the rest of an answer whose first `tokens` tokens (`text`) were
    already sent, or None when that cannot be expressed (several choices or prompts, token ids)."""
    if tokens == 0:
        return payload
    if payload.get("n", 1) != 1:
        return None
    rest = dict(payload)
    limit = max_new_tokens(payload)
    if limit is not None:
        if limit - tokens < 1:
            return None
        rest["max_tokens"] = limit - tokens
        rest.pop("max_completion_tokens", None)
    if "messages" in payload:
        rest["messages"] = [*payload["messages"], {"role": "assistant", "content": text}]
        rest["continue_final_message"], rest["add_generation_prompt"] = True, False
        return rest
    if isinstance(payload.get("prompt"), str):
        rest["prompt"] = payload["prompt"] + text
        return rest
    return None


def prompt_prefix(payload: dict[str, Any], chars: int) -> str:
    """The start of the prompt as text, the key of prefix affinity."""
    if "messages" in payload:
        msgs = payload["messages"] if isinstance(payload["messages"], list) else []
        text = "".join(f"{m.get('role')}:{m.get('content')}\n" for m in msgs if isinstance(m, dict))
    else:
        prompt = payload.get("prompt", "")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)[: chars * 2]
    return text[:chars]
