"""ChildConnection over in-memory streams with a scripted fake child, on trio's MockClock.

Every test runs under ``autojump_clock`` (memory streams only, STYLE item 15) and inside a hard
cap measured in trio time, so a hang fails fast instead of stalling the suite.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
from msgspec import UNSET, Raw, UnsetType
from trio.testing import MockClock

from gateway import errors
from gateway.backend.child import ChildConnection, ChildHandlers
from gateway.backend.connector import LinkContext
from gateway.backend.stdio import LineLink
from gateway.events import BackendProtocolError, EventBus, ServerRequestOutcome
from gateway.limits import Account, ByteBudget
from gateway.protocol import jsonrpc

CAP = 3000.0  # hard cap on every test, in trio time


def context(bus: EventBus, max_line: int, buffers: Account | None = None,
            max_queued: int = sys.maxsize) -> LinkContext:
    account = buffers if buffers is not None else ByteBudget(sys.maxsize).open("fx/0")
    return LinkContext(backend="fx", instance="fx/0", bus=bus, max_line=max_line,
                       buffers=account, max_queued=max_queued)


class Recorder(ChildHandlers):
    def __init__(self) -> None:
        self.notifications: list[tuple[str, Any]] = []
        self.requests: list[tuple[int | str, str, Any]] = []
        self.cancelled: list[int | str] = []

    def on_notification(self, child: ChildConnection, method: str, params: Raw | UnsetType) -> None:
        self.notifications.append((method, None if params is UNSET else json.loads(bytes(params))))

    def on_request(
        self, child: ChildConnection, id: int | str, method: str, params: Raw | UnsetType,
        cause: int | None = None,
    ) -> None:
        self.requests.append((id, method, None if params is UNSET else json.loads(bytes(params))))

    def on_cancelled(self, child: ChildConnection, request_id: int | str) -> None:
        self.cancelled.append(request_id)


class FakeChild:
    """The child's end of the pipes: reads the gateway's lines, writes its own."""

    def __init__(self, recv: trio.abc.ReceiveStream, send: trio.abc.SendStream) -> None:
        self._recv = recv
        self._send = send
        self._buf = b""

    async def receive(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            data = await self._recv.receive_some(65536)
            assert data, "the gateway closed the child's stdin"
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        assert isinstance(msg, dict)
        return msg

    async def send(self, msg: dict[str, Any] | bytes) -> None:
        line = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        await self._send.send_all(line + b"\n")

    async def close_stdin(self) -> None:
        await self._recv.aclose()

    async def close_stdout(self) -> None:
        await self._send.aclose()

    async def reply(self, id: int, result: Any) -> None:
        await self.send({"jsonrpc": "2.0", "id": id, "result": result})


@dataclass
class Harness:
    conn: ChildConnection
    child: FakeChild
    handlers: Recorder
    events: list[Any]
    nursery: trio.Nursery

    def protocol_errors(self) -> list[str]:
        return [e.kind for e in self.events if isinstance(e, BackendProtocolError)]


@asynccontextmanager
async def connected(max_line: int = 1 << 16) -> AsyncIterator[Harness]:
    gw_send, child_recv = trio.testing.memory_stream_one_way_pair()
    child_send, gw_recv = trio.testing.memory_stream_one_way_pair()
    bus = EventBus()
    events: list[Any] = []
    bus.subscribe(events.append)
    handlers = Recorder()
    link = LineLink(gw_send, gw_recv, context(bus, max_line))
    conn = ChildConnection(backend="fx", instance="fx/0", generation=1, link=link,
                           handlers=handlers, bus=bus, max_line=max_line)
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run, conn)
            nursery.start_soon(conn.timer_loop)
            yield Harness(conn, FakeChild(child_recv, child_send), handlers, events, nursery)
            nursery.cancel_scope.cancel()


@dataclass
class Call:
    done: trio.Event = field(default_factory=trio.Event)
    value: Raw | None = None
    error: errors.GatewayError | None = None
    at: float | None = None


def start_call(h: Harness, method: str, params: Raw | UnsetType = UNSET, **kw: Any) -> Call:
    c = Call()

    async def run() -> None:
        try:
            c.value = await h.conn.request(method, params, **kw)
        except errors.GatewayError as exc:
            c.error = exc
        c.at = trio.current_time()
        c.done.set()

    h.nursery.start_soon(run)
    return c


class Owner:
    """Stands in for a ClientSession: records what it is sent and which prompts end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[dict[str, Any]] = []
        self.routes: list[Any] = []  # the routing hint of each
        self.ended: list[tuple[Any, ServerRequestOutcome]] = []

    def send(self, data: bytes, route: Any = None) -> bool:
        self.sent.append(json.loads(data))
        self.routes.append(route)
        return True

    def cancel_request(self, req: Any, outcome: ServerRequestOutcome, reason: str) -> None:
        self.ended.append((req, outcome))


