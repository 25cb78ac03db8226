"""An HTTP session of the legacy Streamable HTTP shape (2025-03-26 … 2025-11-25): one
:class:`~gateway.core.connection.MessageStream` fed by POSTs and written to their response
streams.

An HTTP session is served like any connection, by ``connection.serve`` for its whole life.  A
POSTed message arrives decoded (:meth:`HttpSession.push`); every outgoing message goes to exactly
one open response stream (a :class:`Sink`), chosen by the routing hint the core sends with it.
A legacy session's SSE events carry ids and are kept in a bounded replay log
(:mod:`gateway.transports.replay`) so ``GET`` with ``Last-Event-ID`` can resume a broken stream."""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import trio
from msgspec import UNSET, Raw, UnsetType

from gateway import errors
from gateway.errors import CloseReason, TransportClosed
from gateway.protocol.jsonrpc import Goes
from gateway.transports.replay import ReplayLog, format_id
from gateway.wakeup import Wakeup

if TYPE_CHECKING:
    from gateway.auth.principal import Principal
    from gateway.core.bridge import Bridge
    from gateway.core.connection import Decoded, Direct
    from gateway.core.session import ClientSession
    from gateway.protocol.jsonrpc import Route
    from gateway.transports.http import HttpConnection

LOGGER = logging.getLogger(__name__)

#: Messages parked for a session with no stream open.
PARK_MAX = 64
PARK_MAX_BYTES = 1 << 20
#: Bytes of sent events a session keeps for ``Last-Event-ID`` resumption.
REPLAY_MAX_BYTES = 256 * 1024
#: The revision from which a POST stream opens with a priming event (older clients may try to
#: parse its empty data as JSON).
PRIMING_VERSION = "2025-11-25"
#: Messages POSTed and not yet read by the session's reader (it reads at once unless the
#: session is backlogged); a POST beyond it gets 503.
INBOX_MAX = 256
#: Notifications that relate to no request: they go to the GET stream only.
UNRELATED = frozenset({
    "notifications/tools/list_changed", "notifications/prompts/list_changed",
    "notifications/resources/list_changed", "notifications/resources/updated",
})
SESSION_HEADER = "mcp-session-id"

RequestId = int | str


class _Out(msgspec.Struct):
    id: RequestId | UnsetType | None = UNSET
    method: str | UnsetType = UNSET
    params: Raw | UnsetType = UNSET


class _ProgressParams(msgspec.Struct):
    progressToken: RequestId | None = None


class _Code(msgspec.Struct):
    code: int = 0


class _Error(msgspec.Struct):
    error: _Code | None = None


#: Modern errors answered with HTTP 400 (2026-07-28 Streamable HTTP).
_HTTP_400 = frozenset({errors.HEADER_MISMATCH, errors.MISSING_CAPABILITY,
                       errors.UNSUPPORTED_VERSION})
_error = msgspec.json.Decoder(_Error)
_out = msgspec.json.Decoder(_Out)
_outs = msgspec.json.Decoder(list[_Out])
_progress = msgspec.json.Decoder(_ProgressParams)


