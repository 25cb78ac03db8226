"""One client connection: identity, negotiated state, outbound queue, its pending prompts.

A :class:`ClientSession` is made for every accepted connection, with a gateway-minted
``conn_id``.  :meth:`ClientSession.send` never blocks: it writes straight to the transport or
queues in a bounded :class:`~gateway.core.outbox.Outbox`; a client that lets it overflow is
disconnected (``overflow``), and its reader stops reading past high water.  Server→client
requests are recorded under ids minted for this connection; only this connection may answer
them."""

from __future__ import annotations

import enum
import itertools
import logging
import secrets
import sys
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio
from msgspec import UNSET, Raw, UnsetType

from gateway import errors
from gateway.core.outbox import MessageWriter, Outbox, Route
from gateway.errors import CloseReason
from gateway.events import ServerRequestOutcome
from gateway.limits import ByteBudget
from gateway.protocol import jsonrpc, mcp
from gateway.protocol.era import Era
from gateway.protocol.session import SessionEvent, SessionState, next_state

if TYPE_CHECKING:
    from gateway.auth.principal import Principal
    from gateway.core.request import Request

LOGGER = logging.getLogger(__name__)
_CLOSED = SessionState.CLOSED  # (a module name: read on every message sent)

_conn_counter = itertools.count(1)
#: Random bytes drawn from the OS at once for ids (one system call per few hundred connections,
#: not two per connection: every stateless HTTP request is a connection).
ENTROPY_CHUNK = 4096


class _Entropy:
    """Random bytes from ``secrets``, drawn :data:`ENTROPY_CHUNK` at a time (kept as hex), each
    used once."""

    __slots__ = ("_hex", "_off")

    def __init__(self) -> None:
        self._hex = ""
        self._off = 2 * ENTROPY_CHUNK  # drawn at the first use

    def hex(self, n: int) -> str:
        """``n`` random bytes as hex."""
        start = self._off
        end = start + 2 * n
        if end > 2 * ENTROPY_CHUNK:
            self._hex, start, end = secrets.token_hex(ENTROPY_CHUNK), 0, 2 * n
        self._off = end
        return self._hex[start:end]


_entropy = _Entropy()


def mint_conn_id() -> str:
    return f"c{next(_conn_counter)}-{_entropy.hex(4)}"


class Transport(enum.StrEnum):
    """What a connection came over (its value is the metrics' and policy rules' label)."""

    WEBSOCKET = "websocket"
    UNIX = "unix"
    HTTP = "http"  # a legacy HTTP session or a modern HTTP flow
    MEMORY = "memory"  # tests


_TRANSPORTS: dict[str, Transport] = {t.value: t for t in Transport}


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

    def finish(self, outcome: ServerRequestOutcome, result: Raw | None = None,
               error: jsonrpc.ErrorObject | None = None) -> bool:
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
    def ask(self, owner: ClientSession, served: Call, key: str, req: ServerRequest,
            deadline: float) -> None: ...


class BridgedCall(Protocol):
    """A modern call's round trips (:class:`gateway.core.bridge.Flow`), as its session and its
    call see them."""

    method: str
    parked: bool  # answered input_required, waiting for the retry
    waiting: bool  # the call's current id was answered input_required (no other answer)
    round: int

    def closed(self) -> None:
        """Its session closed."""
        ...

    def call_ended(self) -> None: ...


class Call(Protocol):
    """A request in flight on a session (:class:`gateway.core.serving.Served`), as the modules
    holding the session read it: ``session.inflight``'s values."""

    @property
    def id(self) -> int | str: ...
    @property
    def req(self) -> Request: ...
    @property
    def modern(self) -> bool: ...
    @property
    def caps(self) -> mcp.ClientCaps | None:
        """A modern request's declared capabilities."""
        ...
    @property
    def flow(self) -> BridgedCall | None: ...

    def cancel(self) -> None: ...


