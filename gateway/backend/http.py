"""The ``http`` connector: a remote server over Streamable HTTP (the legacy sessions' shape).

:class:`HttpLink` POSTs each message (requests at most :data:`REQUEST_STREAMS` at once, the
others on :data:`OTHER_STREAMS` more connections, each kind in order from its own queue) and
hands what comes back, a JSON body or SSE events as they arrive, to the session with the request
they came in answer to.  ``initialize``'s answer brings ``Mcp-Session-Id`` and the version sent
as ``MCP-Protocol-Version`` from then on, and opens the GET stream for the server's own messages
(a 405: it has none).  A 404 on the session, a GET stream that cannot be opened again, or an
unreachable remote end the link (the instance restarts it and initializes again); a call whose
answer stream ends without its answer fails.  :meth:`HttpLink.close` DELETEs the session.
Configured header values are read when a link opens and on reload, and never shown.
"""

from __future__ import annotations

import logging
import math
import os
import ssl
from collections import deque

import msgspec
import trio

from gateway import errors
from gateway.backend import httpclient
from gateway.backend.connector import LinkContext, LinkEnd, OpenFailed, Receiver
from gateway.config import BackendConfig, header_value_ok, read_regular
from gateway.limits import REMOTE_CONNECTIONS
from gateway.protocol.sse import EventTooLarge, SseDecoder

LOGGER = logging.getLogger(__name__)

#: Notifications and answers to the remote's requests posted at once.
OTHER_STREAMS = 2
#: Requests at the remote at once (each holds a connection while its answer streams): what
#: is left of :data:`~gateway.limits.REMOTE_CONNECTIONS` beside the others, the GET stream and
#: the DELETE on close.  A new connection is opened only when no idle one is left, so these
#: bound the link's connections; at most :data:`IDLE_CONNECTIONS` idle ones are kept.
REQUEST_STREAMS = REMOTE_CONNECTIONS - OTHER_STREAMS - 2
IDLE_CONNECTIONS = 4
#: Seconds a notification's or answer's POST may take, and a DELETE on close.
SHORT_TIMEOUT = 10.0
DELETE_TIMEOUT = 5.0
#: Seconds a request's event stream may stay open after its answer came (the server should end
#: it then): past that it is closed, so it does not hold a request stream.
ANSWER_TAIL = 1.0
#: Seconds before the GET stream is opened again after it ended; doubled, up to
#: :data:`GET_RETRY_MAX`, each time it ends again without an event and sooner than that.
GET_RETRY = 0.5
GET_RETRY_MAX = 30.0
#: A header value read from a file: its most bytes.
MAX_HEADER_FILE = 16384
#: An SSE event's bytes beyond the message itself (field names, ids).
SSE_OVERHEAD = 1024
_ACCEPT_BOTH = "application/json, text/event-stream"
#: Requests POSTed again when a kept-alive connection closed before their answer (it may have
#: been the remote closing it while idle); any other (a ``tools/call``) may have run already.
SAFE_TO_REPEAT = frozenset({
    "initialize", "ping", "tools/list", "prompts/list", "prompts/get", "resources/list",
    "resources/templates/list", "resources/read", "completion/complete", "logging/setLevel",
    "resources/subscribe", "resources/unsubscribe"})


class _MayHaveRun(Exception):
    """A request's connection closed after its bytes may have reached the remote."""


class _Queue:
    """Messages waiting for a stream (bytes, gateway id, sequence number), and the event that
    wakes their dispatcher."""

    def __init__(self) -> None:
        self.items: deque[tuple[bytes, int | None, int]] = deque()
        self.ready = trio.Event()


class _Peek(msgspec.Struct):
    method: str | None = None
    id: int | str | None = None


def _answers(data: bytes, gid: int) -> bool:
    """Whether ``data`` is the reply to request ``gid``."""
    try:
        peek = msgspec.json.decode(data, type=_Peek)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return peek.method is None and peek.id == gid


class _CancelledParams(msgspec.Struct):
    requestId: int | str | None = None


class _Cancelled(msgspec.Struct):
    method: str | None = None
    params: _CancelledParams | None = None


class _InitResult(msgspec.Struct):
    protocolVersion: str | None = None


class _InitReply(msgspec.Struct):
    result: _InitResult | None = None