class Sink:
    """One response stream of a session: a POST's (``request_id`` set; a batch POST has
    ``batch``) or the GET stream (``stream`` 0).  Its connection task waits in
    :meth:`HttpConnection.watch` under ``scope`` until :attr:`done` or until ``conn`` is no
    longer its connection (detached, or resumed on another)."""

    __slots__ = ("ahead", "answered", "batch", "conn", "done", "ids", "invalid", "request_id",
                 "scope", "session_id", "started", "stream", "token")

    def __init__(self, conn: HttpConnection | None, session_id: str,
                 request_id: RequestId | None = None,
                 *, batch: bool = False, stream: int | None = None) -> None:
        self.conn = conn  # None: detached (its connection broke; it may be resumed)
        self.session_id = session_id
        self.request_id = request_id
        self.batch = batch
        self.ids: frozenset[RequestId] = frozenset()  # a batch POST's request ids
        self.invalid = 0  # a batch POST's invalid entries (answered in its array, id null)
        self.token: RequestId | None = None
        self.stream = stream  # its number in event ids; None: no ids (a modern flow, a batch)
        self.started = False  # SSE head written
        self.done = False
        self.scope: trio.CancelScope | None = None
        self.answered: trio.Event | None = None  # set with ``done`` (see endpoint._hold)
        # its task reads the peer's next request meanwhile: an answer written whole does not
        # wake it (one that the socket did not take whole does, to flush it)
        self.ahead = False

    def deliver(self, message: bytes, final: bool, event_id: bytes | None = None) -> bool:
        """Write ``message`` (``final``: the response that ends this stream).  True when all
        written.  Raises TransportClosed when the peer is gone."""
        conn = self.conn
        assert conn is not None
        if final:
            self.done = True
            if self.answered is not None:
                self.answered.set()
            if self.scope is not None and not self.ahead:
                self.scope.cancel()
            try:
                if not self.started:  # answered before anything else: a plain JSON response
                    status = (200 if self.session_id or b'"error"' not in message
                              else self._status(message))
                    whole = conn.respond_json(status, message, self.session_id)
                else:
                    conn.event(message, event_id)
                    whole = conn.end_events()
            except TransportClosed:
                self.wake()
                raise
            if not whole:
                self.wake()  # its task flushes it
            return whole
        return conn.event(message, event_id)

    def _status(self, message: bytes) -> int:
        """For a sessionless answer that may be an error: 200, or 400 for a modern request
        refused with an error the 2026-07-28 HTTP transport answers with 400 (missing
        capability, header mismatch, unsupported version)."""
        try:
            error = _error.decode(message).error
        except (msgspec.ValidationError, msgspec.DecodeError):
            return 200
        return 400 if error is not None and error.code in _HTTP_400 else 200

    def _headers(self) -> list[tuple[str, str]]:
        """A modern (2026-07-28) flow has no session: no ``Mcp-Session-Id`` is sent."""
        return [(SESSION_HEADER, self.session_id)] if self.session_id else []

    def start(self, priming_id: bytes | None = None) -> None:
        assert self.conn is not None
        self.started = True
        self.conn.start_events(self._headers())
        if priming_id is not None:
            self.conn.priming_event(priming_id)

    def finish_soon(self) -> None:
        self.done = True
        if self.answered is not None:
            self.answered.set()
        if self.scope is not None:
            self.scope.cancel()

    def wake(self) -> None:
        """Its connection task looks again (it is no longer this sink's connection)."""
        if self.answered is not None:
            self.answered.set()
        if self.scope is not None:
            self.scope.cancel()


