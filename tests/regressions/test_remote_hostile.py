"""A hostile remote against the ``http`` connector's link: an in-process h11 server on trio
memory streams (each connection the link opens is a new pair) and the MockClock, or on real
loopback TCP for what only a plain socket does (a request written at once by ``send``), with a
recording receiver in place of the upstream session."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import pytest
import trio
import trio.testing
from fixtures.link_recorder import Recorder, request
from fixtures.remote_server import read_request
from memharness import Owner

from gateway import config, errors
from gateway.backend import http, httpclient
from gateway.backend.connector import LinkContext, OpenFailed
from gateway.events import BackendStateChanged, EventBus
from gateway.hub import Hub
from gateway.limits import ByteBudget
from gateway.protocol import jsonrpc

Handler = Callable[["Hostile", "Exchange"], Awaitable[None]]


class Exchange:
    """One request the hostile server read, and the means to answer it."""

    def __init__(self, stream: trio.abc.Stream, conn: h11.Connection, method: str,
                 body: Any, index: int, headers: dict[str, str] | None = None) -> None:
        self.stream, self.conn, self.method, self.body = stream, conn, method, body
        self.index = index  # the connection's first exchange (1), second (2), ...
        self.headers = headers or {}  # the request's, names lowercased

    @property
    def rpc(self) -> str | None:
        return self.body.get("method") if isinstance(self.body, dict) else None

    async def head(self, status: int, headers: list[tuple[str, str]]) -> None:
        await self.stream.send_all(self.conn.send(h11.Response(status_code=status,
                                                                headers=headers)))

    async def data(self, data: bytes) -> None:
        await self.stream.send_all(self.conn.send(h11.Data(data=data)))

    async def json(self, obj: Any, status: int = 200,
                   headers: tuple[tuple[str, str], ...] = ()) -> None:
        out = json.dumps(obj).encode()
        await self.head(status, [("content-type", "application/json"),
                                 ("content-length", str(len(out))), *headers])
        await self.data(out)
        await self.stream.send_all(self.conn.send(h11.EndOfMessage()))

    async def empty(self, status: int) -> None:
        await self.head(status, [("content-length", "0")])
        await self.stream.send_all(self.conn.send(h11.EndOfMessage()))


async def plain(server: Hostile, ex: Exchange) -> None:
    """A well-behaved remote: a session, no GET stream, 202 to notifications, ``{}`` results."""
    if ex.method == "GET":
        await ex.empty(405)
    elif ex.rpc == "initialize":
        await ex.json({"jsonrpc": "2.0", "id": ex.body["id"], "result": {
            "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
            "serverInfo": {"name": "hostile", "version": "1"}}},
            headers=(("mcp-session-id", "s1"),))
    elif ex.method == "POST" and "id" not in ex.body:
        await ex.empty(202)
    elif ex.rpc == "tools/list":
        await ex.json({"jsonrpc": "2.0", "id": ex.body["id"], "result": {"tools": [
            {"name": name, "inputSchema": {"type": "object"}} for name in ("mine", "theirs")]}})
    elif ex.method == "POST":
        await ex.json({"jsonrpc": "2.0", "id": ex.body["id"], "result": {}})
    else:
        await ex.empty(200)


async def silent_calls(server: Hostile, ex: Exchange) -> None:
    """Every request answered as :func:`plain` does, but a ``tools/call``: no head, ever."""
    if ex.rpc == "tools/call":
        await trio.sleep_forever()  # virtual-time: no head, ever
    await plain(server, ex)


class Hostile:
    """Serves each connection the link opens with ``handler``; records every request, and
    counts the connections open at once (``live``, and ``most`` of them)."""

    def __init__(self, nursery: trio.Nursery, handler: Handler) -> None:
        self.nursery = nursery
        self.handler = handler
        self.seen: list[Exchange] = []
        self.connections = 0
        self.live = self.most = 0
        self.changed = trio.Event()  # set, and replaced, at each request read

    async def open(self, host: str, port: int) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        self.connections += 1
        self.nursery.start_soon(self._serve, server)
        return client

    async def _serve(self, stream: trio.abc.Stream) -> None:
        conn = h11.Connection(h11.SERVER)
        index = 0
        self.live += 1
        self.most = max(self.most, self.live)
        try:
            while True:
                index += 1
                got = await read_request(conn, stream)
                if got is None:
                    return
                request, body = got
                ex = Exchange(stream, conn, request.method.decode(),
                              json.loads(body) if body else None, index,
                              {k.decode().lower(): v.decode() for k, v in request.headers})
                self.seen.append(ex)
                self.changed.set()
                self.changed = trio.Event()
                await self.handler(self, ex)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    await trio.aclose_forcefully(stream)
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            self.live -= 1

    def posted(self, rpc: str) -> list[Exchange]:
        return [ex for ex in self.seen if ex.rpc == rpc]


async def open_link(nursery: trio.Nursery, handler: Handler, keys: str = ""
                    ) -> tuple[Hostile, http.HttpLink, Recorder]:
    """A link to a hostile remote serving ``handler``, its session initialized (request id 1);
    ``keys``: more of the backend's TOML."""
    server = Hostile(nursery, handler)
    link, receiver = await initialized_link(nursery, "http://remote.test/mcp", server.open, keys)
    return server, link, receiver


