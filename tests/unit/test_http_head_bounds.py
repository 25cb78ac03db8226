"""The HTTP layer's bounds on a request head: its size however it arrives (431), and the time a
connection may go without a complete one (slow loris).  ``serve_connection`` over memory
streams; the timing on trio's MockClock."""

from __future__ import annotations

import trio
import trio.testing

from gateway import limits
from gateway.transports.http import MAX_HEAD_BYTES, HttpConnection, Request, serve_connection

IDLE = 60.0
GET = b"GET /x HTTP/1.1\r\nhost: a\r\n"


async def ok(conn: HttpConnection, req: Request) -> None:
    conn.respond(200, b"fine\n", "text/plain")


async def exchange(data: bytes) -> bytes:
    """Send ``data`` in one write, then read until the server closes."""
    client, server = trio.testing.memory_stream_pair()
    got = b""
    async with trio.open_nursery() as nursery:
        async def serve() -> None:
            await serve_connection(HttpConnection(server, 1024), ok, idle_timeout=IDLE, name="t")
            await server.aclose()

        nursery.start_soon(serve)
        await client.send_all(data)
        while chunk := await client.receive_some(65536):
            got += chunk
            if b"\r\n\r\n" in got and b"200 OK" in got:
                await client.aclose()
                break
    return got


async def test_a_head_with_one_long_header_line_in_one_write_gets_431() -> None:
    with trio.fail_after(5):
        answer = await exchange(GET + b"x-big: " + b"a" * (40 * 1024) + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    assert b"connection: close" in answer.lower()


async def test_a_head_of_two_thousand_small_headers_in_one_write_gets_431() -> None:
    headers = b"".join(b"x-h%d: v\r\n" % i for i in range(2000))
    assert len(headers) > MAX_HEAD_BYTES
    with trio.fail_after(5):
        answer = await exchange(GET + headers + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]


async def test_a_head_just_under_the_limit_in_one_write_is_served_and_its_body_does_not_count(
) -> None:
    head = b"POST" + GET[3:] + b"content-length: 1000\r\nx-pad: "
    head += b"a" * (MAX_HEAD_BYTES - len(head) - 4) + b"\r\n\r\n"
    assert len(head) == MAX_HEAD_BYTES
    with trio.fail_after(5):
        answer = await exchange(head + b"b" * 1000)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:100]


async def test_a_head_over_the_limit_in_pieces_gets_431() -> None:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        ended: list[float] = []
        nursery.start_soon(serve_timed, server, ended)
        await client.send_all(GET)
        for _ in range(40):
            await client.send_all(b"x-h: " + b"a" * 1000 + b"\r\n")
            await trio.testing.wait_all_tasks_blocked()
        answer = await client.receive_some(65536)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]


async def serve_timed(server: trio.abc.Stream, ended: list[float]) -> None:
    await serve_connection(HttpConnection(server, 1024), ok, idle_timeout=IDLE, name="t")
    ended.append(trio.current_time())


async def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    _client, server = trio.testing.memory_stream_pair()
    ended: list[float] = []
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_timed, server, ended)
    assert ended[0] - start == limits.HEAD_TIMEOUT == 10.0  # not the 60 s keep-alive idle wait


async def test_a_head_sent_a_byte_at_a_time_gets_408_at_the_head_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    client, server = trio.testing.memory_stream_pair()
    ended: list[float] = []
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_timed, server, ended)
        for byte in GET * 10:  # never ends: no empty line
            if ended:
                break
            await client.send_all(bytes([byte]))
            await trio.sleep(1.0)
    assert ended[0] - start == 10.0
    answer = await client.receive_some(65536)
    assert answer.startswith(b"HTTP/1.1 408 "), answer


async def test_keep_alive_waits_idle_60s_then_the_next_head_has_10s_from_its_first_byte(
        autojump_clock: trio.testing.MockClock) -> None:
    client, server = trio.testing.memory_stream_pair()
    ended: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_timed, server, ended)
        await client.send_all(GET + b"\r\n")
        assert (await client.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        await trio.sleep(59.0)  # idle keep-alive: still open
        first_byte = trio.current_time()
        await client.send_all(b"G")
        await trio.sleep(9.0)
        assert not ended
        await client.send_all(b"ET /x HTTP/1.1\r\n")  # the head is still not complete
    assert ended[0] - first_byte == 10.0
    assert (await client.receive_some(65536)).startswith(b"HTTP/1.1 408 ")
    client2, server2 = trio.testing.memory_stream_pair()
    ended.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_timed, server2, ended)
        await client2.send_all(GET + b"\r\n")
        assert (await client2.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        served = trio.current_time()
    assert ended[0] - served == IDLE  # an idle keep-alive connection: closed after 60 s