def open_prompt(h: Harness, owner: Owner, child_id: int | str) -> None:
    """What gateway.core.ownership does when it forwards a child's request to ``owner``."""
    h.conn.perform(h.conn.router.server_request(child_id, owner, "elicitation/create", object(),
                                                trio.current_time()))


def close_prompt(h: Harness, child_id: int | str) -> None:
    h.conn.perform(h.conn.router.server_request_done(child_id, ServerRequestOutcome.CANCELLED,
                                                     trio.current_time()))

    def __repr__(self) -> str:
        return f"<Owner {self.name}>"


# ---- requests and replies ---------------------------------------------------------------


async def test_wire_ids_are_gateway_ids_and_params_pass_through(autojump_clock: MockClock) -> None:
    params = Raw(b'{"name":"echo","arguments":{"id":"client-7","n":12345678901234567890}}')
    async with connected() as h:
        calls = [start_call(h, "tools/call", params, timeout=30) for _ in range(3)]
        seen = [await h.child.receive() for _ in range(3)]
        ids = [m["id"] for m in seen]
        assert all(type(i) is int for i in ids)
        assert sorted(ids) == [1, 2, 3]  # the connection's own counter, whatever the callers' ids
        assert set(h.conn.pending) == set(ids)
        for m in seen:
            assert m["method"] == "tools/call" and m["jsonrpc"] == "2.0"
            assert m["params"]["arguments"]["n"] == 12345678901234567890
        for i in ids:
            await h.child.reply(i, {"n": i})
        for c in calls:
            await c.done.wait()
        assert h.conn.pending == {}


async def test_each_reply_completes_its_own_call(autojump_clock: MockClock) -> None:
    async with connected() as h:
        a = start_call(h, "tools/call", Raw(b'{"name":"a"}'), timeout=30)
        first = await h.child.receive()
        b = start_call(h, "tools/call", Raw(b'{"name":"b"}'), timeout=30)
        second = await h.child.receive()
        # Answer in reverse order, with bytes that must come back untouched.
        await h.child.send(
            b'{"jsonrpc":"2.0","id":%d,"result":{"who":"b","f":1.0e10}}' % second["id"]
        )
        await b.done.wait()
        assert not a.done.is_set()
        assert b.value is not None and bytes(b.value) == b'{"who":"b","f":1.0e10}'
        await h.child.send({"jsonrpc": "2.0", "id": first["id"],
                            "error": {"code": -32000, "message": "boom", "data": {"x": 1}}})
        await a.done.wait()
        assert isinstance(a.error, errors.RemoteError)
        assert (a.error.code, a.error.message, a.error.error_data()) == (-32000, "boom", {"x": 1})
        assert h.protocol_errors() == []


