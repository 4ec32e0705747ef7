"""The llama_cpp engine's stream reader (engine/llama_cpp/stream.py) against a scripted HTTP
server, no llama.cpp needed: chunked SSE cut at any byte still yields every payload in order,
and an HTTP error, an error event or a stream cut before its end raise with the server's words."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time

import pytest

from kiln.engine.llama_cpp.stream import Completion
from kiln.core.errors import BadInput


def _serve(replies: list[bytes]) -> tuple[int, list[bytes]]:
    """A one-connection server that sends `replies` one by one (a pause between) and closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def run() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            received.append(conn.recv(1 << 16))
            for piece in replies:
                conn.sendall(piece)
                time.sleep(0.005)

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1], received


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _read_all(port: int) -> list[dict]:
    completion = Completion("127.0.0.1", port, {"prompt": [1, 2]}, 10)
    selector = selectors.DefaultSelector()
    selector.register(completion, selectors.EVENT_READ)
    got: list[dict] = []
    try:
        while not (got and got[-1].get("stop")):
            assert selector.select(10), "no data within 10 s"
            got += completion.feed()
        return got
    finally:
        completion.close()


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_payloads_survive_any_split():
    events = [{"tokens": [i], "stop": i == 5} for i in range(6)]
    wire = HEAD + b"".join(_chunk(b"data: " + json.dumps(e).encode() + b"\n\n") for e in events) + b"0\r\n\r\n"
    pieces = [wire[i : i + 7] for i in range(0, len(wire), 7)]  # headers, sizes and lines all cut mid-way
    port, received = _serve(pieces)
    assert _read_all(port) == events
    head, _, body = received[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /completion HTTP/1.1") and json.loads(body) == {"prompt": [1, 2]}


def test_http_error_is_bad_input_with_the_servers_message():
    body = b'{"error":{"code":400,"message":"the request exceeds the available context size"}}'
    port, _ = _serve([b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body) + body])
    with pytest.raises(BadInput, match=r"refused the request \(400\).*exceeds the available context"):
        _read_all(port)


def test_error_event_and_cut_stream_raise():
    error = b'data: {"error":{"code":500,"message":"decode failed"}}\n\n'
    port, _ = _serve([HEAD, _chunk(b'data: {"tokens":[7]}\n\n'), _chunk(error)])
    with pytest.raises(RuntimeError, match="decode failed"):
        _read_all(port)
    port, _ = _serve([HEAD, _chunk(b'data: {"tokens":[7]}\n\n')])  # closes with no stop event
    with pytest.raises(RuntimeError, match="closed the stream before its end"):
        _read_all(port)
