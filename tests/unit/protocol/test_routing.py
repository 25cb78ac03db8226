"""The sans-IO routing core of one child (gateway.protocol.routing).

The state machine below plays the shell faithfully over random interleavings of everything that
can happen to one child generation: it performs every action the router returns (depth first:
an ``EndServerRequest`` ends the request at its owner, whose end is reported back at once, as
``ServerRequest.finish``'s callback does), and keeps its own model of every call (state, owner,
queue position, the time its clock has run) to check the router against.  The example tests at
the end are the behaviours that matter most, written to be read.

Times are whole numbers, so deadlines compare exactly.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from msgspec import Raw

from gateway import errors
from gateway.events import ServerRequestOutcome as Out
from gateway.protocol import jsonrpc
from gateway.protocol.routing import (
    CANCEL_ELICITATION,
    ArmTimer,
    CallState,
    ChildRouter,
    EndServerRequest,
    Finished,
    RoutingError,
    Settled,
    ToChild,
    ToOwner,
    UnknownReply,
)

TIMEOUT = 10  # the router's default timeout
MAX_INFLIGHT = 2
NAMES = ("a", "b")
METHODS = ("tools/call", "resources/read", "prompts/get")
SERVER_METHODS = ("elicitation/create", "sampling/createMessage", "roots/list")

# ---- the model -------------------------------------------------------------------------------


@dataclass
class MCall:
    gid: int
    owner: Any  # None: internal
    call: Any  # the router's Call
    opened: int
    timeout: float
    hard: float
    client_token: Any = None
    state: str = "new"  # new → queued | sent → abandoned | done
    finished: int = 0
    caller_gave_up: bool = False  # cancelled without an error, or its owner closed
    left: float = 0.0  # what is left of its timeout at ``since`` (the clock runs from ``since``)
    since: int = 0
    paused: int = 0
    abandoned_at: int | None = None
    expect_result: Any = None  # the child's answer the caller must get

    @property
    def internal(self) -> bool:
        return self.owner is None

    @property
    def at_child(self) -> bool:  # in the attribution set (while not internal)
        return self.state in ("sent", "abandoned")

    @property
    def running(self) -> bool:  # its caller waits for it: its clock counts
        return self.state in ("queued", "sent")

    def deadline(self) -> float:
        if self.paused:
            return self.hard
        return min(self.since + self.left, self.hard)


@dataclass
class MRequest:  # a server→client request the shell forwarded
    child_id: int
    owner: Any
    method: str
    handle: int
    paused: list[MCall]
    open_at_owner: bool = True
    reported: bool = False
    ended_by: set[Out] = field(default_factory=set)


class RouterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.r = ChildRouter("b", timeout=TIMEOUT, max_inflight=MAX_INFLIGHT)
        self.now = 0
        self.armed = math.inf  # the shell's timer
        self.calls: dict[int, MCall] = {}
        self.gen = dict.fromkeys(NAMES, 0)
        self.closed: set[Any] = set()
        self.queues: dict[Any, list[int]] = {}  # the model's fairness queues (gids, oldest first)
        self.rr_marks: dict[Any, set[Any]] = {}  # owner waiting → owners dispatched since it waits
        self.requests: dict[int, MRequest] = {}  # by child id
        self.by_handle: dict[int, MRequest] = {}
        self.next_child_id = 100
        self.next_handle = 0
        self.to_child_answers: Counter[int] = Counter()  # child id → answers the child got
        self.told: dict[int, Any] = {}  # the last answer, for its report to check
        self.cancel_notes: Counter[int] = Counter()  # gid → notifications/cancelled the child got
        self.received: dict[Any, list[bytes]] = {}  # what each owner got (ToOwner)
        self.exited: errors.GatewayError | None = None
        self.settled = 0
        self.drain = "exit first"
        # per event
        self.event = ""
        self.expect_abandon: set[int] = set()

    @initialize(drain=st.sampled_from(["exit first", "close, exit", "close, answer"]))
    def init(self, drain: str) -> None:
        self.drain = drain

    # ---- helpers ----------------------------------------------------------------------------

    def owners(self) -> list[Any]:
        return [(n, self.gen[n]) for n in NAMES]

    def sent_of(self, owner: Any) -> list[MCall]:
        return [m for m in self.calls.values()
                if m.owner == owner and m.state == "sent" and m.gid not in self.expect_abandon]

    def busy(self) -> int:
        """Clients' calls at the child whose callers wait (abandoned ones free their slot)."""
        return sum(1 for m in self.calls.values() if not m.internal and m.at_child and m.running)

    def model_attribution(self) -> set[Any]:
        return {m.owner for m in self.calls.values() if not m.internal and m.at_child}

    def event_run(self, name: str, actions: list) -> None:
        """Perform the actions of one top-level event."""
        self.event = name
        settled_before = self.settled
        abandoned_before = {g for g, m in self.calls.items() if m.state == "abandoned"}
        self.run(actions)
        assert not self.expect_abandon, f"abandoned, the child not told: {self.expect_abandon}"
        # Settled is emitted exactly when abandoned calls left the attribution set
        left = abandoned_before - {g for g, m in self.calls.items() if m.state == "abandoned"}
        assert (self.settled > settled_before) == bool(left), (name, left)

    def run(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, ToChild):
                self.on_to_child(a)
            elif isinstance(a, ToOwner):
                self.on_to_owner(a)
            elif isinstance(a, Finished):
                self.on_finished(a)
            elif isinstance(a, EndServerRequest):
                self.on_end_request(a)
            elif isinstance(a, Settled):
                self.settled += 1
                for g in list(self.calls):
                    m = self.calls[g]
                    if m.state == "abandoned" and m.call.state is CallState.DONE:
                        m.state = "done"
            elif isinstance(a, ArmTimer):
                self.armed = a.at
            else:  # pragma: no cover
                raise AssertionError(f"unknown action {a!r}")

    def on_to_child(self, a: ToChild) -> None:
        assert self.exited is None, f"written to an exited child: {a!r}"
        if a.gid is not None:  # a call's line
            m = self.calls[a.gid]
            assert a.data == f"line-{a.gid}".encode()
            if m.state == "new":
                assert self.event == "submit"
                assert m.internal or not any(self.queues.values()), "sent past a queue"
            else:
                assert m.state == "queued", f"{m.state} call dispatched"
                self.dispatched(m)
            m.state = "sent"
            assert m.internal or self.busy() <= MAX_INFLIGHT
            return
        msg = json.loads(a.data)
        if msg.get("method") == "notifications/cancelled":
            gid = msg["params"]["requestId"]
            assert gid in self.expect_abandon, f"cancelled {gid} unexpectedly"
            self.expect_abandon.discard(gid)
            self.cancel_notes[gid] += 1
            assert self.cancel_notes[gid] == 1
            m = self.calls[gid]
            m.state = "abandoned"
            m.abandoned_at = self.now
            return
        # an answer to one of the child's requests: at most one per child id
        cid = msg["id"]
        req = self.requests[cid]
        self.to_child_answers[cid] += 1
        self.told[cid] = msg
        assert self.to_child_answers[cid] == 1, f"child request {cid} answered twice"
        assert req.reported

    def dispatched(self, m: MCall) -> None:
        """A queued call was given a slot: its owner's oldest, and round-robin."""
        q = self.queues[m.owner]
        assert q[0] == m.gid, "not the owner's oldest queued call"
        q.pop(0)
        for other, marks in self.rr_marks.items():
            if other != m.owner and self.queues.get(other):
                assert m.owner not in marks, (
                    f"{m.owner} dispatched twice while {other} waited (round-robin broken)")
                marks.add(m.owner)
        self.rr_marks[m.owner] = set()
        if not q:
            del self.queues[m.owner]
            del self.rr_marks[m.owner]

    def unqueue(self, m: MCall) -> None:
        q = self.queues[m.owner]
        q.remove(m.gid)
        if not q:
            del self.queues[m.owner]
            del self.rr_marks[m.owner]

    def on_to_owner(self, a: ToOwner) -> None:
        m = self.calls[a.call.gid]
        assert a.owner == m.owner, "a message reached an owner that does not own the call"
        assert a.owner not in self.closed
        assert m.state == "sent"
        msg = json.loads(a.data)
        assert msg["method"] == "notifications/progress"
        assert msg["params"]["progressToken"] == m.client_token
        self.received.setdefault(a.owner, []).append(a.data)

    def on_finished(self, a: Finished) -> None:
        m = self.calls[a.call.gid]
        assert a.call is m.call and a.call.owner == m.owner, "answered to someone else"
        m.finished += 1
        assert m.finished == 1, f"call {m.gid} finished twice"
        if a.result is None and a.error is None:
            assert m.caller_gave_up, f"call {m.gid} ended without an answer its caller waits for"
        if m.expect_result is not None:
            assert a.error is None and a.result == m.expect_result
        if isinstance(a.error, errors.CallTimeout):
            assert self.event == "timer_due"
            assert a.error.code == -32003
            assert m.deadline() <= self.now, f"call {m.gid} timed out early"
            if m.paused:
                assert self.now >= m.hard, "a paused call timed out before its hard deadline"
        was = m.state
        assert was in ("new", "queued", "sent"), f"{was} call finished"
        if was == "queued":
            self.unqueue(m)
        if was == "sent" and self.event in ("cancel", "timer_due", "owner_closed"):
            self.expect_abandon.add(m.gid)  # the child is told next; it stays attributed
        else:
            m.state = "done"

    def on_end_request(self, a: EndServerRequest) -> None:
        req = self.by_handle[a.handle]
        assert req.owner == a.owner
        req.ended_by.add(a.outcome)
        if a.outcome is Out.CALL_FINISHED:
            assert self.exited is None
            assert not self.sent_of(a.owner), "ended for its call while the owner still has one"
        elif a.outcome is Out.CANCELLED:
            assert self.event == "child_cancelled"
        elif a.outcome is Out.CHILD_RESTARTED:
            assert self.exited is not None
        else:
            raise AssertionError(f"the core ended a request with {a.outcome}")
        self.owner_ends(req, a.outcome)

    def owner_ends(self, req: MRequest, outcome: Out, result: Raw | None = None,
                   error: jsonrpc.ErrorObject | None = None) -> None:
        """``ServerRequest.finish`` at the owner: exactly once, then reported to the core."""
        if not req.open_at_owner:
            return
        req.open_at_owner = False
        req.reported = True
        before = self.r.server_requests
        answers = self.to_child_answers[req.child_id]
        for m in req.paused:
            m.paused -= 1
            if m.paused == 0 and m.state == "sent" and m.gid not in self.expect_abandon:
                m.since = self.now
        self.run(self.r.server_request_done(req.child_id, outcome, self.now, result=result,
                                            error=error))
        assert self.r.server_requests == before - 1
        told = self.told.pop(req.child_id, None)
        if self.exited is not None or outcome in (Out.CANCELLED, Out.CALL_FINISHED,
                                                  Out.CHILD_RESTARTED):
            assert self.to_child_answers[req.child_id] == answers, "told of an end it ignores"
        else:
            assert self.to_child_answers[req.child_id] == answers + 1
            if outcome is Out.ANSWERED:
                assert told == {"jsonrpc": "2.0", "id": req.child_id,
                                "result": json.loads(bytes(result))}
            elif outcome is Out.ERROR:
                assert told["error"]["code"] == error.code
            elif req.method == "elicitation/create":  # the owner went away
                assert told["result"] == json.loads(bytes(CANCEL_ELICITATION))
            else:
                assert told["error"]["code"] == errors.UNROUTABLE
                assert told["error"]["data"] == {"reason": str(outcome)}
        # a second report of the same request is ignored
        assert self.r.server_request_done(req.child_id, outcome, self.now, result=result) == []

    def open_and_submit(self, owner: Any, method: str, timeout: float | None, hard: float,
                        progress: Any) -> None:
        if self.exited is not None:
            with pytest.raises(errors.NotDelivered):
                self.r.open_call(method, owner=owner, handle=None, now=self.now)
            return
        self.submit(self.open(owner, method, timeout, hard, progress))

    def open(self, owner: Any, method: str, timeout: float | None, hard: float,
             progress: Any) -> MCall:
        call = self.r.open_call(method, owner=owner, handle=object(), now=self.now, timeout=timeout,
                                hard_deadline=hard, progress=progress)
        t = TIMEOUT if timeout is None else timeout
        m = MCall(call.gid, owner, call, self.now, t, hard, client_token=progress, left=t,
                  since=self.now)
        assert call.gid not in self.calls
        self.calls[call.gid] = m
        if progress is not None:
            assert call.token is not None
            assert call.token not in {c.call.token for c in self.calls.values() if c is not m}
        return m

    def submit(self, m: MCall) -> None:
        call, owner = m.call, m.owner
        sent_now = owner is None or (self.busy() < MAX_INFLIGHT and not any(self.queues.values()))
        self.event_run("submit", self.r.submit(call, f"line-{call.gid}".encode()))
        if sent_now:
            assert m.state == "sent"
        else:
            assert m.state == "new"
            m.state = "queued"
            if owner not in self.queues:
                self.queues[owner] = []
                self.rr_marks[owner] = set()
            self.queues[owner].append(m.gid)
        with pytest.raises(RoutingError):
            self.r.submit(call, b"again")

    # ---- rules ------------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), method=st.sampled_from(METHODS),
          timeout=st.sampled_from([None, None, None, 4, 25]),
          hard=st.sampled_from([math.inf, math.inf, 6, 30]),
          progress=st.sampled_from([None, None, 7, "tok", ["x"]]),
          n=st.integers(1, 3))
    def client_call(self, name: str, method: str, timeout: float | None, hard: float, progress: Any,
                    n: int) -> None:
        owner = (name, self.gen[name])
        for _ in range(n):
            self.open_and_submit(owner, method, timeout, self.now + hard, progress)

    @rule(first=st.sampled_from(NAMES), second=st.sampled_from(NAMES), dt=st.integers(1, 5))
    def calls_submitted_out_of_order(self, first: str, second: str, dt: int) -> None:
        """The shell opened a call, time passed before it submitted it (its clock runs since it
        was opened), and a call opened later was submitted first."""
        if self.exited is not None:
            return
        early = self.open((first, self.gen[first]), "tools/call", None, math.inf, None)
        self.time_passes(dt, late=False)
        self.submit(self.open((second, self.gen[second]), "tools/call", None, math.inf, None))
        self.submit(early)

    @rule(timeout=st.sampled_from([None, 3]), progress=st.sampled_from([None, 5]))
    def internal_call(self, timeout: float | None, progress: Any) -> None:
        self.open_and_submit(None, "ping", timeout, math.inf, progress)

    @precondition(lambda self: any(m.state in ("sent", "abandoned") for m in self.calls.values()))
    @rule(data=st.data(), error=st.booleans())
    def child_replies(self, data: st.DataObject, error: bool) -> None:
        gids = sorted(g for g, m in self.calls.items() if m.state in ("sent", "abandoned"))
        m = self.calls[data.draw(st.sampled_from(gids))]
        if m.state == "sent" and not error:
            m.expect_result = Raw(json.dumps({"r": m.gid}).encode())
        if error:
            actions = self.r.reply(m.gid, None, jsonrpc.ErrorObject(-32000, "nope"))
            fin = [a for a in actions if isinstance(a, Finished)]
            assert all(isinstance(a.error, errors.RemoteError) for a in fin)
            assert all(a.error.code == -32000 for a in fin)
        else:
            actions = self.r.reply(m.gid, m.expect_result or Raw(b"{}"), None)
        was = m.state
        self.event_run("reply", actions)
        assert m.state == "done"
        assert (was == "abandoned") == (Settled() in actions)
        assert sum(isinstance(a, Finished) for a in actions) == (was == "sent")

    @rule(data=st.data())
    def child_replies_unknown(self, data: st.DataObject) -> None:
        """An id never sent, a queued call's, one already answered, or not an int at all."""
        known = [g for g, m in self.calls.items() if m.state in ("new", "queued", "done")]
        gid = data.draw(st.sampled_from([*known, 0, 999, "1", True, None]))
        with pytest.raises(UnknownReply):
            self.r.reply(gid, Raw(b"{}"), None)
        # (fail_reply takes the int the wire's reply_id_hint found, or None)
        assert self.r.fail_reply(gid if type(gid) is int else None, errors.InternalError("x")) == []

    @precondition(lambda self: any(m.state in ("sent", "abandoned") for m in self.calls.values()))
    @rule(data=st.data())
    def child_reply_undecodable(self, data: st.DataObject) -> None:
        gids = sorted(g for g, m in self.calls.items() if m.state in ("sent", "abandoned"))
        m = self.calls[data.draw(st.sampled_from(gids))]
        actions = self.r.fail_reply(m.gid, errors.BackendProtocolError("bad", backend="b"))
        fin = [a for a in actions if isinstance(a, Finished)]
        assert all(a.error.code == errors.BACKEND_PROTOCOL_ERROR for a in fin)
        self.event_run("reply", actions)

    @rule(data=st.data(), extra=st.sampled_from([None, "gw-999", 3, "gw-x"]))
    def child_progress(self, data: st.DataObject, extra: Any) -> None:
        tokens = sorted(m.call.token for m in self.calls.values() if m.call.token is not None)
        token = data.draw(st.sampled_from([*tokens, extra]))
        target = next((m for m in self.calls.values()
                       if token is not None and m.call.token == token), None)
        actions = self.r.progress(token, {"progress": Raw(b"1"), "message": Raw(b'"m"')})
        should = target is not None and target.state == "sent" and not target.internal
        assert len(actions) == int(should)
        self.event_run("progress", actions)
        if should:
            msg = json.loads(actions[0].data)
            assert msg["params"] == {"progress": 1, "message": "m",
                                     "progressToken": target.client_token}

    @precondition(lambda self: bool(self.calls))
    @rule(data=st.data(), with_error=st.booleans())
    def caller_cancels(self, data: st.DataObject, with_error: bool) -> None:
        """A client's notifications/cancelled (no answer), or a gateway cut-off with an error."""
        m = self.calls[data.draw(st.sampled_from(sorted(self.calls)))]
        if m.owner in self.closed:
            return  # a closed connection cancels nothing any more
        error = errors.Overloaded("cut off") if with_error or m.internal else None
        if m.running and error is None:
            m.caller_gave_up = True
        was = m.state
        actions = self.r.cancel(m.call, self.now, error)
        self.event_run("cancel", actions)
        if was not in ("queued", "sent"):
            assert actions == []
        else:
            fin = [a for a in actions if isinstance(a, Finished)]
            assert len(fin) == 1 and fin[0].error is error and fin[0].result is None
            assert m.state == ("abandoned" if was == "sent" else "done")

    @rule(dt=st.integers(1, 8), late=st.booleans())
    def time_passes(self, dt: int, late: bool) -> None:
        """The shell's timer fires at its time, or late (a busy event loop): timer_due then."""
        unsubmitted = [m for m in self.calls.values() if m.state == "new"]
        assert all(m.deadline() > self.now + dt for m in unsubmitted)  # (its clock runs already)
        target = self.now + dt
        while self.armed <= target:
            self.now = target if late else max(self.now, int(self.armed))
            self.event_run("timer_due", self.r.timer_due(self.now))
            assert self.armed > self.now, "timer_due left a deadline at or before now"
        self.now = target

    @rule()
    def timer_fires_early(self) -> None:
        """A spurious timer_due (the shell's timer may fire before its time): nothing is due."""
        actions = self.r.timer_due(self.now)
        assert not any(isinstance(a, Finished) for a in actions)
        self.event_run("timer_due", actions)

    @rule(method=st.sampled_from(SERVER_METHODS))
    def child_requests(self, method: str) -> None:
        """The child sends a server→client request: forwarded only to the one owner attributed."""
        owners = self.r.attribution()
        assert owners == self.model_attribution()
        cid = self.next_child_id
        self.next_child_id += 1
        if len(owners) != 1 or self.exited is not None:
            return  # the shell answers the child itself (ownership.decide); nothing is recorded
        (owner,) = owners
        self.next_handle += 1
        paused = self.sent_of(owner)
        req = MRequest(cid, owner, method, self.next_handle, paused)
        self.requests[cid] = req
        self.by_handle[req.handle] = req
        for m in paused:
            if m.paused == 0:
                m.left = m.since + m.left - self.now
                m.since = self.now
            m.paused += 1
        before = self.r.server_requests
        self.event_run("server_request",
                       self.r.server_request(cid, owner, method, req.handle, self.now))
        assert self.r.server_requests == before + 1
        with pytest.raises(RoutingError):  # the child reusing the id of an open request
            self.r.server_request(cid, owner, method, object(), self.now)
        if owner in self.closed:  # session.open_request on a closed session ends it at once
            self.event = "owner_gone"
            self.owner_ends(req, Out.OWNER_GONE)

    def open_requests(self) -> list[MRequest]:
        return [q for q in self.requests.values() if q.open_at_owner]

    @precondition(lambda self: any(q.open_at_owner for q in self.requests.values()))
    @rule(data=st.data(), error=st.booleans())
    def owner_answers(self, data: st.DataObject, error: bool) -> None:
        req = data.draw(st.sampled_from(self.open_requests()))
        self.event = "answer"
        if error:
            self.owner_ends(req, Out.ERROR, error=jsonrpc.ErrorObject(-1, "no"))
        else:
            self.owner_ends(req, Out.ANSWERED, result=Raw(b'{"ok":true}'))
        assert self.to_child_answers[req.child_id] == 1

    @precondition(lambda self: any(q.open_at_owner for q in self.requests.values()))
    @rule(data=st.data(), name=st.sampled_from(NAMES))
    def wrong_owner_answers(self, data: st.DataObject, name: str) -> None:
        """Another connection answers an id it was never sent: refused by its own session (the
        request is not in its table), so the core never hears of it."""
        req = data.draw(st.sampled_from(self.open_requests()))
        other = (name, self.gen[name])
        mine = {q.handle for q in self.open_requests() if q.owner == other}
        if other != req.owner:
            assert req.handle not in mine
            assert req.open_at_owner

    @rule(data=st.data())
    def child_cancels_request(self, data: st.DataObject) -> None:
        ids = sorted(self.requests)
        cid = data.draw(st.sampled_from([*ids, 5]))
        actions = self.r.child_cancelled(cid)
        req = self.requests.get(cid)
        if req is None or req.reported:
            assert actions == []
        self.event_run("child_cancelled", actions)
        if req is not None:
            assert not req.open_at_owner

    @rule(name=st.sampled_from(NAMES))
    def owner_closes(self, name: str) -> None:
        owner = (name, self.gen[name])
        self.gen[name] += 1
        self.closed.add(owner)
        # the connection ends its open requests first (connection.py: end_all_requests)
        self.event = "owner_gone"
        for req in [q for q in self.requests.values() if q.owner == owner and q.open_at_owner]:
            self.owner_ends(req, Out.OWNER_GONE)
            assert self.to_child_answers[req.child_id] == 1 or self.exited is not None
        for m in self.calls.values():
            if m.owner == owner and m.running:
                m.caller_gave_up = True
        self.event_run("owner_closed", self.r.owner_closed(owner, self.now))
        assert not any(m.owner == owner and m.running for m in self.calls.values())

    @rule(age=st.integers(0, 10), internal_only=st.booleans())
    def purge(self, age: int, internal_only: bool) -> None:
        before = self.now - age
        stale = {g for g, m in self.calls.items() if m.state == "abandoned"
                 and m.abandoned_at < before and (m.internal or not internal_only)}
        self.event_run("purge", self.r.purge_abandoned(before, internal_only=internal_only))
        assert all(self.calls[g].state == "done" for g in stale)

    @precondition(lambda self: any(m.state in ("sent", "abandoned") for m in self.calls.values()))
    @rule(data=st.data())
    def write_failed(self, data: st.DataObject) -> None:
        gids = sorted(g for g, m in self.calls.items() if m.state in ("sent", "abandoned"))
        chosen = data.draw(st.lists(st.sampled_from([*gids, 999]), max_size=3, unique=True))
        actions = self.r.undelivered(chosen, errors.BackendExited("write failed", backend="b"))
        for a in actions:
            if isinstance(a, Finished):
                assert isinstance(a.error, errors.NotDelivered) and a.error.data == {"backend": "b"}
        self.event_run("undelivered", actions)
        assert all(self.calls[g].state == "done" for g in chosen if g in self.calls)

    @rule(n=st.integers(0, 3))
    def child_exits(self, n: int) -> None:
        if n or len(self.calls) < 4:
            return  # (most runs keep their child for a while; teardown may end it)
        self.exit()

    def exit(self) -> None:
        error = errors.BackendExited("the backend exited", backend="b")
        first = self.exited is None
        running = {g: m.state for g, m in self.calls.items() if m.running}
        self.exited = error
        self.event = "child_exited"
        actions = self.r.child_exited(error)
        if not first:
            assert actions == []
        for a in actions:
            if isinstance(a, Finished):
                if running[a.call.gid] == "queued":
                    assert isinstance(a.error, errors.NotDelivered) and a.error.code == -32004
                else:
                    assert a.error is error
        self.event_run("child_exited", actions)
        assert not self.r.pending and self.r.queued == 0 and self.r.server_requests == 0

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def tables_match_the_model(self) -> None:
        r = self.r
        assert set(r.pending) == {g for g, m in self.calls.items() if m.at_child}
        assert r.queued == sum(len(q) for q in self.queues.values())
        assert {o: [c.gid for c in q] for o, q in r._queues.items()} == self.queues
        assert set(r._turns) == set(self.queues) and len(r._turns) == len(self.queues)
        assert r.attribution() == self.model_attribution()
        waiting = {m.owner for m in self.calls.values() if m.state == "sent"}
        assert r.cancelled_owners() == self.model_attribution() - waiting
        assert set(r._by_token) == {m.call.token for m in self.calls.values()
                                    if m.call.token is not None and m.running}
        assert all(c.state in (CallState.QUEUED, CallState.SENT) for c in r._timed.values())
        assert r.server_requests == sum(1 for q in self.requests.values() if not q.reported)
        for m in self.calls.values():
            assert m.finished == (0 if m.running else 1)
            assert m.call.state is CallState(m.state)

    @invariant()
    def fairness(self) -> None:
        busy = self.busy()
        assert busy <= MAX_INFLIGHT
        assert self.r._busy == busy
        if any(self.queues.values()):
            assert busy == MAX_INFLIGHT, "a slot is idle while calls wait"

    @invariant()
    def no_call_forgotten_by_the_timer(self) -> None:
        nd = self.r.next_deadline
        assert self.armed <= nd
        for m in self.calls.values():
            if m.running:
                assert m.call.deadline == m.deadline(), (m, m.call.deadline, m.deadline())
                assert nd <= m.deadline()
                assert m.deadline() > self.now, f"call {m.gid} is past its deadline and still runs"

    def teardown(self) -> None:
        """Every owner closes; the child exits (before or after) or answers everything: nothing
        is left anywhere."""
        if self.drain == "exit first":
            self.exit()
        for name in NAMES:
            self.owner_closes(name)
        if self.drain == "close, answer" and self.exited is None:
            while self.r.pending:
                self.event_run("reply", self.r.reply(next(iter(self.r.pending)), Raw(b"{}"), None))
            assert self.r.server_requests == 0
        else:
            self.exit()
        r = self.r
        assert not r.pending and r.queued == 0 and r.server_requests == 0
        assert not r._by_token and not r._timed and not r._queues and not r._turns
        assert r.next_deadline == math.inf and not r._heap
        assert r.attribution() == set() and r.load == 0 and r.calls_in_flight() == 0
        assert r.oldest_abandoned() is None
        for m in self.calls.values():
            assert m.finished == 1, f"call {m.gid} never finished"
        for req in self.requests.values():
            assert req.reported and not req.open_at_owner
            assert self.to_child_answers[req.child_id] <= 1


RouterMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_router_state_machine = RouterMachine.TestCase


# ---- examples ----------------------------------------------------------------------------------


def _open(r: ChildRouter, owner: Any, now: float = 0, **kw: Any) -> tuple[Any, list]:
    call = r.open_call("tools/call", owner=owner, handle=None, now=now, **kw)
    return call, r.submit(call, f"line-{call.gid}".encode())


def _sent(actions: list) -> list[int]:
    return [a.gid for a in actions if isinstance(a, ToChild) and a.gid is not None]


def test_round_robin_a_flooding_owner_does_not_starve_a_light_one() -> None:
    r = ChildRouter("b", timeout=TIMEOUT, max_inflight=1)
    flood = [_open(r, "flood") for _ in range(5)]
    light = [_open(r, "light") for _ in range(2)]
    assert _sent(flood[0][1]) == [flood[0][0].gid]  # the first goes at once; the rest wait
    assert r.queued == 6
    order = []
    while r.pending:
        (gid,) = r.pending
        actions = r.reply(gid, Raw(b"{}"), None)
        assert [a.call.gid for a in actions if isinstance(a, Finished)] == [gid]
        order += [(c.owner, c.gid) for c in (r.pending[g] for g in _sent(actions))]
    f, li = [c.gid for c, _ in flood], [c.gid for c, _ in light]
    # the freed slot alternates between the owners with calls waiting
    assert order == [("flood", f[1]), ("light", li[0]), ("flood", f[2]), ("light", li[1]),
                     ("flood", f[3]), ("flood", f[4])]