async def initialized_link(nursery: trio.Nursery, url: str, opener: httpclient.Opener | None,
                           keys: str = "") -> tuple[http.HttpLink, Recorder]:
    """A link to ``url`` (through ``opener``, or real sockets if None), run, its session
    initialized (request id 1); ``keys``: more of the backend's TOML."""
    cfg = config.load(f'[backends.r]\nurl = "{url}"\n{keys}').backends["r"]
    ctx = LinkContext(backend="r", instance="r#1", bus=EventBus(), max_line=65536,
                      buffers=ByteBudget(10**7).open("r"))
    link = await http.HttpConnector(cfg, opener=opener).open(ctx)
    receiver = Recorder()
    nursery.start_soon(link.run, receiver)
    link.send(request(1, "initialize", {"protocolVersion": "2025-11-25"}), 1)
    await receiver.wait(lambda: receiver.answered(1))
    link.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode())
    return link, receiver


def note(method: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "method": method, "params": {}}).encode()


async def test_notification_answers_that_never_end_do_not_wedge_later_calls(
        autojump_clock: trio.testing.MockClock) -> None:
    # A notification's POST answered with a body that trickles forever (a keep-alive each few
    # seconds, never idle long enough for the idle deadline) held one of the two streams for
    # notifications for good: two of them, and every later notification queued, and every
    # request behind it (requests wait for the notifications sent before them) never left.
    async def trickling(server: Hostile, ex: Exchange) -> None:
        if ex.method == "POST" and ex.rpc == "notifications/roots/list_changed":
            await ex.head(200, [("content-type", "text/event-stream")])
            while True:
                await ex.data(b": keep-alive\n\n")
                await trio.sleep(5)  # virtual-time: autojump_clock
        await plain(server, ex)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            server, link, receiver = await open_link(nursery, trickling)
            for _ in range(3):
                link.send(note("notifications/roots/list_changed"))
            link.send(request(2, "tools/list"), 2)
            start = trio.current_time()
            await receiver.wait(lambda: receiver.answered(2))
            assert trio.current_time() - start <= 2 * http.SHORT_TIMEOUT + 1
            assert len(server.posted("notifications/roots/list_changed")) == 3
            nursery.cancel_scope.cancel()