async def test_timeout_at_the_configured_time_cancels_at_the_child_and_drops_the_late_reply(
    autojump_clock: MockClock,
) -> None:
    async with connected() as h:
        t0 = trio.current_time()
        c = start_call(h, "tools/call", Raw(b"{}"), timeout=7.5, owner=Owner("a"))
        req = await h.child.receive()
        cancel = await h.child.receive()  # arrives only when the gateway gives up
        assert trio.current_time() - t0 == pytest.approx(7.5)
        assert cancel["method"] == "notifications/cancelled"
        assert "id" not in cancel
        assert cancel["params"]["requestId"] == req["id"]
        await c.done.wait()
        assert c.at is not None and c.at - t0 == pytest.approx(7.5)
        assert isinstance(c.error, errors.CallTimeout)
        assert c.error.code == errors.TIMEOUT
        assert c.error.error_data() == {"backend": "fx", "reason": "timeout"}
        # The call stays in the attribution set until the child's reply...
        assert req["id"] in h.conn.pending
        # ...and the late reply is dropped quietly (not a protocol error, nobody completed).
        await h.child.reply(req["id"], {"late": True})
        await trio.testing.wait_all_tasks_blocked()
        assert req["id"] not in h.conn.pending
        assert h.protocol_errors() == []
        # The connection keeps serving.
        d = start_call(h, "ping", timeout=5)
        ping = await h.child.receive()
        await h.child.reply(ping["id"], {})
        await d.done.wait()
        assert d.value is not None and bytes(d.value) == b"{}"


async def test_caller_cancellation_tells_the_child_and_keeps_attribution(
    autojump_clock: MockClock,
) -> None:
    async with connected() as h:
        owner = Owner("a")
        with trio.CancelScope() as scope:

            async def cancel_when_sent() -> None:
                await h.child.receive()
                scope.cancel()

            h.nursery.start_soon(cancel_when_sent)
            await h.conn.request("tools/call", Raw(b"{}"), timeout=60, owner=owner)
        assert scope.cancelled_caught
        cancel = await h.child.receive()
        assert cancel["method"] == "notifications/cancelled" and cancel["params"]["requestId"] == 1
        assert h.conn.attribution() == {owner}
        await h.child.reply(1, {})
        await trio.testing.wait_all_tasks_blocked()
        assert h.conn.attribution() == set()


async def test_pause_and_resume_extend_the_deadline_by_the_paused_time(
    autojump_clock: MockClock,
) -> None:
    async with connected() as h:
        t0 = trio.current_time()
        owner = Owner("a")
        c = start_call(h, "tools/call", Raw(b"{}"), timeout=10.0, owner=owner)
        await h.child.receive()
        await trio.sleep(4.0)
        open_prompt(h, owner, "p1")
        open_prompt(h, owner, "p2")  # two prompts for the same call
        await trio.sleep(100.0)
        assert not c.done.is_set()
        close_prompt(h, "p1")  # one prompt still pending: still paused
        await trio.sleep(50.0)
        assert not c.done.is_set()
        close_prompt(h, "p2")  # 6 s of the timeout were left
        await c.done.wait()
        assert isinstance(c.error, errors.CallTimeout)
        assert c.at is not None and c.at - t0 == pytest.approx(4.0 + 150.0 + 6.0)


async def test_reply_while_paused_completes_normally(autojump_clock: MockClock) -> None:
    async with connected() as h:
        owner = Owner("a")
        c = start_call(h, "tools/call", Raw(b"{}"), timeout=10.0, owner=owner)
        req = await h.child.receive()
        open_prompt(h, owner, "p1")
        await trio.sleep(200.0)  # far past the 10 s timeout
        await h.child.reply(req["id"], {"ok": 1})
        await c.done.wait()
        assert [outcome for _, outcome in owner.ended] == [ServerRequestOutcome.CALL_FINISHED]
        close_prompt(h, "p1")  # after the end: harmless
        assert c.error is None and c.value is not None


# ---- progress ---------------------------------------------------------------------------


