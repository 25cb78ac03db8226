"""The routing core of one child: every call and server→client request it carries, as data.

One :class:`ChildRouter` per child process generation, sans-IO like h11: each event is a method
that takes the time and returns the actions the shell performs, in order; owners are hashable
keys.  A call goes ``QUEUED`` → ``SENT`` → over, or ``SENT`` → ``ABANDONED`` → over; its caller
learns the end exactly once, from a :class:`Finished` action.  An abandoned call (its caller gave
up, the child may still work on it) stays in the attribution set until the child answers or the
shell purges it, and frees its slot.  At most ``max_inflight`` client calls whose callers wait
are at the child; the rest queue per owner and freed slots go round-robin, so one flooding
client cannot starve the others.  Internal calls (handshake, list refresh, ping) never wait.
Deadlines are announced by :class:`ArmTimer` and enforced by :meth:`ChildRouter.timer_due`; a
call's clock pauses while a server→client request of its owner from this child is open.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Hashable
from typing import Any, NamedTuple

import msgspec
from msgspec import UNSET, Raw

from gateway import errors
from gateway.events import ServerRequestOutcome
from gateway.protocol import jsonrpc

#: What an elicitation is answered with when its owner went away (others get -32007).
CANCEL_ELICITATION = Raw(b'{"action":"cancel"}')
#: Outcomes after which nobody will answer the child's request: it is told so.
_CLIENT_WENT_AWAY = frozenset({ServerRequestOutcome.OWNER_GONE, ServerRequestOutcome.SHUTDOWN,
                               ServerRequestOutcome.TIMEOUT})


class RoutingError(Exception):
    """An event that is illegal in the router's current state (a bug in the shell or a
    misbehaving child); the state is left unchanged."""


class UnknownReply(RoutingError):
    """The child answered an id the gateway never sent it, or already had the answer to."""


class CallState(enum.Enum):
    QUEUED = "queued"  # waiting for a slot (fairness)
    SENT = "sent"  # at the child, its caller waits
    ABANDONED = "abandoned"  # at the child, its caller gave up
    DONE = "done"  # over: answered, failed, or an abandoned call the child settled


# The states as module names: on CPython 3.11 a member looked up on its enum class is a
# descriptor call, several times dearer than a global, and a call's path reads them often.
_QUEUED, _SENT, _ABANDONED, _DONE = (CallState.QUEUED, CallState.SENT, CallState.ABANDONED,
                                     CallState.DONE)


def request_fields(params: dict[str, Raw], meta: dict[str, Raw] | None,
                   token: str | None) -> dict[str, Raw]:
    """A forwarded request's params for the child (decoded one level), as the core decided them
    (its era's shape), with the gateway's progress ``token`` in ``_meta.progressToken`` when the
    caller asked for progress (``meta``: the ``_meta`` it goes into)."""
    if meta is not None and token is not None:
        token_raw = Raw(msgspec.json.encode(token))
        return {**params, "_meta": jsonrpc.encode_dict({**meta, "progressToken": token_raw})}
    return params


def request_params(params: dict[str, Raw], meta: dict[str, Raw] | None, token: str | None) -> Raw:
    """:func:`request_fields`, encoded."""
    return jsonrpc.encode_dict(request_fields(params, meta, token))


class Call:
    """One request to the child.  ``handle`` is the shell's, opaque here."""

    __slots__ = (
        "abandoned_at", "client_token", "deadline", "gid", "handle", "hard_deadline", "internal",
        "line", "method", "owner", "paused", "remaining", "started", "state", "timeout", "token",
    )  # fmt: skip

    def __init__(self, gid: int, method: str, owner: Hashable | None, handle: Any, now: float,
                 timeout: float, hard_deadline: float, internal: bool) -> None:
        self.gid = gid
        self.method = method
        self.owner = owner
        self.handle = handle
        self.internal = internal
        self.state = _QUEUED
        self.line: bytes | None = None  # the request, while it waits in a queue
        # the gateway's progress token, if the caller asked for progress
        self.token: str | None = None
        self.client_token: Any = None
        self.started = now
        self.timeout = timeout
        self.hard_deadline = hard_deadline
        deadline = now + timeout
        self.deadline = deadline if deadline < hard_deadline else hard_deadline
        self.paused = 0  # open server→client requests of its owner: the clock is stopped
        self.remaining = 0.0  # while paused: what was left of the timeout
        self.abandoned_at: float | None = None

    def __repr__(self) -> str:
        return f"<Call {self.gid} {self.method} {self.state.value}>"


class ToChild(NamedTuple):
    """Write ``data`` (one message, no newline) to the child; ``gid``: the call it carries."""

    data: bytes
    gid: int | None = None


class ToOwner(NamedTuple):
    """Send ``data`` (one message) to ``owner``; ``call``: the owner's call it belongs to."""

    owner: Hashable
    data: bytes
    call: Call


class Finished(NamedTuple):
    """``call`` is over for its caller (exactly once): answer with ``result`` or ``error``, or
    not at all when both are None (the caller cancelled it)."""

    call: Call
    result: Raw | None
    error: errors.GatewayError | None


class EndServerRequest(NamedTuple):
    """End the server→client request ``handle`` at ``owner`` (it tells the owner), for ``outcome``;
    the shell then reports it back with :meth:`ChildRouter.server_request_done`."""

    owner: Hashable
    handle: Any
    outcome: ServerRequestOutcome


class Settled(NamedTuple):
    """Abandoned calls left the attribution set (answered late, purged, or the child exited)."""


class ArmTimer(NamedTuple):
    """The earliest deadline is now ``at``: call :meth:`ChildRouter.timer_due` then."""

    at: float


Action = ToChild | ToOwner | Finished | EndServerRequest | Settled | ArmTimer

_SETTLED = Settled()
_TIMED_STATES = (_QUEUED, _SENT)


class _ServerRequest:
    __slots__ = ("handle", "method", "owner", "paused")

    def __init__(self, owner: Hashable, method: str, handle: Any, paused: list[Call]) -> None:
        self.owner = owner
        self.method = method
        self.handle = handle
        self.paused = paused


class ChildRouter:
    def __init__(self, backend: str, *, timeout: float, max_inflight: int = 32) -> None:
        self.backend = backend
        self.timeout = timeout  # the usual timeout: such calls are timed in ``_timed``
        self.max_inflight = max_inflight
        self.pending: dict[int, Call] = {}  # SENT and ABANDONED: the attribution set (+ internal)
        self.exited: errors.GatewayError | None = None
        self._gid = 0
        self._busy = 0  # clients' calls at the child whose callers wait (SENT)
        self._queues: dict[Hashable, deque[Call]] = {}
        self._turns: deque[Hashable] = deque()  # owners with queued calls, next first
        self._queued = 0
        self._by_token: dict[str, Call] = {}
        # default-timeout calls running their clock: deadline order
        self._timed: dict[int, Call] = {}
        self._timed_until = -math.inf  # no deadline in ``_timed`` is later (while it is not empty)
        # (deadline, gid, call) for the others; an entry whose call ended or moved is stale, skipped
        self._heap: list[tuple[float, int, Call]] = []
        self._announced = math.inf  # the deadline last given out with ArmTimer
        self._server_requests: dict[int | str, _ServerRequest] = {}

    def __repr__(self) -> str:
        return (f"<ChildRouter {self.backend} pending={len(self.pending)} queued={self._queued} "
                f"server_requests={len(self._server_requests)}>")

    # ---- reading the state --------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def load(self) -> int:
        """Calls at the child or waiting for it (what picking the least-loaded instance weighs)."""
        return len(self.pending) + self._queued

    @property
    def server_requests(self) -> int:
        return len(self._server_requests)

    def attribution(self) -> set[Hashable]:
        """The owners with calls at the child (abandoned ones included, internal ones never)."""
        return {c.owner for c in self.pending.values() if not c.internal}

    def cancelled_owners(self) -> set[Hashable]:
        """The owners in :meth:`attribution` only for calls they gave up on (abandoned, not
        answered by the child yet), none they still wait for."""
        waiting = {c.owner for c in self.pending.values() if c.state is _SENT}
        return self.attribution() - waiting

    def calls_of(self, owner: Hashable) -> list[Call]:
        """``owner``'s calls at the child that it still waits for, oldest first."""
        return [c for c in self.pending.values() if c.owner == owner and c.state is _SENT]

    def calls_in_flight(self) -> int:
        """Clients' calls whose callers still wait for them (queued ones included)."""
        return self._queued + sum(1 for c in self.pending.values()
                                  if not c.internal and c.state is _SENT)

    def oldest_abandoned(self, *, clients_only: bool = False) -> float | None:
        """When the oldest abandoned call still at the child was given up (None: there is none)."""
        times = [c.abandoned_at for c in self.pending.values()
                 if c.abandoned_at is not None and not (clients_only and c.internal)]
        return min(times) if times else None

    @property
    def next_deadline(self) -> float:
        """The earliest deadline of a call whose clock runs (``inf``: none)."""
        best = math.inf
        for call in self._timed.values():
            best = call.deadline
            break
        heap = self._heap
        while heap:
            at, _gid, call = heap[0]
            if call.deadline == at and call.state in _TIMED_STATES:
                return min(best, at)
            heapq.heappop(heap)  # stale: the call ended, or its deadline moved
        return best

    # ---- calls ------------------------------------------------------------------------------

    def open_call(self, method: str, *, owner: Hashable | None, handle: Any, now: float,
                  timeout: float | None = None, hard_deadline: float = math.inf,
                  progress: Any = None, internal: bool = False) -> Call:
        """A new call: its gateway id (and progress token, when ``progress`` is the caller's
        token) are minted; the shell builds its line and hands it to :meth:`submit`.  Nothing
        is recorded before that: a call that is never submitted leaves no trace.

        Raises:
            NotDelivered: the child has exited (the call never reached it: safe to retry).
        """
        if self.exited is not None:
            raise errors.NotDelivered(self.exited.message, **self.exited.data)
        self._gid += 1
        call = Call(self._gid, method, owner, handle, now,
                    self.timeout if timeout is None else timeout,
                    hard_deadline, internal or owner is None)
        if progress is not None:
            call.token = f"gw-{call.gid}"
            call.client_token = progress
        return call

    def submit(self, call: Call, line: bytes) -> list[Action]:
        """Send ``call`` (its request ``line``), or queue it while ``max_inflight`` are at the
        child."""
        if call.state is not _QUEUED or call.line is not None or call.gid in self.pending:
            raise RoutingError(f"{call!r} was submitted already")
        if self.exited is not None:
            raise errors.NotDelivered(self.exited.message, **self.exited.data)
        actions: list[Action] = []
        self._arm(call, actions)
        if call.token is not None:
            self._by_token[call.token] = call
        if call.internal or (self._busy < self.max_inflight and not self._queued):
            self._send(call, line, actions)
            return actions
        call.line = line
        queue = self._queues.get(call.owner)
        if queue is None:
            queue = self._queues[call.owner] = deque()
            self._turns.append(call.owner)
        queue.append(call)
        self._queued += 1
        return actions

    def _send(self, call: Call, line: bytes, actions: list[Action]) -> None:
        call.state = _SENT
        call.line = None
        self.pending[call.gid] = call
        if not call.internal:
            self._busy += 1
        actions.append(ToChild(line, call.gid))

    def _dispatch(self, actions: list[Action]) -> None:
        """Give free slots to queued calls, one owner after the other."""
        while self._queued and self._busy < self.max_inflight:
            owner = self._turns.popleft()
            queue = self._queues[owner]
            call = queue.popleft()
            self._queued -= 1
            if queue:
                self._turns.append(owner)
            else:
                del self._queues[owner]
            line = call.line
            assert line is not None
            self._send(call, line, actions)

    def _unqueue(self, call: Call) -> None:
        queue = self._queues[call.owner]
        queue.remove(call)
        self._queued -= 1
        if not queue:
            del self._queues[call.owner]
            self._turns.remove(call.owner)
        call.line = None

    def reply(self, gid: Any, result: Raw | None,
              error: jsonrpc.ErrorObject | None) -> list[Action]:
        """The child answered request ``gid`` with ``result`` or ``error``.

        Raises:
            UnknownReply: no such request is at the child (the shell logs and counts it).
        """
        call = self.pending.get(gid) if type(gid) is int else None
        if call is None:
            raise UnknownReply(f"backend {self.backend!r} answered unknown request id {gid!r}")
        if error is not None:
            data = None if error.data is UNSET else error.data
            return self._reply(call, None, errors.RemoteError(error.code, error.message, data))
        return self._reply(call, result, None)

    def fail_reply(self, gid: int | None, error: errors.GatewayError) -> list[Action]:
        """A reply the gateway cannot pass on (undecodable, oversize): its call, if it is one that
        waits, fails with ``error`` now; an unknown or None ``gid`` is ignored."""
        call = self.pending.get(gid) if gid is not None else None
        if call is None:
            return []
        return self._reply(call, None, error)

    def _reply(self, call: Call, result: Raw | None,
               error: errors.GatewayError | None) -> list[Action]:
        actions: list[Action] = []
        del self.pending[call.gid]
        if call.state is _SENT and not call.internal:
            self._busy -= 1
        if call.state is _ABANDONED:
            call.state = _DONE
            actions.append(_SETTLED)
        else:
            self._finish(call, result, error, actions)
        if self._queued:
            self._dispatch(actions)
        return actions

    def _finish(self, call: Call, result: Raw | None, error: errors.GatewayError | None,
                actions: list[Action]) -> None:
        """``call`` is over for its caller (``pending``/queue bookkeeping is the caller's)."""
        was_sent = call.state is _SENT
        call.state = _DONE
        self._timed.pop(call.gid, None)  # unarmed (heap entries go stale and are skipped)
        if call.token is not None:
            self._by_token.pop(call.token, None)
        actions.append(Finished(call, result, error))
        if was_sent and self._server_requests and not call.internal and self.exited is None:
            self._owner_call_ended(call.owner, actions)

    def cancel(self, call: Call, now: float, error: errors.GatewayError | None = None, *,
               notify: bool = True) -> list[Action]:
        """The caller gave up on ``call``: it is answered ``error`` (None: not at all) now; a call
        at the child is abandoned and the child told ``notifications/cancelled`` (unless not
        ``notify``: the child was told otherwise to stop, and its reply is what takes the call
        out of the attribution set).  A call that is already over is left alone (no action)."""
        actions: list[Action] = []
        if call.state is _QUEUED:
            if call.line is None:  # opened but never submitted
                call.state = _DONE
                actions.append(Finished(call, None, error))
                return actions
            self._unqueue(call)
            self._finish(call, None, error, actions)
        elif call.state is _SENT:
            self._abandon(call, now, error, actions, notify)
        return actions

    def _abandon(self, call: Call, now: float, error: errors.GatewayError | None,
                 actions: list[Action], notify: bool = True) -> None:
        self._finish(call, None, error, actions)
        call.state = _ABANDONED
        call.abandoned_at = now
        if notify:
            actions.append(ToChild(jsonrpc.encode_notification("notifications/cancelled",
                                                               jsonrpc.encode_dict({
                "requestId": call.gid, "reason": "cancelled by the gateway"}))))
        if not call.internal:
            self._busy -= 1
            if self._queued:
                self._dispatch(actions)

    def progress(self, token: Any, fields: dict[str, Raw]) -> list[Action]:
        """The child reported progress for ``token`` (its params, decoded one level): passed to
        the caller under the caller's own token; for an unknown or finished call, dropped."""
        call = self._by_token.get(token) if type(token) is str else None
        if call is None or call.state is not _SENT or call.owner is None:
            return []
        fields["progressToken"] = Raw(msgspec.json.encode(call.client_token))
        data = jsonrpc.encode_notification("notifications/progress", jsonrpc.encode_dict(fields))
        return [ToOwner(call.owner, data, call)]

    def owner_closed(self, owner: Hashable, now: float) -> list[Action]:
        """``owner`` is gone: its calls end without an answer (those at the child are abandoned)."""
        actions: list[Action] = []
        queue = self._queues.get(owner)
        while queue:
            call = queue[0]
            self._unqueue(call)
            self._finish(call, None, None, actions)
            queue = self._queues.get(owner)
        for call in [c for c in self.pending.values() if c.owner == owner
                     and c.state is _SENT]:
            self._abandon(call, now, None, actions)
        return actions

    def purge_abandoned(self, before: float, *, internal_only: bool = False) -> list[Action]:
        """Forget abandoned calls given up before ``before`` (only internal ones if asked): the
        child is taken to be done with them."""
        stale = [c for c in self.pending.values() if c.abandoned_at is not None
                 and c.abandoned_at < before and (c.internal or not internal_only)]
        actions: list[Action] = []
        for call in stale:
            del self.pending[call.gid]
            call.state = _DONE
        if stale:
            actions.append(_SETTLED)
        return actions

    def undelivered(self, gids: list[int], error: errors.GatewayError) -> list[Action]:
        """The write that carried these calls' lines failed: the child never read them."""
        actions: list[Action] = []
        for gid in gids:
            call = self.pending.get(gid)
            if call is not None:
                actions.extend(self._reply(call, None,
                                           errors.NotDelivered(error.message, **error.data)))
        return actions

    def withdraw_queued(self, error: errors.GatewayError) -> list[Action]:
        """The child takes no more calls (drained for a recycle): every queued call ends with
        NotDelivered ``error`` now (it never reached the child: safe to send to the next one)."""
        actions: list[Action] = []
        while self._turns:
            call = self._queues[self._turns[0]][0]
            self._unqueue(call)
            self._finish(call, None, errors.NotDelivered(error.message, **error.data), actions)
        return actions

    def child_exited(self, error: errors.GatewayError) -> list[Action]:
        """The child is gone: every call fails with ``error`` (a queued one with NotDelivered: it
        never reached the child), its server→client requests end; nothing is taken any more."""
        if self.exited is not None:
            return []
        self.exited = error
        actions = self.withdraw_queued(error)
        settled = False
        for call in list(self.pending.values()):
            del self.pending[call.gid]
            if call.state is _ABANDONED:
                call.state = _DONE
                settled = True
            else:
                self._finish(call, None, error, actions)
        self._busy = 0
        if settled:
            actions.append(_SETTLED)
        for sreq in self._server_requests.values():
            actions.append(EndServerRequest(sreq.owner, sreq.handle,
                                            ServerRequestOutcome.CHILD_RESTARTED))
        self._by_token.clear()
        self._timed.clear()
        self._heap.clear()
        return actions

    # ---- timers -----------------------------------------------------------------------------

    def _arm(self, call: Call, actions: list[Action]) -> None:
        deadline = call.deadline
        if (call.timeout == self.timeout and deadline == call.started + call.timeout
                and (self._timed_until <= deadline or not self._timed)):  # (submitted in order)
            self._timed[call.gid] = call
            self._timed_until = deadline
        elif call.deadline < math.inf:
            heapq.heappush(self._heap, (call.deadline, call.gid, call))
        else:
            return
        if call.deadline < self._announced:
            self._announced = call.deadline
            actions.append(ArmTimer(call.deadline))

    def _unarm(self, call: Call) -> None:
        self._timed.pop(call.gid, None)  # heap entries go stale and are skipped

    def timer_due(self, now: float) -> list[Action]:
        """The time is ``now``: every call whose deadline passed times out (abandoned at the
        child, answered -32003).  Ends with an :class:`ArmTimer` for the next deadline."""
        actions: list[Action] = []
        expired: list[Call] = []
        for call in self._timed.values():
            if call.deadline > now:
                break
            expired.append(call)
        for call in expired:
            del self._timed[call.gid]
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _gid, call = heapq.heappop(heap)
            if call.deadline == at:
                expired.append(call)
        for call in expired:
            if call.state in _TIMED_STATES:
                waited = now - call.started
                actions.extend(self.cancel(call, now, errors.CallTimeout(
                    f"backend {self.backend!r} did not answer {call.method} within "
                    f"{min(call.timeout, waited):g}s", backend=self.backend)))
        self._announced = self.next_deadline
        actions.append(ArmTimer(self._announced))
        return actions

    # ---- server→client requests ---------------------------------------------------------------

    def origin(self, owner: Hashable) -> Call | None:
        """The call of ``owner`` a server→client request from this child is taken to belong to
        (its oldest call at the child; the HTTP transport carries the request on its stream)."""
        for call in self.pending.values():
            if call.owner == owner and call.state is _SENT:
                return call
        return None

    def has_server_request(self, child_id: int | str) -> bool:
        return child_id in self._server_requests

    def server_request(self, child_id: int | str, owner: Hashable, method: str, handle: Any,
                       now: float) -> list[Action]:
        """The shell forwarded the child's request ``child_id`` to ``owner`` (as ``handle``):
        the owner's calls at the child pause their timeouts until it ends.

        Raises:
            RoutingError: a request of the child with that id is already open.
        """
        if child_id in self._server_requests:
            raise RoutingError(f"backend {self.backend!r} reused the id {child_id!r} of an open "
                               "request")
        paused = self.calls_of(owner)
        for call in paused:
            call.paused += 1
            if call.paused == 1:
                call.remaining = max(0.0, call.deadline - now)
                self._unarm(call)
                call.deadline = call.hard_deadline
                if call.deadline < math.inf:
                    heapq.heappush(self._heap, (call.deadline, call.gid, call))
        self._server_requests[child_id] = _ServerRequest(owner, method, handle, paused)
        if self.exited is not None:
            return [EndServerRequest(owner, handle, ServerRequestOutcome.CHILD_RESTARTED)]
        return []

    def server_request_done(self, child_id: int | str, outcome: ServerRequestOutcome, now: float,
                            result: Raw | None = None,
                            error: jsonrpc.ErrorObject | None = None) -> list[Action]:
        """The request ``child_id`` ended with ``outcome``: the paused calls resume, and the
        child gets the owner's answer, a refusal (the owner went away), or nothing (it cancelled
        the request itself, the call it came with ended, or it exited).  A second report of the
        same request is ignored."""
        sreq = self._server_requests.pop(child_id, None)
        if sreq is None:
            return []
        actions: list[Action] = []
        for call in sreq.paused:
            call.paused -= 1
            if call.paused == 0 and call.state is _SENT:
                call.deadline = min(now + call.remaining, call.hard_deadline)
                heapq.heappush(self._heap, (call.deadline, call.gid, call))
                if call.deadline < self._announced:
                    self._announced = call.deadline
                    actions.append(ArmTimer(call.deadline))
        if self.exited is not None:
            return actions
        if outcome is ServerRequestOutcome.ANSWERED and result is not None:
            actions.append(ToChild(jsonrpc.encode_result(child_id, result)))
        elif outcome is ServerRequestOutcome.ERROR and error is not None:
            actions.append(ToChild(jsonrpc.encode_error(child_id, error.code, error.message,
                                                        None if error.data is UNSET
                                                        else error.data)))
        elif outcome in _CLIENT_WENT_AWAY:
            if sreq.method == "elicitation/create":
                actions.append(ToChild(jsonrpc.encode_result(child_id, CANCEL_ELICITATION)))
            else:
                actions.append(ToChild(jsonrpc.encode_error(child_id, errors.UNROUTABLE,
                                                            f"{sreq.method}: the client went away",
                                                            {"reason": str(outcome)})))
        return actions

    def child_cancelled(self, child_id: int | str) -> list[Action]:
        """The child cancelled its request ``child_id``: the owner is told (unknown ids:
        nothing)."""
        sreq = self._server_requests.get(child_id)
        if sreq is None:
            return []
        return [EndServerRequest(sreq.owner, sreq.handle, ServerRequestOutcome.CANCELLED)]

    def _owner_call_ended(self, owner: Hashable, actions: list[Action]) -> None:
        """A call of ``owner`` ended: with none left at the child, its requests end too."""
        if any(c.owner == owner and c.state is _SENT for c in self.pending.values()):
            return
        for sreq in self._server_requests.values():
            if sreq.owner == owner:
                actions.append(EndServerRequest(owner, sreq.handle,
                                                ServerRequestOutcome.CALL_FINISHED))
