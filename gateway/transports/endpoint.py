"""The Streamable HTTP endpoint ``/mcp``: HTTP only, each POST decoded once and handed to the
core.

Each connection holds a ``max_connections`` slot and serves its requests in turn
(:mod:`gateway.transports.http`).  A request is checked in order: path, ``Host`` and ``Origin``
(403), the credential (401), method, ``Accept``, ``Content-Type``, the body (decoded here only),
then the session (``Mcp-Session-Id``, bound to its principal: 404 for anyone else) or, for the
2026-07-28 shape, none.  The envelope goes to the core: a legacy session's
:class:`~gateway.transports.streamable.HttpSession` or a stateless request's
:class:`~gateway.core.connection.Direct`.  The core decides refusals
(:func:`~gateway.core.connection.refusal`, :func:`~gateway.core.connection.scope_refusal`); this
module maps them to a status (503 + ``Retry-After``, 403 + challenge, 400).  GET opens or
resumes the session's standalone stream; DELETE ends it."""

from __future__ import annotations

import functools
import logging
import math
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import trio

from gateway import errors, limits
from gateway.auth.authenticator import Unauthorized
from gateway.auth.challenge import METADATA_PATHS
from gateway.config import host_allowed
from gateway.core import connection, tracing
from gateway.core.connection import ConnectionPorts, Decoded
from gateway.core.serving import error_response
from gateway.errors import TransportClosed
from gateway.limits import CapReached, ConnectionSlots, Held, PrincipalCaps
from gateway.protocol import era, jsonrpc, mcp
from gateway.transports import replay, tls
from gateway.transports.http import (
    WRITE_TIMEOUT,
    HttpConnection,
    HttpError,
    Reply,
    Request,
    serve_connection,
)
from gateway.transports.listeners import Accepted, SlottedListener, serve_listeners
from gateway.transports.streamable import SESSION_HEADER, HttpSession, Sink

if TYPE_CHECKING:
    from gateway.auth.authenticator import Authenticator
    from gateway.auth.principal import Principal
    from gateway.core.bridge import Bridge
    from gateway.core.connection import Direct
    from gateway.core.session import ClientSession

LOGGER = logging.getLogger(__name__)

PATH = "/mcp"
#: Served beside /mcp for load balancers, with any Host (never /status or /metrics here).
PROBES = ("/healthz", "/readyz")
#: Seconds between SSE comments on an idle stream.
KEEPALIVE = 15.0
#: A POST's answer is awaited this long before its connection is watched for the peer leaving
#: (closing a response stream earlier cancels the call once this has passed).
QUICK_ANSWER = 0.05
#: Seconds a request refused while the gateway drains is told to wait (``Retry-After``).
RETRY_AFTER = 1
#: The timer of :class:`_QuickWaits` wakes at most this often.
QUICK_TICK = 0.01
#: A keep-alive connection with no request for this long is closed (counted from the answer,
#: or from :data:`KEEPALIVE` after a POST whose task read ahead: see :func:`_hold`).
IDLE_TIMEOUT = 60.0
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
ALLOW = [("allow", "GET, POST, DELETE")]


def _jsonrpc_error(status: int, exc: errors.GatewayError, id: int | str | None = None) -> HttpError:
    """A refusal with HTTP ``status``, its body the JSON-RPC error the core makes of ``exc``."""
    return HttpError(status, exc.message, error_response(id, exc), JSON)