async def test_a_call_whose_connection_drops_before_its_answer_is_not_posted_twice(
        autojump_clock: trio.testing.MockClock) -> None:
    # A kept-alive connection that closes after the remote read a tools/call: the call may
    # have run, so it must not be POSTed again on a new connection (a tool's side effect
    # twice); it fails, and the session goes on (a list is still safe to repeat).
    async def dropping(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "tools/call" and ex.index > 1:
            await trio.aclose_forcefully(ex.stream)  # read it, then gone without an answer
            return
        await plain(server, ex)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server, link, receiver = await open_link(nursery, dropping)
            link.send(request(2, "tools/list"), 2)
            await receiver.wait(lambda: receiver.answered(2))
            link.send(request(3, "tools/call", {"name": "charge", "arguments": {}}), 3)
            await receiver.wait(lambda: 3 in receiver.failures or receiver.answered(3))
            calls = server.posted("tools/call")
            assert [ex.index > 1 for ex in calls] == [True]  # on a kept-alive one, once
            assert 3 in receiver.failures and not receiver.failures[3].data.get("retryable")
            assert not receiver.ended_  # one dropped connection does not end the session
            link.send(request(4, "tools/list"), 4)
            await receiver.wait(lambda: receiver.answered(4))
            nursery.cancel_scope.cancel()


async def test_answer_streams_kept_open_after_their_answer_do_not_hold_the_request_slots(
        autojump_clock: trio.testing.MockClock) -> None:
    # Every answer as an event stream that stays open after the answer (keep-alives forever),
    # and an error status whose body never ends: each held one of the link's request streams
    # until max_call_duration (15 minutes), so a call past them waited that long.
    async def lingering(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "tools/list":
            await ex.head(200, [("content-type", "text/event-stream")])
            await ex.data(b"data: " + json.dumps({"jsonrpc": "2.0", "id": ex.body["id"],
                                                  "result": {"tools": []}}).encode() + b"\n\n")
            while True:
                await ex.data(b": keep-alive\n\n")
                await trio.sleep(5)  # virtual-time: autojump_clock
        if ex.rpc == "prompts/list":
            await ex.head(500, [("content-type", "text/plain")])
            while True:
                await ex.data(b"x")
                await trio.sleep(5)  # virtual-time: autojump_clock
        await plain(server, ex)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            _, link, receiver = await open_link(nursery, lingering)
            lists = range(2, 2 + http.REQUEST_STREAMS)
            for gid in lists:
                link.send(request(gid, "tools/list"), gid)
            link.send(request(100, "prompts/list"), 100)
            link.send(request(101, "ping"), 101)
            start = trio.current_time()
            await receiver.wait(lambda: receiver.answered(101) and 100 in receiver.failures)
            retries = http.RETRY_PAUSE * (2 ** http.RETRIES - 1)  # the 500 to a list: repeated
            assert trio.current_time() - start <= http.SHORT_TIMEOUT + 1 + retries
            assert all(receiver.answered(gid) for gid in lists)
            assert "did not end within" in receiver.failures[100].message
            nursery.cancel_scope.cancel()


async def test_an_answer_to_another_request_on_a_calls_stream_is_not_delivered(
        autojump_clock: trio.testing.MockClock) -> None:
    # What arrives on a call's own answer stream belongs to that call: an answer there to
    # another request (another caller's call) must not complete that other call.
    async def crossing(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "tools/call" and ex.body["params"]["name"] == "mine":
            await ex.json({"jsonrpc": "2.0", "id": ex.body["id"] + 1,
                           "result": {"content": [{"type": "text", "text": "forged"}]}})
            return
        if ex.rpc == "tools/call":
            await trio.sleep(1)  # virtual-time: answered after the forged one
        await plain(server, ex)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _, link, receiver = await open_link(nursery, crossing)
            link.send(request(3, "tools/call", {"name": "theirs", "arguments": {}}), 3)
            link.send(request(2, "tools/call", {"name": "mine", "arguments": {}}), 2)
            await receiver.wait(lambda: 2 in receiver.failures and receiver.answered(3))
            answers = [(m["id"], cause) for m, cause in receiver.messages if m.get("id") in (2, 3)]
            assert answers == [(3, 3)], answers
            assert "without the answer" in receiver.failures[2].message
            nursery.cancel_scope.cancel()


async def test_garbage_on_a_calls_stream_fails_that_call_not_the_one_whose_id_it_shows(
        autojump_clock: trio.testing.MockClock) -> None:
    # A message that does not decode, on one call's answer stream, showing another call's id
    # where a reply's id goes: the session failed that other call (another caller's) with
    # -32009 from what it read of the bytes; it is the call whose stream carried it that fails.
    async def garbling(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "tools/call" and ex.body["params"]["name"] == "mine":
            (theirs,) = [e for e in server.posted("tools/call")
                         if e.body["params"]["name"] == "theirs"]
            out = b'{"jsonrpc":"2.0","id":%d,"result":{"content":' % theirs.body["id"]
            await ex.head(200, [("content-type", "application/json"),
                                ("content-length", str(len(out)))])
            await ex.data(out)
            await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))
            return
        if ex.rpc == "tools/call":
            await trio.sleep(1)  # virtual-time: answered after the garbage
        await plain(server, ex)

    cfg = config.load('[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n[backends.r]\n'
                      'url = "http://remote.test/mcp"\nhealth = { interval = 0.0 }\n')
    bus = EventBus()
    running = trio.Event()
    bus.subscribe(lambda e: running.set() if e.new == "RUNNING" else None, BackendStateChanged)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = Hostile(nursery, garbling)
            hub = Hub(cfg, bus, connectors=lambda name, cfg: http.HttpConnector(
                cfg, opener=server.open))
            await nursery.start(hub.run)
            await running.wait()
            backend = hub.backends["r"]
            outcomes: dict[str, Any] = {}

            async def call(tool: str) -> None:
                owner = Owner()
                inst, child = await backend.acquire(owner)
                try:
                    raw = await child.request("tools/call", jsonrpc.encode_dict(
                        {"name": tool, "arguments": {}}), timeout=30.0, owner=owner)
                    outcomes[tool] = json.loads(bytes(raw))
                except errors.GatewayError as exc:
                    outcomes[tool] = exc
                finally:
                    backend.release(inst, owner)

            async with trio.open_nursery() as calls:
                calls.start_soon(call, "theirs")
                while not server.posted("tools/call"):
                    await server.changed.wait()
                calls.start_soon(call, "mine")
            assert outcomes["theirs"] == {}, outcomes
            assert isinstance(outcomes["mine"], errors.GatewayError)
            nursery.cancel_scope.cancel()


async def test_a_session_id_that_cannot_be_sent_back_fails_the_handshake_plainly(
        autojump_clock: trio.testing.MockClock) -> None:
    # An Mcp-Session-Id that is not visible ASCII (here a space and a Latin-1 byte, both legal
    # in an HTTP/1.1 header) was taken, then every later request failed in the HTTP client
    # ("h11 refused its head") and the session ended: a restart loop with no word of why.
    async def odd_session(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "initialize":
            out = json.dumps({"jsonrpc": "2.0", "id": ex.body["id"], "result": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "serverInfo": {"name": "hostile", "version": "1"}}}).encode()
            await ex.head(200, [("content-type", "application/json"),
                                ("content-length", str(len(out))),
                                ("mcp-session-id", b"s 1\xe9")])
            await ex.data(out)
            await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))
            return
        await plain(server, ex)

    cfg = config.load('[backends.r]\nurl = "http://remote.test/mcp"\n').backends["r"]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = Hostile(nursery, odd_session)
            ctx = LinkContext(backend="r", instance="r#1", bus=EventBus(), max_line=65536,
                              buffers=ByteBudget(10**7).open("r"))
            link = await http.HttpConnector(cfg, opener=server.open).open(ctx)
            receiver = Recorder()
            nursery.start_soon(link.run, receiver)
            link.send(request(1, "initialize", {"protocolVersion": "2025-11-25"}), 1)
            await receiver.wait(lambda: 1 in receiver.failures or receiver.answered(1))
            assert not receiver.answered(1)
            assert "Mcp-Session-Id" in receiver.failures[1].message
            assert [ex.method for ex in server.seen] == ["POST"]  # no GET stream opened
            nursery.cancel_scope.cancel()


