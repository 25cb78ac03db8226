"""The remote backends' HTTP/1.1 client without h11 for common exchanges: each answer, cut
anywhere, reads as h11 reads it (status, headers, body, reusable or not, the failure); the
request bytes are the ones h11 writes; the pool keeps a burst's connections and closes the
stale ones first."""

from __future__ import annotations

import random

import h11
import pytest
import trio
import trio.testing

from gateway.backend import httpclient
from gateway.protocol import http1


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE = b"event: message\nid: 1\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n\n"
ANSWERS = {
    "sse_chunked": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nmcp-session-id: "
                   b"abc\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + chunked(b"id: 0\ndata: \n\n", SSE),
    "json_length": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12"
                   b"\r\nX-A: 1\r\nx-a:  2 \r\n\r\n{\"id\":7,\"a\"}",
    "accepted": b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n",
    "no_content": b"HTTP/1.1 204 No Content\r\n\r\n",
    "closes": b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}",
    "trailers": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"3;ext=1\r\nabc\r\n0\r\nx-t: 1\r\n\r\n",
    # of other shapes: h11's
    "http10": b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n{}",
    "continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
    "until_close": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"a\":1}",
    "obs_text": b"HTTP/1.1 200 OK\r\nx-name: caf\xe9\r\ncontent-length: 2\r\n\r\n{}",
    "gzip_chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n" + chunked(b"x"),
    # broken: both fail alike
    "bad_chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    "bad_chunk_later": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                       b"2\r\nab\r\n3 ;x\r\ncdeXY1\r\nf\r\n0\r\n\r\n",
    "bad_size_later": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                      b"2\r\nab\r\n-1\r\nc\r\n0\r\n\r\n",
    "cut_body": b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345",
    "no_head": b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n",
}


OTHER_SHAPES = {"http10", "continue", "until_close", "obs_text", "gzip_chunked"}


def cuts(data: bytes, how: str) -> list[bytes]:
    if how == "whole":
        return [data]
    if how == "bytes":
        return [data[i:i + 1] for i in range(len(data))]
    rng = random.Random(len(data))
    points = sorted(rng.sample(range(1, len(data)), min(6, len(data) - 1)))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


async def exchange(answer: list[bytes], *, lean: bool) -> tuple[tuple[object, ...], bool]:
    """One POST on a connection (forced to h11 unless ``lean``) answered by ``answer``, then
    the server's close: what the client saw, and whether h11 read it."""
    client, server = trio.testing.memory_stream_pair()
    conn = httpclient.Connection(client, "remote:1")
    if not lean:
        conn._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=httpclient.MAX_HEAD)

    async def serve() -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await server.receive_some(65536)
        for piece in answer:
            await server.send_all(piece)
        await server.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        try:
            response = await conn.request("POST", "/mcp", [("accept", "application/json")],
                                          b"{}", head_timeout=5.0)
            body = await conn.body(1024, idle_timeout=5.0)
        except httpclient.HttpFailure as exc:
            return (type(exc).__name__, conn.broken, conn.reusable()), conn._h11 is not None
    return (response.status, response.headers, body, conn.reusable()), conn._h11 is not None


@pytest.mark.parametrize("name", ["json_length", "http10"])  # read without h11, handed to h11
async def test_a_request_body_is_not_held_once_its_answers_head_is_read(name: str) -> None:
    client, server = trio.testing.memory_stream_pair()
    conn = httpclient.Connection(client, "remote:1")
    body = b'{"big":"' + b"x" * 100_000 + b'"}'

    async def serve() -> None:
        got = b""
        while len(got) < len(body) or b"\r\n\r\n" not in got:
            got += await server.receive_some(65536)
        await server.send_all(ANSWERS[name])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        await conn.request("POST", "/mcp", [("accept", "application/json")], body,
                           head_timeout=5.0)
    assert conn._sent is None  # not kept while the connection idles in a pool


