"""A hostile pass over ``mcp-gateway status``: a /status answer that would hang it or crash it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from gateway.ops import statuscmd


@contextmanager
def fake_admin(answer: Callable[[socket.socket], None]) -> Iterator[int]:
    """A listener on loopback answering one connection with ``answer``; its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:
                answer(conn)
            except OSError:
                pass
            stop.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        thread.join(10)


def test_a_status_answer_dripping_forever_ends_within_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statuscmd, "TIMEOUT", 0.5)

    def drip(conn: socket.socket) -> None:  # one byte per 0.1 s: each read within the timeout
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            conn.sendall(b" ")
            time.sleep(0.1)

    with fake_admin(drip) as port:
        start = time.monotonic()
        with pytest.raises(statuscmd.StatusUnavailable, match="no answer within"):
            statuscmd.fetch("127.0.0.1", port)
        assert time.monotonic() - start < 3


def test_a_deeply_nested_status_answer_is_refused_not_a_traceback() -> None:
    body = b'{"backends":[],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    def nested(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    with fake_admin(nested) as port, pytest.raises(statuscmd.StatusUnavailable):
        statuscmd.fetch("127.0.0.1", port)