def test_progress_reaches_the_caller_under_its_own_token() -> None:
    r = ChildRouter("b", timeout=TIMEOUT)
    mine, _ = _open(r, "alice", progress={"client": 1})
    other, _ = _open(r, "bob", progress="p")
    assert mine.token != other.token  # the gateway's tokens, unique on this child
    (out,) = r.progress(mine.token, {"progress": Raw(b"3"), "total": Raw(b"10")})
    assert out.owner == "alice" and out.call is mine
    msg = json.loads(out.data)
    assert msg == {"jsonrpc": "2.0", "method": "notifications/progress",
                   "params": {"progress": 3, "total": 10, "progressToken": {"client": 1}}}
    assert r.progress("gw-999", {"progress": Raw(b"1")}) == []  # unknown token: dropped
    r.reply(mine.gid, Raw(b"{}"), None)
    assert r.progress(mine.token, {"progress": Raw(b"4")}) == []  # finished call: dropped
    r.cancel(other, 1)
    assert r.progress(other.token, {"progress": Raw(b"4")}) == []  # abandoned call: dropped


def test_a_late_reply_to_a_cancelled_call_is_dropped_and_settles_it() -> None:
    r = ChildRouter("b", timeout=TIMEOUT, max_inflight=1)
    call, _ = _open(r, "alice")
    waiting, _ = _open(r, "bob")
    actions = r.cancel(call, now=2)  # the client's notifications/cancelled: no answer
    assert actions[0] == Finished(call, None, None)
    assert json.loads(actions[1].data)["params"]["requestId"] == call.gid  # the child is told
    # its slot goes to the queued call (a server stops work on a cancelled request), but it
    # stays in the attribution set: the child may still ask something on its behalf
    assert actions[2:] == [ToChild(b"line-%d" % waiting.gid, waiting.gid)]
    assert call.state is CallState.ABANDONED and r.attribution() == {"alice", "bob"}
    assert r.oldest_abandoned() == 2 and r.queued == 0
    actions = r.reply(call.gid, Raw(b'{"late":true}'), None)
    assert actions == [Settled()]  # no Finished
    assert r.attribution() == {"bob"}
    with pytest.raises(UnknownReply):  # a second reply to it is unknown
        r.reply(call.gid, Raw(b"{}"), None)