class _QuickWaits:
    """The POSTs waiting for their answer's first :data:`QUICK_ANSWER` seconds, woken by one timer
    task (run while any waits): most answers come within moments, and a cancel scope (or the
    socket registered with epoll) per POST costs more than the call."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._due: deque[tuple[float, Sink]] = deque()  # by deadline: all wait as long
        self._ticking = False

    async def wait(self, sink: Sink) -> None:
        """Until ``sink`` is answered (or woken), at most about :data:`QUICK_ANSWER` seconds."""
        sink.answered = event = trio.Event()
        try:
            if not self._ticking:
                try:
                    self._nursery.start_soon(self._tick)
                except RuntimeError:  # the service is unwinding: a timer of its own
                    with trio.move_on_after(QUICK_ANSWER):
                        await event.wait()
                    return
                self._ticking = True
            self._due.append((trio.current_time() + QUICK_ANSWER, sink))
            await event.wait()
        finally:
            sink.answered = None

    async def _tick(self) -> None:
        due = self._due
        try:
            while due:
                # the answered ones ahead: nothing to wake; the timer sleeps to the first still
                # waiting (or the last one's deadline: it stays while POSTs keep coming)
                while len(due) > 1 and due[0][1].answered is None:
                    due.popleft()
                await trio.sleep_until(max(due[0][0], trio.current_time() + QUICK_TICK))
                now = trio.current_time()
                while due and due[0][0] <= now:
                    answered = due.popleft()[1].answered
                    if answered is not None:
                        answered.set()
        finally:
            self._ticking = False


class Sessions:
    """The live HTTP sessions by id; each runs ``serve_session`` in ``nursery`` for its life."""

    def __init__(self, serve_session: Callable[[HttpSession], Awaitable[None]],
                 nursery: trio.Nursery, *, max_sessions: int, idle_timeout: float, tag: str = "",
                 caps: PrincipalCaps | None = None) -> None:
        self._serve = serve_session
        self._nursery = nursery
        self.tag = tag  # leads every session id: the replica id
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self.caps = caps if caps is not None else PrincipalCaps()  # a principal's max_sessions
        self.by_id: dict[str, HttpSession] = {}
        self.quick = _QuickWaits(nursery)

    def __len__(self) -> int:
        return len(self.by_id)

    def create(self, principal: Principal | None = None) -> HttpSession | None:
        """A new session of ``principal``; None beyond ``max_sessions``.

        Raises:
            CapReached: ``principal`` holds its ``max_sessions`` already.
        """
        if len(self.by_id) >= self.max_sessions:
            return None
        counted = self.caps.acquire("max_sessions", None if principal is None else principal.name)
        session = HttpSession(self.idle_timeout, tag=self.tag)
        session.principal = principal
        self.by_id[session.id] = session
        self._nursery.start_soon(self._run, session, counted)
        return session

    async def _run(self, session: HttpSession, counted: Held) -> None:
        try:
            await self._serve(session)
        finally:
            counted.release()
            session.closed = True
            if session.id:
                self.by_id.pop(session.id, None)


class Endpoint:
    """What ``/mcp`` needs to answer a request: the checks' allow-lists and the sessions."""

    def __init__(self, sessions: Sessions, *, hosts: frozenset[str], allowed_origins: Sequence[str],
                 max_json_depth: int, ports: frozenset[int] = frozenset(),
                 probes: Callable[[Request], Reply] | None = None,
                 bridge: Bridge | None = None, authn: Authenticator | None = None) -> None:
        self.sessions = sessions
        self.authn = authn  # None or not configured: no authentication (loopback only)
        self.probes = probes  # /healthz and /readyz (gateway.ops.admin.probe), any Host
        self.bridge = bridge  # None: a legacy child's requests to a modern caller are refused
        # serves a modern request's flow without a task of its own (set by the service)
        self.direct: Callable[[HttpSession], Direct] | None = None
        self.hosts = hosts
        self.allowed_origins = allowed_origins
        self.max_json_depth = max_json_depth
        self.ports = ports  # the listener's own ports: an Origin naming this server is allowed
        # the core: its refusals of a request before it starts (drain), set by the service
        self.core: ConnectionPorts | None = None
        self.traced = False  # tracing is on: a POST's traceparent header is read (the service)
        # an authorization server's redirect back, and the gateway's own authorize page
        # (listen.redirect_path): the query and the Cookie header in; the status, the body, its
        # content type and extra headers out (set by the service)
        self.redirect_path: str | None = None
        self.redirect: Callable[[str, str | None], Awaitable[
            tuple[int, str, str, tuple[tuple[str, str], ...]]]] | None = None
        # each connection counts toward the max_connections of its latest request's principal
        self._counted: dict[HttpConnection, Held] = {}

    def _origin_allowed(self, req: Request) -> bool:
        """Every ``Origin`` is in ``allowed_origins`` or is this server itself (a loopback name
        or an allowed host, with the listener's port): a page served from elsewhere, such as
        a DNS-rebinding attacker's, is refused."""
        if req.header(b"origin") is None:  # not from a browser
            return True
        for name, value in req.headers:
            if name.lower() != b"origin":
                continue
            origin = value.decode("latin-1")
            if origin in self.allowed_origins:
                continue
            authority = origin.partition("://")[2]
            port = authority.rpartition(":")[2] if not authority.endswith("]") else ""
            # ASCII digits only, and few: "²".isdigit() is true, and int() refuses 4301+ digits
            if not (host_allowed(authority, self.hosts) and port.isascii() and port.isdigit()
                    and len(port) <= 5 and int(port) in self.ports):
                return False
        return True

    def _session(self, req: Request, principal: Principal | None,
                 id: int | str | None = None) -> HttpSession:
        """The session a request names (``id``: the request's, echoed in a refusal).  A
        session is bound to the principal that created it: presented by another (or with no
        credential) it is answered exactly like an unknown one, 404 (its existence is not
        revealed)."""
        sid = req.header(b"mcp-session-id")
        if sid is None:
            raise _jsonrpc_error(
                400, errors.InvalidRequest("missing Mcp-Session-Id header: initialize first"), id)
        session = self.sessions.by_id.get(sid)
        if (session is not None and session.principal is not principal
                and _key(session.principal) != _key(principal)):
            if self.authn is not None:
                self.authn.refused("http", "/mcp", "a session of another principal",
                                   principal.label if principal else None)
            session = None
        if session is None or session.closed:
            raise _jsonrpc_error(
                404, errors.InvalidRequest("unknown or ended session: initialize again"), id)
        _check_version(req, id)
        if principal is not None and principal is not session.principal:
            # the same principal, its latest token: its scopes (a step-up) and expiry apply
            session.principal = principal
            if session.client is not None:
                session.client.principal = principal
        return session

    async def _authenticate(self, req: Request, *, oauth_body: bool = False) -> Principal | None:
        """The request's principal (None: authentication is not configured); a 401 with the
        ``WWW-Authenticate`` challenge otherwise (``oauth_body``: its body an OAuth error
        object, RFC 6749 §5.2, which an OAuth client reports as it is)."""
        authn = self.authn
        if authn is None or not authn.configured:
            return None
        try:
            return await authn.authenticate(req.header(b"authorization"))
        except Unauthorized as exc:
            authn.refused("http", "/mcp" if req.path == PATH else "another path", exc.kind)
            refusal = HttpError(401, str(exc))
            if oauth_body:
                refusal = HttpError(401, str(exc), msgspec.json.encode(
                    {"error": exc.error or "invalid_request", "error_description": str(exc)}), JSON)
            # a path other than /mcp is answered before the Host check: a Host not allowed
            # must not name where the metadata is (the challenge gives the realm then)
            host = req.header(b"host") if req.host_in(self.hosts) else None
            refusal.headers = [("www-authenticate", authn.challenge(host, exc))]
            raise refusal from None

    def _count(self, conn: HttpConnection, principal: Principal | None) -> None:
        """Count ``conn`` toward ``principal``'s ``max_connections`` (the principal of its latest
        request; none: not counted); 503 with -32006 at the cap."""
        name = None if principal is None else principal.name
        counted = self._counted.get(conn)
        if counted is not None:
            if counted.name == name:
                return
            self.connection_closed(conn)
        if name is not None:
            try:
                self._counted[conn] = self.sessions.caps.acquire("max_connections", name)
            except CapReached as exc:
                raise _jsonrpc_error(503, exc) from None

    def connection_closed(self, conn: HttpConnection) -> None:
        counted = self._counted.pop(conn, None)
        if counted is not None:
            counted.release()

    def _check_scopes(self, req: Request, principal: Principal | None,
                      env: jsonrpc.Envelope) -> None:
        """403 ``insufficient_scope`` when a policy rule wants scopes the token lacks."""
        assert self.core is not None
        refused = connection.scope_refusal(self.core, principal, env)
        if refused is not None:
            assert self.authn is not None and principal is not None
            self.authn.refused("http", "/mcp", f"insufficient scope for {env.method}",
                               principal.label)
            refusal = HttpError(403, refused.message)
            refusal.headers = [("www-authenticate", self.authn.challenge(
                req.header(b"host"), scope=refused.data["scopes"]))]
            raise refusal

    def _metadata(self, conn: HttpConnection, req: Request) -> None:
        """The Protected Resource Metadata (RFC 9728), when an authorization server is
        configured ([auth.oauth]): with none there is nowhere to send a client for a token."""
        doc = None if self.authn is None or not self.authn.configured else self.authn.metadata()
        if doc is None:
            raise HttpError(404, "not found (no OAuth authorization server is configured here: "
                                 "send Authorization: Bearer <token> with a token from the "
                                 "operator)")
        if not req.host_in(self.hosts):
            raise HttpError(403, "Host not allowed")
        if req.method not in ("GET", "HEAD"):
            raise HttpError(405, "method not allowed")
        body = msgspec.json.encode(doc)
        conn.respond(200, body, JSON, [("cache-control", "max-age=300"),
                                       ("access-control-allow-origin", "*")])

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        """Answer one request (raises HttpError for a refusal)."""
        if req.path in METADATA_PATHS:
            self._metadata(conn, req)
            return
        if req.path != PATH:
            if req.path == self.redirect_path and self.redirect is not None:
                if req.method not in ("GET", "HEAD"):
                    raise HttpError(405, "method not allowed")
                status, said, page_type, page_extra = await self.redirect(
                    req.target.partition("?")[2], req.header(b"cookie"))
                conn.respond(status, (said + "\n").encode(), page_type,
                             [("cache-control", "no-store"), ("referrer-policy", "no-referrer"),
                              *page_extra])
                return
            if req.path in PROBES and self.probes is not None:  # a load balancer's health checks
                code, content_type, text, extra = self.probes(req)
                conn.respond(code, text, content_type, [("cache-control", "no-store"), *extra])
                return
            # Every path of a listener that wants a credential wants it: an OAuth client that
            # fell back to this origin as its authorization server (/.well-known/
            # oauth-authorization-server, /register, /token) is told it lacks a token, not 404.
            await self._authenticate(req, oauth_body=True)
            raise HttpError(404, "not found (the MCP endpoint is /mcp)")
        host = req.header(b"host")
        if host is None or conn.passed.get("host") != host:
            if not req.host_in(self.hosts):
                LOGGER.warning("/mcp: refused Host %.100r (listen.allowed_hosts)", host)
                raise HttpError(403, "Host not allowed")
            assert host is not None
            conn.passed["host"] = host
        if req.header(b"origin") is not None and not self._origin_allowed(req):  # a browser's
            LOGGER.warning("/mcp: refused Origin %.100r (listen.allowed_origins)",
                           req.header(b"origin"))
            raise HttpError(403, "Origin not allowed")
        authn = self.authn
        principal = (None if authn is None or not authn.configured
                     else await self._authenticate(req))
        if principal is not None or self._counted:  # (else nothing is counted, nor to release)
            self._count(conn, principal)
        accept = req.header(b"accept") or ""
        if req.method == "POST":
            passed = conn.passed
            if passed.get("accept") != accept:
                if not (_accepts(accept, "application/json")
                        and _accepts(accept, "text/event-stream")):
                    raise HttpError(406, "Accept must list application/json and text/event-stream")
                passed["accept"] = accept
            raw = req.header(b"content-type") or ""
            if passed.get("content-type") != raw:
                if raw.split(";", 1)[0].strip().lower() != JSON:
                    raise HttpError(415, "Content-Type must be application/json")
                passed["content-type"] = raw
            if self.traced:
                await self._traced_post(conn, req, principal)
            else:
                await self._post(conn, req, principal)
        elif (req.method in ("GET", "DELETE")
              and req.header(b"mcp-protocol-version") in era.MODERN_VERSIONS):
            raise HttpError(405, "no sessions and no standalone stream in protocol version "
                                 f"{era.LATEST_MODERN}: POST each request")
        elif req.method == "GET":
            if not _accepts(accept, "text/event-stream"):
                raise HttpError(406, "Accept must list text/event-stream")
            session = self._session(req, principal)
            last = req.header(b"last-event-id")
            resume = None if last is None else replay.parse_id(last)
            if last is not None and resume is None:
                raise _jsonrpc_error(400, errors.InvalidRequest(
                    f"Last-Event-ID {last[:40]!r} is not an event id of this server"))
            if resume is not None and resume[0] != 0:  # a POST stream
                assert last is not None
                sink = session.resume(conn, *resume)
                if sink is None:
                    raise _jsonrpc_error(400, errors.InvalidRequest(
                        f"nothing to resume after event {last[:40]!r}: the stream ended, or its "
                        "events fell out of the replay buffer"))
                if not sink.done:
                    await _hold(conn, session, sink, self.sessions.quick)
                return
            if session.get is not None:
                raise HttpError(409, "this session already has a GET stream open")
            sink = Sink(conn, session.id)
            session.open_get(sink, None if resume is None else resume[1])
            # A stream opened with a JWT ends when the token does: the client reopens it with a
            # fresh one (every request is checked; a long-lived stream must not outlive it).
            expires = principal.expires if principal is not None else None
            deadline = (math.inf if expires is None
                        else trio.current_time() + max(0.0, expires - time.time()))
            with trio.move_on_at(deadline) as expiry:
                await _hold(conn, session, sink, self.sessions.quick)
            if expiry.cancelled_caught:  # expired: end the stream cleanly (the session goes on)
                try:
                    conn.end_events()
                except TransportClosed:
                    pass
        elif req.method == "DELETE":
            session = self._session(req, principal)
            session.terminate()
            conn.respond(200)
        else:
            raise HttpError(405, "method not allowed")

    async def _traced_post(self, conn: HttpConnection, req: Request,
                           principal: Principal | None) -> None:
        """:meth:`_post` with the request's trace context headers at hand (``http_context``)."""
        parent = req.header(b"traceparent")
        token = tracing.http_context.set(
            None if parent is None else (parent, req.header(b"tracestate")))
        try:
            await self._post(conn, req, principal)
        finally:
            tracing.http_context.reset(token)

    async def _post(self, conn: HttpConnection, req: Request, principal: Principal | None) -> None:
        body = req.body
        if jsonrpc.is_batch(body):
            if req.header(b"mcp-protocol-version") in era.MODERN_VERSIONS:  # not "initialize first"
                raise _jsonrpc_error(400, errors.InvalidRequest(
                    f"JSON-RPC batches are only accepted from clients that negotiated "
                    f"{jsonrpc.BATCH_VERSION}, not in {era.LATEST_MODERN}: POST each request"))
            await self._batch(conn, req, principal, body)
            return
        try:
            env = jsonrpc.decode(body, self.max_json_depth)
            kind = jsonrpc.classify(env)
        except errors.GatewayError as exc:
            bad_id = exc.data.pop("id", None)
            raise _jsonrpc_error(400, exc, bad_id) from None
        if kind == "request" and principal is not None:  # (no principal: no scopes to lack)
            self._check_scopes(req, principal, env)
        if _is_modern(req, env):
            await self._modern(conn, req, env, kind, body, principal)
            return
        rid = env.id if isinstance(env.id, int | str) else None
        if kind == "request":  # an initialize too
            assert self.core is not None
            if self.core.draining:  # (else nothing refuses it here)
                self._refuse(None, env)
        created = (req.header(b"mcp-session-id") is None and kind == "request"
                   and env.method == "initialize")
        if created:
            _check_version(req, rid)
            try:
                session = self.sessions.create(principal)
            except CapReached as exc:
                raise _jsonrpc_error(503, exc, rid) from None
            if session is None:
                raise _jsonrpc_error(503, errors.Overloaded(
                    "too many HTTP sessions (listen.http_max_sessions); retry later",
                    limit=self.sessions.max_sessions), rid)
            LOGGER.debug("http session %.8s… created", session.id)
        else:
            session = self._session(req, principal, rid)
        if kind != "request":
            self._accepted(conn, session, (env, kind, len(body), None))
            _cancellations(session, [env])
            return
        assert isinstance(env.id, int | str)
        if session.has_request(env.id):
            raise _jsonrpc_error(400, errors.InvalidRequest(
                f"request id {env.id!r} is already in flight on this session"), env.id)
        sink = Sink(conn, session.id, env.id)
        params = _params(env)
        sink.token = _progress_token(params)
        if sink.token is not None and session.token_in_use(sink.token):
            # the spec: a progress token is unique across active requests; two would mix their
            # progress on one stream.  A JSON-RPC error for this request (HTTP 200, like any)
            raise _jsonrpc_error(200, errors.InvalidParams(
                f"progressToken {sink.token!r} is in use by another request of this session",
                reason="progress_token_in_use"), env.id)
        try:
            _open(session, sink, (env, kind, len(body), params))
            await _hold(conn, session, sink, self.sessions.quick, ahead=not created)
        finally:
            if created and not (session.client is not None and session.client.initialized):
                # its initialize failed (or its POST ended unanswered): no session was made;
                # it must not hold a place (http_max_sessions, the principal's max_sessions)
                # until http_session_idle_timeout
                session.terminate()

    async def _batch(self, conn: HttpConnection, req: Request, principal: Principal | None,
                     body: bytes) -> None:
        """A batch POST (2025-03-26 sessions): refused as a whole (400) by the batch rule
        (:func:`gateway.protocol.jsonrpc.decode_batch`); else answered 200 with one array (the
        session's connection answers each entry, an invalid one with -32600 ``id: null``), or
        202 when nothing in it wants an answer."""
        session = self._session(req, principal)
        client = session.client
        try:
            entries = jsonrpc.decode_batch(body,
                                           None if client is None else client.protocol_version,
                                           0 if client is None else client.max_inflight,
                                           self.max_json_depth)
        except errors.GatewayError as exc:
            raise _jsonrpc_error(400, exc) from None
        requests = [e.env for e in entries if e.kind == "request" and e.env is not None]
        for env in requests:
            self._check_scopes(req, principal, env)
        invalid = sum(e.env is None for e in entries)
        notices = [e.env for e in entries if e.kind == "notification" and e.env is not None]
        if not requests and not invalid:
            self._accepted(conn, session, entries)
            _cancellations(session, notices)
            return
        if requests:
            self._refuse(None, requests[0], None)
        for env in requests:  # its answer would go to the other POST's batch, and theirs here
            if isinstance(env.id, int | str) and session.has_request(env.id):
                raise _jsonrpc_error(400, errors.InvalidRequest(
                    f"request id {env.id!r} is already in flight on this session"))
        sink = Sink(conn, session.id, batch=True)
        sink.ids = frozenset(env.id for env in requests if isinstance(env.id, int | str))
        sink.invalid = invalid
        _open(session, sink, entries, notices)
        await _hold(conn, session, sink, self.sessions.quick)

    def _refuse(self, session: ClientSession | None, env: jsonrpc.Envelope,
                id: int | str | None = -1) -> None:
        """The core's refusal of request ``env`` before it starts (:func:`connection.refusal`),
        as an HTTP refusal (``id``: the one its error names; -1: ``env``'s)."""
        assert self.core is not None
        refused = connection.refusal(self.core, session, env)
        if refused is None:
            return
        rid = env.id if id == -1 else id
        if refused.reason != "shutdown":
            raise _jsonrpc_error(400, refused, rid if isinstance(rid, int | str) else None)
        # draining: a load balancer retries it on another replica (HAProxy retry-on 503)
        refusal = _jsonrpc_error(503, refused, rid if isinstance(rid, int | str) else None)
        refusal.headers = [("retry-after", str(RETRY_AFTER))]
        raise refusal

    async def _modern(self, conn: HttpConnection, req: Request, env: jsonrpc.Envelope,
                      kind: jsonrpc.Kind,
                      body: bytes, principal: Principal | None) -> None:
        """A 2026-07-28 POST: stateless, checked at the edge (headers against the body, the
        request's ``_meta``), served by its own flow; closing the response stream cancels it."""
        if kind != "request":
            conn.respond(202)  # nothing of the client's needs the gateway's attention
            return
        assert isinstance(env.method, str) and isinstance(env.id, int | str)
        try:
            params = jsonrpc.params_dict(env.params)
            if env.method not in era.MODERN_METHODS:
                raise errors.MethodNotFound(f"method {env.method!r} not found")
            modern = era.check_http(env.method, params, {
                "mcp-protocol-version": req.header(b"mcp-protocol-version"),
                "mcp-method": req.header(b"mcp-method"), "mcp-name": req.header(b"mcp-name")})
        except errors.MethodNotFound as exc:
            raise _jsonrpc_error(404, exc, env.id) from None
        except errors.GatewayError as exc:
            raise _jsonrpc_error(400, exc, env.id) from None
        caps = modern.judged.caps
        sink = Sink(conn, "", env.id)
        sink.token = modern.progress
        if self.bridge is not None and self.bridge.continues(env.method, params):
            session = self._resume(env, params, caps, sink, principal)  # a drain lets it in
            asked = _rounds(session)
            try:
                await _hold(conn, session, sink, self.sessions.quick)
            finally:
                if _rounds(session) == asked:
                    _end(session)
            return
        assert self.core is not None
        if self.core.draining:  # (else nothing refuses it here)
            self._refuse(None, env)
        session = HttpSession(self.sessions.idle_timeout, id="")
        session.mrtr = self.bridge
        session.principal = principal
        session.open_post(sink)
        assert self.direct is not None
        flow = session.direct = self.direct(session)
        try:
            flow.handle(env, kind, len(body), params, modern.judged)
            if not sink.done:
                # the flow ends in the task that answers it (connection.Direct): this one
                # reads the peer's next request meanwhile, as a legacy session's POST does
                await _hold(conn, session, sink, self.sessions.quick, ahead=True)
        finally:
            # answered (the flow ended with its call, mostly), or the client closed the stream:
            # that cancels the call, unless this POST was answered input_required (the flow
            # waits for the retry, which may already run)
            if not flow.done and _rounds(session) == 0:
                flow.finish()

    def _resume(self, env: jsonrpc.Envelope, params: dict[str, msgspec.Raw],
                caps: dict[str, object], sink: Sink, principal: Principal | None) -> HttpSession:
        """A retry carrying ``requestState``: the parked flow it continues (gateway.core.bridge),
        with ``sink`` open for the retry's id (only for the principal the flow is bound to)."""
        assert isinstance(env.method, str) and isinstance(env.id,
                                                          int | str) and self.bridge is not None
        try:
            owner = self.bridge.resume(env.method, params, env.id, caps,
                                       principal=None if principal is None else principal.key)
        except errors.GatewayError as exc:
            raise _jsonrpc_error(400, exc, env.id) from None
        session = owner.writer
        assert isinstance(session, HttpSession)
        session.open_post(sink)
        return session

    def _accepted(self, conn: HttpConnection, session: HttpSession, message: Decoded) -> None:
        if not session.push(message):
            raise HttpError(503, "this session's inbox is full; retry later")
        conn.respond(202, headers=[(SESSION_HEADER, session.id)])