async def test_progress_reaches_the_owner_with_the_clients_token(
    autojump_clock: MockClock,
) -> None:
    owner = Owner("a")
    got = owner.sent

    fields = {"name": Raw(b'"slow"'), "_meta": Raw(b'{"progressToken":42}')}
    meta = {"progressToken": Raw(b"42")}  # the core decided the params; the token goes in here

    async with connected() as h:
        c = start_call(h, "tools/call", timeout=30, owner=owner, progress=42, fields=fields,
                       meta=meta)
        req = await h.child.receive()
        wire_token = req["params"]["_meta"]["progressToken"]
        assert isinstance(wire_token, str) and wire_token != 42  # gateway-unique, not the client's

        async def progress(token: Any, n: int) -> None:
            await h.child.send({"jsonrpc": "2.0", "method": "notifications/progress",
                                "params": {"progressToken": token, "progress": n, "total": 3}})

        await progress(wire_token, 1)
        await progress("gw-unknown", 2)  # unknown token: dropped
        await progress(42, 2)  # the client's own token means nothing to the gateway
        await progress(wire_token, 3)
        await trio.testing.wait_all_tasks_blocked()
        assert [m["method"] for m in got] == ["notifications/progress"] * 2
        assert [(m["params"]["progressToken"], m["params"]["progress"])
                for m in got] == [(42, 1), (42, 3)]
        assert got[0]["params"]["total"] == 3
        assert owner.routes == [(jsonrpc.Goes.PROGRESS, 42)] * 2  # its hint: the client's token
        await h.child.reply(req["id"], {})
        await c.done.wait()
        await progress(wire_token, 4)  # after the reply: dropped
        await trio.testing.wait_all_tasks_blocked()
        assert len(got) == 2
        assert h.protocol_errors() == []
        assert h.handlers.notifications == []  # progress is never handed on as-is


async def test_progress_tokens_are_unique_across_calls(autojump_clock: MockClock) -> None:
    async with connected() as h:
        for _ in range(3):
            start_call(h, "tools/call", timeout=30, owner=Owner("a"), progress="same",
                       fields={"_meta": Raw(b"{}")}, meta={})
        tokens = {(await h.child.receive())["params"]["_meta"]["progressToken"] for _ in range(3)}
        assert len(tokens) == 3


async def test_malformed_progress_is_a_protocol_error(autojump_clock: MockClock) -> None:
    async with connected() as h:
        await h.child.send(
            {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}
        )
        await trio.testing.wait_all_tasks_blocked()
        assert h.protocol_errors() == ["invalid_message"]


# ---- child death --------------------------------------------------------------------------


async def test_fail_all_completes_every_pending_call_at_once(autojump_clock: MockClock) -> None:
    async with connected() as h:
        calls = [
            start_call(h, "tools/call", Raw(b"{}"), timeout=60, owner=Owner(str(i)))
            for i in range(4)
        ]
        calls.append(start_call(h, "ping", timeout=60, internal=True))
        for _ in calls:
            await h.child.receive()
        t0 = trio.current_time()
        exited = errors.BackendExited("backend 'fx' exited: crashed", backend="fx", retryable=True)
        h.conn.fail_all(exited)
        for c in calls:
            await c.done.wait()
        for c in calls:
            assert c.error is exited
            assert c.at == t0  # at once: no time passed
        assert h.conn.pending == {}
        assert h.conn.attribution() == set()
        # The connection is closed: new requests and writes fail immediately.
        with pytest.raises(errors.BackendExited):
            await h.conn.request("ping", timeout=5)
        with pytest.raises(errors.BackendExited):
            h.conn.post(jsonrpc.encode_notification("notifications/initialized"))
        h.conn.notify("notifications/initialized")  # notifying or answering a gone child: dropped
        h.conn.respond(1, Raw(b"{}"))
        assert trio.current_time() == t0


async def test_closed_stdin_is_backend_exited_and_the_call_is_not_attributed(
    autojump_clock: MockClock,
) -> None:
    async with connected() as h:
        await h.child.close_stdin()  # the child stopped reading
        with pytest.raises(errors.BackendExited):
            await h.conn.request("tools/call", Raw(b"{}"), timeout=5, owner=Owner("a"))
        # The child never saw the call: it is not in the attribution set.
        assert h.conn.pending == {}
        assert h.conn.attribution() == set()