async def test_a_get_stream_that_ends_at_once_is_opened_again_ever_later(
        autojump_clock: trio.testing.MockClock) -> None:
    # A GET stream answered 200 and ended at once, with no event, was opened again every
    # half second forever (a new connection each time: 120 a minute); it backs off now, and
    # is still opened again.
    async def quick_end(server: Hostile, ex: Exchange) -> None:
        if ex.method == "GET":
            await ex.head(200, [("content-type", "text/event-stream"), ("content-length", "0")])
            await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))
            return
        await plain(server, ex)

    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            server, _, receiver = await open_link(nursery, quick_end)
            await trio.sleep(120)  # virtual-time: autojump_clock
            gets = [ex for ex in server.seen if ex.method == "GET"]
            assert 5 <= len(gets) <= 12, len(gets)
            await trio.sleep(2 * http.GET_RETRY_MAX)  # virtual-time: still opened again
            assert len([ex for ex in server.seen if ex.method == "GET"]) > len(gets)
            assert not receiver.ended_
            nursery.cancel_scope.cancel()


def test_a_fifo_as_a_header_file_is_refused_at_once_not_waited_on(tmp_path: Any) -> None:
    """Header values are read on the event loop: a FIFO there (no writer) must not block it."""
    fifo = str(tmp_path / "token")
    os.mkfifo(fifo)
    cfg = config.BackendConfig(url="http://remote:1/mcp",
                               headers={"Authorization": {"file": fifo, "prefix": "Bearer "}})
    with pytest.raises(OpenFailed, match="not a regular file"):
        http.read_headers(cfg)