def _open(session: HttpSession, sink: Sink, message: Decoded,
          notices: Sequence[jsonrpc.Envelope] = ()) -> None:
    """A POST's stream opened and its ``message`` given to ``session`` (503 when its inbox is
    full); the requests ``notices`` cancel end (see :func:`_cancellations`)."""
    session.open_post(sink)
    if not session.push(message):
        session.close_sink(sink)
        raise HttpError(503, "this session's inbox is full; retry later")
    if notices:
        _cancellations(session, notices)


def _cancellations(session: HttpSession, notices: Sequence[jsonrpc.Envelope]) -> None:
    """The POST streams of the requests ``notices`` cancel (``notifications/cancelled``, alone
    or in a batch) end now: a cancelled request gets no response."""
    for env in notices:
        if env.method == "notifications/cancelled":
            try:
                session.cancelled(mcp.decode_cancelled(env.params).requestId)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass  # the connection layer ignores it too


def _end(session: HttpSession) -> None:
    """End a modern flow (its calls are cancelled)."""
    if session.direct is not None:
        session.direct.finish()
    else:
        session.terminate()


def _key(principal: Principal | None) -> str | None:
    return None if principal is None else principal.key


def _rounds(session: HttpSession) -> int:
    """How many ``input_required`` answers the flow gave so far: a POST during which it grew
    was answered so, and its end must not end the flow."""
    client = session.client
    return client.flow.round if client is not None and client.flow is not None else 0