async def test_eof_tells_the_session_the_upstream_ended(autojump_clock: MockClock) -> None:
    async with connected() as h:
        ended = trio.Event()
        h.conn.on_ended = ended.set
        await h.child.close_stdout()
        with trio.fail_after(1):
            await ended.wait()  # the link stays up (a child's stderr may still come) until closed


# ---- what the child sends besides replies ------------------------------------------------


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (b"Starting server on stdio...", "not_json"),
        (b"{not json", "not_json"),
        (b'{"id": 999, "result": {}}', "invalid_message"),  # no jsonrpc
        (b'{"jsonrpc":"2.0","id":true,"method":"x"}', "invalid_message"),
        (b'{"jsonrpc":"2.0","id":999,"result":{}}', "unknown_response"),
        (b'{"jsonrpc":"2.0","id":"1","result":{}}', "unknown_response"),  # our ids are ints
        (b'{"jsonrpc":"2.0","method":"notifications/cancelled","params":{}}', "invalid_message"),
    ],
)
async def test_bad_lines_emit_protocol_errors_and_the_child_keeps_serving(
    line: bytes, kind: str, autojump_clock: MockClock
) -> None:
    async with connected() as h:
        c = start_call(h, "ping", timeout=5)
        req = await h.child.receive()
        await h.child.send(line)
        await h.child.reply(req["id"], {})
        await c.done.wait()
        assert c.error is None
        assert h.protocol_errors() == [kind]
        (event,) = [e for e in h.events if isinstance(e, BackendProtocolError)]
        assert (event.backend, event.instance) == ("fx", "fx/0")


@pytest.mark.parametrize("line", [
    b'{"jsonrpc":"1.0","id":{ID},"result":{}}',
    b'{"jsonrpc":"2.0","id":{ID},"error":{"code":"x","message":1}}',
    b'{"jsonrpc":"2.0","id":{ID},"result":{},"error":{"code":1,"message":"m"}}',
    b'{"jsonrpc":"2.0","id":{ID},"error":{"code":1e400,"message":"m"}}',
    b'{"jsonrpc":"2.0","id":{ID},"result":{"unterminated"',
])
async def test_an_invalid_reply_showing_its_id_fails_the_call_at_once(
    line: bytes, autojump_clock: MockClock
) -> None:
    async with connected() as h:
        c = start_call(h, "ping", timeout=30)
        req = await h.child.receive()
        started = trio.current_time()
        await h.child.send(line.replace(b"{ID}", str(req["id"]).encode()))
        await c.done.wait()
        assert c.at == started  # not after the 30 s timeout
        assert isinstance(c.error, errors.BackendProtocolError), c.error
        assert not h.conn.pending  # nothing left to attribute or to restart for


async def test_a_reply_after_a_byte_order_mark_is_read(autojump_clock: MockClock) -> None:
    async with connected() as h:
        c = start_call(h, "ping", timeout=30)
        req = await h.child.receive()
        await h.child.send(b'\xef\xbb\xbf{"jsonrpc":"2.0","id":%d,"result":{"ok":1}}' % req["id"])
        await c.done.wait()
        assert c.error is None and bytes(c.value) == b'{"ok":1}'


async def test_oversize_line_is_a_protocol_error(autojump_clock: MockClock) -> None:
    async with connected(max_line=64) as h:
        c = start_call(h, "ping", timeout=5)
        req = await h.child.receive()
        await h.child.send(b'{"jsonrpc":"2.0","method":"x","params":"' + b"y" * 200 + b'"}')
        await h.child.reply(req["id"], {})
        await c.done.wait()
        assert c.error is None
        assert h.protocol_errors() == ["oversize"]