async def test_a_modern_tools_list_nested_past_any_parsers_depth_does_not_crash_the_link(
        autojump_clock: trio.testing.MockClock) -> None:
    # The link peeks into every answer (its id; a 2026-07-28 tools/list, to drop the tools
    # whose x-mcp-header is invalid): a reply nested 100000 deep raised RecursionError there
    # (in either era's shape), out of the link's tasks, instead of reaching the session (which
    # refuses it as too deep).
    deep = b'{"jsonrpc":"2.0","id":2,"result":{"tools":[' + b"[" * 100000 + b"]" * 100000 + b"]}}"

    async def nested(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "tools/list":
            await ex.head(200, [("content-type", "application/json"),
                                ("content-length", str(len(deep)))])
            await ex.data(deep)
            await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))
        else:
            await plain(server, ex)

    class Raw(Recorder):
        def message(self, data: bytes, cause: int | None = None) -> None:
            self.messages.append((data, cause))
            self._note()

    cfg = config.load('[backends.r]\nurl = "http://remote.test/mcp"\n').backends["r"]
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = Hostile(nursery, nested)
            ctx = LinkContext(backend="r", instance="r#1", bus=EventBus(), max_line=1 << 20,
                              buffers=ByteBudget(10**7).open("r"))
            link = await http.HttpConnector(cfg, opener=server.open).open(ctx)
            receiver = Raw()
            nursery.start_soon(link.run, receiver)
            link.send(request(2, "tools/list", {"_meta": meta}), 2)
            await receiver.wait(lambda: bool(receiver.messages))
            assert receiver.messages == [(deep, 2)]
            ex, = server.posted("tools/list")
            assert ex.method == "POST"
            nursery.cancel_scope.cancel()


async def open_tcp_link(nursery: trio.Nursery, handler: Handler
                        ) -> tuple[Hostile, http.HttpLink, Recorder, list[trio.SocketStream]]:
    """:func:`open_link` over real loopback TCP (the remote's ends of its connections listed)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    server = Hostile(nursery, handler)
    ends: list[trio.SocketStream] = []

    async def accept() -> None:
        async with listeners[0]:
            while True:
                stream = await listeners[0].accept()
                ends.append(stream)
                server.connections += 1
                nursery.start_soon(server._serve, stream)

    nursery.start_soon(accept)
    link, receiver = await initialized_link(nursery, f"http://127.0.0.1:{port}/mcp", None)
    while not server.posted("notifications/initialized"):
        await server.changed.wait()
    link.send(request(2, "tools/list"), 2)
    await receiver.wait(lambda: receiver.answered(2))
    await trio.testing.wait_all_tasks_blocked()  # the notification's answer read, workers parked
    return server, link, receiver, ends


async def close_tcp(nursery: trio.Nursery, link: http.HttpLink,
                    ends: list[trio.SocketStream]) -> None:
    """The link closed (its connections with it), the remote's ends too, the tasks ended."""
    await link.close()
    for end in ends:
        await trio.aclose_forcefully(end)
    nursery.cancel_scope.cancel()


def waiting(stream: trio.SocketStream) -> bytes:
    """What the remote's end of a connection holds unread, looked at without a checkpoint."""
    peek = socket.socket(fileno=os.dup(stream.socket.fileno()))
    try:
        return peek.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""
    finally:
        peek.close()


async def test_a_request_is_on_the_wire_when_send_returns_and_its_answer_comes() -> None:
    # A request a parked worker takes next, on an idle plain TCP connection: written by send()
    # itself, before the sender's task yields; the worker reads its answer.
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, plain)
            link.send(request(3, "tools/call", {"name": "mine", "arguments": {}}), 3)
            assert any(b'"tools/call"' in waiting(end) for end in ends)
            await receiver.wait(lambda: receiver.answered(3))
            assert len(server.posted("tools/call")) == 1
            await close_tcp(nursery, link, ends)