def _check_version(req: Request, id: int | str | None) -> None:
    """A legacy-shape request's ``MCP-Protocol-Version``, when present, is one the gateway
    speaks (absent: 2025-03-26 is assumed); else 400 with the supported versions."""
    version = req.header(b"mcp-protocol-version")
    if version is not None and version not in mcp.LEGACY_VERSIONS:
        raise _jsonrpc_error(400, errors.InvalidRequest(
            f"unsupported MCP-Protocol-Version {version[:40]!r}",
            supported=list(era.SUPPORTED_VERSIONS)), id)


def _is_modern(req: Request, env: jsonrpc.Envelope) -> bool:
    """Whether a POST is of the 2026-07-28 shape: its ``MCP-Protocol-Version`` says so, or it
    has no session and its ``_meta`` names a protocol version (an unsupported one too: it gets
    -32022 with the versions the gateway speaks).  An ``initialize`` with an unknown version
    header is a legacy client's (400 with the supported versions, not the modern 404)."""
    version = req.header(b"mcp-protocol-version")
    if version is not None:
        return version in era.MODERN_VERSIONS or (
            version not in mcp.LEGACY_VERSIONS and req.header(b"mcp-session-id") is None
            and env.method != "initialize")
    if req.header(b"mcp-session-id") is not None or not isinstance(env.params, msgspec.Raw):
        return False
    try:
        return era.modern_version(jsonrpc.params_dict(env.params)) is not None
    except errors.GatewayError:
        return False