def read_headers(cfg: BackendConfig, environ: dict[str, str] | None = None
                 ) -> list[tuple[str, str]]:
    """The configured headers with their values now (literal, from the environment, from a
    file with its prefix).

    Raises:
        OpenFailed: a variable is unset or a file unreadable (named, never the value).
    """
    env = os.environ if environ is None else environ
    out: list[tuple[str, str]] = []
    for name, spec in cfg.headers.items():
        if isinstance(spec, str):
            value = spec
        elif "env" in spec:
            if spec["env"] not in env:
                raise OpenFailed(f"header {name}: environment variable {spec['env']} is not set")
            value = env[spec["env"]]
        else:
            path = spec["file"]
            try:  # read on the event loop (open, reload): a FIFO there must not block it
                raw = read_regular(path, MAX_HEADER_FILE)
            except OSError as exc:
                raise OpenFailed(f"header {name}: cannot read {path}: "
                                 f"{exc.strerror or exc}") from None
            except ValueError as exc:
                raise OpenFailed(f"header {name}: {path}: {exc}") from None
            try:
                value = spec.get("prefix", "") + raw.decode().strip()
            except UnicodeDecodeError:
                raise OpenFailed(f"header {name}: {path} is not UTF-8 text") from None
        if not header_value_ok(value):
            raise OpenFailed(f"header {name}: its value is not printable ASCII")
        out.append((name.lower(), value))
    return out