async def test_notifications_requests_and_cancellations_go_to_the_handlers(
    autojump_clock: MockClock,
) -> None:
    async with connected() as h:
        await h.child.send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        await h.child.send({"jsonrpc": "2.0", "id": "s1", "method": "roots/list"})
        await h.child.send({"jsonrpc": "2.0", "id": 5, "method": "elicitation/create",
                            "params": {"message": "?"}})
        await h.child.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                            "params": {"requestId": 5, "reason": "changed my mind"}})
        await trio.testing.wait_all_tasks_blocked()
        assert h.handlers.notifications == [("notifications/tools/list_changed", None)]
        assert h.handlers.requests == [
            ("s1", "roots/list", None),
            (5, "elicitation/create", {"message": "?"}),
        ]
        assert h.handlers.cancelled == [5]
        assert h.protocol_errors() == []


async def test_respond_and_respond_error_write_to_the_child(autojump_clock: MockClock) -> None:
    async with connected() as h:
        h.conn.respond("s1", Raw(b'{"roots":[]}'))
        h.conn.respond_error(5, -32007, "refused", {"reason": "unattributable"})
        h.conn.respond_error(6, -32601, "nope")
        assert await h.child.receive() == {"jsonrpc": "2.0", "id": "s1", "result": {"roots": []}}
        assert await h.child.receive() == {
            "jsonrpc": "2.0", "id": 5,
            "error": {"code": -32007, "message": "refused", "data": {"reason": "unattributable"}},
        }
        assert await h.child.receive() == {
            "jsonrpc": "2.0", "id": 6, "error": {"code": -32601, "message": "nope"},
        }


# ---- attribution ------------------------------------------------------------------------


async def test_attribution_ignores_internal_calls(autojump_clock: MockClock) -> None:
    async with connected() as h:
        a = Owner("a")
        start_call(h, "ping", timeout=60, internal=True)
        start_call(h, "resources/subscribe", timeout=60, owner=Owner("b"), internal=True)
        await h.child.receive()
        await h.child.receive()
        assert h.conn.attribution() == set()
        start_call(h, "tools/call", Raw(b"{}"), timeout=60, owner=a)
        await h.child.receive()
        assert h.conn.attribution() == {a}
        assert [c.method for c in h.conn.calls_of(a)] == ["tools/call"]


async def test_abandoned_calls_count_until_answered_or_purged(autojump_clock: MockClock) -> None:
    async with connected() as h:
        a, b = Owner("a"), Owner("b")
        start_call(h, "tools/call", Raw(b"{}"), timeout=1000, owner=a)
        await h.child.receive()
        timed_out = start_call(h, "tools/call", Raw(b"{}"), timeout=2, owner=b)
        req_b = await h.child.receive()
        await timed_out.done.wait()
        assert isinstance(timed_out.error, errors.CallTimeout)
        t_abandoned = trio.current_time()
        assert h.conn.oldest_abandoned() == t_abandoned
        assert h.conn.attribution() == {a, b}  # b's call is still open at the child
        assert h.conn.calls_of(b) == []  # ... but over for b: its prompts end, nothing pauses
        await trio.sleep(500)
        assert h.conn.attribution() == {a, b}  # time alone never drops it (no guessing)
        assert h.conn.purge_abandoned(t_abandoned) == 0  # only entries given up before that
        assert h.conn.purge_abandoned(trio.current_time()) == 1
        assert h.conn.attribution() == {a}
        assert req_b["id"] not in h.conn.pending  # purged
        # Its reply, when it finally comes, is an unknown id now.
        await h.child.reply(req_b["id"], {})
        await trio.testing.wait_all_tasks_blocked()
        assert h.protocol_errors() == ["unknown_response"]


async def test_pause_never_extends_past_the_hard_maximum(autojump_clock: MockClock) -> None:
    async with connected() as h:
        t0 = trio.current_time()
        owner = Owner("a")
        call = start_call(h, "tools/call", Raw(b"{}"), timeout=10, hard_timeout=25, owner=owner)
        await h.child.receive()
        await trio.testing.wait_all_tasks_blocked()
        open_prompt(h, owner, "p1")  # a prompt for this call is pending for a long time
        await call.done.wait()
        assert isinstance(call.error, errors.CallTimeout)
        assert call.at - t0 == 25