def _allow(exc: HttpError) -> list[tuple[str, str]]:
    return ALLOW if exc.status == 405 else []


def _accepts(accept: str, media: str) -> bool:
    kinds = _media_kinds(accept) if len(accept) <= 256 else _media_kinds.__wrapped__(accept)
    return media in kinds or "*/*" in kinds or f"{media.split('/')[0]}/*" in kinds


@functools.lru_cache(maxsize=64)
def _media_kinds(accept: str) -> frozenset[str]:
    """The media types an ``Accept`` value lists (a client sends the same one every time)."""
    return frozenset(part.split(";", 1)[0].strip().lower() for part in accept.split(","))


def _params(env: jsonrpc.Envelope) -> dict[str, msgspec.Raw] | None:
    """A request's params' top level, decoded once for the edge and the core (None: not an
    object, the core's to answer)."""
    try:
        return jsonrpc.params_dict(env.params)
    except errors.GatewayError:
        return None


def _progress_token(params: dict[str, msgspec.Raw] | None) -> int | str | None:
    """The request's progress token (None: none, or not a string or integer), ``_meta`` decoded
    one level (a malformed one is the core's to answer)."""
    raw = None if params is None else params.get("_meta")
    if raw is None:
        return None
    try:
        return era.progress_of(jsonrpc.raw_dict(raw))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def _hold(conn: HttpConnection, session: HttpSession, sink: Sink,
                quick: _QuickWaits, *, ahead: bool = False) -> None:
    """Wait until ``sink`` is answered (or its session ends), watching the peer; an SSE comment
    every :data:`KEEPALIVE` seconds of silence.  Raises TransportClosed when the peer left.

    ``ahead`` (a POST on a plain socket): the task waits for the peer's next bytes at once, not
    for the answer, which is written whole by the task that has it without waking this one:
    the next request (or the peer leaving) ends the wait, else the first keep-alive time."""
    try:
        if conn.io.held:  # a GET stream's parked backlog, more than the socket took at once
            with trio.move_on_after(WRITE_TIMEOUT):
                await conn.flush()
        ahead = ahead and sink.request_id is not None and conn.reads_ahead
        if not sink.done and sink.request_id is not None and not ahead:
            # Most answers come within moments: wait for them without watching the socket
            # (registering it with epoll and cancelling that wait costs more than the call).
            await quick.wait(sink)
        while not sink.done and sink.conn is conn:
            with trio.move_on_after(KEEPALIVE) as scope:
                sink.scope = scope
                if ahead:  # the answer is written by whoever has it, without waking this task
                    ahead = False
                    sink.ahead = True
                    try:
                        await conn.read_ahead()  # the peer's next request, or its leaving
                    finally:
                        sink.ahead = False
                    continue  # answered (and written whole): its next request is at hand
                await conn.watch()
            sink.scope = None
            if not sink.done and sink.conn is conn and scope.cancelled_caught:
                if not sink.started:
                    session.start_stream(sink)
                if not conn.keepalive():
                    with trio.move_on_after(WRITE_TIMEOUT):
                        await conn.flush()
    finally:
        session.release(sink, conn)


