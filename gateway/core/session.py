"""One client connection: identity, negotiated state, outbound queue, its pending prompts.

A :class:`ClientSession` is created by the hub for every accepted connection.  Its ``conn_id``
is minted by the gateway (clients never choose it).  Everything sent to the client goes through
:meth:`ClientSession.send`, which never blocks: the message is written straight to the transport
when nothing is queued toward the client, else queued in a bounded :class:`~gateway.core.outbox.Outbox`
that the connection's flusher task drains (see :mod:`gateway.core.outbox`).  A client that lets the
queue overflow (``outbound_queue`` messages not yet handed to the transport, or
``outbound_bytes`` bytes, counting what the transport holds and has not written) is disconnected
(reason ``overflow``) instead of stalling a backend's reader.  The same bytes, and those of the
requests it sent that are still being served, are charged to the connection's account on the
daemon-wide :class:`~gateway.limits.ByteBudget`; when the budget evicts this connection (it
holds the most when the total runs over) it is closed with reason ``overflow`` too.

Backpressure on the client's own requests: once the queue holds more than half of
``outbound_queue`` messages or half of ``outbound_bytes`` bytes (``high_water``), the
connection's reader stops reading (:meth:`ClientSession.wait_drained`) until the writer has
brought it down to a quarter of both, or the connection closes.  A burst of pipelined requests
from a client that reads is thus answered in full; a client that never reads simply stops being
read, and what its calls already in flight answer still runs into ``outbound_bytes``.

Server→client requests (a backend's elicitation, sampling, roots; the gateway's own consent
prompts) are recorded in ``server_requests`` under ids minted for this connection only.  An
answer is accepted only from this connection for an id it was sent; anything else is refused
(:class:`~gateway.events.AnswerRefused`), except late answers to requests that already ended,
which are dropped quietly.
"""

from __future__ import annotations

import enum
import itertools
import logging
import secrets
import sys
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio
from msgspec import UNSET, Raw, UnsetType

from gateway import errors
from gateway.core.outbox import MessageWriter, Outbox, Route
from gateway.errors import CloseReason
from gateway.events import ServerRequestOutcome
from gateway.limits import ByteBudget
from gateway.protocol import jsonrpc, mcp
from gateway.protocol.era import Era

if TYPE_CHECKING:
    from gateway.auth.principal import Principal

LOGGER = logging.getLogger(__name__)

_conn_counter = itertools.count(1)


def mint_conn_id() -> str:
    return f"c{next(_conn_counter)}-{secrets.token_hex(4)}"


class AnswerOutcome(enum.StrEnum):
    """What :meth:`ClientSession.on_answer` made of a client's response."""

    ACCEPTED = "accepted"  # it answered an open request of this connection
    LATE = "late"  # the request had already ended: dropped quietly
    REFUSED = "refused"  # no such request for this connection (logged and counted)


class ServerRequest:
    """A request the gateway sent to this client and is waiting on (one owner, one answer)."""

    __slots__ = ("done", "error", "id", "method", "on_end", "outcome", "params", "result", "sent",
                 "started")

    def __init__(self, id: str, method: str, params: Any) -> None:
        self.id = id
        self.method = method
        self.params = params
        self.done = trio.Event()
        self.outcome: ServerRequestOutcome | None = None
        self.result: Raw | None = None
        self.error: jsonrpc.ErrorObject | None = None
        self.started = trio.current_time()
        self.on_end: list[Callable[[ServerRequest], None]] = []
        self.sent = False  # sent to the client (not: asked in a bridged flow's InputRequiredResult)

    def finish(self, outcome: ServerRequestOutcome, result: Raw | None = None, error: jsonrpc.ErrorObject | None = None) -> bool:
        """Close the request; only the first call has an effect (exactly-once)."""
        if self.done.is_set():
            return False
        self.outcome, self.result, self.error = outcome, result, error
        self.done.set()
        for cb in self.on_end:
            cb(self)
        return True


class Bridging(Protocol):
    """Era bridging (:class:`gateway.core.bridge.Bridge`) as the modules holding a session see
    it: a modern caller's input requests are asked in its call's ``InputRequiredResult``."""

    ttl: float

    @property
    def full(self) -> bool: ...
    def admit(self) -> None: ...
    def continues(self, method: str, params: dict[str, Raw]) -> bool: ...
    def resume(self, method: str, params: dict[str, Raw], request_id: int | str,
               caps: dict[str, object], *, principal: str | None = None,
               owner: ClientSession | None = None) -> ClientSession: ...
    def requested(self, owner: ClientSession, key: str, req: ServerRequest) -> None: ...
    # ``served``: the session's entry in ``inflight`` for the call (gateway.core.serving.Served)
    def ask(self, owner: ClientSession, served: Any, key: str, req: ServerRequest,
            deadline: float) -> None: ...


class BridgedCall(Protocol):
    """A session's bridged call (:class:`gateway.core.bridge.Flow`) as others read it."""

    method: str
    parked: bool  # answered input_required, waiting for the retry
    round: int

    def closed(self) -> None:
        """Its session closed."""
        ...


