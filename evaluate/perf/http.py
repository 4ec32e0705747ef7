"""A minimal HTTP/1.1 client for streamed responses, parsed inside `data_received`.

Why not aiohttp for the token stream: aiohttp wakes a coroutine and runs its flow-control
machinery for every chunk of a streamed body, which costs more CPU than everything else a load
generator does per request; on a small machine that CPU decides the highest rate a generator can
send honestly. Here each network read is handled synchronously in the protocol callback: de-chunk,
hand the bytes to the caller's `on_body(data, arrival_time)`, and wake the waiting coroutine once
per response. Keep-alive connections are pooled per (host, port).

Scope: one request in flight per connection (no pipelining), `Content-Length`, chunked and
read-until-close bodies, TLS via an `ssl.SSLContext`. Anything else is an error, never a guess.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_mod
import time
from collections.abc import Callable
from urllib.parse import urlsplit

BodyCallback = Callable[[bytes, float], None]
SentCallback = Callable[[float], None]


class HTTPError(Exception):
    pass


class _Conn(asyncio.Protocol):
    """One keep-alive connection; `start()` arms it for the next response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.done: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            if self.mode == "eof" and self.head_done:
                self._finish()
            else:
                self.done.set_exception(HTTPError(f"connection closed mid-response ({exc or 'EOF'})"))

    def start(self, on_body: BodyCallback) -> asyncio.Future:
        self.on_body, self.buf, self.head_done = on_body, b"", False
        self.status, self.keep_alive, self.mode, self.left, self.received = 0, True, "", 0, False
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.received = True
        if self.done is None or self.done.done():
            return  # bytes after a finished response: the connection will not be reused
        try:
            self._feed(self.buf + data if self.buf else data, now)
        except HTTPError as e:
            self.keep_alive = False
            self.done.set_exception(e)

    def _feed(self, data: bytes, now: float) -> None:
        self.buf = b""
        if not self.head_done:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self.buf = data
                return
            self._head(data[:end].decode("latin-1"))
            data = data[end + 4 :]
        if self.mode == "length":
            take = data[: self.left]
            self.left -= len(take)
            if take:
                self.on_body(take, now)
            if self.left == 0:
                self._finish()
        elif self.mode == "chunked":
            self._chunks(data, now)
        elif data:
            self.on_body(data, now)

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise HTTPError(f"bad status line {lines[0]!r}")
        self.status, self.head_done = int(parts[1]), True
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        self.keep_alive = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.mode, self.left = "chunked", -1
        elif "content-length" in headers:
            self.mode, self.left = "length", int(headers["content-length"])
            if self.left == 0:
                self._finish()
        else:
            self.mode, self.keep_alive = "eof", False

    def _chunks(self, data: bytes, now: float) -> None:
        pos, out = 0, []
        while pos < len(data):
            if self.left < 0:  # expecting a size line
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(data[pos:eol].split(b";")[0], 16)
                pos = eol + 2
                if size == 0:
                    self._finish(out, now)  # trailers are not used by any server kiln talks to
                    return
                self.left = size
            take = min(self.left, len(data) - pos)
            out.append(data[pos : pos + take])
            pos += take
            self.left -= take
            if self.left == 0:
                if len(data) - pos < 2:
                    break
                pos += 2  # the CRLF after each chunk
                self.left = -1
        self.buf = data[pos:]
        if out:
            self.on_body(b"".join(out), now)

    def _finish(self, out: list[bytes] | None = None, now: float = 0.0) -> None:
        if out:
            self.on_body(b"".join(out), now)
        if self.done is not None and not self.done.done():
            self.done.set_result(self.status)


class StreamingHTTP:
    """POST requests whose response body is handed to a callback as it arrives."""

    def __init__(self, base_url: str, headers: dict[str, str], ssl: ssl_mod.SSLContext | None = None):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {base_url!r}")
        self.host, self.tls = u.hostname or "127.0.0.1", u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.ssl = (ssl or ssl_mod.create_default_context()) if self.tls else None
        self.prefix = u.path.rstrip("/")
        host_header = self.host if u.port is None else f"{self.host}:{self.port}"
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host_header, **headers}.items())
        self.idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port, ssl=self.ssl)
        return conn

    async def post(self, path: str, body: bytes, on_body: BodyCallback, on_sent: SentCallback | None = None) -> int:
        """Send; returns the status once the body has ended. Retries once on a stale pooled
        connection that closed before answering (the server's idle timeout).

        `on_sent(perf_counter)` is called when the request's bytes are handed to the socket (again
        on a retry): the real send time, after any wait for a new connection."""
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self.fixed}Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        for attempt in (0, 1):
            conn = None
            while self.idle and conn is None:
                candidate = self.idle.pop()
                conn = None if candidate.closed else candidate
            reused = conn is not None
            conn = conn or await self._connect()
            done = conn.start(on_body)
            conn.transport.write(request)  # type: ignore[union-attr]
            if on_sent is not None:
                on_sent(time.perf_counter())
            try:
                status = await done
            except HTTPError:
                conn.transport.close()  # type: ignore[union-attr]
                if attempt == 0 and reused and not conn.received:
                    continue
                raise
            except BaseException:
                conn.transport.close()  # type: ignore[union-attr]  # cancelled mid-stream: never reuse
                raise
            if conn.keep_alive and not conn.closed:
                self.idle.append(conn)
            else:
                conn.transport.close()  # type: ignore[union-attr]
            return status
        raise HTTPError("could not get a working connection")

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport:
                conn.transport.close()
        self.idle.clear()