class HttpConnector:
    """Opens sessions with the backend's ``url``; each link checks the remote is reachable."""

    kind = "http"

    def __init__(self, cfg: BackendConfig, opener: httpclient.Opener | None = None) -> None:
        self.cfg = cfg
        self.target = httpclient.parse_url(cfg.url)
        self._opener = opener  # (host, port): a byte stream to it (TCP when None)
        self.headers: list[tuple[str, str]] | None = None  # read at open, and by refresh
        self._tls: ssl.SSLContext | None = None  # https: made at the first open, and by refresh

    @property
    def origin(self) -> str:
        return self.target.text

    def refresh(self) -> None:
        """Read the header values again (a reload): the next requests carry them.  A value
        that cannot be read keeps the one before (logged, without it).  The ``ca_file`` is read
        again at the next open."""
        try:
            self.headers = read_headers(self.cfg)
        except OpenFailed as exc:
            LOGGER.warning("backend %s: keeping the headers read before: %s", self.origin, exc)
        self._tls = None  # ca_file read again at the next open

    def _context(self) -> ssl.SSLContext | None:
        if self.target.tls and self._tls is None:
            try:
                self._tls = httpclient.tls_context(self.cfg.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise OpenFailed(f"ca_file {self.cfg.ca_file}: {exc}") from None
        return self._tls

    async def open(self, ctx: LinkContext) -> HttpLink:
        self.headers = read_headers(self.cfg)
        pool = httpclient.Pool(self.target, connect_timeout=self.cfg.start_timeout,
                               idle_max=IDLE_CONNECTIONS, ssl_context=self._context(),
                               opener=self._opener)
        try:
            conn = await pool.connect()
        except httpclient.ConnectFailed as exc:
            raise OpenFailed(f"cannot reach {self.origin}: {exc.detail}") from None
        await pool.put(conn)  # a fresh connection: kept for the handshake
        return HttpLink(ctx, self, pool)


class HttpLink:
    """One session with the remote: POSTs out, JSON and SSE answers in, the GET stream."""

    kind = "http"
    pid = None

    def __init__(self, ctx: LinkContext, connector: HttpConnector, pool: httpclient.Pool) -> None:
        self._ctx = ctx
        self._connector = connector
        self._cfg = connector.cfg
        self._pool = pool
        self.buffers = ctx.buffers
        self.max_queued = ctx.max_queued
        self.closed: errors.GatewayError | None = None
        self.last_error: str | None = None
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self._requests = _Queue()  # requests (a gateway id each), each on a stream of its own
        self._others = _Queue()  # notifications and answers to the remote's requests
        # A request is POSTed only once every notification sent before it was (its answer's
        # head is in): ``notifications/initialized`` reaches the server before the lists.
        self._seq = 0
        self._others_pending: set[int] = set()
        self._others_done = trio.Event()
        self._receiver: Receiver | None = None
        self._nursery: trio.Nursery | None = None
        self._get_started = False
        self._streams: dict[int, trio.CancelScope] = {}  # requests' POSTs, by gateway id
        self._cancelled: set[int] = set()  # requests whose POST the gateway dropped (cancelled)
        # the GET stream's answer head is in (or it failed): notifications wait for it, so the
        # server's answers to them (a list_changed after notifications/initialized) have a stream
        self._get_ready = trio.Event()
        self._ended = False
        self._end: LinkEnd | None = None
        self._max_line = ctx.max_line

    @property
    def origin(self) -> str:
        return self._connector.origin

    # ---- the session's side -----------------------------------------------------------------

    def send(self, data: bytes, gid: int | None = None) -> None:
        if self.closed is not None:
            raise errors.NotDelivered(self.closed.message, **self.closed.data)
        self._seq += 1
        if gid is None:
            self._others_pending.add(self._seq)
            queue = self._others
        else:
            queue = self._requests
        queue.items.append((data, gid, self._seq))
        self.buffers.charge(len(data))
        queue.ready.set()

    def fits(self, size: int) -> bool:
        return self.buffers.held + size <= self.max_queued

    def fail(self, error: errors.GatewayError) -> None:
        if self.closed is None:
            self.closed = error
        self._requests.items.clear()
        self._others.items.clear()
        self._others_pending.clear()
        self._others_done.set()
        self.buffers.close()

    async def run(self, receiver: Receiver) -> None:
        """POST what is sent, read the answers and the GET stream, until cancelled."""
        self._receiver = receiver
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._dispatch, self._others, OTHER_STREAMS, False)
            await self._dispatch(self._requests, REQUEST_STREAMS, True)

    async def _dispatch(self, queue: _Queue, streams: int, requests: bool) -> None:
        """Start a POST per queued message, in order, at most ``streams`` at once."""
        assert self._nursery is not None
        limiter = trio.CapacityLimiter(streams)
        while True:
            while not queue.items:
                queue.ready = trio.Event()
                await queue.ready.wait()
            token = object()
            await limiter.acquire_on_behalf_of(token)
            if not queue.items:  # dropped meanwhile (the link failed)
                limiter.release_on_behalf_of(token)
                continue
            data, gid, seq = queue.items.popleft()
            self.buffers.release(len(data))
            if requests and gid is not None:
                while any(other < seq for other in self._others_pending):
                    self._others_done = trio.Event()
                    await self._others_done.wait()
                self._nursery.start_soon(self._post_request, data, gid, limiter, token)
            else:
                self._nursery.start_soon(self._post_other, data, seq, limiter, token)

    def _headers(self, accept: str) -> list[tuple[str, str]]:
        head = [("accept", accept)]
        if self.session_id is not None:
            head.append(("mcp-session-id", self.session_id))
        if self.protocol_version is not None:
            head.append(("mcp-protocol-version", self.protocol_version))
        return head + (self._connector.headers or [])

    # ---- ending -----------------------------------------------------------------------------

    def _lost(self, detail: str) -> None:
        """The session with the remote is over: nothing more arrives (the instance restarts)."""
        self.last_error = detail
        if self._ended:
            return
        self._ended = True
        LOGGER.warning("backend %s: %s", self._ctx.instance, detail,
                       extra={"MCP_BACKEND": self._ctx.backend})
        if self.closed is None:
            self.closed = errors.BackendExited(
                f"backend {self._ctx.backend!r} is unreachable: {detail}",
                backend=self._ctx.backend, retryable=True)
        if self._receiver is not None:
            self._receiver.ended()

    def _call_failed(self, gid: int, detail: str, *, retryable: bool = True) -> None:
        """A request's answer cannot come any more (its stream ended without it);
        ``retryable``: false when the request may have run."""
        self.last_error = detail
        if self._receiver is not None:
            self._receiver.failed(gid, errors.BackendExited(
                f"backend {self._ctx.backend!r}: {detail}", backend=self._ctx.backend,
                retryable=retryable))

    async def close(self) -> LinkEnd:
        """DELETE the session (bounded), close every idle connection; the streams in use end
        with the link's tasks."""
        if self._end is not None:
            return self._end
        crashed = self._ended
        self._ended = True
        self._end = LinkEnd(self.last_error or "session closed", crashed=crashed)
        with trio.CancelScope(shield=True):
            if self.session_id is not None and not crashed:
                with trio.move_on_after(DELETE_TIMEOUT):
                    try:
                        conn = await self._pool.get()
                        await conn.request("DELETE", self._connector.target.target,
                                           self._headers("application/json, text/event-stream"),
                                           head_timeout=DELETE_TIMEOUT)
                        await conn.aclose()
                    except httpclient.HttpFailure as exc:
                        LOGGER.info("backend %s: DELETE of the session failed: %s",
                                    self._ctx.instance, exc.detail)
            await self._pool.aclose()
        return self._end

    # ---- posting ----------------------------------------------------------------------------

    async def _exchange(self, data: bytes, timeout: float,  # noqa: ASYNC109 - head deadline
                        repeat: bool = True,
                        ) -> tuple[httpclient.Connection, httpclient.Response] | None:
        """POST ``data``; its connection and answer's head, or None when the remote is gone
        (the link ended).  A kept-alive connection the remote had closed is tried once anew if
        ``repeat``.

        Raises:
            _MayHaveRun: it closed and not ``repeat``.
        """
        target = self._connector.target.target
        head = [("content-type", "application/json"), *self._headers(_ACCEPT_BOTH)]
        for _attempt in range(2):
            try:
                conn = await self._pool.get()
            except httpclient.ConnectFailed as exc:
                self._lost(f"cannot reach {self.origin}: {exc.detail}")
                return None
            try:
                return conn, await conn.request("POST", target, head, data, head_timeout=timeout)
            except trio.Cancelled:
                await conn.aclose()
                raise
            except httpclient.ConnectionLost as exc:
                await conn.aclose()
                if conn.reused and not repeat:
                    raise _MayHaveRun(exc.detail) from None
                if conn.reused:
                    continue
                self._lost(f"{self.origin}: {exc.detail}")
                return None
            except httpclient.HttpTimeout as exc:
                await conn.aclose()
                self._lost(f"{self.origin}: {exc.detail} ({timeout:g}s)")
                return None
        self._lost(f"{self.origin}: the connection broke twice")
        return None

    def _drop_cancelled(self, data: bytes) -> None:
        """``data`` told the remote the gateway cancelled a request: that request's answer
        stream is dropped (a cancelled request gets no answer: its stream might never end)."""
        if b"notifications/cancelled" not in data:
            return
        try:
            note = msgspec.json.decode(data, type=_Cancelled)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if note.method != "notifications/cancelled" or note.params is None:
            return
        gid = note.params.requestId
        scope = self._streams.get(gid) if isinstance(gid, int) else None
        if scope is not None and isinstance(gid, int):
            self._cancelled.add(gid)
            scope.cancel()

    async def _drain(self, conn: httpclient.Connection, limit: int) -> bytes:
        """A body that must end: all of it within :data:`SHORT_TIMEOUT` (one trickling forever
        would hold its stream, and what waits for that stream, for good).

        Raises:
            BodyTooLarge, ConnectionLost, HttpTimeout.
        """
        with trio.move_on_after(SHORT_TIMEOUT):
            return await conn.body(limit, SHORT_TIMEOUT)
        raise httpclient.HttpTimeout(f"an answer's body did not end within {SHORT_TIMEOUT:g}s")

    def _session_gone(self, response: httpclient.Response) -> bool:
        if response.status == 404 and self.session_id is not None:
            self._lost(f"{self.origin}: the session is gone (HTTP 404)")
            return True
        return False

    async def _post_other(self, data: bytes, seq: int, limiter: trio.CapacityLimiter,
                          token: object) -> None:
        try:
            if self._get_started:
                await self._get_ready.wait()
            try:
                got = await self._exchange(data, SHORT_TIMEOUT)
            finally:
                self._others_pending.discard(seq)
                self._others_done.set()
            if got is None:
                return
            conn, response = got
            self._drop_cancelled(data)
            try:
                await self._drain(conn, self._max_line)
            except httpclient.HttpFailure as exc:
                await conn.aclose()
                if isinstance(exc, httpclient.HttpTimeout):
                    self.last_error = f"{self.origin}: {exc.detail}"
                    LOGGER.warning("backend %s: %s", self._ctx.instance, self.last_error)
                return
            await self._pool.put(conn)
            if not self._session_gone(response) and response.status >= 300:
                self.last_error = f"{self.origin} answered HTTP {response.status} to a message"
                LOGGER.warning("backend %s: %s", self._ctx.instance, self.last_error)
        finally:
            limiter.release_on_behalf_of(token)

    async def _post_request(self, data: bytes, gid: int, limiter: trio.CapacityLimiter,
                            token: object) -> None:
        """POST a request and hand its answer stream to the session; the stream is dropped
        when the gateway cancels the call (``notifications/cancelled`` for it was POSTed) or
        after ``max_call_duration``."""
        method = msgspec.json.decode(data, type=_Peek).method
        initialize = self.protocol_version is None and method == "initialize"
        conn: httpclient.Connection | None = None
        kept = False
        try:
            with trio.CancelScope(deadline=trio.current_time() + self._cfg.max_call_duration
                                  ) as scope:
                self._streams[gid] = scope
                try:
                    got = await self._exchange(data, self._cfg.max_call_duration,
                                               method in SAFE_TO_REPEAT)
                except _MayHaveRun as exc:
                    self._call_failed(gid, f"the connection to {self.origin} closed before the "
                                           f"answer ({exc}); the call may have run",
                                      retryable=False)
                    return
                if got is None:
                    self._call_failed(gid, f"{self.origin} is unreachable")
                    return
                conn, response = got
                try:
                    await self._answer(conn, response, gid, initialize)
                except httpclient.HttpFailure as exc:
                    self._call_failed(gid, f"the answer stream from {self.origin} broke: "
                                           f"{exc.detail}")
                    return
                await self._pool.put(conn)
                kept = True
            if scope.cancelled_caught and gid in self._cancelled and self._receiver is not None:
                # its answer cannot come now: the abandoned call leaves the attribution set
                self._receiver.failed(gid, errors.BackendExited(
                    f"backend {self._ctx.backend!r}: the call was cancelled",
                    backend=self._ctx.backend, retryable=False))
            elif scope.cancelled_caught:
                self._call_failed(gid, f"no answer from {self.origin} within max_call_duration")
        finally:
            self._streams.pop(gid, None)
            self._cancelled.discard(gid)
            if conn is not None and not kept:
                await conn.aclose()
            limiter.release_on_behalf_of(token)

    async def _answer(self, conn: httpclient.Connection, response: httpclient.Response, gid: int,
                      initialize: bool) -> None:
        receiver = self._receiver
        assert receiver is not None
        if self._session_gone(response):
            await conn.aclose()
            return
        if initialize and response.status == 200:
            sid = response.headers.get("mcp-session-id") or None
            if sid is not None and not all("!" <= c <= "~" for c in sid):
                await conn.aclose()  # it could not be sent back: the spec's visible ASCII only
                self._call_failed(gid, f"{self.origin} sent an Mcp-Session-Id that is not "
                                       "visible ASCII")
                return
            self.session_id = sid
        if response.status != 200:
            body = await self._drain(conn, self._max_line)
            if response.content_type == "application/json" and _answers(body, gid):
                receiver.message(body, gid)  # a JSON-RPC error answering the call
            else:
                self._call_failed(gid, f"{self.origin} answered HTTP {response.status}")
            return
        answered = False
        if response.content_type == "text/event-stream":
            decoder = SseDecoder(self._max_line + SSE_OVERHEAD)
            with trio.CancelScope() as tail:  # after the answer: ANSWER_TAIL more at most
                while (chunk := await conn.chunk()) is not None:
                    try:
                        events = decoder.feed(chunk)
                    except EventTooLarge:
                        await conn.aclose()
                        self._too_large(gid)
                        return
                    for event in events:
                        answered |= self._deliver(event, gid, initialize)
                    if answered and tail.deadline == math.inf:
                        tail.deadline = trio.current_time() + ANSWER_TAIL
            if tail.cancelled_caught:
                await conn.aclose()
                return
        elif response.content_type == "application/json":
            try:
                body = await conn.body(self._max_line)
            except httpclient.BodyTooLarge:
                await conn.aclose()
                self._too_large(gid)
                return
            answered = self._deliver(body, gid, initialize)
        else:
            await self._drain(conn, self._max_line)
            self._call_failed(gid, f"{self.origin} answered {response.content_type or 'no type'}"
                                   ", not JSON nor an event stream")
            return
        if not answered:
            self._call_failed(gid, f"the answer stream from {self.origin} ended without the "
                                   "answer")

    def _deliver(self, data: bytes, gid: int, initialize: bool) -> bool:
        """Hand ``data`` to the session as caused by ``gid``; whether it was its reply.  A reply
        to another request is dropped: what comes on a request's stream is that request's."""
        assert self._receiver is not None
        try:
            peek = msgspec.json.decode(data, type=_Peek)
        except (msgspec.DecodeError, msgspec.ValidationError):
            peek = _Peek(method="")  # not a message: the session says why
        if peek.method is None and peek.id is not None and peek.id != gid:
            LOGGER.warning("backend %s: dropping an answer to request %.100r that came on the "
                           "answer stream of request %d", self._ctx.instance, peek.id, gid)
            self.last_error = "an answer to another request on a request's answer stream"
            return False
        if initialize and self.protocol_version is None:
            try:
                reply = msgspec.json.decode(data, type=_InitReply)
            except (msgspec.DecodeError, msgspec.ValidationError):
                reply = _InitReply()
            if reply.result is not None and reply.result.protocolVersion:
                self.protocol_version = reply.result.protocolVersion
                if not self._get_started and self._nursery is not None:
                    self._get_started = True
                    self._nursery.start_soon(self._get_stream)
        self._receiver.message(data, gid)
        return peek.method is None and peek.id == gid

    def _too_large(self, gid: int) -> None:
        LOGGER.warning("backend %s: dropping an answer of more than %d bytes (max_message_bytes)",
                       self._ctx.instance, self._max_line)
        self.last_error = f"an answer of more than {self._max_line} bytes"
        if self._receiver is not None:
            self._receiver.failed(gid, errors.ResponseTooLarge(
                f"backend {self._ctx.backend!r} answered with more than {self._max_line} bytes "
                "(max_message_bytes)", backend=self._ctx.backend, limit=self._max_line))

    # ---- the GET stream ---------------------------------------------------------------------

    async def _get_stream(self) -> None:
        """The server's own requests and notifications; opened again when it ends (later
        each time it ends at once without an event), until the remote refuses it (405: it has
        none) or cannot be reached (the link ends)."""
        target = self._connector.target.target
        delay = GET_RETRY
        while not self._ended:
            opened = trio.current_time()
            delivered = False
            try:
                conn = await self._pool.get()
            except httpclient.ConnectFailed as exc:
                self._get_ready.set()
                self._lost(f"cannot reach {self.origin}: {exc.detail}")
                return
            try:
                try:
                    response = await conn.request("GET", target,
                                                  self._headers("text/event-stream"),
                                                  head_timeout=self._cfg.start_timeout)
                finally:
                    self._get_ready.set()
                if response.status == 405 or (response.status in (400, 404)
                                              and not self.session_id):
                    await conn.aclose()  # no stream (a 400/404 without a session: a stateless one)
                    return
                if self._session_gone(response):
                    await conn.aclose()
                    return
                if response.status != 200 or response.content_type != "text/event-stream":
                    await conn.aclose()
                    self._lost(f"{self.origin} refused the GET stream (HTTP {response.status})")
                    return
                decoder = SseDecoder(self._max_line + SSE_OVERHEAD)
                while (chunk := await conn.chunk()) is not None:
                    for event in decoder.feed(chunk):
                        assert self._receiver is not None
                        delivered = True
                        self._receiver.message(event)
            except EventTooLarge:
                LOGGER.warning("backend %s: the GET stream sent an event of more than %d bytes; "
                               "opening it again", self._ctx.instance, self._max_line)
            except httpclient.HttpFailure as exc:
                self.last_error = f"the GET stream from {self.origin} ended: {exc.detail}"
            await conn.aclose()
            if delivered or trio.current_time() - opened >= GET_RETRY_MAX:
                delay = GET_RETRY
            await trio.sleep(delay)
            delay = min(2 * delay, GET_RETRY_MAX)
