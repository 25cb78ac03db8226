"""The gateway's MCP client session with one upstream generation, over a
:class:`~gateway.backend.connector.Link`: the shell around its
:class:`~gateway.protocol.routing.ChildRouter`.

The router holds every call and server→client request of this child as data and returns what to
do; :meth:`ChildConnection.perform` does it: requests go to the link (written at once or
queued), messages to a client's outbound queue, a finished call to its caller's handle.  No task
per call: the link hands each incoming message to the session (it is the link's
:class:`~gateway.backend.connector.Receiver`), and one timer task (:meth:`timer_loop`) wakes at
the earliest deadline.  A client's request id never reaches a child: the router mints ids,
progress tokens are mapped back.  A call stays in the attribution set until the child answers
it, also once abandoned; the instance recycles a child that leaves one unanswered past
``cancel_grace``, or purges them where attribution does not matter.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Hashable
from typing import Any, Protocol, cast

import msgspec
import trio
from msgspec import UNSET, Raw, UnsetType

from gateway import errors
from gateway.backend.connector import Link
from gateway.events import BackendProtocolError, EventBus, ServerRequestOutcome
from gateway.limits import Account
from gateway.protocol import jsonrpc, wire
from gateway.protocol.era import Era
from gateway.protocol.framing import HEAD, Oversize, OversizeEnd
from gateway.protocol.mcp import decode_cancelled
from gateway.protocol.routing import (
    Action,
    ArmTimer,
    Call,
    ChildRouter,
    EndServerRequest,
    Finished,
    Settled,
    ToChild,
    ToOwner,
    UnknownReply,
    request_fields,
)

LOGGER = logging.getLogger(__name__)

#: Why the gateway withdraws a request it forwarded to a client, by how it ended.
_WITHDRAWN = {
    ServerRequestOutcome.CANCELLED: "cancelled by the backend",
    ServerRequestOutcome.CALL_FINISHED: "the call that caused this request has ended",
    ServerRequestOutcome.CHILD_RESTARTED: "the backend exited",
}


class Owner(Protocol):
    """A call's owner, opaque to the backend layer (a client session of the core): what a
    child's shell and the pool need of it."""

    @property
    def closed(self) -> trio.Event:
        """Set once the owner is gone."""
        ...

    def __hash__(self) -> int: ...

    def send(self, data: bytes, route: jsonrpc.Route | None = None) -> bool: ...
    def cancel_request(self, req: Any, outcome: ServerRequestOutcome, reason: str) -> None: ...


class CallHandle(Protocol):
    """Told once when its call is over (see :class:`~gateway.protocol.routing.Finished`)."""

    def finished(self, result: Raw | None, error: errors.GatewayError | None) -> None: ...