@pytest.mark.parametrize("how", ["whole", "bytes", "random"])
@pytest.mark.parametrize("name", sorted(ANSWERS))
async def test_each_answer_reads_as_h11_reads_it(name: str, how: str) -> None:
    pieces = cuts(ANSWERS[name], how)
    seen, by_h11 = await exchange(pieces, lean=True)
    assert seen == (await exchange(pieces, lean=False))[0]
    assert by_h11 == (name in OTHER_SHAPES)


async def test_requests_are_the_bytes_h11_writes_and_unusual_heads_h11_refuses() -> None:
    head = [("host", "remote:1"), ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"), ("mcp-session-id", "a-b"),
            ("authorization", "Bearer x\ty"), ("content-length", "2")]
    conn = h11.Connection(h11.CLIENT)
    by_h11 = conn.send(h11.Request(method="POST", target="/mcp?x=1", headers=head))
    assert http1.request_head("POST", "/mcp?x=1", head) == by_h11
    cache: httpclient.Heads = {}
    for _ in range(2):  # encoded once, then from the cache with this request's length
        assert httpclient._common_head("POST", "/mcp?x=1", head[:-1], [], b"{}", cache) == by_h11
        assert len(cache) == 1
    # a request's own headers follow the cached stable part, encoded each time, not kept
    for value in ("Bearer x\ty", "Bearer z"):
        own = [("authorization", value)]
        assert httpclient._common_head("POST", "/mcp?x=1", head[:-2], own, b"{}", cache) == \
            h11.Connection(h11.CLIENT).send(h11.Request(
                method="POST", target="/mcp?x=1", headers=[*head[:-2], *own, head[-1]]))
    assert len(cache) == 2
    assert httpclient._common_head("POST", "/mcp", head[:-2], [("x-bad", "a\r\nb")], b"{}",
                                   cache) is None
    for name, value in (("x-bad", "a\r\nx-injected: 1"), ("x-bad", "caf\u00e9"), ("bad name", "1")):
        assert http1.request_head("POST", "/mcp", [(name, value)]) is None
        client, _server = trio.testing.memory_stream_pair()
        with pytest.raises(httpclient.ConnectionLost, match="h11 refused its head"):
            await httpclient.Connection(client, "remote:1").request("POST", "/mcp",
                                                                    [(name, value)], b"{}")


async def test_pool_keeps_a_bursts_connections_and_closes_the_stale_first(
        autojump_clock: trio.testing.MockClock) -> None:
    opened: list[trio.abc.Stream] = []  # the remote's ends

    async def opener(host: str, port: int) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        opened.append(server)
        return client

    origin = httpclient.parse_url("http://remote:1/mcp")
    pool = httpclient.Pool(origin, connect_timeout=1.0, idle_max=14, opener=opener)
    burst = [await pool.connect() for _ in range(12)]
    for conn in burst:  # each after a clean exchange
        conn._keep, conn._body = True, None
        await pool.put(conn)
    assert len(pool.open) == 12  # all kept: the next burst opens none
    again = [await pool.get() for _ in range(12)]
    assert {id(c) for c in again} == {id(c) for c in burst} and len(opened) == 12
    for conn in burst:
        await pool.put(conn)
    await trio.sleep(httpclient.IDLE_TTL / 2)
    fresh = burst[0]
    pool._idle.remove(fresh)
    await pool.put(fresh)  # used again since: not stale
    await trio.sleep(httpclient.IDLE_TTL / 2)
    assert await pool.get() is fresh
    assert pool.open == {fresh}  # the 11 idle past IDLE_TTL were closed, oldest first


