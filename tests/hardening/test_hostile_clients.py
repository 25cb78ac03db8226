"""Hostile clients on every listener (WebSocket and unix socket) of the real daemon:
hypothesis-generated JSON-RPC, deep and huge values, invalid UTF-8, oversize and fragmented
frames, forbidden batches, requests before and a second ``initialize``, slow readers and
connect/abort churn.  Every request with a usable id gets exactly one answer, nothing invalid
reaches a backend, and afterwards the invariants of tests/invariants.py hold."""

from __future__ import annotations

import json
import secrets
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from helpers import Client, connect, poll, text_of, unix_connect
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from invariants import Daemon, DaemonSlot, baseline, chaos_backend, check
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Request,
    TextMessage,
)

pytestmark = pytest.mark.system

MAX_MESSAGE = 256 * 1024
MAX_DEPTH = 128  # gateway.max_json_depth (default)
GATEWAY = (f"max_message_bytes = {MAX_MESSAGE}\noutbound_queue = 4\n"
           f"outbound_bytes = {MAX_MESSAGE}\n"
           "write_stall_timeout = 2.0")
TRANSPORTS = ["websocket", "unix"]
ANSWER_BOUND = 3.0  # seconds for an answer to a generated message (echo or an error at once)


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("hostile"), chaos_backend("fx"), gateway=GATEWAY)
    yield s
    s.close()


async def send_raw(c: Client, data: bytes) -> None:
    """Send bytes as one message: a binary WebSocket frame, or one line on the unix socket."""
    await c.ws.send_message(data)


async def backend_stats(c: Client) -> dict[str, int]:
    return json.loads(text_of(await c.call("fx__stats", {})))


def answers(c: Client, start: int) -> list[dict[str, Any]]:
    """What ``c`` received since index ``start`` that is not a request or notification."""
    return [m for m in c.received[start:] if "method" not in m]


async def fence(c: Client) -> None:
    """A call through the gateway and the backend pipe: every earlier answer has arrived."""
    tag = secrets.token_hex(6)
    r = await c.call("fx__echo", {"message": tag}, id=f"fence-{tag}")
    assert text_of(r) == tag


# ---- hypothesis: generated JSON-RPC -----------------------------------------------------------

INT64 = (-(2**63), 2**64 - 1)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
ids = st.one_of(
    st.integers(*INT64), st.text(max_size=16), st.none(), st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False), st.integers(2**64, 2**80),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2),
)
methods = st.one_of(
    st.sampled_from(["ping", "tools/call", "tools/list", "initialize", "resources/read",
                     "prompts/get", "completion/complete", "logging/setLevel",
                     "notifications/initialized", "notifications/cancelled", "tasks/get"]),
    st.text(max_size=24), json_values,
)
tool_params = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["fx__echo", "fx__stats", "nope__x", ""]), json_values)},
    optional={"arguments": st.one_of(
        st.fixed_dictionaries({"message": st.one_of(st.text(max_size=40), json_values)}),
        json_values,
        st.integers(0, 150_000).map(lambda n: {"message": "h" * n}),  # huge, under the limit
    ), "_meta": json_values},
)
DEEP = "\x00DEEP\x00"  # replaced by a nested array after json.dumps
params = st.one_of(json_values, tool_params, st.just(DEEP))
requests = st.fixed_dictionaries(  # well-formed envelopes, hostile contents
    {"jsonrpc": st.just("2.0"), "id": st.one_of(st.integers(*INT64), st.text(max_size=16)),
     "method": methods},
    optional={"params": params},
)
messages = st.one_of(
    requests,
    st.fixed_dictionaries({}, optional={
        "jsonrpc": st.one_of(st.just("2.0"), json_scalars),
        "id": ids, "method": methods, "params": params, "result": json_values,
        "error": json_values,
    }),
    st.lists(st.fixed_dictionaries({"jsonrpc": st.just("2.0"), "id": st.integers(0, 9),
                                    "method": st.just("ping")}), max_size=3),  # batches
    json_scalars,
)


def usable(i: Any) -> bool:
    """An id the gateway echoes back: any JSON integer (big ones too) or string."""
    return (isinstance(i, int) and not isinstance(i, bool)) or isinstance(i, str)