# ---- the write queue's bytes on the daemon-wide budget ------------------------------------


async def test_write_queue_bytes_are_charged_until_written_or_dropped() -> None:
    budget = ByteBudget(1 << 20)
    gw_send, child_recv = trio.testing.memory_stream_one_way_pair()
    _child_send, gw_recv = trio.testing.memory_stream_one_way_pair()
    link = LineLink(gw_send, gw_recv, context(EventBus(), 1 << 16, budget.open("child fx/0")))
    conn = ChildConnection(backend="fx", instance="fx/0", generation=1, link=link,
                           handlers=Recorder(), bus=EventBus(), max_line=1 << 16)
    conn.post(b"x" * 99)
    conn.post(b"y" * 9)
    assert budget.total == 110  # queued: no write loop yet (and no pipe to write to directly)
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run, conn)
            assert await child_recv.receive_some() == b"x" * 99 + b"\n" + b"y" * 9 + b"\n"
            await trio.testing.wait_all_tasks_blocked()  # the write loop is idle again
            assert budget.total == 0  # written: released
            nursery.cancel_scope.cancel()
    conn.post(b"z" * 49)
    assert budget.total == 50
    conn.fail_all(conn.exited_error("test"))  # the child is gone: its queue is dropped
    assert budget.total == 0 and not budget.accounts
    with pytest.raises(errors.NotDelivered):
        conn.post(b"late")
    assert budget.total == 0


async def test_a_child_that_stops_reading_cannot_hold_more_than_max_queued(
    autojump_clock: MockClock,
) -> None:
    """Requests beyond the bound get -32006 at once (a hostile tester's child pinned the
    daemon-wide byte budget and got a bystander evicted)."""
    gw_send, _child_never_reads = trio.testing.lockstep_stream_one_way_pair()
    _unused, gw_recv = trio.testing.memory_stream_one_way_pair()
    link = LineLink(gw_send, gw_recv, context(EventBus(), 1 << 16, max_queued=300))
    conn = ChildConnection(backend="fx", instance="fx/0", generation=1, link=link,
                           handlers=Recorder(), bus=EventBus(), max_line=1 << 16)
    owner = Owner("a")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run, conn)
        nursery.start_soon(conn.timer_loop)
        h = Harness(conn, None, None, [], nursery)  # type: ignore[arg-type]  # no fake child or recorder in this test
        first = start_call(h, "tools/call", jsonrpc.encode_dict({"m": "x" * 100}), timeout=5,
                           owner=owner)
        await trio.testing.wait_all_tasks_blocked()
        second = start_call(h, "tools/call", jsonrpc.encode_dict({"m": "y" * 250}), timeout=5,
                            owner=owner)
        await second.done.wait()
        assert isinstance(second.error, errors.Overloaded) and second.at == 0  # at once, unsent
        assert conn.buffers.held < 300 and len(conn.pending) == 1
        await first.done.wait()
        assert isinstance(first.error, errors.CallTimeout)
        nursery.cancel_scope.cancel()


def test_request_params_put_the_gateways_token_where_the_callers_was() -> None:
    """The core decides the params for the child's era; the router only puts its token in."""
    from gateway.protocol.routing import request_params

    meta = {"a": Raw(b"1"), "progressToken": Raw(b"7"), "io.x/v": Raw(b'"2026"')}
    params = {"name": Raw(b'"t"'), "_meta": Raw(b'{"a":1,"progressToken":7}')}
    sent = json.loads(bytes(request_params(params, meta, "gw-3")))
    assert list(sent["_meta"].items()) == [("a", 1), ("progressToken", "gw-3"), ("io.x/v", "2026")]
    assert json.loads(bytes(request_params(params, None, "gw-3"))) == {
        "name": "t", "_meta": {"a": 1, "progressToken": 7}}  # no progress asked: as decided
    assert params["_meta"] == Raw(b'{"a":1,"progressToken":7}')  # the core's params unchanged
