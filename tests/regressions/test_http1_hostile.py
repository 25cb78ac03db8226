"""A hostile HTTP client against a connection served without h11 until its first request of
another shape (``gateway.transports.http``): trio memory streams and the MockClock.  What the
lean path meets must be answered as h11 alone answers it, at the same moment."""

from __future__ import annotations

import contextlib
from functools import partial

import h11
import pytest
import trio
import trio.testing

from gateway.transports.http import HttpConnection, Request, serve_connection

GET = b"GET /mcp HTTP/1.1\r\nhost: a\r\n\r\n"


async def answer(conn: HttpConnection, req: Request) -> None:
    conn.respond_json(200, b"{}")


@pytest.mark.parametrize("junk", [b"\x16\x03\x01\x02\x00\x01\xfc\x03\x03", b"\x00", b" GET /",
                                  b"\r\n", b"\r", b"\t"],
                         ids=["tls-hello", "nul", "space", "crlf", "cr", "tab"])
@pytest.mark.parametrize("after", [b"", GET], ids=["first", "after-a-request"])
async def test_a_request_starting_with_a_control_byte_gets_400_at_once(
        autojump_clock: trio.testing.MockClock, junk: bytes, after: bytes) -> None:
    # h11 refuses a request whose first byte is below 0x21 as soon as it sees it (a TLS client
    # on the plain port); the lean path waited for a blank line until the head timeout
    client, server = trio.testing.memory_stream_pair()
    conn = HttpConnection(server, 1024)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(serve_connection, idle_timeout=60.0, name="t"), conn, answer)
        await client.send_all(after + junk)
        got = b""
        while got.count(b"HTTP/1.1 ") < (2 if after else 1):
            got += await client.receive_some(65536)
        answered = trio.current_time()
        nursery.cancel_scope.cancel()
    assert answered == 0.0
    assert got.count(b"HTTP/1.1 400 Bad Request\r\n") == 1 and b"connection: close" in got


POST = b"POST /mcp HTTP/1.1\r\nHost: a\r\n"
#: Requests a hostile client sends, each followed by a lean GET (where does the first one end?)
#: unless its name ends in ``-last``.
HOSTILE = {
    "cl-and-te": POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-and-cl": POST + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "two-cl-equal": POST + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nabcde",
    "two-cl-differ": POST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef",
    "cl-list": POST + b"Content-Length: 5, 5\r\n\r\nabcde",
    "cl-plus": POST + b"Content-Length: +5\r\n\r\nabcde",
    "cl-spaces": POST + b"Content-Length:  5 \r\n\r\nabcde",
    "cl-hex": POST + b"Content-Length: 0x5\r\n\r\nabcde",
    "cl-zero-led": POST + b"Content-Length: 05\r\n\r\nabcde",
    "cl-huge": POST + b"Content-Length: 99999999999999999999999\r\n\r\nabcde",
    "cl-over-body-bound": POST + b"Content-Length: 1025\r\n\r\n" + b"x" * 1025,
    "cl-at-body-bound": POST + b"Content-Length: 1024\r\n\r\n" + b"x" * 1024,
    "cl-short": POST + b"Content-Length: 20\r\n\r\nabc",  # the body takes most of the GET
    "obs-fold": POST + b"X-A: 1\r\n Content-Length: 5\r\n\r\nabcde",
    "space-before-colon": POST + b"Content-Length : 5\r\n\r\nabcde",
    "bad-name": POST + b"X(A): 1\r\n\r\n",
    "bare-lf": b"GET /mcp HTTP/1.1\nHost: a\nContent-Length: 5\n\nabcde",
    "bare-lf-ends-head": POST + b"Content-Length: 5\r\n\nabcde",
    "nul": POST + b"X: a\x00b\r\n\r\n",
    "del": POST + b"X: a\x7fb\r\n\r\n",
    "obs-text": POST + b"X: caf\xe9\r\n\r\n",
    "lowercase-method": b"get /mcp HTTP/1.1\r\nHost: a\r\n\r\n",
    "http-1.0": b"GET /mcp HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
    "version-trailing-space": b"GET /mcp HTTP/1.1 \r\nHost: a\r\n\r\n",
    "absolute-uri": b"GET http://evil/mcp HTTP/1.1\r\nHost: a\r\n\r\n",
    "options-star": b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
    "target-space": b"GET /m cp HTTP/1.1\r\nHost: a\r\n\r\n",
    "no-host": b"GET /mcp HTTP/1.1\r\n\r\n",
    "two-hosts": b"GET /mcp HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    "empty-host": b"GET /mcp HTTP/1.1\r\nHost:\r\n\r\n",
    "keep-alive-close": b"GET /mcp HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, close\r\n\r\n",
    "leading-crlf": b"\r\n" + GET,
    "tls-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    "tls-hello-last": GET + b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
}


async def served(data: bytes, pieces: int, *, by_h11: bool) -> tuple[bytes, list[object]]:
    """What a connection wrote for ``data`` (sent ``pieces`` bytes at a time, then the end of
    the stream) and the requests it read; ``by_h11``: h11 serves it from the first byte."""
    client, server = trio.testing.memory_stream_pair()
    conn = HttpConnection(server, 1024, max_head=256)
    if by_h11:
        conn.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=256)
    seen: list[object] = []

    async def record(conn: HttpConnection, req: Request) -> None:
        seen.append((req.method, req.path, req.headers, req.body))
        conn.respond_json(200, b"{}")

    async def serve() -> None:
        await serve_connection(conn, record, idle_timeout=60.0, name="t")
        await server.aclose()

    got = b""
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            with contextlib.suppress(trio.BrokenResourceError):
                for at in range(0, len(data), pieces):
                    await client.send_all(data[at:at + pieces])
                    await trio.testing.wait_all_tasks_blocked()
                await client.send_eof()
            with contextlib.suppress(trio.BrokenResourceError):
                while chunk := await client.receive_some(65536):
                    got += chunk
    return got, seen


@pytest.mark.parametrize("pieces", [1, 7, 4096])
@pytest.mark.parametrize("name", list(HOSTILE))
async def test_hostile_requests_are_answered_as_h11_alone_answers_them(name: str,
                                                                       pieces: int) -> None:
    data = HOSTILE[name] + (b"" if name.endswith("-last") else GET)
    lean = await served(data, pieces, by_h11=False)
    alone = await served(data, pieces, by_h11=True)
    assert lean == alone
    assert lean[0].startswith(b"HTTP/1.1 ")