async def serve_http(
    listeners: list[trio.SocketListener],
    endpoint: Endpoint,
    *,
    max_message: int,
    handler_nursery: trio.Nursery,
    slots: ConnectionSlots | None = None,
    tls_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept HTTP connections on ``listeners`` until cancelled; connections run in
    ``handler_nursery`` (cancelling this stops accepting only).  With ``tls_context`` each
    connection is HTTPS: its TLS handshake first (bounded, :mod:`gateway.transports.tls`), and
    one beyond ``max_connections`` is closed at once.

    Error handling:
        Nothing a client does escapes its connection task: refusals get their status, a broken
        connection ends its task, anything else is logged and the connection closed.
    """

    async def handler(accepted: Accepted) -> None:
        stream: trio.abc.Stream = accepted.stream
        conn: HttpConnection | None = None
        opened = trio.current_time()  # the first request head is due HEAD_TIMEOUT after this
        try:
            if tls_context is not None:  # one beyond max_connections could not read a plain 503
                secured = None
                if accepted.admitted:
                    secured = await tls.handshake(accepted.stream, tls_context, "/mcp",
                                                  opened + limits.HEAD_TIMEOUT)
                if secured is None:
                    return
                stream = secured
            conn = HttpConnection(stream, max_message, opened=opened)
            if not accepted.admitted:  # beyond max_connections (already counted)
                with trio.move_on_after(WRITE_TIMEOUT):
                    try:
                        conn.respond(503, b"too many connections (max_connections)\n", TEXT,
                                     close=True)
                        await conn.flush()
                    except TransportClosed:
                        pass
                return
            await serve_connection(conn, endpoint.handle, idle_timeout=IDLE_TIMEOUT, name="/mcp",
                                   error_headers=_allow)
            if isinstance(stream, trio.SSLStream):
                await tls.close(stream)
        finally:
            if conn is not None:
                endpoint.connection_closed(conn)
            if accepted.admitted and slots is not None:
                slots.release()

    await serve_listeners(handler, [SlottedListener(lst, slots, "http") for lst in listeners],
                          handler_nursery=handler_nursery, task_status=task_status)