def encode(msg: Any, depth: int) -> bytes:
    if isinstance(msg, dict) and msg.get("method") == "notifications/cancelled":
        msg = {**msg, "params": {"requestId": "no-such-request"}}  # never cancel our own calls
    text = json.dumps(msg)
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


@pytest.mark.parametrize("transport", TRANSPORTS)
@settings(max_examples=60, deadline=None, report_multiple_bugs=False,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: bounded CI time
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example(batch=[{"jsonrpc": "2.0", "id": 0, "method": None}], depth=3)  # found by this test
@example(batch=[{"jsonrpc": "2.0", "id": "t", "method": True, "params": DEEP}], depth=129)
@given(batch=st.lists(messages, min_size=1, max_size=4),
       depth=st.sampled_from([3, 100, 129, 1000, 20_000]))
async def test_generated_jsonrpc_gets_exactly_one_answer_per_usable_id(
    daemon: Daemon, transport: str, batch: list[Any], depth: int
) -> None:
    expected: dict[str, int] = {}  # json of a usable request id -> answers seen
    too_deep: dict[str, int] = {}  # the same, for requests refused before their id is read
    other: dict[str, int] = {}  # usable ids of messages that are not requests: at most one answer
    for msg in batch:
        if isinstance(msg, dict) and "id" in msg and usable(msg["id"]):
            key = json.dumps(msg["id"])
            if key in expected or key in too_deep or key in other or key == "1":
                msg.pop("id")
                continue
            if "method" not in msg or "result" in msg or "error" in msg:
                other[key] = 0  # not a request: an error answer at most
                continue
            deep = depth > MAX_DEPTH - 4 and json.dumps(DEEP) in json.dumps(msg)
            (too_deep if deep else expected)[key] = 0
    with trio.fail_after(30):
        async with daemon.client(transport) as c:
            start = len(c.received)
            for msg in batch:
                await c.send(encode(msg, depth).decode())
            await c.wait_for(lambda: all(  # the gateway answers these at once
                any(json.dumps(m.get("id")) == key for m in answers(c, start)) for key in expected),
                timeout=ANSWER_BOUND)
            await fence(c)
            got = [m for m in answers(c, start) if not str(m.get("id")).startswith("fence-")]
            assert sum(m.get("id") is None for m in got) <= len(batch), got
            for m in got:
                key = json.dumps(m.get("id"))
                assert key in expected or key in too_deep or key in other \
                    or m.get("id") is None, f"answer to an id never sent: {m}"
                for table in (too_deep, other):
                    if key in table:
                        table[key] += 1
                assert ("result" in m) != ("error" in m), m
                if "error" in m:
                    assert isinstance(m["error"]["code"], int), m
                if key in expected:
                    expected[key] += 1
                if isinstance(m.get("error"), dict) and (m["error"].get("data") or {}).get(
                        "reason") == "too_deep":
                    assert m["error"]["code"] == -32600
            assert all(n == 1 for n in expected.values()), expected
            assert all(n <= 1 for n in [*too_deep.values(), *other.values()]), (too_deep, other)
            assert not c.closed


# ---- explicit hostile inputs ------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_requests_before_initialize_and_a_second_initialize_are_refused(
    daemon: Daemon, transport: str
) -> None:
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with daemon.client(transport, initialize=False) as c:
            r = await c.call("fx__echo", {"message": "early"}, id="early")
            assert r["error"]["code"] == -32600, r
            assert (await c.request("ping", id="early-ping"))["result"] == {}
            await c.initialize()
            r = await c.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                               "clientInfo": {"name": "again", "version": "0"}},
                                id="again")
            assert "result" not in r, r
            assert r["error"]["code"] == -32600, r
            await fence(c)  # the session stays as it was
        await check(daemon, base)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_json_deeper_than_the_limit_is_refused_and_the_connection_stays(
    daemon: Daemon, transport: str
) -> None:
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with daemon.client(transport) as c:
            for depth in (MAX_DEPTH + 1, 1000, 100_000):
                rid = f"deep-{depth}"
                body = json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                                   "params": {"name": "fx__echo", "arguments": {"message": DEEP}}})
                start = len(c.received)
                await c.send(body.replace(json.dumps(DEEP), "[" * depth + "]" * depth))
                (r,) = await c.wait_for(lambda start=start: answers(c, start), ANSWER_BOUND)
                assert r["id"] in (rid, None), r
                assert r["error"]["code"] == -32600, r
                assert r["error"]["data"]["reason"] == "too_deep", r
                await fence(c)
                assert len(answers(c, start)) == 2  # the refusal and the fence
            # nested a little less than the limit passes through to the backend
            ok_depth = MAX_DEPTH - 8
            body = json.dumps({"jsonrpc": "2.0", "id": "shallow", "method": "tools/call",
                               "params": {"name": "fx__echo", "arguments": {"x": DEEP}}})
            await c.send(body.replace(json.dumps(DEEP), "[" * ok_depth + "]" * ok_depth))
            assert "result" in await c.response("shallow")
            assert not c.closed
        await check(daemon, base)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_invalid_utf8_gets_parse_error_and_never_reaches_a_backend(
    daemon: Daemon, transport: str
) -> None:
    """A unix-socket line holding invalid UTF-8 gets -32700; over WebSocket, bytes that are not
    UTF-8 can only come in a binary frame, which is refused as such (-32600, then close 1003)."""
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with daemon.client("unix") as c:
            before = await backend_stats(c)
        async with daemon.client(transport) as c:
            tag = secrets.token_hex(6)
            raw = json.dumps({"jsonrpc": "2.0", "id": "bad-utf8", "method": "tools/call",
                              "params": {"name": "fx__echo", "arguments": {"message": "@@"}}})
            start = len(c.received)
            await send_raw(c, raw.encode().replace(b"@@", tag.encode() + b"\xff\xfe"))
            (r,) = await c.wait_for(lambda: answers(c, start), ANSWER_BOUND)
            expected = -32700 if transport == "unix" else -32600
            assert r["error"]["code"] == expected and r["id"] is None, r
            if transport == "unix":
                assert r["error"]["data"]["reason"] == "invalid_utf8", r
                await fence(c)
            else:
                assert r["error"]["data"]["reason"] == "binary_frame", r
        async with daemon.client("unix") as c:
            after = await backend_stats(c)
        assert after["bad_utf8_in"] == before["bad_utf8_in"]
        fenced = 1 if transport == "unix" else 0  # fence() makes one call of its own
        assert after["lines_in"] == before["lines_in"] + 1 + fenced  # and the second fx__stats
        await check(daemon, base)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_batch_in_a_session_that_forbids_batches_runs_nothing(
    daemon: Daemon, transport: str
) -> None:
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with daemon.client(transport) as c:
            start = len(c.received)
            await c.send([{"jsonrpc": "2.0", "id": "b1", "method": "tools/call",
                           "params": {"name": "fx__echo", "arguments": {"message": "b"}}},
                          {"jsonrpc": "2.0", "id": "b2", "method": "ping"}])
            (r,) = await c.wait_for(lambda: answers(c, start), ANSWER_BOUND)
            assert r["error"]["code"] == -32600 and r["id"] is None, r
            await fence(c)
            assert "b1" not in c.responses and "b2" not in c.responses
        await check(daemon, base)


