"""The ``http`` connector: a remote server over Streamable HTTP, in either era's shape.

:class:`HttpLink` POSTs each message (requests at most :func:`request_streams` at once, others on
:data:`OTHER_STREAMS` connections, each kind in order) and hands what comes back, JSON or SSE
events as they arrive, to the session with the request they answer.  Legacy: ``initialize``
brings ``Mcp-Session-Id`` and ``MCP-Protocol-Version`` and opens the GET stream (405, or 400/404
before a session: none); a 404 on the session, or a 400 saying it is unknown, ends the link as
expired (renewed at once); :meth:`HttpLink.close` DELETEs it.  A stream that ends before its
answer after an event with an id is resumed (``Last-Event-ID`` after ``retry``, bounded); a
request safe to repeat is POSTed again on a 5xx or reset, no other.  A 2026-07-28 request (its
``_meta`` names the version) goes with its routing headers (:mod:`~gateway.protocol.mcpheaders`),
is cancelled by closing its stream, and ``subscriptions/listen`` holds the GET stream's slot.
Header values are read at open and on reload, never shown; ``[oauth]`` adds the backend's token
(one refetch on a 401); a principal's session asks its credential source for its headers before
each request.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from gateway import errors
from gateway.auth.principal import Principal
from gateway.backend import httpclient, oauth
from gateway.backend.authcode import AuthorizationCode, NeedsAuthorization
from gateway.backend.client import NotModern
from gateway.backend.connector import LinkContext, LinkEnd, OpenFailed, Receiver
from gateway.backend.credentials import CredentialsUnavailable, PrincipalCredentials, call_error
from gateway.config import BackendConfig, header_value_ok, read_regular, remote_connections_of
from gateway.limits import REMOTE_CONNECTIONS
from gateway.protocol import mcpheaders
from gateway.protocol.era import VERSION_KEY
from gateway.protocol.sse import EventTooLarge, SseDecoder

LOGGER = logging.getLogger(__name__)

#: Notifications and answers to the remote's requests posted at once.
OTHER_STREAMS = 2


def request_streams(connections: int) -> int:
    """Requests at the remote at once (each holds a connection while its answer streams) for a
    link of at most ``connections`` (the backend's ``max_connections``): what is left beside
    the others, the GET stream (or, in the 2026-07-28 shape, the one ``subscriptions/listen``:
    the listen slot, never taken from these; a second listen waits for a request stream) and
    the DELETE on close.  A new connection is opened only when no idle one is left, so these
    bound the link's connections; every POST's connection is kept idle for the next one
    (within the pool's idle time; a smaller bound closes and opens connections at every burst
    of calls): these and :data:`OTHER_STREAMS` idle ones at most."""
    return connections - OTHER_STREAMS - 2


#: :func:`request_streams` of the default pool (:data:`~gateway.limits.REMOTE_CONNECTIONS`).
REQUEST_STREAMS = request_streams(REMOTE_CONNECTIONS)
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
#: Resuming a request's event stream that ended before its answer (a GET with
#: ``Last-Event-ID``): seconds waited first when the server gave no ``retry``, the least and
#: the most waited whatever it gave, and the GETs in a row that may bring no message before
#: the call fails.
RESUME_WAIT = 1.0
RESUME_WAIT_MIN = 0.1
RESUME_WAIT_MAX = 10.0
RESUME_ATTEMPTS = 3
#: A request safe to repeat that met a 5xx or a connection reset: tried this many more times,
#: after a pause of :data:`RETRY_PAUSE` (doubled each time, jittered down to half).
RETRIES = 2
RETRY_PAUSE = 0.2
RETRY_STATUSES = frozenset({500, 502, 503, 504})
#: The most of an error body quoted in the error a call gets (printable ASCII only).
SNIPPET = 200
#: A header value read from a file: its most bytes.
MAX_HEADER_FILE = 16384
#: An SSE event's bytes beyond the message itself (field names, ids).
SSE_OVERHEAD = 1024
_ACCEPT_BOTH = "application/json, text/event-stream"
#: A message the link cannot peek into (nested past msgspec's depth: RecursionError); the
#: session, with its own depth bound, says what is wrong with it.
_UNREADABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
#: Requests POSTed again when a kept-alive connection closed before their answer (it may have
#: been the remote closing it while idle); any other (a ``tools/call``) may have run already.
SAFE_TO_REPEAT = frozenset({
    "initialize", "ping", "tools/list", "prompts/list", "prompts/get", "resources/list",
    "resources/templates/list", "resources/read", "completion/complete", "logging/setLevel",
    "resources/subscribe", "resources/unsubscribe", "server/discover"})
#: Extra headers for a message POSTed, from its bytes; set by the service while tracing is on
#: (the trace context the gateway put into a request's ``_meta``); None: none.
message_headers: Callable[[bytes], list[tuple[str, str]]] | None = None


class _MayHaveRun(Exception):
    """A request's connection closed after its bytes may have reached the remote."""


class _NoCredentials(Exception):
    """The principal's credential source has nothing for it now (per-principal remotes)."""

    def __init__(self, cause: CredentialsUnavailable) -> None:
        super().__init__(cause.detail)
        self.cause = cause


class _Reset(Exception):
    """A new connection broke before a request's answer (only when asked to say so)."""


class _Queue:
    """Messages waiting for a stream (bytes, gateway id, sequence number), and the event that
    wakes their dispatcher (the others), or the workers parked waiting for one (the requests)."""

    def __init__(self) -> None:
        self.items: deque[tuple[bytes, int | None, int]] = deque()
        self.ready = trio.Event()
        self.idle = trio.lowlevel.ParkingLot()
        self.workers = 0


class _Worker:
    """A request worker: its cancel scope (each call's deadline set on it while the call runs),
    the call that scope cancelled, and while idle the connection it kept from its last call and
    watches, and the request written on that connection for it (bytes, gateway id)."""

    __slots__ = ("conn", "cut", "handed", "scope")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.cut: tuple[int, bool] | None = None  # (gateway id, dropped by the gateway)
        self.conn: httpclient.Connection | None = None
        self.handed: tuple[bytes, int] | None = None


class _Peek(msgspec.Struct):
    method: str | None = None
    id: int | str | None = None


def _answers(data: bytes, gid: int) -> bool:
    """Whether ``data`` is the reply to request ``gid``."""
    try:
        peek = msgspec.json.decode(data, type=_Peek)
    except _UNREADABLE:
        return False
    return peek.method is None and peek.id == gid


class _CancelledParams(msgspec.Struct):
    requestId: int | str | None = None


class _Cancelled(msgspec.Struct):
    method: str | None = None
    params: _CancelledParams | None = None


class _ModernParams(msgspec.Struct):
    name: object = None
    uri: object = None
    arguments: msgspec.Raw = msgspec.Raw(b"null")
    meta: dict[str, object] | None = msgspec.field(default=None, name="_meta")


class _ModernRequest(msgspec.Struct):
    method: str | None = None
    params: _ModernParams | None = None


_MODERN_MARK = VERSION_KEY.encode()


def modern_request(data: bytes, tools: dict[str, mcpheaders.Paths]
                   ) -> tuple[str, list[tuple[str, str]]] | None:
    """A 2026-07-28 request's method and routing headers (its ``_meta`` names a version), or
    None (a legacy message)."""
    if _MODERN_MARK not in data:
        return None
    try:
        req = msgspec.json.decode(data, type=_ModernRequest)
    except _UNREADABLE:
        return None
    params = req.params
    meta = params.meta if params is not None else None
    version = meta.get(VERSION_KEY) if meta is not None else None
    if req.method is None or params is None or not isinstance(version, str):
        return None
    fields: dict[str, object] = {"name": params.name, "uri": params.uri}
    paths = tools.get(params.name) if isinstance(params.name, str) else None
    if paths:
        try:
            fields["arguments"] = msgspec.json.decode(params.arguments)
        except _UNREADABLE:
            paths = None
    return req.method, mcpheaders.request_headers(req.method, version, fields, paths)


class _InitResult(msgspec.Struct):
    protocolVersion: str | None = None


class _InitReply(msgspec.Struct):
    result: _InitResult | None = None


def _cancelled_id(data: bytes) -> int | None:
    """The request a ``notifications/cancelled`` names (None: not one, or not a gateway id)."""
    if b"notifications/cancelled" not in data:
        return None
    try:
        note = msgspec.json.decode(data, type=_Cancelled)
    except _UNREADABLE:
        return None
    if note.method != "notifications/cancelled" or note.params is None:
        return None
    gid = note.params.requestId
    return gid if isinstance(gid, int) and not isinstance(gid, bool) else None


def _is_listen(data: bytes) -> bool:
    if b"subscriptions/listen" not in data:
        return False
    try:
        return msgspec.json.decode(data, type=_Peek).method == "subscriptions/listen"
    except _UNREADABLE:
        return False


class _ErrorDetail(msgspec.Struct):
    message: object = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail | None = None


#: Words that, beside "session", make a 400's message say the session is unknown.
_UNKNOWN_WORDS = ("no valid", "invalid", "unknown", "not found", "expired", "terminated")


def unknown_session(body: bytes) -> bool:
    """Whether a 400's body says the session it carried is unknown: its JSON-RPC error's
    message (else the body as text) names the session with one of :data:`_UNKNOWN_WORDS`."""
    try:
        error = msgspec.json.decode(body, type=_ErrorBody).error
        message = error.message if error is not None else None
    except _UNREADABLE:
        message = body[:SNIPPET].decode("ascii", "replace")
    if not isinstance(message, str):
        return False
    text = message[:SNIPPET].lower()
    return "session" in text and any(word in text for word in _UNKNOWN_WORDS)


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

    def __init__(self, cfg: BackendConfig, opener: httpclient.Opener | None = None, *,
                 name: str = "") -> None:
        self.cfg = cfg
        self.target = httpclient.parse_url(cfg.url)
        label = name or self.target.text
        # its own access token, one per backend
        self.auth: oauth.TokenSource | None = (
            None if cfg.oauth is None or cfg.credentials == "per-principal"
            else AuthorizationCode(label, cfg.url, cfg.oauth, opener)
            if cfg.oauth.grant == "authorization_code"
            else oauth.TokenSource(label, cfg.url, cfg.oauth, opener))
        self._opener = opener  # (host, port): a byte stream to it (TCP when None)
        self.headers: list[tuple[str, str]] | None = None  # read at open, and by refresh
        self._tls: ssl.SSLContext | None = None  # https: made at the first open, and by refresh
        # per-principal: whose session this opens, and the source of its upstream headers
        # (asked before every request; the principal kept current by the pool)
        self.principal: Principal | None = None
        self.credentials: PrincipalCredentials | None = None

    def for_principal(self, principal: Principal,
                      source: PrincipalCredentials | None) -> HttpConnector:
        """The connector of ``principal``'s own sessions (``source``: its headers; None: the
        backend's own identity)."""
        other = copy.copy(self)
        other.principal, other.credentials = principal, source
        return other

    async def principal_headers(self) -> list[tuple[str, str]]:
        """The principal's upstream headers now (none without a source).

        Raises:
            CredentialsUnavailable: from the source.
        """
        if self.credentials is None or self.principal is None:
            return []
        return await self.credentials.headers(self.principal)

    @property
    def origin(self) -> str:
        return self.target.text

    @property
    def request_streams(self) -> int:
        """:func:`request_streams` of the backend's ``max_connections``."""
        return request_streams(remote_connections_of(self.cfg))

    def refresh(self) -> None:
        """Read the header values again (a reload): the next requests carry them.  A value
        that cannot be read keeps the one before (logged, without it).  The ``ca_file`` is read
        again at the next open."""
        try:
            self.headers = read_headers(self.cfg)
        except OpenFailed as exc:
            LOGGER.warning("backend %s: keeping the headers read before: %s", self.origin, exc)
        self._tls = None  # ca_file read again at the next open
        if self.auth is not None:
            self.auth.refresh()

    def _context(self) -> ssl.SSLContext | None:
        if self.target.tls and self._tls is None:
            try:
                self._tls = httpclient.tls_context(self.cfg.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise OpenFailed(f"ca_file {self.cfg.ca_file}: {exc}") from None
        return self._tls

    async def open(self, ctx: LinkContext) -> HttpLink:
        self.headers = read_headers(self.cfg)
        try:
            first = await self.principal_headers()
        except CredentialsUnavailable as exc:
            raise OpenFailed(f"upstream credentials: {exc.detail}") from None
        if self.auth is not None:
            try:
                await self.auth.fresh()
            except NeedsAuthorization as exc:
                assert isinstance(self.auth, AuthorizationCode)
                raise OpenFailed(exc.detail, authorize=self.auth.waiter()) from None
            except oauth.TokenFailed as exc:  # an authorization server down: not the remote's
                raise OpenFailed(f"access token: {exc.detail}",
                                 transient=isinstance(self.auth, AuthorizationCode)) from None
        pool = httpclient.Pool(self.target, connect_timeout=self.cfg.start_timeout,
                               idle_max=self.request_streams + OTHER_STREAMS,
                               ssl_context=self._context(),
                               opener=self._opener)
        try:
            conn = await pool.connect()
        except httpclient.ConnectFailed as exc:
            raise OpenFailed(f"cannot reach {self.origin}: {exc.detail}") from None
        await pool.put(conn)  # a fresh connection: kept for the handshake
        link = HttpLink(ctx, self, pool)
        link.principal_auth = first
        return link


class HttpLink:
    """One session with the remote: POSTs out, JSON and SSE answers in, the GET stream."""

    kind = "http"
    pid = None

    def __init__(self, ctx: LinkContext, connector: HttpConnector, pool: httpclient.Pool) -> None:
        self._ctx = ctx
        self._connector = connector
        self._cfg = connector.cfg
        self._pool = pool
        self._request_streams = connector.request_streams
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
        self._methods: dict[int, str | None] = {}  # requests' methods while their POST is on
        self._begun: dict[int, httpclient.Connection] = {}  # requests written by _send_now
        self._watchers: list[_Worker] = []  # idle workers watching the connection they kept
        # the GET stream's answer head is in (or it failed): notifications wait for it, so the
        # server's answers to them (a list_changed after notifications/initialized) have a stream
        self._get_ready = trio.Event()
        self._ended = False
        self._expired = False  # the remote ended the session (a 404)
        self._unauthorized = False  # the remote wants an authorization first
        # requests that failed for want of a token (the authorization server unreachable): they
        # fail as the backend being unavailable (-32001, retryable), the session holds
        self._no_token: set[int] = set()
        self._end: LinkEnd | None = None
        self._max_line = ctx.max_line
        # 2026-07-28 requests (their _meta names a version): no session; cancelled by closing
        # their stream; a tools/list answer drops the tools whose x-mcp-header is invalid
        self._modern: set[int] = set()  # modern requests not answered yet
        self._tool_lists: set[int] = set()  # modern tools/list requests not answered yet
        self._tool_params: dict[str, mcpheaders.Paths] = {}  # marked arguments, by tool
        self._dropped_early: set[int] = set()  # cancelled while still queued
        self._listening = False  # the listen slot is taken
        # per-principal: the principal's headers as last asked (before each request)
        self.principal_auth: list[tuple[str, str]] = []

    @property
    def origin(self) -> str:
        return self._connector.origin

    # ---- the session's side -----------------------------------------------------------------

    def send(self, data: bytes, gid: int | None = None) -> None:
        if self.closed is not None:
            raise errors.NotDelivered(self.closed.message, **self.closed.data)
        if gid is None and self._modern and self._cancel_modern(data):
            return
        self._seq += 1
        if gid is None:
            self._others_pending.add(self._seq)
            queue = self._others
        else:
            queue = self._requests
            if _MODERN_MARK in data:
                self._modern.add(gid)
        if gid is not None and not queue.items:
            if self._watchers and self._hand(data, gid):
                return
            if queue.idle:
                self._send_now(data, gid)
        queue.items.append((data, gid, self._seq))
        self.buffers.charge(len(data))
        if gid is None:
            queue.ready.set()
        else:
            self._wake_worker()

    def _plain(self, data: bytes, gid: int) -> bool:
        """Whether request ``gid`` may be written from the sender's task: no notification
        before it waits and the session needs nothing awaited first (no token, no credentials;
        a legacy session set up, not a listen)."""
        connector = self._connector
        return not (self._others_pending or self.protocol_version is None
                    or connector.auth is not None or connector.credentials is not None
                    or gid in self._modern or b"subscriptions/listen" in data)

    def _hand(self, data: bytes, gid: int) -> bool:
        """Write request ``gid`` now, from the sender's task, on the connection an idle worker
        watches (:meth:`_watch`), when :meth:`_plain` and that connection not idle for
        :data:`~gateway.backend.httpclient.IDLE_TTL` yet (else that worker lets it go): its
        answer wakes that worker, whose scope holds the call's deadline from now.  Whether it
        was written (else it is queued)."""
        if not self._plain(data, gid):
            return False
        worker = self._watchers.pop()
        conn = worker.conn
        assert conn is not None
        now = trio.current_time()
        if now - conn.idle_since >= httpclient.IDLE_TTL:
            worker.scope.cancel()  # stale: given back to the pool (which closes it)
            return False
        if not self._write_now(conn, data):
            self._watchers.append(worker)
            return False
        self._begun[gid] = conn
        worker.handed = (data, gid)
        self._methods[gid] = msgspec.json.decode(data, type=_Peek).method or ""
        worker.scope.deadline = now + self._cfg.max_call_duration
        self._streams[gid] = worker.scope
        return True

    def _send_now(self, data: bytes, gid: int) -> None:
        """A request a parked worker will take next: written now, from the sender's task, on an
        idle plain TCP connection when :meth:`_plain`; the worker then reads its answer
        (:meth:`_exchange_once`)."""
        if not self._plain(data, gid):
            return
        conn = self._pool.get_now()
        if conn is None:
            return
        if self._write_now(conn, data):
            self._begun[gid] = conn
        else:
            self._pool.unget(conn)

    def _write_now(self, conn: httpclient.Connection, data: bytes) -> bool:
        """Write request ``data``'s POST on plain TCP connection ``conn`` at once; whether it
        was written."""
        head = [("content-type", "application/json"), *self._headers(_ACCEPT_BOTH)]
        more = message_headers(data) if message_headers is not None else []
        return conn.send_now("POST", self._connector.target.target, head, data, more)

    def _wake_worker(self) -> None:
        """A request is queued: an idle worker takes it, else a new one while there are fewer
        than :func:`request_streams` (else the first worker done with its request will)."""
        queue = self._requests
        if queue.idle:
            queue.idle.unpark()
        elif self._watchers:  # one watching its connection gives it back and takes the request
            self._watchers.pop().scope.cancel()
        elif self._nursery is not None and queue.workers < self._request_streams:
            queue.workers += 1
            self._nursery.start_soon(self._request_worker)

    def _cancel_modern(self, data: bytes) -> bool:
        """``notifications/cancelled`` for a modern request: not sent, its stream is closed
        (how a 2026-07-28 HTTP client cancels); whether it was one."""
        gid = _cancelled_id(data)
        if gid is None or gid not in self._modern:
            return False
        scope = self._streams.get(gid)
        self._cancelled.add(gid)
        if scope is not None:
            scope.cancel()
        else:
            self._dropped_early.add(gid)  # still queued: dropped when its turn comes
        return True

    def fits(self, size: int) -> bool:
        return self.buffers.held + size <= self.max_queued

    def fail(self, error: errors.GatewayError) -> None:
        if self.closed is None:
            self.closed = error
        self._requests.items.clear()
        self._begun.clear()  # their connections close with the pool (and handed ones are
        # not read: see _watch)
        self._others.items.clear()
        self._others_pending.clear()
        self._others_done.set()
        self.buffers.close()

    async def run(self, receiver: Receiver) -> None:
        """POST what is sent, read the answers and the GET stream, until cancelled."""
        self._receiver = receiver
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._dispatch, self._others, OTHER_STREAMS)
                for _ in range(min(len(self._requests.items), self._request_streams)):
                    self._wake_worker()  # what was sent before
        finally:
            self._nursery = None  # closed: a request sent now starts no worker

    async def _request_worker(self) -> None:
        """POST the queued requests in order, one at a time (at most :func:`request_streams`
        workers: one per request stream), parked while none is queued; a
        ``subscriptions/listen`` at the front goes on the listen slot in a task of its own
        when that is free."""
        assert self._nursery is not None
        queue = self._requests
        items = queue.items
        worker = _Worker()
        while True:
            # each call's scope (its deadline set while it runs), renewed once one cancelled
            with worker.scope as scope:
                while not scope.cancel_called:
                    if worker.conn is not None and not items:
                        await self._watch(worker)
                        continue
                    if worker.conn is not None:  # requests wait: the connection goes back
                        conn, worker.conn = worker.conn, None
                        await self._pool.put(conn)
                    while not items:
                        await queue.idle.park()
                    data, gid, seq = items.popleft()
                    self.buffers.release(len(data))
                    assert gid is not None  # only requests are queued here
                    if not self._listening and _is_listen(data):
                        self._listening = True
                        self._nursery.start_soon(self._post_request, data, gid, True)
                        continue
                    while any(other < seq for other in self._others_pending):
                        if self._others_done.is_set():
                            self._others_done = trio.Event()
                        await self._others_done.wait()
                    await self._post_request(data, gid, worker=worker)
            if scope.cancelled_caught and worker.cut is not None:
                self._interrupted(*worker.cut)
            worker.cut = None
            worker.scope = trio.CancelScope()

    async def _watch(self, worker: _Worker) -> None:
        """An idle worker watches the connection it kept until :meth:`_hand` writes a request
        on it (its answer's bytes wake it: it reads them at once), the remote closes it, or the
        worker is wanted for a queued request (its scope cancelled: the connection goes back to
        the pool) or the handed call is dropped or times out (its scope cancelled: it fails)."""
        conn = worker.conn
        assert conn is not None
        self._watchers.append(worker)
        try:
            await conn.wait_readable()
        except trio.Cancelled:
            handed = self._unwatch(worker)
            if handed is None:
                await self._pool.restore(conn)
            else:
                gid = handed[1]
                self._begun.pop(gid, None)
                await conn.aclose()
                worker.cut = (gid, gid in self._cancelled)
                self._end_call(gid)
            raise
        handed = self._unwatch(worker)
        if handed is None:  # the remote closed it (or sent what no request asked for)
            await conn.aclose()
            return
        data, gid = handed
        if self._begun.get(gid) is not conn:  # the link failed meanwhile: not read
            await conn.aclose()
            self._end_call(gid)
            return
        await self._post_request(data, gid, worker=worker, handed=True)

    def _unwatch(self, worker: _Worker) -> tuple[bytes, int] | None:
        """``worker`` no longer watches its connection (nor keeps it): the request handed to it,
        if any."""
        if worker in self._watchers:
            self._watchers.remove(worker)
        handed, worker.handed, worker.conn = worker.handed, None, None
        return handed

    async def _dispatch(self, queue: _Queue, streams: int) -> None:
        """Start a POST per queued message other than a request, in order, at most ``streams``
        at once."""
        assert self._nursery is not None
        limiter = trio.CapacityLimiter(streams)
        while True:
            while not queue.items:
                queue.ready = trio.Event()
                await queue.ready.wait()
            token = object()
            try:  # a free stream: no checkpoint here (the POST's task is the next hop)
                limiter.acquire_on_behalf_of_nowait(token)
            except trio.WouldBlock:
                await limiter.acquire_on_behalf_of(token)
            if not queue.items:  # dropped meanwhile (the link failed)
                limiter.release_on_behalf_of(token)
                continue
            data, _gid, seq = queue.items.popleft()
            self.buffers.release(len(data))
            self._nursery.start_soon(self._post_other, data, seq, limiter, token)

    def _headers(self, accept: str) -> list[tuple[str, str]]:
        head = [("accept", accept)]
        if self.session_id is not None:
            head.append(("mcp-session-id", self.session_id))
        if self.protocol_version is not None:
            head.append(("mcp-protocol-version", self.protocol_version))
        connector = self._connector
        if connector.credentials is not None:  # the principal's, never the backend's own
            return head + [h for h in connector.headers or () if h[0] != "authorization"] + (
                self.principal_auth)
        auth = connector.auth
        return head + (connector.headers or []) + (auth.headers() if auth else [])

    # ---- ending -----------------------------------------------------------------------------

    def _lost(self, detail: str, unrun: int | None = None) -> None:
        """The session with the remote is over: nothing more arrives (the instance restarts).
        The requests whose POST is on fail now, retryable only when they cannot have run:
        ``unrun`` (refused) and those :data:`SAFE_TO_REPEAT`; the rest fail as the instance
        fails a child's calls."""
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
        for gid in list(self._streams):
            self._call_failed(gid, detail, retryable=gid == unrun
                              or self._methods.get(gid) in SAFE_TO_REPEAT)
        if self._receiver is not None:
            self._receiver.ended()

    def _call_failed(self, gid: int, detail: str, *, retryable: bool = True) -> None:
        """A request's answer cannot come any more (its stream ended without it);
        ``retryable``: false when the request may have run."""
        self.last_error = detail
        kind = errors.BackendUnavailable if gid in self._no_token else errors.BackendExited
        self._no_token.discard(gid)
        if self._receiver is not None:
            self._receiver.failed(gid, kind(
                f"backend {self._ctx.backend!r}: {detail}", backend=self._ctx.backend,
                retryable=retryable))

    async def close(self) -> LinkEnd:
        """DELETE the session (bounded), close every idle connection; the streams in use end
        with the link's tasks."""
        if self._end is not None:
            return self._end
        crashed = self._ended
        self._ended = True
        self._end = LinkEnd(self.last_error or "session closed", crashed=crashed,
                            expired=self._expired, unauthorized=self._unauthorized)
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
                        repeat: bool = True, extra: list[tuple[str, str]] | None = None,
                        resets: bool = False, gid: int | None = None,
                        ) -> tuple[httpclient.Connection, httpclient.Response] | None:
        """:meth:`_exchange_once` with the backend's access token, when it has ``[oauth]``:
        fetched or refreshed first; after a 401 a new one is fetched (the endpoint discovered
        from the challenge if need be) and the POST sent once more (the remote did not run it).
        No token, or a 401 again: the link ends with the reason."""
        if self._connector.credentials is not None:
            return await self._exchange_principal(data, timeout, repeat, extra, resets, gid)
        auth = self._connector.auth
        if auth is None:
            return await self._exchange_once(data, timeout, repeat, extra, resets, gid)
        try:
            await auth.fresh()
            sent: list[str | None] = []  # the token each POST carried
            got = await self._exchange_once(data, timeout, repeat, extra, resets, gid, sent)
            if got is not None and got[1].status == 403 and isinstance(auth, AuthorizationCode):
                try:
                    auth.step_up(got[1].headers.get("www-authenticate"))  # may want more scope
                except NeedsAuthorization:
                    await self._discard(*got)
                    raise
            if got is None or got[1].status != 401:
                return got
            await self._discard(*got)
            await auth.renew(sent[-1], got[1].headers.get("www-authenticate"))
            got = await self._exchange_once(data, timeout, repeat, extra, resets, gid, sent)
            if got is None or got[1].status != 401:
                return got
            await self._discard(*got)
            self._lost(f"{self.origin} refused the access token (HTTP 401) also after a new "
                       "one was fetched")
        except NeedsAuthorization as exc:
            self._unauthorized = True
            self._lost(exc.detail)
        except oauth.TokenFailed as exc:
            if isinstance(auth, AuthorizationCode):  # this call fails; the session holds
                self.last_error = f"no access token for {self.origin}: {exc.detail}"
                if gid is not None:
                    self._no_token.add(gid)
                return None
            self._lost(f"no access token for {self.origin}: {exc.detail}")
        return None

    async def _exchange_principal(self, data: bytes, timeout: float,  # noqa: ASYNC109
                                  repeat: bool, extra: list[tuple[str, str]] | None,
                                  resets: bool, gid: int | None,
                                  ) -> tuple[httpclient.Connection, httpclient.Response] | None:
        """:meth:`_exchange_once` with the principal's headers asked of the source first; after
        a 401 the source forgets what it held and is asked again, and the POST sent once more.

        Raises:
            _NoCredentials: the source has none for the principal now.
        """
        connector = self._connector
        assert connector.credentials is not None and connector.principal is not None
        for attempt in range(2):
            try:
                self.principal_auth = await connector.principal_headers()
            except CredentialsUnavailable as exc:
                raise _NoCredentials(exc) from None
            got = await self._exchange_once(data, timeout, repeat, extra, resets, gid)
            if got is not None and got[1].status == 403:
                try:
                    connector.credentials.step_up(connector.principal,
                                                  got[1].headers.get("www-authenticate"))
                except CredentialsUnavailable as exc:
                    await self._discard(*got)
                    raise _NoCredentials(exc) from None
            if got is None or got[1].status != 401 or attempt:
                return got
            await self._discard(*got)
            connector.credentials.forget(connector.principal.key)
        return None  # (not reached)

    async def _discard(self, conn: httpclient.Connection, response: httpclient.Response) -> None:
        """An answer not used: its body read (bounded) and its connection kept, else closed."""
        try:
            await self._drain(conn, self._max_line)
        except httpclient.HttpFailure:
            await conn.aclose()
            return
        await self._pool.put(conn)

    async def _exchange_once(self, data: bytes, timeout: float,  # noqa: ASYNC109 - deadline
                             repeat: bool = True, extra: list[tuple[str, str]] | None = None,
                             resets: bool = False, gid: int | None = None,
                             sent: list[str | None] | None = None,
                             ) -> tuple[httpclient.Connection, httpclient.Response] | None:
        """POST ``data``; its connection and answer's head, or None when the remote is gone
        (the link ended).  A kept-alive connection the remote had closed is tried once anew if
        ``repeat``.  The headers (the access token among them) are read once a connection is
        had: a token renewed while it was being opened goes; ``sent`` gets the one that went.
        A request :meth:`_send_now` wrote already has its answer's head read here.

        Raises:
            _MayHaveRun: it closed and not ``repeat``.
        """
        target = self._connector.target.target
        auth = self._connector.auth
        begun = self._begun.pop(gid, None) if gid is not None else None
        for _attempt in range(2):
            conn = begun
            if conn is None:
                try:
                    conn = await self._pool.get()
                except httpclient.ConnectFailed as exc:  # request ``gid`` was not sent
                    self._lost(f"cannot reach {self.origin}: {exc.detail}", gid)
                    return None
                head = [("content-type", "application/json"), *self._headers(_ACCEPT_BOTH)]
                if sent is not None:
                    sent.append(auth.token if auth is not None else None)
                more = [*(extra or ()),
                        *(message_headers(data) if message_headers is not None else ())]
            try:
                if begun is not None:  # written already (_send_now): its answer is read here
                    begun = None  # (a reused one: lost, it goes once more if ``repeat``)
                    return conn, await conn.answer_head(timeout)
                return conn, await conn.request("POST", target, head, data, extra=more,
                                                head_timeout=timeout)
            except trio.Cancelled:
                await conn.aclose()
                raise
            except httpclient.ConnectionLost as exc:
                await conn.aclose()
                if conn.reused and not repeat:
                    raise _MayHaveRun(exc.detail) from None
                if conn.reused:
                    continue
                if resets:
                    raise _Reset(exc.detail) from None
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
        gid = _cancelled_id(data)
        scope = self._streams.get(gid) if gid is not None else None
        if scope is not None and gid is not None:
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

    def _session_gone(self, response: httpclient.Response, unrun: int | None = None) -> bool:
        """A 404 to a request carrying the session: the remote ended it.  The link ends (the
        instance opens a new session at once, :attr:`LinkEnd.expired`); ``unrun``: the request
        it refused."""
        if response.status != 404 or self.session_id is None:
            return False
        self._expire(f"{self.origin} ended the session (HTTP 404)", unrun)
        return True

    def _session_unknown(self, response: httpclient.Response, body: bytes,
                         unrun: int | None = None) -> bool:
        """A 400 to a request carrying the session whose body says the session is unknown
        (server-everything's answer for one it ended): as a 404, the link ends as expired."""
        if response.status != 400 or self.session_id is None or not unknown_session(body):
            return False
        self._expire(f"{self.origin} no longer knows the session (HTTP 400)", unrun)
        return True

    def _expire(self, detail: str, unrun: int | None) -> None:
        if not self._ended:
            self._expired = True
        self._lost(detail, unrun)

    async def _post_other(self, data: bytes, seq: int, limiter: trio.CapacityLimiter,
                          token: object) -> None:
        try:
            if self._get_started:
                await self._get_ready.wait()
            try:
                got = await self._exchange(data, SHORT_TIMEOUT)
            except _NoCredentials as exc:
                self.last_error = f"a message not sent: {exc.cause.detail}"
                LOGGER.warning("backend %s: %s", self._ctx.instance, self.last_error)
                return
            finally:
                self._others_pending.discard(seq)
                self._others_done.set()
            if got is None:
                return
            conn, response = got
            self._drop_cancelled(data)
            try:
                body = await self._drain(conn, self._max_line)
            except httpclient.HttpFailure as exc:
                await conn.aclose()
                if isinstance(exc, httpclient.HttpTimeout):
                    self.last_error = f"{self.origin}: {exc.detail}"
                    LOGGER.warning("backend %s: %s", self._ctx.instance, self.last_error)
                return
            await self._pool.put(conn)
            if (not self._session_gone(response) and not self._session_unknown(response, body)
                    and response.status >= 300):
                self.last_error = f"{self.origin} answered HTTP {response.status} to a message"
                LOGGER.warning("backend %s: %s", self._ctx.instance, self.last_error)
        finally:
            limiter.release_on_behalf_of(token)

    async def _post_request(self, data: bytes, gid: int, listen: bool = False,
                            worker: _Worker | None = None, handed: bool = False) -> None:
        """POST a request and hand its answer stream to the session; the stream is dropped
        when the gateway cancels the call (``notifications/cancelled`` for it was POSTed, or
        for a modern request would have been) or after ``max_call_duration``.  ``listen``:
        the ``subscriptions/listen`` on the listen slot, open as long as the remote keeps it.
        ``worker``: the request worker's whose scope (entered already) gets the call's deadline,
        cleared after; when it cancels the call the worker says so (:meth:`_interrupted`), and
        it keeps the connection after.  ``handed``: written by :meth:`_hand` (its method, its
        deadline and stream set there)."""
        modern = modern_request(data, self._tool_params)
        extra: list[tuple[str, str]] | None = None
        if modern is not None:
            method, extra = modern
            if method == "tools/list":
                self._tool_lists.add(gid)
        elif handed:
            method = self._methods[gid] or ""
        else:
            method = msgspec.json.decode(data, type=_Peek).method or ""
        initialize = self.protocol_version is None and method == "initialize"
        self._methods[gid] = method
        deadline = (math.inf if listen or handed  # (handed: set already)
                    else trio.current_time() + self._cfg.max_call_duration)
        probe = modern is not None and method == "server/discover"
        try:
            if gid in self._dropped_early:  # cancelled before its turn: never sent
                self._dropped_early.discard(gid)
                self._cancelled_answer(gid)
                return
            if worker is not None:
                scope = worker.scope
                if not handed:
                    scope.deadline = deadline
                    self._streams[gid] = scope
                try:
                    await self._call(data, gid, method, extra, listen, initialize, probe, worker)
                except trio.Cancelled:
                    worker.cut = (gid, gid in self._cancelled)
                    raise
                finally:
                    scope.deadline = math.inf
                return
            with trio.CancelScope(deadline=deadline) as own:
                self._streams[gid] = own
                await self._call(data, gid, method, extra, listen, initialize, probe)
            if own.cancelled_caught:
                self._interrupted(gid, gid in self._cancelled)
        finally:
            self._end_call(gid)
            if listen:
                self._listening = False

    def _end_call(self, gid: int) -> None:
        """Request ``gid``'s POST is over: what the link kept for it goes."""
        self._streams.pop(gid, None)
        self._methods.pop(gid, None)
        self._cancelled.discard(gid)
        self._modern.discard(gid)
        self._tool_lists.discard(gid)

    def _interrupted(self, gid: int, dropped: bool) -> None:
        """Request ``gid``'s call scope cancelled it: the gateway dropped it (``dropped``), or
        ``max_call_duration`` passed."""
        if dropped:
            self._cancelled_answer(gid)
        else:
            self._call_failed(gid, f"no answer from {self.origin} within max_call_duration")

    async def _call(self, data: bytes, gid: int, method: str,
                    extra: list[tuple[str, str]] | None, listen: bool, initialize: bool,
                    probe: bool, worker: _Worker | None = None) -> None:
        """:meth:`_post_request`'s exchange and answer, within the call's scope; the connection
        after kept by ``worker`` (see :meth:`_watch`) if it has none and a request like this
        one could be handed to it (:meth:`_plain`), else given back."""
        conn: httpclient.Connection | None = None
        try:
            try:
                got = await self._exchange_retried(data, gid, method, extra, listen)
            except _NoCredentials as exc:
                self.last_error = exc.cause.detail
                if self._receiver is not None:
                    self._receiver.failed(gid, call_error(exc.cause, self._ctx.backend))
                return
            except _MayHaveRun as exc:
                self._call_failed(gid, f"the connection to {self.origin} closed before the "
                                       f"answer ({exc}); the call may have run", retryable=False)
                return
            if got is None:
                self._call_failed(gid, self.last_error or f"{self.origin} is unreachable")
                return
            conn, response = got
            try:
                await self._answer(conn, response, gid, initialize, probe=probe)
            except httpclient.HttpFailure as exc:
                self._call_failed(gid, f"the answer stream from {self.origin} broke: "
                                       f"{exc.detail}", retryable=method in SAFE_TO_REPEAT)
                return
            kept, conn = conn, None
            if (worker is None or worker.conn is not None or not kept.can_send_now
                    or not self._plain(data, gid)):  # (the next could not be handed either)
                await self._pool.put(kept)
            elif await self._pool.hold(kept):
                worker.conn = kept
        finally:
            if conn is not None:
                await conn.aclose()

    def _cancelled_answer(self, gid: int) -> None:
        """Its answer cannot come now: the abandoned call leaves the attribution set."""
        if self._receiver is not None:
            self._receiver.failed(gid, errors.BackendExited(
                f"backend {self._ctx.backend!r}: the call was cancelled",
                backend=self._ctx.backend, retryable=False))

    async def _answer(self, conn: httpclient.Connection, response: httpclient.Response, gid: int,
                      initialize: bool, *, probe: bool = False) -> None:
        """Hand the answer to ``gid`` to the session.  ``probe``: a modern ``server/discover``,
        whose refusal without a JSON-RPC error answering it says "a legacy server"."""
        receiver = self._receiver
        assert receiver is not None
        if self._session_gone(response, gid):
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
            if self._session_unknown(response, body, gid):
                return
            if response.content_type == "application/json" and _answers(body, gid):
                receiver.message(body, gid)  # a JSON-RPC error answering the call
            elif probe:
                receiver.failed(gid, NotModern(
                    f"backend {self._ctx.backend!r}: {self.origin} answered HTTP "
                    f"{response.status} to server/discover without a JSON-RPC error: not a "
                    "2026-07-28 server"))
            else:  # the remote refused it (a 4xx is not a backend that exited: not again)
                self._server_error(gid, response.status, body)
            return
        answered = False
        broke = False  # the event stream broke rather than ended (the remote may be gone)
        if response.content_type == "text/event-stream":
            decoder = SseDecoder(self._max_line + SSE_OVERHEAD)
            try:
                answered = await self._events(conn, decoder, gid, initialize, until_answer=True)
            except httpclient.ConnectionLost:
                if not self._resumable(decoder):
                    raise
                broke = True
            except EventTooLarge:
                await conn.aclose()
                self._too_large(gid)
                return
            if answered and conn.ended:
                pass  # its end was read with the answer
            elif answered:  # the rest of the stream: ANSWER_TAIL more at most
                with trio.move_on_after(ANSWER_TAIL) as tail:
                    try:
                        await self._events(conn, decoder, gid, initialize)
                    except EventTooLarge:
                        await conn.aclose()
                        self._too_large(gid)
                        return
                if tail.cancelled_caught:
                    await conn.aclose()
                    return
            elif self._resumable(decoder):
                await conn.aclose()
                await self._resume(gid, decoder, broke, initialize)
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

    async def _events(self, conn: httpclient.Connection, decoder: SseDecoder, gid: int,
                      initialize: bool, *, until_answer: bool = False) -> bool:
        """Hand each event of an answer stream to the session (:meth:`_deliver`), to the
        stream's end or, ``until_answer``, the end of the bytes that brought the answer;
        whether the answer came.

        Raises:
            EventTooLarge, httpclient.HttpFailure.
        """
        answered = False
        while (chunk := await conn.chunk()) is not None:
            for event in decoder.feed(chunk):
                answered |= self._deliver(event, gid, initialize)
            if answered and until_answer:
                return True
        return answered

    def _deliver(self, data: bytes, gid: int, initialize: bool) -> bool:
        """Hand ``data`` to the session as caused by ``gid``; whether it was its reply.  A reply
        to another request is dropped: what comes on a request's stream is that request's.

        Raises:
            EventTooLarge: ``data`` is over max_message_bytes (an event's data can be).
        """
        assert self._receiver is not None
        if len(data) > self._max_line:
            raise EventTooLarge(len(data), self._max_line)
        try:
            peek = msgspec.json.decode(data, type=_Peek)
        except _UNREADABLE:
            peek = _Peek(method="")  # not a message: the session says why
        if peek.method is None and peek.id is not None and peek.id != gid:
            LOGGER.warning("backend %s: dropping an answer to request %.100r that came on the "
                           "answer stream of request %d", self._ctx.instance, peek.id, gid)
            self.last_error = "an answer to another request on a request's answer stream"
            return False
        if gid in self._tool_lists and peek.method is None and peek.id == gid:
            data = self._keep_tools(data)
        if initialize and self.protocol_version is None:
            try:
                reply = msgspec.json.decode(data, type=_InitReply)
            except _UNREADABLE:
                reply = _InitReply()
            if reply.result is not None and reply.result.protocolVersion:
                self.protocol_version = reply.result.protocolVersion
                if not self._get_started and self._nursery is not None:
                    self._get_started = True
                    self._nursery.start_soon(self._get_stream)
        self._receiver.message(data, gid)
        return peek.method is None and peek.id == gid

    def _keep_tools(self, data: bytes) -> bytes:
        """A modern ``tools/list`` page: its marked arguments learnt, the tools with an invalid
        ``x-mcp-header`` dropped (logged)."""
        try:
            message = msgspec.json.decode(data)
        except _UNREADABLE:
            return data  # the session says what is wrong with it
        result = message.get("result") if isinstance(message, dict) else None
        if not isinstance(result, dict) or not isinstance(result.get("tools"), list):
            return data
        tools: list[Any] = result["tools"]
        kept, marked, dropped = mcpheaders.split_tools(tools)
        for name in (t.get("name") for t in kept if isinstance(t, dict)):
            if isinstance(name, str):
                self._tool_params.pop(name, None)
        self._tool_params.update(marked)
        if not dropped:
            return data
        for name, why in dropped:
            LOGGER.warning("backend %s: dropping tool %r: %s", self._ctx.instance, name, why,
                           extra={"MCP_BACKEND": self._ctx.backend})
        result["tools"] = kept
        return msgspec.json.encode(message)

    async def _exchange_retried(self, data: bytes, gid: int, method: str | None,
                                extra: list[tuple[str, str]] | None = None,
                                listen: bool = False,
                                ) -> tuple[httpclient.Connection, httpclient.Response] | None:
        """:meth:`_exchange` for a request; one :data:`SAFE_TO_REPEAT` is POSTed again, up to
        :data:`RETRIES` times after a pause, when a 5xx (:data:`RETRY_STATUSES`) or a reset
        answers it.  The last answer is returned as it came; resets each time fail the call.
        The answer's head is awaited within ``max_call_duration`` by the call's own deadline
        (:meth:`_post_request`), not a second one; the ``listen`` has none: here.

        Raises:
            _MayHaveRun: as :meth:`_exchange`, for a request not safe to repeat.
        """
        timeout = self._cfg.max_call_duration if listen else math.inf
        if method not in SAFE_TO_REPEAT:
            connector = self._connector
            if connector.auth is None and connector.credentials is None:  # nothing to ask first
                return await self._exchange_once(data, timeout, False, extra, gid=gid)
            return await self._exchange(data, timeout, False, extra, gid=gid)
        for attempt in range(RETRIES + 1):
            if attempt:
                pause = RETRY_PAUSE * 2 ** (attempt - 1)
                await trio.sleep(pause * (0.5 + 0.5 * random.random()))
            try:
                got = await self._exchange(data, timeout, True, extra, resets=True, gid=gid)
            except _Reset as exc:
                self.last_error = f"{self.origin}: {exc} ({method})"
                continue
            if got is None or got[1].status not in RETRY_STATUSES or attempt == RETRIES:
                return got
            conn, response = got
            await conn.aclose()  # its body unread: not reusable
            self.last_error = f"{self.origin} answered HTTP {response.status} to {method}"
        self._call_failed(gid, f"the connection to {self.origin} broke before the answer "
                               f"{RETRIES + 1} times")
        return None

    def _server_error(self, gid: int, status: int, body: bytes) -> None:
        """An HTTP error status answered request ``gid`` (not with a JSON-RPC error): it fails
        with the status and the body's first printable bytes; retryable after a 429 (it did not
        run: any method), or a 5xx (:data:`RETRY_STATUSES`) when it could not have run twice."""
        self.last_error = f"{self.origin} answered HTTP {status}"
        if self._receiver is None:
            return
        text = "".join(c if " " <= c <= "~" else "?"
                       for c in body[:SNIPPET].decode("ascii", "replace")).strip()
        self._receiver.failed(gid, errors.BackendUnavailable(
            f"backend {self._ctx.backend!r}: {self.origin} answered HTTP {status}",
            backend=self._ctx.backend, status=status, body=text,
            retryable=status == 429 or (status in RETRY_STATUSES
                                        and self._methods.get(gid) in SAFE_TO_REPEAT)))

    def _resumable(self, decoder: SseDecoder) -> bool:
        return (decoder.last_id is not None and self.session_id is not None
                and not self._ended)

    async def _resume(self, gid: int, decoder: SseDecoder, broke: bool,
                      initialize: bool = False) -> None:
        """Request ``gid``'s event stream ended before its answer after an event with an id:
        GET it again with ``Last-Event-ID`` after the server's ``retry`` (capped), and again
        while streams end without the answer, until :data:`RESUME_ATTEMPTS` GETs in a row
        bring no message.  What comes is ``gid``'s, as on its POST's stream.  After a stream
        that ``broke``, the first wait watches the remote (:meth:`_wait_reachable`)."""
        target = self._connector.target.target
        quiet = 0
        while quiet < RESUME_ATTEMPTS and not self._ended:
            last_id = decoder.last_id
            if last_id is None:  # an id that cannot be sent back came meanwhile
                break
            wait = min(max(RESUME_WAIT if decoder.retry is None else decoder.retry / 1000,
                           RESUME_WAIT_MIN), RESUME_WAIT_MAX)
            if broke:
                broke = False
                if not await self._wait_reachable(wait):
                    return
            else:
                await trio.sleep(wait)
            conn = await self._get_connection()  # the call may have outlived its token
            if conn is None:
                return
            delivered = False
            decoder = SseDecoder(decoder.limit, decoder.last_id, decoder.retry)  # a new stream
            try:
                response = await conn.request(
                    "GET", target, [*self._headers("text/event-stream"),
                                    ("last-event-id", last_id)],
                    head_timeout=self._cfg.start_timeout)
                if self._session_gone(response):
                    await conn.aclose()
                    return
                if response.status != 200 or response.content_type != "text/event-stream":
                    body = await self._drain(conn, self._max_line)
                    await conn.aclose()
                    if self._session_unknown(response, body):
                        return
                    self._call_failed(gid, f"{self.origin} answered HTTP {response.status} to "
                                           "resuming the answer stream",
                                      retryable=self._methods.get(gid) in SAFE_TO_REPEAT)
                    return
                while (chunk := await conn.chunk()) is not None:
                    for event in decoder.feed(chunk):
                        delivered = True
                        if self._deliver(event, gid, initialize):
                            await conn.aclose()  # the answer: the rest is not this call's
                            return
            except EventTooLarge:
                await conn.aclose()
                self._too_large(gid)
                return
            except httpclient.HttpFailure as exc:
                self.last_error = f"resuming an answer stream from {self.origin}: {exc.detail}"
            await conn.aclose()
            quiet = 0 if delivered else quiet + 1
        self._call_failed(gid, f"the answer stream from {self.origin} ended without the answer "
                               f"({RESUME_ATTEMPTS} resumptions brought nothing)",
                          retryable=self._methods.get(gid) in SAFE_TO_REPEAT)

    async def _wait_reachable(self, wait: float) -> bool:
        """Wait ``wait`` seconds holding a new connection to the remote, so one that is gone
        (killed: its streams broke) ends the link at once rather than after the wait: False
        then.  A connection it closes meanwhile is opened once more: a refusal is the answer."""
        deadline = trio.current_time() + wait
        for attempt in range(2):
            try:
                probe = await self._pool.connect()
            except httpclient.ConnectFailed as exc:
                self._lost(f"cannot reach {self.origin}: {exc.detail}")
                return False
            try:
                if attempt == 0:
                    with trio.move_on_at(deadline):
                        try:  # nothing comes on it but its end (a remote dying)
                            await probe.stream.receive_some(1)
                        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                            pass
            finally:
                await probe.aclose()
            if trio.current_time() >= deadline:
                return True
        await trio.sleep_until(deadline)
        return True

    def _too_large(self, gid: int) -> None:
        LOGGER.warning("backend %s: dropping an answer of more than %d bytes (max_message_bytes)",
                       self._ctx.instance, self._max_line)
        self.last_error = f"an answer of more than {self._max_line} bytes"
        if self._receiver is not None:
            self._receiver.failed(gid, errors.ResponseTooLarge(
                f"backend {self._ctx.backend!r} answered with more than {self._max_line} bytes "
                "(max_message_bytes)", backend=self._ctx.backend, limit=self._max_line))

    async def _get_connection(self) -> httpclient.Connection | None:
        """A connection for a GET, the access token made fresh first (when the backend has
        ``[oauth]``); None when either cannot be had: the link ended."""
        auth = self._connector.auth
        try:
            if auth is not None:
                await auth.fresh()
            if self._connector.credentials is not None:
                self.principal_auth = await self._connector.principal_headers()
            return await self._pool.get()
        except CredentialsUnavailable as exc:
            self._lost(f"no upstream credentials for the GET stream: {exc.detail}")
        except NeedsAuthorization as exc:
            self._unauthorized = True
            self._lost(exc.detail)
        except oauth.TokenFailed as exc:
            self._lost(f"no access token for {self.origin}: {exc.detail}")
        except httpclient.ConnectFailed as exc:
            self._lost(f"cannot reach {self.origin}: {exc.detail}")
        return None

    # ---- the GET stream ---------------------------------------------------------------------

    async def _get_stream(self) -> None:
        """The server's own requests and notifications; opened again when it ends (later
        each time it ends at once without an event), until the remote refuses it (405: it has
        none) or cannot be reached (the link ends)."""
        target = self._connector.target.target
        delay = GET_RETRY
        last_id: str | None = None  # resumes the stream where it ended
        retry: int | None = None  # the server's own wait (ms) before opening it again
        auth = self._connector.auth
        renewed = False  # a 401 answered the last GET: a new token was fetched for this one
        while not self._ended:
            opened = trio.current_time()
            delivered = False
            conn = await self._get_connection()
            if conn is None:
                self._get_ready.set()
                return
            sent = auth.token if auth is not None else None
            try:
                try:
                    resume = [] if last_id is None else [("last-event-id", last_id)]
                    response = await conn.request("GET", target,
                                                  [*self._headers("text/event-stream"), *resume],
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
                if response.status == 401 and auth is not None and not renewed:
                    await conn.aclose()  # a new token, as for a POST, and the GET once more
                    try:
                        await auth.renew(sent, response.headers.get("www-authenticate"))
                    except oauth.TokenFailed as exc:
                        self._unauthorized = isinstance(exc, NeedsAuthorization)
                        self._lost(f"no access token for {self.origin}: {exc.detail}")
                        return
                    renewed = True
                    continue
                renewed = False
                if response.status != 200 or response.content_type != "text/event-stream":
                    body = await self._drain(conn, self._max_line)
                    await conn.aclose()
                    if not self._session_unknown(response, body):
                        self._lost(f"{self.origin} refused the GET stream "
                                   f"(HTTP {response.status})")
                    return
                decoder = SseDecoder(self._max_line + SSE_OVERHEAD, last_id, retry)
                try:
                    while (chunk := await conn.chunk()) is not None:
                        for event in decoder.feed(chunk):
                            assert self._receiver is not None
                            if len(event) > self._max_line:
                                raise EventTooLarge(len(event), self._max_line)
                            delivered = True
                            self._receiver.message(event)
                finally:
                    last_id = decoder.last_id
                    retry = decoder.retry
            except EventTooLarge:
                LOGGER.warning("backend %s: the GET stream sent an event of more than %d bytes; "
                               "opening it again", self._ctx.instance, self._max_line)
            except httpclient.HttpFailure as exc:
                self.last_error = f"the GET stream from {self.origin} ended: {exc.detail}"
            await conn.aclose()
            if delivered or trio.current_time() - opened >= GET_RETRY_MAX:
                delay = GET_RETRY
            await trio.sleep(delay if retry is None else min(max(delay, retry / 1000),
                                                             GET_RETRY_MAX))
            delay = min(2 * delay, GET_RETRY_MAX)