async def test_answer_heads_are_parsed_once_per_pool_within_its_bound() -> None:
    async with trio.open_nursery() as nursery:
        async def serve(stream: trio.abc.Stream) -> None:
            n = 0
            while await stream.receive_some(65536):
                n += 1  # the same head twice, then another one
                await stream.send_all(b"HTTP/1.1 200 OK\r\nx-n: %d\r\ncontent-length: 2\r\n\r\n{}"
                                      % (n // 2))

        async def opener(host: str, port: int) -> trio.abc.Stream:
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(serve, server)
            return client

        pool = httpclient.Pool(httpclient.parse_url("http://remote:1/mcp"), connect_timeout=1,
                               idle_max=1, opener=opener)
        conn = await pool.get()
        for n in range(2 * httpclient.ANSWER_HEADS_MAX + 4):
            response = await conn.request("POST", "/mcp", [], b"{}")
            assert response.headers == {"x-n": str((n + 1) // 2), "content-length": "2"}
            response.headers["x-n"] = "changed"  # a caller's copy: the pool's is untouched
            assert await conn.body(10) == b"{}" and conn.reusable()
            assert 1 <= len(pool.answers) <= httpclient.ANSWER_HEADS_MAX
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def _tcp_server(nursery: trio.Nursery, got: list[bytes], *, answer: bool,
                      read_late: bool = False) -> int:
    """A one-connection HTTP server on 127.0.0.1: it reads (``read_late``: once every other task
    is blocked, e.g. the client on a full socket buffer) the request whole (or what comes
    within 0.3 s when not ``answer``) into ``got``."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def serve() -> None:
        stream = await listeners[0].accept()
        if read_late:
            await trio.testing.wait_all_tasks_blocked()
        data = b""
        with trio.move_on_after(0.3 if not answer else 30):
            while (b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1])
                   < int(data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])):
                piece = await stream.receive_some(1 << 16)
                if not piece:
                    break
                data += piece
        got.append(data)
        if answer:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await stream.aclose()
        await listeners[0].aclose()

    nursery.start_soon(serve)
    return int(listeners[0].socket.getsockname()[1])


async def test_a_plain_socket_takes_a_body_larger_than_its_buffer_in_order() -> None:
    """Written straight to a plain TCP socket, what it does not take at once follows through
    the stream: the server reads the whole request, in order."""
    got: list[bytes] = []
    body = bytes(random.Random(1).randrange(256) for _ in range(1 << 16)) * 64  # 4 MiB
    async with trio.open_nursery() as nursery:
        port = await _tcp_server(nursery, got, answer=True, read_late=True)
        conn = httpclient.Connection(await trio.open_tcp_stream("127.0.0.1", port),
                                     f"127.0.0.1:{port}")
        response = await conn.request("POST", "/mcp", [("content-type", "application/json")],
                                      body)
        assert response.status == 200 and await conn.body(10) == b"{}"
        await conn.aclose()
    head, sent = got[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /mcp HTTP/1.1\r\n") and sent == body


async def test_a_request_cancelled_before_it_is_written_sends_nothing() -> None:
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:
        port = await _tcp_server(nursery, got, answer=False)
        conn = httpclient.Connection(await trio.open_tcp_stream("127.0.0.1", port),
                                     f"127.0.0.1:{port}")
        with trio.CancelScope() as scope:
            scope.cancel()
            await conn.request("POST", "/mcp", [("content-type", "application/json")], b"{}")
        assert scope.cancelled_caught
        await conn.aclose()
    assert got == [b""]


async def test_a_plain_socket_closed_before_the_answer_is_a_lost_connection() -> None:
    """The answer's head awaited on a plain TCP socket (the wait first, then one read): the
    remote closing instead of answering is ConnectionLost, and the connection is broken."""
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:
        port = await _tcp_server(nursery, got, answer=False)
        conn = httpclient.Connection(await trio.open_tcp_stream("127.0.0.1", port),
                                     f"127.0.0.1:{port}")
        with pytest.raises(httpclient.ConnectionLost, match="closed before an answer"):
            await conn.request("POST", "/mcp", [("content-type", "application/json")], b"{}")
        assert conn.broken
        await conn.aclose()
    assert got[0].endswith(b"\r\n\r\n{}")