async def test_a_request_written_at_once_on_a_connection_the_remote_closed() -> None:
    # The idle connection a request is written on at once (the one its worker kept) was closed
    # by the remote just before, its worker not woken by that yet: a list is POSTed again on
    # another connection; a tools/call may have run (it fails, not retryable, and is not
    # POSTed again).
    listed: list[trio.SocketStream] = []  # the remote's ends that answered a tools/list

    async def recording(server: Hostile, ex: Exchange) -> None:
        await plain(server, ex)
        if ex.rpc == "tools/list":
            assert isinstance(ex.stream, trio.SocketStream)
            listed.append(ex.stream)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, recording)
            listed[-1].socket.close()  # no checkpoint between the close and the write
            link.send(request(3, "tools/list"), 3)
            await receiver.answer(3)
            assert receiver.answered(3) and len(server.posted("tools/list")) == 2
            await trio.testing.wait_all_tasks_blocked()
            listed[-1].socket.close()
            link.send(request(4, "tools/call", {"name": "charge", "arguments": {}}), 4)
            await receiver.answer(4)
            assert 4 in receiver.failures and not receiver.failures[4].data.get("retryable")
            assert not server.posted("tools/call")
            assert not receiver.ended_
            await close_tcp(nursery, link, ends)


async def test_an_idle_connection_the_remote_closes_is_let_go_at_once() -> None:
    # The remote closes each connection after a tools/list answer, while idle: the worker
    # watching it lets it go then, so the next requests go on another one, a tools/call too.
    async def closing(server: Hostile, ex: Exchange) -> None:
        await plain(server, ex)
        if ex.rpc == "tools/list":  # answered, then the connection closes while idle
            await trio.aclose_forcefully(ex.stream)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, closing)
            for gid in (3, 4):
                await trio.testing.wait_all_tasks_blocked()
                link.send(request(gid, "tools/list"), gid)
                await receiver.answer(gid)
                assert receiver.answered(gid)
            await trio.testing.wait_all_tasks_blocked()
            link.send(request(5, "tools/call", {"name": "charge", "arguments": {}}), 5)
            await receiver.answer(5)
            assert receiver.answered(5) and not receiver.failures
            assert len(server.posted("tools/list")) == 3 and len(server.posted("tools/call")) == 1
            assert not receiver.ended_
            await close_tcp(nursery, link, ends)


async def test_a_call_written_on_a_watched_connection_times_out_or_is_dropped_the_link_goes_on(
        autojump_clock: trio.testing.MockClock) -> None:
    # A call written at once on the connection an idle worker watches: its deadline and its
    # cancellation are that worker's scope's; it fails at max_call_duration, or is dropped
    # once its notifications/cancelled was POSTed, and the worker serves the next calls.
    with trio.fail_after(10**5):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, silent_calls)
            assert link._watchers
            start = trio.current_time()
            link.send(request(3, "tools/call", {"name": "mine", "arguments": {}}), 3)
            assert 3 in link._streams and not link._requests.items  # written, not queued
            await receiver.answer(3)
            assert trio.current_time() - start == link._cfg.max_call_duration
            assert "within max_call_duration" in receiver.failures[3].message
            await trio.testing.wait_all_tasks_blocked()
            link.send(request(4, "tools/list"), 4)
            await receiver.answer(4)
            assert receiver.answered(4)
            await trio.testing.wait_all_tasks_blocked()
            assert link._watchers
            link.send(request(5, "tools/call", {"name": "mine", "arguments": {}}), 5)
            assert 5 in link._streams and not link._requests.items
            while len(server.posted("tools/call")) < 2:
                await server.changed.wait()
            link.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                  "params": {"requestId": 5}}).encode())
            await receiver.answer(5)
            assert "cancelled" in receiver.failures[5].message
            assert trio.current_time() - start < 2 * link._cfg.max_call_duration
            await trio.testing.wait_all_tasks_blocked()
            link.send(request(6, "tools/list"), 6)
            await receiver.answer(6)
            assert receiver.answered(6)
            assert not receiver.ended_ and set(receiver.failures) == {3, 5}
            await close_tcp(nursery, link, ends)