def test_a_server_request_pauses_its_owners_timeouts_until_it_ends() -> None:
    r = ChildRouter("b", timeout=10)
    call, actions = _open(r, "alice", now=0)
    assert actions[0] == ArmTimer(10)
    r.server_request(7, "alice", "elicitation/create", "h", now=4)  # 6 s were left
    assert r.next_deadline == math.inf  # no hard deadline: nothing runs
    assert [a for a in r.timer_due(10) if isinstance(a, Finished)] == []  # the owner is thinking
    actions = r.server_request_done(7, Out.ANSWERED, now=20, result=Raw(b'{"action":"accept"}'))
    assert actions == [ArmTimer(26),
                       ToChild(b'{"jsonrpc":"2.0","id":7,"result":{"action":"accept"}}')]
    assert [a for a in r.timer_due(25) if isinstance(a, Finished)] == []
    (fin,) = [a for a in r.timer_due(26) if isinstance(a, Finished)]
    assert fin.call is call and fin.error.code == errors.TIMEOUT == -32003


def test_a_paused_call_still_ends_at_its_hard_deadline() -> None:
    r = ChildRouter("b", timeout=10)
    call, _ = _open(r, "alice", now=0, hard_deadline=30)
    r.server_request(7, "alice", "sampling/createMessage", "h", now=1)
    assert r.next_deadline == 30
    assert r.timer_due(29) == [ArmTimer(30)]
    actions = r.timer_due(30)
    fin, end, note, arm = actions
    assert fin.call is call and isinstance(fin.error, errors.CallTimeout)
    # its call is over: the request ends too (the child expects nothing for it)
    assert end == EndServerRequest("alice", "h", Out.CALL_FINISHED)
    assert json.loads(note.data)["method"] == "notifications/cancelled"
    assert arm == ArmTimer(math.inf)
    assert r.server_request_done(7, Out.CALL_FINISHED, now=30) == []
    assert r.server_requests == 0
    # resumed, it gets what was left of its timeout, but never past its hard deadline
    call, _ = _open(r, "alice", now=30, hard_deadline=45)
    r.server_request(8, "alice", "sampling/createMessage", "h", now=31)  # 9 s were left
    r.server_request_done(8, Out.ANSWERED, now=33, result=Raw(b"{}"))
    assert call.deadline == 42
    call, _ = _open(r, "bob", now=33, hard_deadline=45)
    r.server_request(9, "bob", "sampling/createMessage", "h", now=34)  # 9 s were left
    r.server_request_done(9, Out.ANSWERED, now=40, result=Raw(b"{}"))
    assert call.deadline == 45