class HttpSession:
    """A legacy Streamable HTTP session as a :class:`~gateway.core.connection.MessageStream`.

    An HTTP session is served like any connection, by ``connection.serve(hub, session, "http")``
    for its whole life (one :class:`~gateway.core.session.ClientSession`, one owner for the
    routing core). A POSTed message arrives decoded (:meth:`HttpSession.push`) and is served in
    the POST's task, or queued for the session's reader when others wait before it (a bounded
    inbox). :meth:`HttpSession.write_nowait` puts every outgoing message on one open response
    stream (a :class:`Sink`), chosen by the routing hint the core sends with it (a message
    without one is parsed for it):

    - a response goes to the POST that carries its request id (a batch's array to the batch
      POST whose ids it answers); with that POST's stream gone it is dropped (the call goes
      on);
    - ``notifications/progress`` goes to the POST whose request carried that
      ``progressToken``;
    - list and resource-update notifications (unrelated to any request) go to the GET stream
      (a modern flow, which has none, gets them only for its ``subscriptions/listen``: to its
      POST);
    - anything else (log messages, server→client requests) goes to the only open POST stream
      when there is exactly one, else to the GET stream, else to the oldest open POST;
    - with no stream open it is parked (at most :data:`PARK_MAX` messages,
      :data:`PARK_MAX_BYTES` bytes) until the GET stream opens; beyond that the oldest is
      dropped and counted.

    A POST's response is JSON when the response is the first thing for it, else an SSE stream
    that the response ends; a modern flow's -32020/-32021/-32022 errors get status 400.
    Resumption (:mod:`gateway.transports.replay`): a legacy session's SSE events carry ids and
    are kept in its replay log (:data:`REPLAY_MAX_BYTES`); a POST stream whose connection breaks
    is kept detached until its response, and ``GET`` with ``Last-Event-ID``
    (:meth:`HttpSession.resume`) replays and re-attaches it. Writes are synchronous; what a
    socket does not take is held by it and :meth:`HttpSession.flush` waits for all of them. The
    session ends on DELETE or after ``http_session_idle_timeout`` idle (:meth:`receive` then
    raises TransportClosed).
    """

    def __init__(self, idle_timeout: float, *, id: str | None = None, tag: str = "") -> None:
        # visible ASCII, 192 random bits, led by ``<tag>.`` (the replica id: a load balancer
        # routes a session's requests to the replica that minted it, see README "Replicas
        # behind HAProxy"); "" for a modern flow (no session id)
        if id is None:
            id = f"{tag}.{secrets.token_urlsafe(24)}" if tag else secrets.token_urlsafe(24)
        self.id = id
        self.idle_timeout = idle_timeout
        self.client: ClientSession | None = None  # bound by connection.serve
        self.mrtr: Bridge | None = None  # a modern flow's: its child's requests are bridged
        self.direct: Direct | None = None  # a modern flow's: served without a task of its own
        self.principal: Principal | None = None  # who opened it (gateway.auth); bound for its life
        self.closed = False
        # when a stream last ended: read by its reader only (a modern flow has none)
        self.last_active = trio.current_time() if id else 0.0
        self.dropped = 0  # messages no stream could take (logged once per session)
        self._inbox: deque[Decoded] = deque()
        # serves a POSTed message in the POST's task (set by gateway.core.connection.serve)
        self.inline: Callable[[Decoded], bool] | None = None
        self._wakeup = Wakeup()
        self._posts: dict[RequestId, Sink] = {}
        self._batches: deque[Sink] = deque()
        self._tokens: dict[RequestId, Sink] = {}
        self._detached: dict[int, Sink] = {}  # POST streams whose connection broke, by stream
        self._streams = 0  # POST streams numbered so far
        self.replay = ReplayLog(REPLAY_MAX_BYTES)
        self.get: Sink | None = None
        self._parked: deque[bytes] = deque()
        self._parked_bytes = 0
        self._dirty: set[HttpConnection] = set()  # connections holding bytes not yet written

    # ---- the POST/GET side ------------------------------------------------------------------

    def bind(self, client: ClientSession) -> None:
        self.client = client
        client.bridge_with(self.mrtr)
        if self.principal is not None:  # (a new client has none)
            client.principal = self.principal

    def push(self, message: Decoded) -> bool:
        """A POSTed message, decoded, for the reader; False when the inbox is full."""
        if self.closed or len(self._inbox) >= INBOX_MAX:
            return False
        self.last_active = trio.current_time()
        if not self._inbox and self.inline is not None and self.inline(message):
            return True
        self._inbox.append(message)
        self._wakeup.set()
        return True

    def has_request(self, request_id: RequestId) -> bool:
        """Whether a POST of this session still open carries request ``request_id`` (alone or
        in a batch): another with that id would have its answer routed to the wrong POST."""
        return request_id in self._posts or any(request_id in s.ids for s in self._batches)

    def token_in_use(self, token: RequestId) -> bool:
        """Whether a request of this session still open carries progress token ``token``."""
        return token in self._tokens or any(s.token == token for s in self._detached.values())

    def open_post(self, sink: Sink) -> None:
        if sink.batch:
            self._batches.append(sink)
        else:
            assert sink.request_id is not None
            self._posts[sink.request_id] = sink
            if sink.token is not None:
                self._tokens[sink.token] = sink
            if self.id:  # a legacy session's stream: its events get ids
                self._streams += 1
                sink.stream = self._streams

    def start_stream(self, sink: Sink) -> None:
        """The SSE head of ``sink`` (and a priming event for a 2025-11-25 POST stream)."""
        prime = None
        if (sink.stream and self.client is not None
                and self.client.protocol_version == PRIMING_VERSION):
            prime = format_id(sink.stream, self.replay.next_seq())
        sink.start(prime)

    def cancelled(self, request_id: RequestId) -> None:
        """The client cancelled ``request_id``: a cancelled request gets no response, so its
        POST's stream ends now, empty (an answer already on its way is dropped: the client
        ignores it anyway); a batch POST's once every request in it was cancelled."""
        sink = self._posts.get(request_id)
        if sink is None:
            sink = next((s for s in self._batches if request_id in s.ids), None)
            if sink is None:
                return
            sink.ids -= {request_id}
            if sink.ids or sink.invalid:
                return  # its other requests answer it, or its invalid entries' errors do
        sink.finish_soon()
        if sink.conn is not None:
            try:
                if not sink.started:
                    sink.start()  # no priming: nothing to resume
                sink.conn.end_events()
            except TransportClosed:
                pass
        self.close_sink(sink)

    def open_get(self, sink: Sink, after: int | None = None) -> None:
        """The GET stream opens: its head, what the replay log holds of it after id ``after``
        (a resumption), then what was parked."""
        self.get = sink
        sink.stream = 0 if self.id else None
        sink.start()
        if after is not None:
            self._replay(sink, after)
        parked, self._parked = self._parked, deque()
        self._release_parked()
        for message in parked:
            self._write(sink, message, final=False)

    def resume(self, conn: HttpConnection, stream: int, after: int) -> Sink | None:
        """A ``GET`` with ``Last-Event-ID`` naming POST stream ``stream`` (not 0: that is
        :meth:`open_get`): the stream's events after id ``after`` are written on ``conn``; a
        detached stream (or one whose old connection the gateway has not seen break yet) is
        attached to ``conn`` and goes on live until its response, an ended one ends after
        them.  None: nothing of that stream to resume (unknown, or ended with nothing left
        after that id)."""
        sink = self._detached.pop(stream, None)
        if sink is None:  # the client saw the break before the gateway did: take the stream over
            sink = next((s for s in self._posts.values() if s.stream == stream), None)
            if sink is not None and sink.conn is not None:
                self._dirty.discard(sink.conn)
                sink.wake()
        if sink is None:
            if not any(e.stream == stream and e.seq > after for e in self.replay.entries):
                self._note_lost(stream, after)
                return None
            sink = Sink(conn, self.id, stream=stream)  # ended: its replay only
            sink.done = True
        else:
            sink.conn = conn
            if sink.token is not None:
                self._tokens.setdefault(sink.token, sink)
        sink.start()
        final = self._replay(sink, after)
        if sink.done and not final:
            conn.end_events()  # ended without its response (cancelled, or it fell out)
        LOGGER.debug("http session %.8s…: stream %d resumed after %d", self.id, stream, after)
        return sink

    def _replay(self, sink: Sink, after: int) -> bool:
        """Write the log's events of ``sink``'s stream after ``after``; True when the last was
        its final response (then the stream has ended)."""
        assert sink.stream is not None and sink.conn is not None
        self._note_lost(sink.stream, after)
        entries = self.replay.after(sink.stream, after)
        for entry in entries:
            event_id = format_id(entry.stream, entry.seq)
            try:
                ok = sink.deliver(entry.message, entry.final, event_id)
            except TransportClosed:
                return False  # the caller's connection task sees the peer gone
            if not ok:
                self._dirty.add(sink.conn)
            if entry.final:
                return True
        return False

    def _note_lost(self, stream: int, after: int) -> None:
        if self.replay.floor > after:
            LOGGER.warning("http session %.8s…: resuming stream %d after event %d: events up to "
                           "%d fell out of the replay buffer (%d bytes); some may be lost",
                           self.id, stream, after, self.replay.floor, REPLAY_MAX_BYTES)

    def release(self, sink: Sink, conn: HttpConnection) -> None:
        """``conn``'s task stops serving ``sink`` (answered, or the peer gone)."""
        if sink.conn is not conn:
            return  # detached already, or resumed on another connection
        if sink.done:
            self.close_sink(sink)
        else:
            self._lost(sink)

    @staticmethod
    def _resumable(sink: Sink) -> bool:
        """A POST stream of a legacy session that may have given the client an event id."""
        return sink.started and sink.stream is not None and sink.request_id is not None

    def _lost(self, sink: Sink) -> None:
        """``sink``'s connection is gone before its end.  A POST stream the client may hold an
        id of is detached (kept for resumption until its response); any other is forgotten."""
        if not self._resumable(sink):
            self.close_sink(sink)
            sink.finish_soon()
            return
        if sink.conn is not None:
            self._dirty.discard(sink.conn)
        sink.conn = None
        if sink.token is not None and self._tokens.get(sink.token) is sink:
            del self._tokens[sink.token]  # its progress goes elsewhere meanwhile
        assert sink.stream is not None  # resumable
        self._detached[sink.stream] = sink
        sink.wake()
        self.last_active = trio.current_time()
        self._wakeup.set()

    def close_sink(self, sink: Sink) -> None:
        """The stream is over (answered, cancelled, or gone): forget it."""
        sink.done = True
        if self.id:
            self.last_active = trio.current_time()
        if self.get is sink:
            self.get = None
        elif sink.batch:
            if sink in self._batches:
                self._batches.remove(sink)
        elif sink.request_id is not None and self._posts.get(sink.request_id) is sink:
            del self._posts[sink.request_id]
            if sink.token is not None and self._tokens.get(sink.token) is sink:
                del self._tokens[sink.token]
        if sink.stream is not None and self._detached.get(sink.stream) is sink:
            del self._detached[sink.stream]
        if sink.conn is not None:
            self._dirty.discard(sink.conn)
        # the reader is not woken: at its deadline it reads ``last_active`` again (a wake-up per
        # answered POST would cost its session's task a step per call)

    def idle(self) -> bool:
        client = self.client
        return (not self._posts and not self._batches and self.get is None and not self._inbox
                and (client is None or (not client.inflight and not client.server_requests)))

    def terminate(self) -> None:
        """DELETE: end the session (its calls are cancelled by the connection layer)."""
        self.closed = True
        if self.client is not None:
            self.client.close(CloseReason.CLIENT_CLOSED)
        self._wakeup.set()

    # ---- MessageStream ----------------------------------------------------------------------

    async def receive(self) -> Decoded:
        while not self._inbox:
            if self.closed:
                raise TransportClosed("session ended")
            now = trio.current_time()
            deadline = self.last_active + self.idle_timeout
            if now >= deadline:
                if self.idle():
                    self.closed = True
                    raise TransportClosed("session expired (http_session_idle_timeout)")
                self.last_active = now  # busy: look again one timeout later
                continue
            with trio.move_on_at(deadline):
                await self._wakeup.wait()
        return self._inbox.popleft()

    def write_nowait(self, messages: list[bytes], route: Route | None = None) -> bool:
        if len(messages) == 1:
            return self.write_one(messages[0], route)
        if self.closed:
            raise TransportClosed("session ended")
        for message in messages:
            self._route(message)
        return not self._dirty

    def write_one(self, data: bytes, route: Route | None) -> bool:
        """:meth:`write_nowait` of one message (the common case, without the list)."""
        if self.closed:
            raise TransportClosed("session ended")
        if route is None:
            self._route(data)
        elif route[0] is Goes.ANSWER:
            self._answer(data, route[1])
        else:
            self._notify(data, *route)
        return not self._dirty

    def _route(self, message: bytes) -> None:
        """A message the core sent without a routing hint (one it queued, a batch's array,
        what the routing core passes on): its hint read from its JSON."""
        if message[:1] == b"[":  # a batch's answers
            batch = self._batch_for(message)
            if batch is not None:
                self._write(batch, message, final=True)
            else:
                self._drop(message)
            return
        try:
            out = _out.decode(message)
        except (msgspec.ValidationError, msgspec.DecodeError):
            out = _Out()
        method = out.method
        if method is UNSET:  # a response
            self._answer(message, out.id if isinstance(out.id, int | str) else None)
            return
        token: RequestId | None = None
        if method == "notifications/progress" and out.params is not UNSET:
            try:
                token = _progress.decode(out.params).progressToken
            except (msgspec.ValidationError, msgspec.DecodeError):
                token = None
        if token is not None:
            self._notify(message, Goes.PROGRESS, token)
        else:
            self._notify(message, Goes.UNRELATED if method in UNRELATED else Goes.OTHER, None)

    def _answer(self, message: bytes, id: RequestId | None) -> None:
        """The response to request ``id``: to its POST (an id-less one to the oldest batch)."""
        sink = self._posts.pop(id, None) if id is not None else None
        if sink is None and self._batches and id is None:
            sink = self._batches.popleft()
        if sink is None:
            self._drop(message)
            return
        if sink.token is not None and self._tokens.get(sink.token) is sink:
            del self._tokens[sink.token]
        self._write(sink, message, final=True)

    def _notify(self, message: bytes, goes: Goes, key: RequestId | None) -> None:
        """Anything but a response: progress to its request's POST, an unrelated message to
        the GET stream, anything else where one of its calls' streams is (see above)."""
        sink = None
        if goes is Goes.PROGRESS and key is not None:
            sink = self._tokens.get(key)
        if sink is None:
            if goes is Goes.UNRELATED and self.id:  # a modern flow has no GET: its listen's POST
                sink = self.get
            elif len(self._posts) - len(self._detached) == 1 and not self._batches:
                sink = next(s for s in self._posts.values() if s.conn is not None)
            elif self.get is not None:
                sink = self.get
            elif len(self._posts) > len(self._detached):
                sink = next(s for s in self._posts.values() if s.conn is not None)
        if sink is None:
            self._park(message)
        else:
            self._write(sink, message, final=False)

    def _batch_for(self, answers: bytes) -> Sink | None:
        """The open batch POST that ``answers`` answer, taken out of the queue (batches finish
        in any order): the one with exactly those request ids, else one sharing an id; answers
        without a usable id go to the oldest.  None: that POST's stream is gone."""
        try:
            ids = {o.id for o in _outs.decode(answers) if isinstance(o.id, int | str)}
        except (msgspec.ValidationError, msgspec.DecodeError):
            ids = set()
        sink = next((s for s in self._batches if s.ids == ids), None) \
            or next((s for s in self._batches if s.ids & ids), None)
        if sink is None and not ids and self._batches:
            sink = self._batches[0]
        if sink is not None:
            self._batches.remove(sink)
        return sink

    def _write(self, sink: Sink, message: bytes, *, final: bool) -> None:
        conn = sink.conn
        event_id = None
        try:
            if not (final or sink.started):  # the first event: the SSE head first
                assert conn is not None
                self.start_stream(sink)
            if sink.stream is not None and sink.started:  # an SSE event of a legacy session
                seq, delta = self.replay.record(sink.stream, message, final)
                event_id = format_id(sink.stream, seq)
                if self.client is not None and delta:
                    if delta > 0:
                        self.client.buffers.charge(delta)
                    else:
                        self.client.buffers.release(-delta)
            if conn is None:  # detached: kept in the replay log for its resumption only
                if final:
                    sink.done = True
                    self.close_sink(sink)
                    LOGGER.debug("http session %.8s…: a response kept for resumption", self.id)
                return
            if not sink.deliver(message, final, event_id):
                self._dirty.add(conn)
        except TransportClosed:
            if not final and self._resumable(sink):
                self._lost(sink)  # the message is in the log: a resumption gets it
                return
            if event_id is None:
                LOGGER.debug("http session %.8s…: a response stream is gone; message dropped",
                             self.id)
                self.dropped += 1
            self.close_sink(sink)
            sink.finish_soon()

    def _park(self, message: bytes) -> None:
        n = len(message)
        while self._parked and (len(self._parked) >= PARK_MAX
                                or self._parked_bytes + n > PARK_MAX_BYTES):
            old = self._parked.popleft()
            self._parked_bytes -= len(old)
            if self.client is not None:
                self.client.buffers.release(len(old))
            self._drop(old)
        if n > PARK_MAX_BYTES:
            self._drop(message)
            return
        self._parked.append(message)
        self._parked_bytes += n
        if self.client is not None:
            self.client.buffers.charge(n)

    def _release_parked(self) -> None:
        if self.client is not None:
            self.client.buffers.release(self._parked_bytes)
        self._parked_bytes = 0

    def _drop(self, message: bytes) -> None:
        if not self.dropped:
            LOGGER.info("http session %.8s…: no open stream for a message of %d bytes; dropped "
                        "(open a GET stream to receive server messages)", self.id, len(message))
        self.dropped += 1

    async def flush(self) -> None:
        while self._dirty:
            conn = next(iter(self._dirty))
            try:
                await conn.flush()
            except TransportClosed:
                pass
            self._dirty.discard(conn)

    async def aclose(self, reason: str) -> None:
        """The session is over: end every open stream (a POST not yet answered gets 404)."""
        self.abort()

    def abort(self) -> None:
        """:meth:`aclose`, synchronously (a modern flow served without a task of its own)."""
        self.closed = True
        sinks = [*self._posts.values(), *self._batches]
        if self.get is not None:
            sinks.append(self.get)
        for sink in sinks:
            try:
                if sink.conn is None:
                    pass  # detached
                elif sink.started:
                    sink.conn.end_events()
                elif sink.request_id is not None or sink.batch:
                    sink.conn.respond(404, b"session ended\n", "text/plain; charset=utf-8")
            except TransportClosed:
                pass
            self.close_sink(sink)
            sink.finish_soon()
        if self._parked:
            self._parked.clear()
            self._release_parked()
        held = self.replay.clear() if self.replay.entries else 0  # (a modern flow keeps none)
        if held and self.client is not None:
            self.client.buffers.release(held)
        self._dirty.clear()
