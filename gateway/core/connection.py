"""Serving one client connection: read, dispatch, write.

A transport hands over a :class:`MessageStream` (whole messages; its exceptions already mapped to
:class:`~gateway.errors.TransportClosed` / :class:`~gateway.errors.MessageTooLarge`); a message
comes as bytes (WebSocket, unix) or already decoded (:data:`Decoded`, an HTTP POST's body).
:func:`serve` runs a reader loop and a flusher task; the reader decodes what is not decoded yet
(:func:`gateway.protocol.jsonrpc.decode_batch`), refuses what it must (:func:`refusal`) and hands
each request to :func:`gateway.core.serving.serve_request`.  An :class:`InlineStream` (an HTTP
session) serves a message in the task that received it when nothing waits before it; a
:class:`Direct` (a stateless HTTP request) has no reader at all.  A cancelled request gets no
response.  JSON-RPC errors are made by :func:`gateway.core.serving.error_response` only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec
import trio

from gateway import errors
from gateway.core.outbox import MessageWriter
from gateway.core.serving import ServingPorts, error_response, serve_request
from gateway.core.session import AnswerOutcome, ClientSession
from gateway.errors import CloseReason
from gateway.events import AnswerRefused, ConnectionClosed, ConnectionOpened, ServerRequestOutcome
from gateway.protocol import era, jsonrpc, mcp
from gateway.protocol.era import Era

if TYPE_CHECKING:
    from gateway.auth.principal import Principal
    from gateway.limits import ByteBudget

LOGGER = logging.getLogger(__name__)

#: Messages the flusher hands a transport in one go at most (one syscall).
WRITE_BATCH = 64
#: A batch stops growing past this many bytes (the transport copies a batch while framing it).
WRITE_BATCH_BYTES = 1 << 20
#: Room kept in ``outbound_bytes`` for the -32006 errors that replace a batch's answers that do
#: not fit (see :class:`_BatchCollector`).
BATCH_RESERVE = 64 * 1024
#: Messages handled in one task step at most: one client's burst of pipelined requests must not
#: hold the other connections' tasks back for milliseconds (fair sharing).
SLICE = 8
#: Bound on delivering the last queued messages (e.g. an error before closing) to a client.
FLUSH_TIMEOUT = 2.0


#: A message its transport decoded already (an HTTP POST's body): one envelope with its kind,
#: size and, when decoded too, its params' top level; or a batch's entries
#: (:func:`gateway.protocol.jsonrpc.decode_batch`).
Decoded = (tuple[jsonrpc.Envelope, jsonrpc.Kind, int, "dict[str, msgspec.Raw] | None"]
           | list[jsonrpc.BatchEntry])


class MessageStream(MessageWriter, Protocol):
    """A bidirectional stream of whole JSON-RPC messages (one per WebSocket frame or line);
    its write side is a :class:`~gateway.core.outbox.MessageWriter`."""

    async def receive(self) -> bytes | Decoded:
        """The next message, as bytes or already decoded.  Raises TransportClosed or
        MessageRefused."""
        ...

    async def aclose(self, reason: str) -> None: ...


@runtime_checkable
class InlineStream(MessageStream, Protocol):
    """A stream whose messages arrive in other tasks (an HTTP session's POSTs): it hands one
    to ``inline`` to have it served at once in that task (True), saving the reader's wake-up;
    False: queue it for the reader (it must wait behind others, or the session is backlogged)."""

    inline: Callable[[Decoded], bool] | None


@runtime_checkable
class BufferedStream(MessageStream, Protocol):
    """A stream that tells how many messages it holds from reads already made: while it holds
    none, :meth:`receive` reads, and so lets the other tasks run."""

    @property
    def buffered(self) -> int: ...


class ConnectionPorts(ServingPorts, Protocol):
    """What a connection needs: serving's ports, the daemon-wide byte budget, the message limits,
    and where its session registers while it is open."""

    def session_opened(self, session: ClientSession) -> None: ...

    def session_left(self, session: ClientSession) -> None:
        """The connection closed (its calls are cancelled next, then :meth:`session_closed`)."""
        ...

    @property
    def budget(self) -> ByteBudget: ...
    @property
    def max_message_bytes(self) -> int: ...
    @property
    def max_json_depth(self) -> int: ...


def _open(ports: ConnectionPorts, stream: MessageStream, transport: str,
          bind: Callable[[ClientSession], None] | None) -> ClientSession:
    """A connection's session, registered with the hub."""
    cfg = ports.cfg.gateway
    session = ClientSession(transport, outbound_capacity=cfg.outbound_queue,
                            max_inflight=cfg.max_inflight_per_connection,
                            outbound_bytes=cfg.outbound_bytes, budget=ports.budget)
    if bind is not None:
        bind(session)
    session.attach(stream)
    ports.session_opened(session)
    ports.bus.emit(ConnectionOpened(session.conn_id, transport))
    if LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("connection %s opened (%s)", session.conn_id, transport,
                     extra=session.log_fields)
    return session


def _release(ports: ConnectionPorts, session: ClientSession) -> None:
    """What a closed connection holds goes: it leaves the hub, the requests it was sent end,
    its calls are cancelled, the backends forget it."""
    session.detach()  # what is sent from now on is queued: flushed, or dropped
    ports.session_left(session)
    ports.connections_changed()
    if session.server_requests:
        session.end_all_requests(ServerRequestOutcome.OWNER_GONE)
    if session.inflight:
        for served in list(session.inflight.values()):  # calls forwarded without a task
            served.cancel()
    ports.session_closed(session)
    flow = session.flow
    if flow is not None:
        flow.closed()


def _closed(ports: ConnectionPorts, session: ClientSession, transport: str) -> None:
    session.drop_outbound()  # every byte it still had charged is released here
    reason = session.close_reason
    ports.bus.emit(ConnectionClosed(session.conn_id, transport, reason,
                                  session.now() - session.opened))
    if LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("connection %s closed: %s", session.conn_id, reason,
                     extra=session.log_fields)


async def serve(ports: ConnectionPorts, stream: MessageStream, transport: str,
                bind: Callable[[ClientSession], None] | None = None) -> None:
    """Serve one client connection until it closes; never raises for client misbehaviour.

    ``bind`` is told the connection's :class:`ClientSession` before anything is read (an HTTP
    session's stream asks it whether calls are in flight)."""
    session = _open(ports, stream, transport, bind)
    try:
        async with trio.open_nursery() as nursery:
            session.run_in(nursery, cancel_scope=nursery.cancel_scope)
            nursery.start_soon(_writer, session, stream)
            reply = _replier(session)  # one for every message of the connection (a batch: its own)
            if isinstance(stream, InlineStream):
                stream.inline = partial(_inline, ports, session, nursery, reply)
            try:
                await _reader(ports, session, stream, nursery, reply)
            finally:
                if isinstance(stream, InlineStream):
                    stream.inline = None
            session.close(CloseReason.CLIENT_CLOSED)
    except Exception:
        LOGGER.exception("connection %s: unexpected error", session.conn_id,
                         extra=session.log_fields)
        session.close(CloseReason.ERROR)
    finally:
        with trio.CancelScope(shield=True):
            try:
                _release(ports, session)
                await _flush(session, stream)
                with trio.move_on_after(FLUSH_TIMEOUT):
                    await stream.aclose(session.close_reason)
            except Exception:  # a bug must end this connection only, never the daemon
                LOGGER.exception("connection %s: error while closing", session.conn_id,
                                 extra=session.log_fields)
            _closed(ports, session, transport)


class DirectStream(MessageStream, Protocol):
    def abort(self) -> None:
        """End every open stream of it at once (it is closed)."""
        ...


class Direct:
    """A connection served without a task of its own: a modern (2026-07-28) HTTP request's flow.

    Its one message is handled in the caller's task (:meth:`handle`); what must wait (the slow
    path, a bridged flow's timers) runs in ``nursery``, a long-lived one, and a flusher task is
    started there only when a write did not fit.  :meth:`finish` ends it (idempotent): called
    inline when its call ends (the ``on_settled`` of ``ClientSession.run_in``, in the task
    that answered it) or its POST's task stops waiting, or from a task when it is closed by
    anything else (``on_close``: overflow, a bridged flow ending, drain).
    Saves the two tasks and the inbox a served connection costs per request.
    """

    __slots__ = ("done", "nursery", "ports", "session", "stream", "transport", "writer_scope")

    def __init__(self, ports: ConnectionPorts, stream: DirectStream, nursery: trio.Nursery,
                 transport: str, bind: Callable[[ClientSession], None] | None = None) -> None:
        self.ports = ports
        self.stream = stream
        self.nursery = nursery
        self.transport = transport
        self.done = False
        self.writer_scope: trio.CancelScope | None = None
        session = self.session = _open(ports, stream, transport, bind)
        session.choose_era(Era.MODERN)  # its request was judged modern at the edge already
        session.run_in(nursery, on_close=self._finish_soon, on_settled=self._settled)
        session.outbound.on_wake = self._start_writer

    def _finish_soon(self) -> None:
        try:
            self.nursery.start_soon(self._finish_task)
        except RuntimeError:  # the listener's nursery is closed (the service is unwinding)
            self.finish()

    def _settled(self) -> None:
        """Its call ended: it is over, unless the call answered ``input_required`` and waits
        for the retry (a bridged flow past its first round: that retry's POST ends it)."""
        flow = self.session.flow
        if flow is None or flow.round == 0:
            self.finish()

    def handle(self, env: jsonrpc.Envelope, kind: jsonrpc.Kind, size: int,
               params: dict[str, msgspec.Raw] | None = None,
               judged: era.Modern | None = None) -> None:
        """Its one message, decoded by the transport (the refusals of :func:`refusal` apply;
        ``judged``: its ``_meta`` as the transport judged it, see :func:`serve_request`)."""
        _dispatch(self.ports, self.session, env, kind, size, self.nursery, _replier(self.session),
                  in_batch=False, params=params, judged=judged)

    def _start_writer(self) -> None:
        if not self.done:
            self.writer_scope = trio.CancelScope()
            self.nursery.start_soon(self._write)

    async def _write(self) -> None:
        assert self.writer_scope is not None
        with self.writer_scope:
            await _writer(self.session, self.stream)

    async def _finish_task(self) -> None:
        self.finish()

    def finish(self) -> None:
        """Close it and release everything it holds (once)."""
        if self.done:
            return
        self.done = True
        session = self.session
        session.detach()
        session.close(CloseReason.CLIENT_CLOSED)  # no-op when something else closed it
        if self.writer_scope is not None:
            self.writer_scope.cancel()
        try:
            _release(self.ports, session)
            self.stream.abort()
        except Exception:  # a bug must end this connection only, never the daemon
            LOGGER.exception("connection %s: error while closing", session.conn_id,
                             extra=session.log_fields)
        _closed(self.ports, session, self.transport)


async def _flush(session: ClientSession, stream: MessageStream) -> None:
    """Deliver what is still held or queued (e.g. the error explaining a close), bounded."""
    if session.close_reason in (CloseReason.OVERFLOW, CloseReason.CLIENT_CLOSED):
        return
    with trio.move_on_after(FLUSH_TIMEOUT):
        try:
            await stream.flush()
            while True:
                batch, _size = session.outbound.take(WRITE_BATCH, WRITE_BATCH_BYTES)
                if not batch:
                    return
                if not stream.write_nowait(batch):
                    await stream.flush()
        except errors.TransportClosed:
            return


async def _writer(session: ClientSession, stream: MessageStream) -> None:
    """The flusher: writes what :meth:`ClientSession.send` could not write at once.

    Woken only when something is queued or held (see :mod:`gateway.core.outbox`); hands the
    transport what piled up meanwhile in batches, and waits for it to take them.
    """
    outbound = session.outbound
    try:
        while True:
            if session.held:
                await stream.flush()
                session.held_written()
            batch, size = outbound.take(WRITE_BATCH, WRITE_BATCH_BYTES)
            if not batch:
                await outbound.wait()
                continue
            if stream.write_nowait(batch):
                session.sent(size, len(batch))
            else:
                session.hold(len(batch), size)
    except errors.TransportClosed:
        session.close(CloseReason.CLIENT_CLOSED)


async def _reader(ports: ConnectionPorts, session: ClientSession, stream: MessageStream,
                  nursery: trio.Nursery, reply: Reply) -> None:
    """Read and dispatch messages until the client closes (``reply``: the session's
    :func:`_replier`).

    Backpressure: a transport hands out the messages it already holds without a checkpoint, so
    a burst of pipelined requests would be handled (and its answers queued) without the writer
    ever running.  Above the outbound queue's high water the reader waits for the writer to
    drain it (see :meth:`ClientSession.wait_drained`); when not backlogged that costs two int
    comparisons per message and no checkpoint.
    """
    handled = 0  # messages since the last read (a stream that does not say: since the last pause)
    held = stream if isinstance(stream, BufferedStream) else None
    while not session.closed.is_set():
        if session.queued > session.high_water or session.queued_bytes > session.high_water_bytes:
            await _wait_drained(session, ports.cfg.gateway.write_stall_timeout)
            continue
        if held is not None and not held.buffered:
            handled = 0  # receive reads: the other tasks run meanwhile
        else:
            handled += 1
            if handled == SLICE:  # a long run of pipelined messages: let the other tasks run
                handled = 0
                await trio.lowlevel.checkpoint()
        try:
            data = await stream.receive()
        except errors.TransportClosed:
            return
        except errors.MessageRefused as exc:
            if exc.reason is not None:
                session.send(error_response(None, errors.InvalidRequest(
                    str(exc), reason=exc.reason, **exc.data)))
            session.close(exc.close_reason)
            return
        if isinstance(data, bytes):
            if data[:1] != b"{" and jsonrpc.is_batch(data):  # (a message: no call to tell)
                _handle_batch(ports, session, data, nursery)
            else:
                _handle(ports, session, data, nursery, reply)
        else:
            _take(ports, session, data, nursery, reply)


def _inline(ports: ConnectionPorts, session: ClientSession, nursery: trio.Nursery,
            reply: Reply, message: Decoded) -> bool:
    """Serve ``message`` in the caller's task, as the reader would at once (see
    :class:`InlineStream`); False when it must go through the reader (backlogged, closed)."""
    if (session.closed.is_set() or session.queued > session.high_water
            or session.queued_bytes > session.high_water_bytes):
        return False
    try:
        _take(ports, session, message, nursery, reply)
    except Exception:  # a bug must end this connection only, as in its reader
        LOGGER.exception("connection %s: unexpected error", session.conn_id,
                         extra=session.log_fields)
        session.close(CloseReason.ERROR)
    return True


def _take(ports: ConnectionPorts, session: ClientSession, message: Decoded,
          nursery: trio.Nursery, reply: Reply) -> None:
    """A message its transport decoded; ``reply``: the session's :func:`_replier`."""
    if type(message) is tuple:
        env, kind, size, params = message
        _dispatch(ports, session, env, kind, size, nursery, reply, in_batch=False,
                  params=params)
    else:
        assert isinstance(message, list)
        _serve_batch(ports, session, message, nursery)


async def _wait_drained(session: ClientSession, stall: float) -> None:
    """Wait until the client has taken its answers down to low water; a client that takes none
    of them for ``stall`` seconds (``write_stall_timeout``) is disconnected (``overflow``): with
    its reader stopped it would otherwise hold the connection and its buffers forever."""
    stopped = trio.current_time()
    while not session.closed.is_set():
        deadline = max(session.last_sent, stopped) + stall
        with trio.move_on_at(deadline):
            await session.wait_drained()
            return
        if trio.current_time() >= max(session.last_sent, stopped) + stall:
            LOGGER.warning("connection %s: took none of its %d queued answers (%d bytes) for "
                           "%gs (write_stall_timeout); disconnecting it", session.conn_id,
                           session.queued, session.queued_bytes, stall, extra=session.log_fields)
            session.close(CloseReason.OVERFLOW)
            return


class _BatchCollector:
    """Gathers the responses to one batch and sends them as one array.

    The answers collected so far are charged to the session's byte account (``/status``
    ``buffered_bytes``, and ``buffered_bytes_total`` evicts as for any queue) until the array is
    queued.  The array is one message, so it must fit in ``max_message_bytes`` (what a peer of
    the gateway accepts, e.g. ``mcp-gateway connect``) and in ``outbound_bytes``: an answer that
    would take the collected ones past the smaller, less :data:`BATCH_RESERVE`, is replaced by a
    -32006 ``overloaded`` error for its id (the call ran; its result is dropped).  A batch has
    at most ``max_inflight_per_connection`` items, so those errors fit in the reserve.
    """

    def __init__(self, session: ClientSession, max_message: int) -> None:
        self._session = session
        self._parts: list[bytes] = []
        self._size = 1  # bytes of the array so far: "[", and per part its bytes and "," or "]"
        self._bound = min(session.max_outbound_bytes, max_message)
        self._limit = max(self._bound - BATCH_RESERVE, self._bound // 2)
        self._open = 0
        self._sealed = False
        self._dropped = 0

    def expect(self) -> Callable[[bytes | None, int | str | None], None]:
        self._open += 1

        def deliver(data: bytes | None, id: int | str | None = None) -> None:
            if data is not None:
                if self._size + len(data) + 1 > self._limit:
                    self._dropped += len(data)
                    data = error_response(id, errors.Overloaded(
                        "the answers to this batch would not fit in one message; "
                        "send this request again on its own", limit=self._bound))
                self._parts.append(data)
                self._size += len(data) + 1
                self._session.buffers.charge(len(data))  # may evict this connection
            self._open -= 1
            self._maybe_send()

        return deliver

    def seal(self) -> None:
        self._sealed = True
        self._maybe_send()

    def _maybe_send(self) -> None:
        if self._sealed and self._open == 0 and self._parts:
            session = self._session
            if self._dropped:
                LOGGER.warning("connection %s: a batch's answers would pass %d bytes "
                               "(max_message_bytes, outbound_bytes); %d bytes of results "
                               "replaced by -32006 errors", session.conn_id, self._bound,
                               self._dropped, extra=session.log_fields)
            session.buffers.release(self._size - 1 - len(self._parts))  # charged again by send()
            session.send(b"[" + b",".join(self._parts) + b"]")
            self._parts = []


Reply = Callable[[bytes | None, int | str | None], None]


def _replier(session: ClientSession) -> Reply:
    """How a message's answer reaches ``session`` (sent at once, with its routing hint: one
    array collects a batch's)."""
    send = session.send
    answer = jsonrpc.Goes.ANSWER

    def reply(message: bytes | None, id: int | str | None = None) -> None:
        if message is not None:
            send(message, (answer, id))

    return reply


def _handle(ports: ConnectionPorts, session: ClientSession, data: bytes,
            nursery: trio.Nursery, reply: Reply) -> None:
    """One message (not a batch); ``reply``: the session's :func:`_replier`."""
    try:
        env = jsonrpc.decode(data, ports.max_json_depth)
        kind = jsonrpc.classify(env)
    except errors.GatewayError as exc:
        bad_id = exc.data.pop("id", None)
        session.send(error_response(bad_id, exc))
        return
    _dispatch(ports, session, env, kind, len(data), nursery, reply, in_batch=False)


def _handle_batch(ports: ConnectionPorts, session: ClientSession, data: bytes,
                  nursery: trio.Nursery) -> None:
    """A batch (:func:`gateway.protocol.jsonrpc.decode_batch`): refused as a whole with one
    error, or each entry handled and the answers sent as one array (an invalid entry's -32600
    among them)."""
    try:
        entries = jsonrpc.decode_batch(data, session.protocol_version, session.max_inflight,
                                       ports.max_json_depth)
    except errors.GatewayError as exc:
        session.send(error_response(None, exc))
        return
    _serve_batch(ports, session, entries, nursery)


def _serve_batch(ports: ConnectionPorts, session: ClientSession, entries: list[jsonrpc.BatchEntry],
                 nursery: trio.Nursery) -> None:
    """A decoded batch's entries, answered as one array."""
    collector = _BatchCollector(session, ports.max_message_bytes)
    for entry in entries:
        reply = collector.expect()
        if entry.env is None:
            assert entry.error is not None
            reply(error_response(None, entry.error), None)
        else:
            assert entry.kind is not None
            _dispatch(ports, session, entry.env, entry.kind, entry.size, nursery, reply,
                      in_batch=True)
    collector.seal()


def _dispatch(ports: ConnectionPorts, session: ClientSession, env: jsonrpc.Envelope,
              kind: jsonrpc.Kind, size: int, nursery: trio.Nursery, reply: Reply, *,
              in_batch: bool, params: dict[str, msgspec.Raw] | None = None,
              judged: era.Modern | None = None) -> None:
    """A decoded message: a request is served (or refused), anything else taken in; ``reply``
    is called once (with None when there is nothing to answer now)."""
    if kind == "request":
        assert (type(env.id) is int or type(env.id) is str) and type(env.method) is str
        refused = refusal(ports, session, env) if ports.draining else None
        if refused is not None:
            session.drain(trio.current_time())  # its close waits for it to settle
            reply(error_response(env.id, refused), env.id)
            return
        if env.method == "initialize" and in_batch:
            reply(error_response(env.id, errors.InvalidRequest(
                "initialize must not be part of a batch")), env.id)
            return
        try:
            session.check_new_call(env.id, size)
        except errors.GatewayError as exc:
            reply(error_response(env.id, exc), env.id)
            return
        serve_request(ports, session, env, env.id, env.method, size, reply, params, judged)
        return
    reply(None, None)
    if kind == "notification":
        assert isinstance(env.method, str)
        _on_notification(ports, session, env.method, env)
    else:
        outcome = session.on_answer(env)
        if outcome is AnswerOutcome.REFUSED:
            LOGGER.warning("connection %s answered unknown request id %.100r: refused",
                           session.conn_id, env.id, extra=session.log_fields)
            ports.bus.emit(AnswerRefused(session.conn_id, "unknown_id"))


def refusal(ports: ConnectionPorts, session: ClientSession | None,
            env: jsonrpc.Envelope) -> errors.GatewayError | None:
    """Why request ``env`` of ``session`` (None: a session it would create) is refused before it
    starts, on every transport; None: it is served.  While the gateway drains, a request never
    started is safe elsewhere: -32005 ``shutdown``, ``retryable`` (an HTTP POST gets it with 503
    and ``Retry-After``), unless it continues a parked bridged call (an answer, in effect)."""
    if ports.draining and (session is None or not _continues_flow(ports, session, env)):
        return errors.Denied("the gateway is shutting down; send this request elsewhere",
                             reason="shutdown", retryable=True)
    return None


def scope_refusal(ports: ConnectionPorts, principal: Principal | None,
                  env: jsonrpc.Envelope) -> errors.GatewayError | None:
    """Why request ``env`` is refused before anything else when ``principal``'s token lacks
    scopes a policy rule wants for it (``insufficient_scope`` with those ``scopes``: an HTTP
    client is told to step up, 403); None: not for that.  A connection of another transport
    is refused the same by the policy when its call is served."""
    if principal is None or not isinstance(env.method, str):
        return None
    missing = ports.policy.missing_scopes(principal, env.method, env.params)
    if not missing:
        return None
    return errors.Denied(f"insufficient scope: this request needs {' '.join(missing)}",
                         reason="insufficient_scope", scopes=missing)


def _continues_flow(ports: ConnectionPorts, session: ClientSession, env: jsonrpc.Envelope) -> bool:
    """Whether a request is the retry of this connection's parked bridged call (it carries the
    call's ``requestState``, gateway.core.bridge): it answers the prompts of a call already running,
    so a drain lets it in like any answer.  (A new call to a modern backend carrying that
    backend's own state is not one: :meth:`~gateway.core.bridge.Bridge.continues`.)"""
    if not any((f := s.flow) is not None and f.parked and f.method == env.method
               for s in session.inflight.values()):
        return False
    try:
        params = jsonrpc.params_dict(env.params)
    except errors.GatewayError:
        return False
    assert isinstance(env.method, str)
    return ports.bridge.continues(env.method, params)


def _on_notification(ports: ConnectionPorts, session: ClientSession, method: str,
                     env: jsonrpc.Envelope) -> None:
    if method == "notifications/cancelled":
        try:
            request_id = mcp.decode_cancelled(env.params).requestId
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        if ports.listens.end(session, request_id):  # a listen ends with its result (2026-07-28)
            return
        served = session.inflight.get(request_id)
        if served is not None:
            served.cancel()
    elif method == "notifications/initialized":
        pass
    elif method == "notifications/roots/list_changed":
        ports.roots_changed(session)
    else:
        LOGGER.debug("connection %s: ignored notification %s", session.conn_id, method,
                     extra=session.log_fields)