class _Waiter:
    """The handle of a caller that awaits its call (:meth:`ChildConnection.request`)."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Raw | None = None
        self.error: errors.GatewayError | None = None

    def finished(self, result: Raw | None, error: errors.GatewayError | None) -> None:
        self.result, self.error = result, error
        self.done.set()


class ChildHandlers(Protocol):
    """What the owner of a child connection does with traffic that is not a reply."""

    def on_notification(self, child: ChildConnection, method: str,
                        params: Raw | UnsetType) -> None: ...

    def on_request(self, child: ChildConnection, id: int | str, method: str,
                   params: Raw | UnsetType, cause: int | None = None) -> None: ...

    def on_cancelled(self, child: ChildConnection, request_id: int | str) -> None: ...


class ChildConnection:
    """The MCP client session of one generation: router, era and envelope over a link."""

    def __init__(
        self,
        *,
        backend: str,
        instance: str,
        generation: int,
        link: Link,
        handlers: ChildHandlers,
        bus: EventBus,
        max_line: int,
        max_depth: int = jsonrpc.MAX_DEPTH,
        timeout: float = 60.0,
        max_inflight: int = sys.maxsize,
    ) -> None:
        self.backend = backend
        self.instance = instance
        self.generation = generation
        self.router = ChildRouter(backend, timeout=timeout, max_inflight=max_inflight)
        self.link = link
        self._send = link.send
        self._handlers = handlers
        self._bus = bus
        self._max_line = max_line
        self._max_depth = max_depth
        self._oversize_head = b""  # first bytes of the oversize line being discarded
        self._timer: trio.CancelScope | None = None  # the timer task's sleep, while it sleeps
        self._timer_at = math.inf
        self.protocol_version: str | None = None
        self.server_capabilities: dict[str, Any] = {}
        # The era the handshake found (pinned for this generation), and for a modern child the
        # envelope of the gateway's own requests (see gateway.backend.client.open_child).
        self.era = Era.LEGACY
        self.envelope: dict[str, Raw] | None = None
        self.on_settled: Callable[[], None] | None = None  # abandoned calls left the set
        self.on_ended: Callable[[], None] | None = None  # the upstream's side ended

    @property
    def closed(self) -> errors.GatewayError | None:
        """Why nothing can be sent to this child any more (None while it can)."""
        return self.link.closed

    @property
    def buffers(self) -> Account:
        """The write queue's bytes on the daemon-wide budget."""
        return self.link.buffers

    @property
    def pending(self) -> dict[int, Call]:
        """The calls at the child (the attribution set, internal calls included)."""
        return self.router.pending

    # ---- performing the router's actions ----------------------------------------------------

    def perform(self, actions: list[Action]) -> None:
        """Do what the router said, in order (never blocks, never raises for a dead child)."""
        # ``type(action) is``: exact classes (NamedTuples), cheaper than isinstance; mypy narrows
        # it.  The router knows owners as hashable keys: this shell gives it Owners (casts).
        for action in actions:
            if type(action) is ToChild:
                try:
                    self._send(action.data, action.gid)
                except errors.NotDelivered as exc:
                    if action.gid is not None:
                        # stdin is gone for good: the queued calls cannot reach the child either.
                        # All of them at once: one by one, each freed slot would dispatch the next
                        # and fail it in a nested perform (a RecursionError with ~1000 queued).
                        undelivered = self.router.withdraw_queued(exc)
                        undelivered += self.router.undelivered([action.gid], exc)
                        self.perform(undelivered)
            elif type(action) is Finished:
                action.call.handle.finished(action.result, action.error)
            elif type(action) is ToOwner:
                # the only message the router passes to an owner: progress under its token
                cast(Owner, action.owner).send(
                    action.data, (jsonrpc.Goes.PROGRESS, action.call.client_token))
            elif type(action) is ArmTimer:
                self._timer_at = action.at
                if self._timer is not None and action.at < self._timer.deadline:
                    self._timer.deadline = action.at
            elif type(action) is EndServerRequest:
                cast(Owner, action.owner).cancel_request(
                    action.handle, action.outcome,
                    _WITHDRAWN.get(action.outcome, str(action.outcome)))
            elif type(action) is Settled:
                if self.on_settled is not None:
                    self.on_settled()

    async def timer_loop(self) -> None:
        """Sleep until the router's earliest deadline, time out what is due, repeat."""
        while True:
            with trio.CancelScope(deadline=self._timer_at) as scope:
                self._timer = scope
                await trio.sleep_forever()
            self._timer = None
            self.perform(self.router.timer_due(trio.current_time()))

    # ---- writing ----------------------------------------------------------------------------

    def post(self, line: bytes, gid: int | None = None) -> None:
        """Send one message without blocking (the link writes it at once or queues it).

        Raises:
            NotDelivered: the child is already known to be gone.
        """
        self._send(line, gid)

    def _queue_full(self) -> errors.Overloaded:
        return errors.Overloaded(
            f"backend {self.backend!r} is not reading its input: {self.buffers.held} bytes "
            "already wait to be written to it (outbound_bytes)", backend=self.backend,
            limit=self.link.max_queued)

    def exited_error(self, detail: str) -> errors.GatewayError:
        return errors.BackendExited(
            f"backend {self.backend!r} exited: {detail}", backend=self.backend, retryable=True
        )

    def notify(self, method: str, params: Raw | UnsetType = UNSET) -> None:
        """Send a notification (dropped if the child is gone)."""
        try:
            self.post(jsonrpc.encode_notification(method, params))
        except errors.NotDelivered:
            pass

    def respond(self, id: int | str, result: Raw) -> None:
        """Answer the child's request ``id`` (dropped if the child is gone)."""
        try:
            self.post(jsonrpc.encode_result(id, result))
        except errors.NotDelivered:
            LOGGER.debug("backend %s gone before its request %r was answered", self.instance, id)

    def respond_error(self, id: int | str, code: int, message: str, data: Any = None) -> None:
        try:
            self.post(jsonrpc.encode_error(id, code, message, data))
        except errors.NotDelivered:
            LOGGER.debug("backend %s gone before its request %r was answered", self.instance, id)

    # ---- requests ---------------------------------------------------------------------------

    def start(self, method: str, params: Raw | UnsetType, *, handle: CallHandle, now: float,
              owner: Hashable | None = None, internal: bool = False, timeout: float | None = None,
              hard_timeout: float | None = None, progress: Any = None,
              fields: dict[str, Raw] | None = None, meta: dict[str, Raw] | None = None) -> Call:
        """Start a call without waiting: ``handle.finished`` is told how it ended.

        Args:
            timeout: seconds until the gateway gives up (default: the backend's
                ``request_timeout``; paused while a prompt of the owner is pending).
            hard_timeout: the most the call may take even with pauses.
            progress: the caller's progress token, when it asked for progress.
            fields: the params (decoded one level) as the core decided them for this child's
                era; sent instead of ``params``, with the gateway's progress token put into
                ``meta`` (the ``_meta`` it goes into, when the caller asked for progress).

        Raises:
            NotDelivered: the child is gone.  Overloaded: its write queue is full.
        """
        closed = self.link.closed
        if closed is not None:
            raise errors.NotDelivered(closed.message, **closed.data)
        hard = math.inf if hard_timeout is None else now + hard_timeout
        call = self.router.open_call(method, owner=owner, handle=handle, now=now, timeout=timeout,
                                     hard_deadline=hard, progress=progress, internal=internal)
        if fields is not None:
            if meta is not None:
                fields = request_fields(fields, meta, call.token)
            line = jsonrpc.encode_request_fields(call.gid, method, fields)
        else:
            line = jsonrpc.encode_request(call.gid, method, params)
        if not internal and not self.link.fits(len(line)):
            raise self._queue_full()  # an opened call that is never submitted leaves no trace
        self.perform(self.router.submit(call, line))
        return call

    def cancel(self, call: Call, error: errors.GatewayError | None = None) -> None:
        """The caller gives up on ``call`` (answered ``error``, or not at all)."""
        self.perform(self.router.cancel(call, trio.current_time(), error))

    def give_up(self, calls: list[Call]) -> None:
        """These calls end for their caller now (unanswered) without ``notifications/cancelled``
        to the child: it was told to stop otherwise (its requests answered ``cancel``), and a
        spec-following child never answers a cancelled request, which would hold the call in the
        attribution set until ``cancel_grace``; its reply takes it out instead (then dropped)."""
        now = trio.current_time()
        for call in calls:
            self.perform(self.router.cancel(call, now, notify=False))

    async def request(
        self,
        method: str,
        params: Raw | UnsetType = UNSET,
        *,
        timeout: float,  # noqa: ASYNC109 - the router's call deadline (paused while the child asks the client; CallTimeout), not a cancel scope
        hard_timeout: float | None = None,
        owner: Hashable | None = None,
        internal: bool = False,
        progress: Any = None,
        fields: dict[str, Raw] | None = None,
        meta: dict[str, Raw] | None = None,
        started: Callable[[Call], None] | None = None,
    ) -> Raw:
        """Send a request to the child and wait for its reply (the slow path and the gateway's
        own requests; see :meth:`start`).  ``started`` is told its call, once started.

        Raises:
            CallTimeout, BackendExited, NotDelivered, Overloaded, RemoteError.  On cancellation
            or timeout the child is sent ``notifications/cancelled`` and a late reply is dropped.
        """
        waiter = _Waiter()
        call = self.start(method, params, handle=waiter, now=trio.current_time(), owner=owner,
                          internal=internal, timeout=timeout, hard_timeout=hard_timeout,
                          progress=progress, fields=fields, meta=meta)
        if started is not None:
            started(call)
        try:
            await waiter.done.wait()
        finally:
            if not waiter.done.is_set():  # cancelled from outside
                self.cancel(call)
        if waiter.error is not None:
            raise waiter.error
        if waiter.result is None:  # given up (give_up): its caller answers nobody
            raise errors.Denied(f"the gateway gave up on this {method} call", reason="preempted")
        return waiter.result

    def attribution(self) -> set[Any]:
        """The owners with calls in this child's attribution set (internal calls never)."""
        return self.router.attribution()

    def oldest_abandoned(self, *, clients_only: bool = False) -> float | None:
        return self.router.oldest_abandoned(clients_only=clients_only)

    def calls_in_flight(self) -> int:
        """Clients' calls whose callers still wait for them (not internal, not abandoned)."""
        return self.router.calls_in_flight()

    def purge_abandoned(self, before: float, *, internal_only: bool = False) -> int:
        """Forget abandoned calls given up before ``before`` (only internal ones if asked)."""
        count = len(self.router.pending)
        self.perform(self.router.purge_abandoned(before, internal_only=internal_only))
        return count - len(self.router.pending)

    def calls_of(self, owner: Hashable) -> list[Call]:
        """``owner``'s calls still waited for (abandoned ones are over for the owner)."""
        return self.router.calls_of(owner)

    def fail_all(self, error: errors.GatewayError) -> None:
        """The child is gone: complete every pending call with ``error`` now."""
        self.link.fail(error)
        self.perform(self.router.child_exited(error))

    # ---- from the link ----------------------------------------------------------------------

    def undelivered(self, gids: list[int], error: errors.GatewayError) -> None:
        """The link lost these requests before the child read them (safe to retry)."""
        self.perform(self.router.undelivered(gids, error))

    def failed(self, gid: int, error: errors.GatewayError) -> None:
        """The link says the answer to request ``gid`` cannot come any more: its call fails
        with ``error`` (nothing happens if it was answered already)."""
        self._fail_reply(gid, error)

    def ended(self) -> None:
        if self.on_ended is not None:
            self.on_ended()

    def oversize(self, frame: Oversize) -> None:
        """A line crossed the limit: it is dropped; if its first bytes show a reply's id, that
        call fails now, else the line's last bytes are looked at when it ends."""
        LOGGER.warning("backend %s: dropping a line of more than %d bytes (max_message_bytes)",
                       self.instance, self._max_line)
        self._protocol_error("oversize")
        gid = wire.reply_id_hint(frame.head)
        if gid is None:
            self._oversize_head = frame.head
        else:
            self._fail_reply(gid, self._too_large())

    def oversize_end(self, frame: OversizeEnd) -> None:
        head, self._oversize_head = self._oversize_head, b""
        if head:
            self._fail_reply(wire.reply_id_hint(head, frame.tail), self._too_large())

    def _too_large(self) -> errors.GatewayError:
        return errors.ResponseTooLarge(
            f"backend {self.backend!r} answered with more than {self._max_line} bytes "
            "(max_message_bytes)", backend=self.backend, limit=self._max_line)

    def _fail_reply(self, gid: int | None, error: errors.GatewayError) -> None:
        """A reply the gateway will not pass on: its call (if it is one) fails now."""
        self.perform(self.router.fail_reply(gid, error))

    def _protocol_error(self, kind: str) -> None:
        self._bus.emit(BackendProtocolError(self.backend, self.instance, kind))

    def message(self, line: bytes, cause: int | None = None) -> None:
        """One whole message from the child (the link's :class:`Receiver` side); ``cause``: the
        request whose own answer stream carried it, if the link knows."""
        if line[:1] == b"\xef" and line.startswith(b"\xef\xbb\xbf"):  # a byte order mark
            line = line[3:]
        try:
            env = jsonrpc.decode(line, self._max_depth)
            kind = jsonrpc.classify(env)
        except errors.GatewayError as exc:
            self._on_undecodable(line, exc, cause)
            return
        if kind == "response" or kind == "error":
            try:
                actions = self.router.reply(env.id, None if env.result is UNSET else env.result,
                                            None if env.error is UNSET else env.error)
            except UnknownReply:
                LOGGER.warning("backend %s answered unknown request id %.100r", self.instance,
                               env.id)
                self._protocol_error("unknown_response")
                return
            self.perform(actions)
        elif kind == "notification":
            assert isinstance(env.method, str)
            if env.method == "notifications/progress":
                self._on_progress(env.params)
            elif env.method == "notifications/cancelled":
                try:
                    request_id = decode_cancelled(env.params).requestId
                except (msgspec.ValidationError, msgspec.DecodeError):
                    self._protocol_error("invalid_message")
                    return
                self._handlers.on_cancelled(self, request_id)
            else:
                self._handlers.on_notification(self, env.method, env.params)
        else:
            assert isinstance(env.method, str) and isinstance(env.id, int | str)
            self._handlers.on_request(self, env.id, env.method, env.params, cause)

    def _on_undecodable(self, line: bytes, exc: errors.GatewayError,
                        cause: int | None = None) -> None:
        """A line that is not a message the gateway can pass on: logged and counted.  The call
        whose own answer stream carried it (``cause``), else the one whose reply id the line
        shows (read from its first or last bytes: it may not decode at all), fails now with
        -32009 instead of waiting for its timeout."""
        if exc.reason in ("invalid_utf8", "too_deep"):
            kind = exc.reason
        else:
            kind = "not_json" if isinstance(exc, errors.ParseError) else "invalid_message"
        LOGGER.warning("backend %s sent a line that is not a valid message (%s: %s): %.200r",
                       self.instance, kind, exc.message, line)
        self._protocol_error(kind)
        gid = cause if cause is not None else wire.reply_id_hint(line[:HEAD], line[-HEAD:])
        self._fail_reply(gid, errors.BackendProtocolError(
            f"backend {self.backend!r} sent a reply that cannot be passed on: {exc.message}",
            backend=self.backend, detail=kind))

    def _on_progress(self, params: Raw | UnsetType) -> None:
        try:
            fields = jsonrpc.params_dict(params)
            key = jsonrpc.loads(fields["progressToken"])
        except (KeyError, errors.InvalidRequest, msgspec.DecodeError):
            self._protocol_error("invalid_message")
            return
        self.perform(self.router.progress(key, fields))  # unknown or finished tokens: dropped