def test_when_the_owner_goes_away_the_child_is_told() -> None:
    r = ChildRouter("b", timeout=10)
    _open(r, "alice")
    r.server_request(7, "alice", "elicitation/create", "h1", now=0)
    r.server_request(8, "alice", "roots/list", "h2", now=0)
    # the connection ends its requests first (session.end_all_requests), then its calls
    (cancel,) = r.server_request_done(7, Out.OWNER_GONE, now=1)
    assert json.loads(cancel.data) == {"jsonrpc": "2.0", "id": 7, "result": {"action": "cancel"}}
    (refusal,) = r.server_request_done(8, Out.OWNER_GONE, now=1)
    assert json.loads(refusal.data)["error"]["code"] == errors.UNROUTABLE == -32007
    assert [type(a) for a in r.owner_closed("alice", now=1)] == [Finished, ToChild]


def test_a_call_submitted_after_a_later_one_still_times_out_on_time() -> None:
    """The shell may submit a call some time after it opened it (its clock runs from the
    opening), so after a call opened later: its deadline is still the one the timer keeps."""
    r = ChildRouter("b", timeout=10)
    early = r.open_call("tools/call", owner="alice", handle=None, now=0)
    late, _ = _open(r, "bob", now=5)
    assert r.submit(early, b"early")[0] == ArmTimer(10)
    assert r.next_deadline == 10
    (fin,) = [a for a in r.timer_due(10) if isinstance(a, Finished)]
    assert fin.call is early and fin.error.code == errors.TIMEOUT
    assert r.next_deadline == 15 and late.state is CallState.SENT


