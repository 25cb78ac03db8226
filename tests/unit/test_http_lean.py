"""Requests of the common shape served without h11 (``gateway.protocol.http1``): which heads are
of that shape, that every response is the bytes h11 writes for it, and that a connection hands
itself to h11 at its first request of another shape and is served by it from then on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from gateway import limits
from gateway.errors import TransportClosed
from gateway.protocol import http1
from gateway.transports.http import MAX_PIPELINED, HttpConnection, Request, serve_connection

HEAD = (b"POST /mcp?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8\r\naccept: application/json, "
        b"text/event-stream\r\ncontent-type:application/json  \r\nContent-Length: 2\r\n"
        b"x-many: a\r\nx-many: b\r\n")
#: A header value with a byte beyond ASCII: h11 takes it, the lean parser does not.
OBS_TEXT = b"x-obs: caf\xe9\r\n"


def test_a_common_head_is_parsed_with_its_fields_in_order_and_by_name() -> None:
    head = http1.parse_head(HEAD)
    assert head is not None
    assert (head.method, head.target, head.length) == ("POST", "/mcp?x=1", 2)
    assert head.fields[0] == (b"host", b"127.0.0.1:8")
    assert head.fields[2] == (b"content-type", b"application/json")
    assert head.by_name[b"x-many"] == "a, b"
    assert head.by_name[b"accept"] == "application/json, text/event-stream"


def test_header_lines_seen_before_parse_alike_and_those_kept_are_bounded() -> None:
    first = http1.parse_head(HEAD)
    assert first is not None and http1.parse_head(HEAD) == first  # the second from what was kept
    for n in range(2 * http1._KNOWN_MAX):  # many clients' distinct values: kept up to the bound
        value = b"v%d" % n + b"x" * (n % 3 * http1._KNOWN_VALUE_MAX)
        head = http1.parse_head(b"GET /mcp HTTP/1.1\r\nHost: a\r\nX-Id:  " + value + b" \r\n")
        assert head is not None and head.fields[1] == (b"x-id", value)
        assert head.by_name[b"x-id"] == value.decode()
    assert len(http1._KNOWN_FIELDS) <= http1._KNOWN_MAX
    assert all(len(raw[1]) <= http1._KNOWN_VALUE_MAX for raw in http1._KNOWN_FIELDS)
    assert http1.parse_head(HEAD) == first


def test_content_length_lines_kept_fill_at_most_half_of_the_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "_KNOWN_FIELDS", {})
    for n in range(http1._KNOWN_MAX):  # one body size after another
        head = http1.parse_head(b"POST /mcp HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n" % n)
        assert head is not None and head.length == n
    assert len(http1._KNOWN_FIELDS) == http1._KNOWN_MAX // 2  # and Host: a
    head = http1.parse_head(b"GET /mcp HTTP/1.1\r\nHost: a\r\nX-Id: b\r\n")
    assert head is not None and head.by_name[b"x-id"] == "b"
    assert (b"X-Id", b" b") in http1._KNOWN_FIELDS  # the other half is for other lines


def test_a_head_without_content_length_has_no_body() -> None:
    head = http1.parse_head(b"GET /mcp HTTP/1.1\r\nhost: a\r\nconnection: Keep-Alive\r\n")
    assert head is not None and head.length == 0


@pytest.mark.parametrize("head", [
    b"HEAD /mcp HTTP/1.1\r\nhost: a",
    b"PUT /mcp HTTP/1.1\r\nhost: a",
    b"GET /mcp HTTP/1.0\r\nhost: a",
    b"GET  /mcp HTTP/1.1\r\nhost: a",
    b"GET /mcp HTTP/1.1",  # no Host
    b"GET /mcp HTTP/1.1\r\nhost: a\r\nhost: b",
    b"POST /mcp HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked",
    b"POST /mcp HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\ncontent-length: 2",
    b"POST /mcp HTTP/1.1\r\nhost: a\r\ncontent-length: +2",
    b"POST /mcp HTTP/1.1\r\nhost: a\r\ncontent-length: " + b"9" * 19,
    b"POST /mcp HTTP/1.1\r\nhost: a\r\nexpect: 100-continue",
    b"GET /mcp HTTP/1.1\r\nhost: a\r\nupgrade: websocket",
    b"GET /mcp HTTP/1.1\r\nhost: a\r\nconnection: close",
    b"GET /mcp HTTP/1.1\r\nhost: a\r\nx-fold: a\r\n b",
    b"GET /mcp HTTP/1.1\r\nhost: a\r\nx bad: a",
    b"GET /mcp HTTP/1.1\r\nhost: a\r\nno-colon",
    b"GET /mcp HTTP/1.1\r\nhost: a\r\n" + OBS_TEXT[:-2],
    b"GET /mcp HTTP/1.1\r\nhost: a\r\nx-cr: a\rb",
    b"",
])
def test_any_other_head_is_left_to_h11(head: bytes) -> None:
    assert http1.parse_head(head + b"\r\n") is None


async def exchange(requests: bytes, handle: Callable[[HttpConnection, Request], Awaitable[None]],
                   ) -> tuple[bytes, HttpConnection]:
    """``requests`` sent in one write, then the end of the client's stream; what the server
    wrote until it closed, and the connection it served them on."""
    client, server = trio.testing.memory_stream_pair()
    conn = HttpConnection(server, 1 << 16)
    got = b""

    async def serve() -> None:
        await serve_connection(conn, handle, idle_timeout=60.0, name="t")
        await server.aclose()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            await client.send_all(requests)
            await client.send_eof()
            while chunk := await client.receive_some(65536):
                got += chunk
    return got, conn


async def answers(conn: HttpConnection, req: Request) -> None:
    """A different response for each path: every writing method once."""
    if req.path == "/json":
        conn.respond_json(200, b'{"a":1}', "sid.1")
    elif req.path == "/plain":
        conn.respond(403, b"no\n", "text/plain; charset=utf-8",
                     [("www-authenticate", 'Bearer realm="mcp"')])
    elif req.path == "/close":
        conn.respond(503, b"bye\n", "text/plain", close=True)
    else:
        conn.start_events([("mcp-session-id", "sid.1")])
        conn.priming_event(b"1-0")
        conn.event(b'{"a":\r\n1}', b"1-1")
        conn.keepalive()
        conn.event(b"{}")
        conn.end_events()


def request(path: str, extra: bytes = b"") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: a\r\n".encode() + extra + b"\r\n"


@pytest.mark.parametrize("path", ["/json", "/plain", "/sse", "/close"])
async def test_each_response_is_the_bytes_h11_writes(path: str) -> None:
    lean, lean_conn = await exchange(request(path), answers)
    by_h11, h11_conn = await exchange(request(path, OBS_TEXT), answers)
    assert lean_conn.h11 is None and h11_conn.h11 is not None
    assert lean == by_h11
    assert lean.startswith(b"HTTP/1.1 ")


async def test_pipelined_requests_are_answered_in_turn_without_h11() -> None:
    got, conn = await exchange(request("/json") + request("/sse") + request("/json"), answers)
    assert conn.h11 is None
    assert got.count(b'{"a":1}') == 2 and got.count(b"0\r\n\r\n") == 1


async def test_a_connection_goes_to_h11_at_its_first_uncommon_request_and_stays_there() -> None:
    chunked = (b"POST /json HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n"
               b"2\r\n{}\r\n0\r\n\r\n")
    bodies: list[bytes] = []

    async def handle(conn: HttpConnection, req: Request) -> None:
        bodies.append(req.body)
        await answers(conn, req)

    got, conn = await exchange(request("/json") + chunked + request("/json"), handle)
    assert conn.h11 is not None
    assert bodies == [b"", b"{}", b""]
    assert got.count(b'{"a":1}') == 3


@pytest.mark.parametrize("extra", [b"", OBS_TEXT], ids=["lean", "h11"])
async def test_writing_past_the_response_is_refused_as_h11_refuses_it(extra: bytes) -> None:
    outcome: list[bool] = []

    async def twice(conn: HttpConnection, req: Request) -> None:
        conn.respond_json(200, b"{}")
        for write in (lambda: conn.respond_json(200, b"{}"), conn.end_events, conn.keepalive):
            try:
                write()
                outcome.append(False)
            except TransportClosed:
                outcome.append(True)
        outcome.append(not conn.reusable)

    got, _conn = await exchange(request("/x", extra), twice)
    assert got.count(b"HTTP/1.1 ") == 1
    assert outcome == [True, True, True, True]


async def test_a_body_in_pieces_is_served_and_an_unfinished_one_gets_408_in_time(
        autojump_clock: trio.testing.MockClock) -> None:
    client, server = trio.testing.memory_stream_pair()
    bodies: list[bytes] = []

    async def handle(conn: HttpConnection, req: Request) -> None:
        bodies.append(req.body)
        conn.respond_json(200, b"{}")

    post = b"POST /mcp HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\n"
    conn = HttpConnection(server, 1024)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(serve_connection, idle_timeout=60.0, name="t"), conn, handle)
        await client.send_all(post + b"0123")
        await trio.sleep(1.0)
        await client.send_all(b"456789")
        assert (await client.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        started = trio.current_time()
        await client.send_all(post + b"012")  # never finished
        answer = await client.receive_some(65536)
        assert trio.current_time() - started == limits.INCOMPLETE_MESSAGE_TIMEOUT
    assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer
    assert bodies == [b"0123456789"] and conn.h11 is None


async def test_a_body_over_the_bound_is_refused_413_by_its_content_length() -> None:
    big = b"POST /mcp HTTP/1.1\r\nhost: a\r\ncontent-length: 1025\r\n\r\n"
    got, conn = await exchange(big, answers)  # exchange's bound: 64 KiB
    small, _ = await exchange(big.replace(b"1025", b"70000"), answers)
    assert small.startswith(b"HTTP/1.1 413 ") and b"connection: close" in small
    assert not got.startswith(b"HTTP/1.1 413 ") and conn.h11 is None


async def test_bytes_pipelined_while_a_response_streams_are_bounded() -> None:
    outcome: list[str] = []

    async def stream(conn: HttpConnection, req: Request) -> None:
        conn.start_events()
        await conn.flush()
        try:
            await conn.watch()
        except TransportClosed as exc:
            outcome.append(str(exc))
            raise

    client, server = trio.testing.memory_stream_pair()
    conn = HttpConnection(server, 1024)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(serve_connection, idle_timeout=60.0, name="t"), conn,
                               stream)
            await client.send_all(request("/sse"))
            assert (await client.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
            for _ in range(MAX_PIPELINED // 1024 + 1):
                await client.send_all(b"x" * 1024)
                await trio.testing.wait_all_tasks_blocked()
    assert outcome == ["too much pipelined data while streaming a response"]
    assert conn.h11 is None


async def test_a_head_with_bare_line_feeds_is_h11s_to_serve() -> None:
    got, conn = await exchange(request("/json") + b"GET /json HTTP/1.1\nhost: a\n\n", answers)
    assert conn.h11 is not None and got.count(b'{"a":1}') == 2


async def test_each_json_answer_names_its_own_session_on_a_connection_of_several() -> None:
    async def handle(conn: HttpConnection, req: Request) -> None:
        conn.respond_json(200, b"{}", req.target.partition("?")[2])

    got, conn = await exchange(b"".join(request(f"/json?{sid}") for sid in ("a", "b", "a", "")),
                               handle)
    assert conn.h11 is None
    sent = got.split(b"HTTP/1.1 ")[1:]
    assert [b"mcp-session-id: a\r\n" in a for a in sent] == [True, False, True, False]
    assert [b"mcp-session-id: b\r\n" in a for a in sent] == [False, True, False, False]
    assert all(a.count(b"mcp-session-id") <= 1 for a in sent)