class ClientSession:
    def __init__(self, transport: str, *, outbound_capacity: int, max_inflight: int,
                 outbound_bytes: int = sys.maxsize, budget: ByteBudget | None = None) -> None:
        self.conn_id = mint_conn_id()
        self.log_fields = {"MCP_CONN": self.conn_id}  # structured log field (journald)
        self.transport = transport
        self.opened = trio.current_time()
        self.initialized = False
        self.protocol_version: str | None = None
        self.era: Era | None = None  # chosen by the connection's first request
        self.caps = mcp.ClientCaps({})
        self.log_level: str | None = None
        self.max_inflight = max_inflight
        self.inflight: dict[int | str, Any] = {}  # client id -> gateway.core.serving.Served
        self.server_requests: dict[str, ServerRequest] = {}
        self._ended_ids: deque[str] = deque(maxlen=1024)
        self._ids = itertools.count(1)
        self._id_salt = secrets.token_hex(3)
        self.writer: MessageWriter | None = None  # the transport, while the connection is served
        self.outbound = Outbox(outbound_capacity)  # what could not be written at once
        self.max_outbound_bytes = outbound_bytes
        self.queued_bytes = 0  # in ``outbound`` or handed to the transport, not yet written
        self.queued = 0  # messages, counted like ``queued_bytes``
        self.held = 0  # of them: messages handed to the transport that it has not written out
        self.held_bytes = 0
        # backpressure on the reader: above high water it waits until both are at low water
        self.high_water = max(1, outbound_capacity // 2)
        self.high_water_bytes = outbound_bytes // 2
        self._low_water = outbound_capacity // 4
        self._low_water_bytes = outbound_bytes // 4
        self._drained: trio.Event | None = None  # the reader waits on it
        self.last_sent = self.opened  # when queued bytes were last written to the client
        self.refused_at = 0.0  # when the drain last refused a request of it (-32005 retryable)
        self._budget = budget if budget is not None else ByteBudget(sys.maxsize)
        self.buffers = self._budget.open(self.conn_id, self._evicted)
        self.closed = trio.Event()
        self.close_reason = CloseReason.CLIENT_CLOSED
        self.cancel_scope: trio.CancelScope | None = None
        self.nursery: trio.Nursery | None = None  # where requests that must wait run
        # A modern HTTP flow: the child's requests to it are bridged (gateway.core.bridge), not sent
        self.mrtr: Bridging | None = None
        self.flow: BridgedCall | None = None  # its bridged call, once the child asked for input
        # A connection without a task of its own (connection.Direct): its end, once closed
        self.on_close: Callable[[], None] | None = None
        self._principal: Principal | None = None

    def calls(self) -> list[Any]:
        """The requests in flight that may be at a backend: all but open listens
        (``subscriptions/listen`` is served by the gateway itself, never by a child)."""
        return [s for s in self.inflight.values() if s.req.method != "subscriptions/listen"]

    @property
    def principal(self) -> Principal | None:
        """Who is calling (gateway.auth), when known; None: not authenticated."""
        return self._principal

    @principal.setter
    def principal(self, principal: Principal | None) -> None:
        self._principal = principal
        if principal is None:
            self.log_fields.pop("MCP_PRINCIPAL", None)
        else:  # the bounded label, never a raw subject
            self.log_fields["MCP_PRINCIPAL"] = principal.label

    def __repr__(self) -> str:
        return f"<ClientSession {self.conn_id} {self.transport}>"

    # ---- outbound ---------------------------------------------------------------------------

    def send(self, data: bytes, route: Route | None = None) -> bool:
        """Write one message to the client, or queue it.  Never blocks; on overflow the
        connection is closed.  Straight to the transport when nothing is queued (see
        :mod:`gateway.core.outbox`), with its routing hint ``route``."""
        if self.closed.is_set():
            return False
        n = len(data)
        if self.queued_bytes + n > self.max_outbound_bytes:
            LOGGER.warning("connection %s: a message of %d bytes does not fit in the outbound queue "
                           "(%d bytes already queued toward the client, outbound_bytes %d); "
                           "disconnecting it", self.conn_id, n, self.queued_bytes,
                           self.max_outbound_bytes, extra=self.log_fields)
            self.close(CloseReason.OVERFLOW)
            return False
        writer = self.writer
        if self.queued == 0 and writer is not None:
            try:
                if writer.write_nowait([data], route):
                    return True
            except errors.TransportClosed:
                self.close(CloseReason.CLIENT_CLOSED)
                return False
            self.held, self.held_bytes = 1, n  # its rest is held by the transport
            self.outbound.wake()
        elif not self.outbound.put(data):
            LOGGER.warning("connection %s: outbound queue full, disconnecting a slow client", self.conn_id, extra=self.log_fields)
            self.close(CloseReason.OVERFLOW)
            return False
        self.queued_bytes += n
        self.queued += 1
        self.buffers.charge(n)  # may evict a connection (this one too) when the total runs over
        return True

    def sent(self, n: int, count: int = 1) -> None:
        """``count`` queued messages of ``n`` bytes in all are written to the client."""
        self.last_sent = trio.current_time()
        self.queued_bytes -= n
        self.queued -= count
        self.buffers.release(n)
        if (self._drained is not None and self.queued <= self._low_water
                and self.queued_bytes <= self._low_water_bytes):
            self._drained.set()
            self._drained = None

    async def wait_drained(self) -> None:
        """Until the writer has brought the queue down to low water, or the connection closed."""
        if self.closed.is_set():
            return
        if self._drained is None:
            self._drained = trio.Event()
        await self._drained.wait()

    def drop_outbound(self) -> None:
        """The connection is over: drop what is still queued and release all its bytes."""
        self.writer = None
        self.outbound.clear()
        self.queued_bytes = 0
        self.queued = 0
        self.held = self.held_bytes = 0
        self.buffers.close()

    def _evicted(self) -> None:
        LOGGER.warning("connection %s: the gateway's message buffers are full (buffered_bytes_total); "
                       "closing this connection, which holds the most (%d bytes)", self.conn_id,
                       self.buffers.held, extra=self.log_fields)
        self.close(CloseReason.OVERFLOW)

    def notify(self, method: str, params: Raw | bytes | UnsetType = UNSET) -> bool:
        return self.send(jsonrpc.encode_notification(method, params))

    def close(self, reason: CloseReason) -> None:
        """End the connection (idempotent); the first reason given is the one recorded."""
        if not self.closed.is_set():
            self.close_reason = reason
            self.closed.set()
            if self._drained is not None:  # a reader waiting for the queue to drain
                self._drained.set()
                self._drained = None
            if self.cancel_scope is not None:
                self.cancel_scope.cancel()
            if self.on_close is not None:
                finish, self.on_close = self.on_close, None
                finish()

    # ---- server→client requests ---------------------------------------------------------------

    def open_request(self, method: str, params: Any, *, send: bool = True) -> ServerRequest:
        """Record a request to this client and send it (unless ``send`` is false: a bridged
        flow asks for it in its ``InputRequiredResult``); the caller awaits ``req.done``."""
        rid = f"gw-{self._id_salt}-{next(self._ids)}"
        req = ServerRequest(rid, method, params)
        self.server_requests[rid] = req
        req.on_end.append(self._forget)
        if self.closed.is_set():  # nobody will ever answer (end_all_requests already ran)
            req.finish(ServerRequestOutcome.OWNER_GONE)
            return req
        if not send:
            return req
        req.sent = True
        payload = params if isinstance(params, Raw) else jsonrpc.encode_dict(params)
        self.send(jsonrpc.encode_request(rid, method, payload))
        return req

    def _forget(self, req: ServerRequest) -> None:
        self.server_requests.pop(req.id, None)
        self._ended_ids.append(req.id)

    def cancel_request(self, req: ServerRequest, outcome: ServerRequestOutcome, reason: str) -> None:
        """End ``req`` without an answer and tell the client with ``notifications/cancelled``
        (if it was sent one: a modern caller was asked in an ``InputRequiredResult``)."""
        if req.finish(outcome) and req.sent:
            self.notify("notifications/cancelled", jsonrpc.encode_dict({"requestId": req.id, "reason": reason}))

    def on_answer(self, env: jsonrpc.Envelope) -> AnswerOutcome:
        """A response from the client: accepted, late or refused."""
        rid = env.id
        req = self.server_requests.get(rid) if isinstance(rid, str) else None
        if req is not None and not req.sent:
            # asked in a modern call's InputRequiredResult (gateway.core.bridge): only the call's
            # retry, with its signed requestState, answers it; the client never saw this id
            req = None
        if req is None:
            if isinstance(rid, str) and rid in self._ended_ids:
                return AnswerOutcome.LATE
            return AnswerOutcome.REFUSED
        if env.error is not UNSET:
            req.finish(ServerRequestOutcome.ERROR, error=env.error)
        else:
            assert isinstance(env.result, Raw)
            req.finish(ServerRequestOutcome.ANSWERED, result=env.result)
        return AnswerOutcome.ACCEPTED

    def end_all_requests(self, outcome: ServerRequestOutcome) -> None:
        for req in list(self.server_requests.values()):
            req.finish(outcome)

    # ---- calls ------------------------------------------------------------------------------

    def check_new_call(self, client_id: int | str, size: int = 0) -> None:
        """Admit a request of ``size`` bytes, or raise the error to answer it with."""
        if client_id in self.inflight:
            raise errors.InvalidRequest(f"request id {client_id!r} is already in flight on this connection")
        if len(self.inflight) >= self.max_inflight:
            raise errors.Overloaded(
                f"too many requests in flight on this connection (limit {self.max_inflight})",
                limit=self.max_inflight,
            )
        if not self._budget.admits(size):
            self._budget.overrun()  # the connection holding the most is closed (maybe this one)
            raise errors.Overloaded(
                "the gateway's message buffers are full (buffered_bytes_total); retry later",
                limit=self._budget.limit,
            )