class ClientSession:
    """One client connection (a WebSocket or unix one, a legacy HTTP session, a modern HTTP
    flow): the one owner type of a call.  Its lifecycle is :class:`SessionState`
    (:mod:`gateway.protocol.session`); its negotiated fields change only through its transition
    methods (:meth:`choose_era`, :meth:`initialize`, :meth:`set_log_level`, :meth:`drain`,
    :meth:`close`) and are read-only properties to everyone else.

    A :class:`ClientSession` is created by the hub for every accepted connection. Its
    ``conn_id`` is minted by the gateway (clients never choose it). Everything sent to the
    client goes through :meth:`ClientSession.send`, which never blocks: the message is written
    straight to the transport when nothing is queued toward the client, else queued in a bounded
    :class:`~gateway.core.outbox.Outbox` that the connection's flusher task drains (see
    :mod:`gateway.core.outbox`). A client that lets the queue overflow (``outbound_queue``
    messages not yet handed to the transport, or ``outbound_bytes`` bytes, counting what the
    transport holds and has not written) is disconnected (reason ``overflow``) instead of
    stalling a backend's reader. The same bytes, and those of the requests it sent that are
    still being served, are charged to the connection's account on the daemon-wide
    :class:`~gateway.limits.ByteBudget`; when the budget evicts this connection (it holds the
    most when the total runs over) it is closed with reason ``overflow`` too.

    Backpressure on the client's own requests: once the queue holds more than half of
    ``outbound_queue`` messages or half of ``outbound_bytes`` bytes (``high_water``), the
    connection's reader stops reading (:meth:`ClientSession.wait_drained`) until the writer has
    brought it down to a quarter of both, or the connection closes. A burst of pipelined
    requests from a client that reads is thus answered in full; a client that never reads simply
    stops being read, and what its calls already in flight answer still runs into
    ``outbound_bytes``.

    Server→client requests (a backend's elicitation, sampling, roots; the gateway's own consent
    prompts) are recorded in ``server_requests`` under ids minted for this connection only. An
    answer is accepted only from this connection for an id it was sent; anything else is refused
    (:class:`~gateway.events.AnswerRefused`), except late answers to requests that already
    ended, which are dropped quietly.
    """

    def __init__(self, transport: str, *, outbound_capacity: int, max_inflight: int,
                 outbound_bytes: int = sys.maxsize, budget: ByteBudget | None = None) -> None:
        self.conn_id: Final = mint_conn_id()
        self.log_fields = {"MCP_CONN": self.conn_id}  # structured log field (journald)
        self.transport: Final = _TRANSPORTS.get(transport) or Transport(transport)
        # the run's clock, bound once: one call per reading on the hot path
        self.now: Final[Callable[[], float]] = trio.lowlevel.current_clock().current_time
        self.opened: Final = self.now()
        self._state = SessionState.AWAITING_INIT
        self._protocol_version: str | None = None  # what initialize negotiated
        self._era: Era | None = None  # chosen by the connection's first request
        self._caps = mcp.NO_CAPS
        self._log_level: str | None = None
        self.client_info: dict[str, str] | None = None  # initialize's clientInfo (name, version)
        self.max_inflight: Final = max_inflight
        # client id -> its call (gateway.core.serving adds and ends them)
        self.inflight: Final[dict[int | str, Call]] = {}
        self.server_requests: Final[dict[str, ServerRequest]] = {}
        self._ended_ids: deque[str] = deque(maxlen=1024)
        self._ids = itertools.count(1)
        self._id_salt = ""  # drawn at its first server->client request
        self._writer: MessageWriter | None = None  # the transport, while the connection is served
        self.outbound: Final = Outbox(outbound_capacity)  # what could not be written at once
        self.max_outbound_bytes: Final = outbound_bytes
        self.queued_bytes = 0  # in ``outbound`` or handed to the transport, not yet written
        self.queued = 0  # messages, counted like ``queued_bytes``
        self._held = 0  # of them: messages handed to the transport that it has not written out
        self._held_bytes = 0
        # backpressure on the reader: above high water it waits until both are at low water
        self.high_water: Final = max(1, outbound_capacity // 2)
        self.high_water_bytes: Final = outbound_bytes // 2
        self._low_water = outbound_capacity // 4
        self._low_water_bytes = outbound_bytes // 4
        self._drained: trio.Event | None = None  # the reader waits on it
        self.last_sent = self.opened  # when queued bytes were last written to the client
        self._refused_at = 0.0  # when the drain last refused a request of it (-32005 retryable)
        self._budget = budget if budget is not None else ByteBudget(sys.maxsize)
        self.buffers: Final = self._budget.open(self.conn_id, self._evicted)
        self.closed: Final = trio.Event()
        self._close_reason = CloseReason.CLIENT_CLOSED
        self._cancel_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None  # where requests that must wait run
        # A modern caller: the child's requests to it are bridged (gateway.core.bridge), not sent
        self._mrtr: Bridging | None = None
        self._flow: BridgedCall | None = None  # its bridged call, once the child asked for input
        # A connection without a task of its own (connection.Direct): its end, once closed
        self._on_close: Callable[[], None] | None = None
        # ... and what it is told when its last call ended (read by gateway.core.serving)
        self.on_settled: Callable[[], None] | None = None
        self._principal: Principal | None = None
        # the gateway's own URL elicitations (-32042) it was sent, not completed yet: their ids
        self.url_asks: list[str] | None = None

    # ---- the state machine ------------------------------------------------------------------

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def era(self) -> Era | None:
        """The era its first request pinned it to (None: nothing served yet)."""
        return self._era

    @property
    def protocol_version(self) -> str | None:
        """The revision ``initialize`` negotiated (None: not initialized)."""
        return self._protocol_version

    @property
    def initialized(self) -> bool:
        return self._protocol_version is not None

    @property
    def caps(self) -> mcp.ClientCaps:
        """The capabilities its ``initialize`` declared (none before)."""
        return self._caps

    @property
    def log_level(self) -> str | None:
        """The level it wants log messages at (None: none at all)."""
        return self._log_level

    @property
    def refused_at(self) -> float:
        """When the drain last refused a request of it (trio time; 0: never)."""
        return self._refused_at

    @property
    def close_reason(self) -> CloseReason:
        """Why it closed (the first reason given); ``client_closed`` while open."""
        return self._close_reason

    @property
    def mrtr(self) -> Bridging | None:
        """Era bridging, for a modern caller (its child's requests are asked in its call's
        ``InputRequiredResult``); None: a legacy caller is sent them."""
        return self._mrtr

    @property
    def flow(self) -> BridgedCall | None:
        """Its bridged call, once a child asked it for input."""
        return self._flow

    @property
    def nursery(self) -> trio.Nursery | None:
        """Where its requests that must wait run, while it is served."""
        return self._nursery

    @property
    def writer(self) -> MessageWriter | None:
        """The transport, while the connection is served."""
        return self._writer

    def choose_era(self, chosen: Era) -> None:
        """Its first request pins its era (once)."""
        if self._era is not None:
            raise RuntimeError(f"connection {self.conn_id}: its era is chosen already")
        event = SessionEvent.MODERN if chosen is Era.MODERN else SessionEvent.LEGACY
        self._state = next_state(self._state, event)
        self._era = chosen

    def check_initialize(self) -> None:
        """Raise InvalidRequest ``already_initialized`` when it is initialized already (a second
        ``initialize`` is refused; the negotiated revision stays)."""
        if self._protocol_version is not None:
            raise errors.InvalidRequest(
                f"initialize: this connection is already initialized (protocol "
                f"{self._protocol_version}); a second initialize is refused, the negotiated "
                "revision stays", reason="already_initialized")

    def initialize(self, version: str, caps: mcp.ClientCaps) -> None:
        """``initialize`` succeeded with revision ``version`` and the client's ``caps``.

        Raises:
            InvalidRequest: ``already_initialized`` (see :meth:`check_initialize`).
        """
        self.check_initialize()
        self._state = next_state(self._state, SessionEvent.INITIALIZED)
        self._protocol_version = version
        self._caps = caps

    def set_log_level(self, level: str | None) -> bool:
        """The client wants log messages at ``level``; True when that changed it."""
        if level == self._log_level:
            return False
        self._log_level = level
        return True

    def bridge_with(self, bridge: Bridging | None) -> None:
        """A modern caller's input requests go through ``bridge`` (set once; None: no-op)."""
        if self._mrtr is None:
            self._mrtr = bridge

    def set_flow(self, flow: BridgedCall) -> None:
        """A child asked its call ``flow`` for input."""
        self._flow = flow

    def end_flow(self, flow: BridgedCall) -> None:
        """``flow`` is over: its next call may ask for input afresh."""
        if self._flow is flow:
            self._flow = None

    def drain(self, now: float) -> None:
        """The daemon's drain refused a request of it at ``now`` (its close waits for it to
        settle)."""
        self._state = next_state(self._state, SessionEvent.DRAIN)
        self._refused_at = now

    def attach(self, writer: MessageWriter) -> None:
        """It is served: what it is sent is written to ``writer``."""
        self._writer = writer

    def run_in(self, nursery: trio.Nursery, *, cancel_scope: trio.CancelScope | None = None,
               on_close: Callable[[], None] | None = None,
               on_settled: Callable[[], None] | None = None) -> None:
        """Its requests that must wait run in ``nursery``; :meth:`close` cancels
        ``cancel_scope`` (its own task's) or calls ``on_close`` (a connection without a task
        of its own, which is told ``on_settled`` when a call ends and none is left)."""
        self._nursery = nursery
        self._cancel_scope = cancel_scope
        self._on_close = on_close
        self.on_settled = on_settled

    def detach(self) -> None:
        """It is no longer served: what it is sent from now on is queued (flushed, or
        dropped), and its close calls nothing."""
        self._writer = None
        self._on_close = None
        self.on_settled = None

    def move_call(self, old_id: int | str, new_id: int | str, call: Call) -> None:
        """``call`` (in flight under ``old_id``) goes on under ``new_id``: a bridged call's
        retry takes it over."""
        self.inflight.pop(old_id, None)
        self.inflight[new_id] = call

    def calls(self) -> list[Call]:
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

    def asked_url(self, elicitation_id: str) -> None:
        """The gateway sent it a URL elicitation (-32042) with this id (its latest 16 kept)."""
        asks = self.url_asks if self.url_asks is not None else []
        if elicitation_id not in asks:
            asks.append(elicitation_id)
            del asks[:-16]
        self.url_asks = asks

    def url_completed(self, elicitation_id: str) -> bool:
        """The interaction of that URL elicitation is over: when it was sent one with this id,
        it is told (``notifications/elicitation/complete``, to it alone); whether it was."""
        if not self.url_asks or elicitation_id not in self.url_asks:
            return False
        self.url_asks.remove(elicitation_id)
        params = jsonrpc.encode_dict({"elicitationId": elicitation_id})
        self.send(jsonrpc.encode_notification("notifications/elicitation/complete", params),
                  (jsonrpc.Goes.UNRELATED, None))
        return True

    def send(self, data: bytes, route: Route | None = None) -> bool:
        """Write one message to the client, or queue it.  Never blocks; on overflow the
        connection is closed.  Straight to the transport when nothing is queued (see
        :mod:`gateway.core.outbox`), with its routing hint ``route``."""
        if self._state is _CLOSED:  # (set with ``closed``)
            return False
        n = len(data)
        if self.queued_bytes + n > self.max_outbound_bytes:
            LOGGER.warning("connection %s: a message of %d bytes does not fit in the outbound "
                           "queue (%d bytes already queued toward the client, outbound_bytes %d); "
                           "disconnecting it", self.conn_id, n, self.queued_bytes,
                           self.max_outbound_bytes, extra=self.log_fields)
            self.close(CloseReason.OVERFLOW)
            return False
        writer = self._writer
        if self.queued == 0 and writer is not None:
            try:
                if writer.write_one(data, route):
                    return True
            except errors.TransportClosed:
                self.close(CloseReason.CLIENT_CLOSED)
                return False
            self._held, self._held_bytes = 1, n  # its rest is held by the transport
            self.outbound.wake()
        elif not self.outbound.put(data):
            LOGGER.warning("connection %s: outbound queue full, disconnecting a slow client",
                           self.conn_id, extra=self.log_fields)
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

    @property
    def held(self) -> int:
        """Messages handed to the transport that it has not written out yet."""
        return self._held

    def hold(self, count: int, size: int) -> None:
        """The transport holds ``count`` queued messages of ``size`` bytes in all, not yet
        written."""
        self._held, self._held_bytes = count, size

    def held_written(self) -> None:
        """The transport wrote out what it held."""
        n, count = self._held_bytes, self._held
        self._held = self._held_bytes = 0
        self.sent(n, count)

    def drop_outbound(self) -> None:
        """The connection is over: drop what is still queued and release all its bytes."""
        self._writer = None
        if self.queued:  # (nothing queued: the outbox is empty)
            self.outbound.clear()
        self.queued_bytes = 0
        self.queued = 0
        self._held = self._held_bytes = 0
        self.buffers.close()

    def _evicted(self) -> None:
        LOGGER.warning("connection %s: the gateway's message buffers are full "
                       "(buffered_bytes_total); closing this connection, which holds the most "
                       "(%d bytes)", self.conn_id,
                       self.buffers.held, extra=self.log_fields)
        self.close(CloseReason.OVERFLOW)

    def notify(self, method: str, params: Raw | bytes | UnsetType = UNSET) -> bool:
        return self.send(jsonrpc.encode_notification(method, params))

    def close(self, reason: CloseReason) -> None:
        """End the connection (idempotent); the first reason given is the one recorded."""
        if not self.closed.is_set():
            self._state = next_state(self._state, SessionEvent.CLOSE)
            self._close_reason = reason
            self.closed.set()
            if self._drained is not None:  # a reader waiting for the queue to drain
                self._drained.set()
                self._drained = None
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()
            if self._on_close is not None:
                finish, self._on_close = self._on_close, None
                finish()

    # ---- server→client requests ---------------------------------------------------------------

    def open_request(self, method: str, params: Any, *, send: bool = True) -> ServerRequest:
        """Record a request to this client and send it (unless ``send`` is false: a bridged
        flow asks for it in its ``InputRequiredResult``); the caller awaits ``req.done``."""
        if not self._id_salt:
            self._id_salt = _entropy.hex(3)
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

    def cancel_request(self, req: ServerRequest, outcome: ServerRequestOutcome,
                       reason: str) -> None:
        """End ``req`` without an answer and tell the client with ``notifications/cancelled``
        (if it was sent one: a modern caller was asked in an ``InputRequiredResult``)."""
        if req.finish(outcome) and req.sent:
            self.notify("notifications/cancelled",
                        jsonrpc.encode_dict({"requestId": req.id, "reason": reason}))

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
            raise errors.InvalidRequest(
                f"request id {client_id!r} is already in flight on this connection")
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
