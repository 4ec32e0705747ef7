"""llama-server's streamed `/completion`, read by whoever drives the engine, with no thread between.

The `llama_cpp` engine keeps one HTTP/1.1 connection per sequence and waits on all of them
with one selector: `step()` blocks on it; under kiln serve the event loop watches the selector's
own descriptor and `poll()`s when a stream has bytes, so a token goes from llama-server's socket
to the client's response on one thread. A reader thread of its own (the `remote` backend's way)
costs every token a cross-thread hand-off and the GIL going back and forth; on a machine whose
cores llama-server's threads keep busy, every such wake-up stalls its decode (docs/engines.md).

A `Completion` is one request: `send` writes it, `feed` takes what the socket delivered and
returns the SSE payloads completed so far; the HTTP status is checked once the headers are in.
The engine closes the socket to end a sequence early (llama-server frees its slot).
"""

from __future__ import annotations

import json
import socket
from typing import Any

from kiln.core.errors import BadInput

_REFUSED = (400, 401, 403, 404, 422)  # the request's fault: BadInput, as the remote backend reports it


class Completion:
    """One streamed POST /completion on its own connection (`Connection: close`)."""

    def __init__(self, host: str, port: int, body: dict[str, Any], timeout_s: float):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = json.dumps(body).encode()
        head = (f"POST /completion HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
        self.sock.sendall(head.encode() + payload)
        self.sock.setblocking(False)
        self.url = f"http://{host}:{port}/completion"
        self._raw = bytearray()  # bytes received, framing not yet removed
        self._body = bytearray()  # response body not yet split into lines
        self._status: int | None = None
        self._chunked = False
        self._ended = False  # the last chunk arrived

    def fileno(self) -> int:
        return self.sock.fileno()

    def feed(self) -> list[dict[str, Any]]:
        """Read what the socket holds; the SSE `data:` payloads it completed, in order. Raises
        BadInput / RuntimeError for an HTTP error (its body in the message) or a cut stream."""
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:  # woken with nothing to read after all
            return []
        self._raw += data
        if self._status is None and not self._headers():
            if not data:
                raise RuntimeError(f"{self.url}: the server closed the connection before answering")
            return []
        self._unframe(closed=not data)
        if self._status >= 400:
            if not (data and not self._ended):  # the whole error body is in
                text = self._body.decode(errors="replace")[:500]
                kind = BadInput if self._status in _REFUSED else RuntimeError
                raise kind(f"Endpoint {self.url} {'refused the request' if kind is BadInput else 'failed'} "
                           f"({self._status}): {text}")
            return []
        out = []
        while (end := self._body.find(b"\n")) >= 0:
            line = bytes(self._body[:end]).strip()
            del self._body[: end + 1]
            if line.startswith(b"data:") and line != b"data: [DONE]":
                payload = json.loads(line[5:])
                if "error" in payload:  # an error after the stream began (before: the HTTP status)
                    raise RuntimeError(f"{self.url}: {payload['error'].get('message', payload['error'])}")
                out.append(payload)
        if not data and not out:
            raise RuntimeError(f"{self.url}: the server closed the stream before its end")
        return out

    def _headers(self) -> bool:
        end = self._raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self._raw[:end]).decode("latin-1").split("\r\n")
        del self._raw[: end + 4]
        self._status = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip().lower() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        self._chunked = "chunked" in fields.get("transfer-encoding", "")
        return True

    def _unframe(self, closed: bool) -> None:
        """Move body bytes from the chunked framing (or, unchunked, as they are) to `_body`."""
        if not self._chunked:
            self._body += self._raw
            self._raw.clear()
            self._ended = closed
            return
        while not self._ended and (eol := self._raw.find(b"\r\n")) >= 0:
            size = int(bytes(self._raw[:eol]).split(b";")[0], 16)
            if len(self._raw) < eol + 2 + size + 2:
                return  # the rest of this chunk is still on its way
            self._body += self._raw[eol + 2 : eol + 2 + size]
            del self._raw[: eol + 2 + size + 2]
            self._ended = size == 0

    def close(self) -> None:
        self.sock.close()