async def test_oversize_message_is_refused_and_only_that_connection_closes(
    daemon: Daemon
) -> None:
    big = call_bytes("huge", "z" * MAX_MESSAGE)
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with daemon.client("websocket") as bystander:
            async with RawWs.open(daemon.ws_port) as ws:  # WebSocket: -32600, then close 1009
                await ws.frame(1, INIT)
                assert (await ws.message())["id"] == "init"
                await ws.frame(1, big)
                r = await ws.message()
                assert not isinstance(r, CloseConnection), r
                assert r["error"]["code"] == -32600, r
                assert r["error"]["data"]["reason"] == "message_too_large", r
                close = await ws.message()
                assert isinstance(close, CloseConnection) and close.code == 1009, close
            async with daemon.client("unix") as c:  # unix socket: -32600, then EOF
                start = len(c.received)
                await c.ws.send_message(big)
                with trio.fail_after(10):
                    while not c.closed:
                        await c._changed.wait()
                (r,) = answers(c, start)
                assert r["error"]["code"] == -32600, r
                assert r["error"]["data"]["reason"] == "message_too_large", r
            await fence(bystander)
        await check(daemon, base)


class RawWs:
    """A WebSocket client that writes its own frames (fragments, invalid UTF-8 text) and reads
    with wsproto."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.events: list[Any] = []
        self._parts: list[str | bytes] = []

    @classmethod
    @asynccontextmanager
    async def open(cls, port: int) -> AsyncIterator[RawWs]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            raw = cls(stream)
            await stream.send_all(raw.ws.send(Request(host="127.0.0.1", target="/",
                                                      subprotocols=["mcp"])))
            event = await raw.next_event()
            assert isinstance(event, AcceptConnection), event
            yield raw

    async def next_event(self) -> Any:
        while not self.events:
            data = await self.stream.receive_some(1 << 20)
            self.ws.receive_data(data or None)
            self.events.extend(self.ws.events())
            if not data and not self.events:
                return CloseConnection(1006)
        return self.events.pop(0)

    async def message(self) -> dict[str, Any] | CloseConnection:
        """The next complete message decoded, or the close."""
        while True:
            event = await self.next_event()
            if isinstance(event, Ping):
                await self.stream.send_all(self.ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                return event
            elif isinstance(event, TextMessage | BytesMessage):
                self._parts.append(event.data)
                if event.message_finished:
                    data = "".join(self._parts) if isinstance(event, TextMessage) \
                        else b"".join(self._parts)  # type: ignore[arg-type]  # bytes parts for a binary message
                    self._parts = []
                    return json.loads(data)

    async def frame(self, opcode: int, payload: bytes, fin: bool = True) -> None:
        """One masked frame (mask key 0: the payload goes as is, which RFC 6455 allows)."""
        head = bytes([(0x80 if fin else 0) | opcode])
        n = len(payload)
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        await self.stream.send_all(head + b"\0\0\0\0" + payload)

    async def send_fragmented(self, data: bytes, size: int, opcode: int = 1) -> None:
        chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
        for i, chunk in enumerate(chunks):
            await self.frame(opcode if i == 0 else 0, chunk, fin=i == len(chunks) - 1)


def call_bytes(rid: str, message: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                       "params": {"name": "fx__echo", "arguments": {"message": message}}}).encode()


INIT = json.dumps({"jsonrpc": "2.0", "id": "init", "method": "initialize",
                   "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                              "clientInfo": {"name": "raw", "version": "0"}}}).encode()


async def test_websocket_fragments_and_invalid_utf8_text_frames(daemon: Daemon) -> None:
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with RawWs.open(daemon.ws_port) as ws:
            await ws.send_fragmented(INIT, 7)
            assert (await ws.message())["id"] == "init"
            await ws.frame(1, b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
            # a call in 1-byte fragments, then one in binary fragments
            await ws.send_fragmented(call_bytes("frag", "fragmented"), 1)
            r = await ws.message()
            assert r["id"] == "frag" and r["result"]["content"][0]["text"] == "fragmented"
            # fragments that add up to more than the limit: refused like one big message
            await ws.send_fragmented(call_bytes("frag-big", "q" * MAX_MESSAGE), 65536)
            r = await ws.message()
            assert not isinstance(r, CloseConnection) and r["error"]["code"] == -32600, r
            assert r["error"]["data"]["reason"] == "message_too_large"
        async with RawWs.open(daemon.ws_port) as ws:
            await ws.frame(1, INIT)
            assert (await ws.message())["id"] == "init"
            # a message in binary fragments: refused (MCP is one message per text frame)
            await ws.send_fragmented(call_bytes("frag-bin", "binary"), 100, opcode=2)
            r = await ws.message()
            assert r["error"]["code"] == -32600 and r["error"]["data"][
                "reason"] == "binary_frame", r
            r = await ws.message()
            assert isinstance(r, CloseConnection) and r.code == 1003, r
        async with RawWs.open(daemon.ws_port) as ws:
            await ws.frame(1, INIT)
            assert (await ws.message())["id"] == "init"
            # invalid UTF-8 in a text frame: -32700 (or the RFC 6455 close 1007), never forwarded
            await ws.frame(1, call_bytes("bad-text", "@@").replace(b"@@", b"\xc3\x28"))
            r = await ws.message()
            if isinstance(r, CloseConnection):
                assert r.code == 1007, r
            else:
                assert r["error"]["code"] == -32700 and r["id"] is None, r
        async with connect(daemon.url) as c:
            assert (await backend_stats(c))["bad_utf8_in"] == 0
        await check(daemon, base)


async def test_unix_line_split_across_many_writes_is_one_message(daemon: Daemon) -> None:
    with trio.fail_after(20):
        base = await baseline(daemon)
        async with unix_connect(daemon.unix_path) as c:
            data = call_bytes("split", "split-line")
            for i in range(0, len(data), 5):
                await c.ws.stream.send_all(data[i:i + 5])
                await trio.lowlevel.checkpoint()
            await c.ws.stream.send_all(b"\n")
            assert text_of(await c.response("split")) == "split-line"
        await check(daemon, base)


# ---- slow readers and churn -------------------------------------------------------------------


CLOSED = "mcp_gateway_client_connections_closed_total"


async def test_slow_reader_is_cut_off_and_the_invariants_hold(daemon: Daemon) -> None:
    with trio.fail_after(40):
        base = await baseline(daemon)
        overflows = await daemon.metric(CLOSED, transport="unix", reason="overflow")
        stream = await trio.open_unix_socket(daemon.unix_path)
        async with stream:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await stream.send_all(INIT + b"\n")
            got = 0
            with trio.fail_after(20):
                try:
                    for i in range(60):  # 60 x 200 kB answers, not read yet
                        await stream.send_all(call_bytes(f"s{i}", "s" * 200_000) + b"\n")
                    # the slowest reader: none until the gateway gave up on it (polled: the
                    # daemon is another process), then EOF (or a reset) after whatever fitted
                    async def cut_off() -> bool:
                        return await daemon.metric(CLOSED, transport="unix",
                                                   reason="overflow") > overflows

                    await poll(cut_off)
                    while data := await stream.receive_some(1 << 20):
                        got += len(data)
                except trio.BrokenResourceError:
                    pass
            assert got < 60 * 200_000, got  # cut off before it got everything
        await check(daemon, base)


async def test_connect_abort_churn_leaves_nothing_behind(daemon: Daemon) -> None:
    with trio.fail_after(60):
        base = await baseline(daemon)
        for i in range(40):
            kind = i % 5
            if kind == 0:  # TCP connect, then reset
                s = await trio.open_tcp_stream("127.0.0.1", daemon.ws_port)
                s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await s.aclose()
            elif kind == 1:  # half an upgrade request, then close
                s = await trio.open_tcp_stream("127.0.0.1", daemon.ws_port)
                await s.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websock")
                await s.aclose()
            elif kind == 2:  # a call in flight, then a reset
                async with RawWs.open(daemon.ws_port) as ws:
                    await ws.frame(1, INIT)
                    await ws.message()
                    await ws.frame(1, call_bytes(f"c{i}", "x" * 1000))
                    ws.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                struct.pack("ii", 1, 0))
            elif kind == 3:  # unix: half a line, then close
                s = await trio.open_unix_socket(daemon.unix_path)
                await s.send_all(INIT + b"\n" + call_bytes(f"u{i}", "y")[:20])
                await s.aclose()
            else:  # unix: a call in flight, then close without reading
                s = await trio.open_unix_socket(daemon.unix_path)
                await s.send_all(INIT + b"\n" + call_bytes(f"u{i}", "y") + b"\n")
                await s.aclose()
        await check(daemon, base)


async def test_invariants_notice_a_connection_left_open(daemon: Daemon) -> None:
    """The invariants can fail: a connection still open is not the baseline."""
    with trio.fail_after(20):
        base = await baseline(daemon)
        async with daemon.client("unix"):
            with pytest.raises(AssertionError, match="did not settle"):
                await check(daemon, base, settle=0.3)
        await check(daemon, base)
