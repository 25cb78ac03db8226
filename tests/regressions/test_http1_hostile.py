"""A hostile HTTP client against a connection served without h11 until its first request of
another shape (``gateway.transports.http``): trio memory streams and the MockClock.  What the
lean path meets must be answered as h11 alone answers it, at the same moment."""

from __future__ import annotations

from functools import partial

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
