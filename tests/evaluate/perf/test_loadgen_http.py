"""The streaming HTTP transport against a scripted raw server: framing, errors, keep-alive."""

from __future__ import annotations

import asyncio

import pytest

from kiln.evaluate.perf.http import HTTPError, StreamingHTTP

SSE = [b'data: {"text":"a"}\n\n', b'data: {"text":"b"}\n\n', b"data: [DONE]\n\n"]


def _chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def _serve(responses: list[tuple[bytes, int, bool]], accepted: list[int]):
    """Answer each request with (raw bytes, piece size, close after) in small pieces."""
    queue = list(responses)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        while queue:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            await reader.readexactly(length)
            raw, piece, close = queue.pop(0)
            for i in range(0, len(raw), piece):
                writer.write(raw[i : i + piece])
                await writer.drain()
                await asyncio.sleep(0.001)
            if close:
                writer.close()
                return
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _run(responses, posts: int = 1):
    async def main():
        accepted: list[int] = []
        server, port = await _serve(responses, accepted)
        http = StreamingHTTP(f"http://127.0.0.1:{port}", {"Content-Type": "application/json"})
        results = []
        try:
            for _ in range(posts):
                got: list[bytes] = []
                try:
                    status = await http.post("/v1/completions", b"{}", lambda d, t, got=got: got.append(d))
                    results.append((status, b"".join(got)))
                except HTTPError as e:
                    results.append(("error", str(e)))
        finally:
            http.close()
            server.close()
        return results, len(accepted)

    return asyncio.run(main())


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_chunked_body_survives_any_split(piece):
    (result,), _ = _run([(HEAD + _chunked(SSE), piece, False)])
    assert result == (200, b"".join(SSE))


def test_content_length_and_error_status():
    body = b'{"error": {"message": "bad"}}'
    raw = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    (result,), _ = _run([(raw, 5, False)])
    assert result == (400, body)


def test_connection_closed_mid_stream_is_an_error():
    raw = HEAD + _chunked(SSE)[:30]
    (result,), _ = _run([(raw, 10, True)])
    assert result[0] == "error" and "closed mid-response" in result[1]


def test_read_until_close_body():
    raw = b"HTTP/1.0 200 OK\r\n\r\n" + b"".join(SSE)
    (result,), _ = _run([(raw, 8, True)])
    assert result == (200, b"".join(SSE))


def test_keep_alive_reuses_one_connection():
    results, connections = _run([(HEAD + _chunked(SSE), 50, False)] * 3, posts=3)
    assert [r[0] for r in results] == [200, 200, 200] and connections == 1


def test_stale_pooled_connection_is_retried_on_a_new_one():
    # The server closes after the first answer (an idle timeout): the second request must not fail.
    results, connections = _run([(HEAD + _chunked(SSE), 50, True), (HEAD + _chunked(SSE), 50, False)], posts=2)
    assert [r[0] for r in results] == [200, 200] and connections == 2