def test_child_exit_fails_queued_calls_as_not_delivered_and_sent_ones_with_the_error() -> None:
    r = ChildRouter("b", timeout=10, max_inflight=1)
    sent, _ = _open(r, "alice")
    queued, _ = _open(r, "bob")
    gone, _ = _open(r, "carol")
    r.cancel(gone, now=0)  # (queued: it just ends)
    abandoned = r.open_call("ping", owner=None, handle=None, now=0)
    r.submit(abandoned, b"ping")
    r.cancel(abandoned, now=0, error=errors.CallTimeout("t"))
    r.server_request(7, "alice", "roots/list", "h", now=0)
    exit_error = errors.BackendExited("the backend exited", backend="b")
    actions = r.child_exited(exit_error)
    fins = {a.call.gid: a.error for a in actions if isinstance(a, Finished)}
    assert fins[sent.gid] is exit_error
    # the queued call never reached the child: -32004 as NotDelivered, safe to retry elsewhere
    assert isinstance(fins[queued.gid], errors.NotDelivered)
    assert fins[queued.gid].code == -32004 and fins[queued.gid].data == {"backend": "b"}
    assert Settled() in actions  # the abandoned call left the attribution set
    assert EndServerRequest("alice", "h", Out.CHILD_RESTARTED) in actions
    assert r.server_request_done(7, Out.CHILD_RESTARTED, now=1) == []  # a dead child: nothing
    assert not r.pending and r.queued == 0 and r.server_requests == 0 and r.attribution() == set()
    with pytest.raises(errors.NotDelivered):
        r.open_call("tools/call", owner="alice", handle=None, now=1)
    assert r.child_exited(exit_error) == []
