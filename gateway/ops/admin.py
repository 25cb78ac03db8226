"""The admin HTTP listener: ``/metrics``, ``/healthz``, ``/readyz`` and ``/status``.

Meant for loopback or a management interface: no TLS, GET/HEAD only, served by the gateway's one
HTTP layer (:mod:`gateway.transports.http`) with every read and write bounded and at most
:data:`gateway.limits.ADMIN_CONNECTIONS` connections (one more closes the oldest not writing a
response, so ``/healthz`` is never starved).  ``/healthz`` and ``/readyz`` answer anyone and
reveal nothing; they are also served beside ``/mcp`` (:func:`probe`).  ``/status`` (backend
stderr) and ``/metrics`` answer only a loopback, bound or allowed ``Host`` (else 421: DNS
rebinding) and no ``Origin`` (403: a browser page).  ``/status`` also needs the
``admin.token_sha256`` bearer token when one is set, and off loopback is refused until one is
(:func:`status_refusal`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import msgspec
import trio

from gateway.limits import ADMIN_CONNECTIONS
from gateway.transports.http import HttpConnection, Reply, Request, serve_connection
from gateway.transports.listeners import allowed_host_names, bound_off_loopback, serve_listeners

if TYPE_CHECKING:
    from gateway.ops.metrics import GatewayMetrics
    from gateway.status import GatewayStatus

LOGGER = logging.getLogger(__name__)

READ_TIMEOUT = 10.0  # a scraper sends its whole request at once; slower peers are dropped
MAX_HEAD_BYTES = 16 * 1024  # request line + headers; browsers and Prometheus send < 2 KiB
MAX_BODY_BYTES = 64 * 1024  # GET/HEAD carry no body; tolerate a small one, refuse more
ALLOWED_METHODS = ("GET", "HEAD")
PROBES = ("/healthz", "/readyz")  # answer any Host, on the admin and the client listener
HOST_CHECKED = ("/metrics", "/status")  # what a rebound browser page must not read
AUTHORIZE = "/authorize/"  # POST /authorize/BACKEND: that backend's authorization URL
TEXT = "text/plain; charset=utf-8"


async def serve_admin(
    listeners: list[trio.SocketListener],
    metrics: GatewayMetrics,
    status: Callable[[], GatewayStatus],
    *,
    handler_nursery: trio.Nursery | None = None,
    allowed_hosts: Sequence[str] = (),
    token_sha256: str | None = None,
    authorize: Callable[[str], tuple[int, str]] | None = None,
    read_timeout: float = READ_TIMEOUT,
    max_head_bytes: int = MAX_HEAD_BYTES,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin endpoints on ``listeners`` until cancelled; ``await
    nursery.start(serve_admin, ...)`` returns the listeners once accepting.

    Args:
        listeners: bound listeners; this function closes them when it returns.
        metrics: rendered on ``GET /metrics`` with content negotiation on ``Accept``.
        status: the snapshot for ``/readyz`` and ``/status``; called in the trio thread.
        handler_nursery: where connection tasks run (default: an internal nursery).
        allowed_hosts: ``Host`` names ``/status`` and ``/metrics`` answer besides the loopback
            names and the bound address (``admin.allowed_hosts``).
        token_sha256: hex SHA-256 of the bearer token ``/status`` needs (``admin.token_sha256``);
            without it ``/status`` is refused on a listener bound off loopback.
        authorize: ``POST /authorize/BACKEND`` (``mcp-gateway authorize``): a backend's
            authorization URL, or why there is none, with its status (the same checks as
            ``/status``).
        read_timeout: seconds to receive a complete request (also the keep-alive idle limit).
        max_head_bytes: the largest request head accepted (larger ones get a 431).
        task_status: reports the listeners once accepting.

    Error handling:
        Nothing a client does escapes its connection task: protocol errors get a 4xx and a
        close, failures in a route a 500, anything else is logged and the connection closed.
    """
    off_loopback = bound_off_loopback(listeners)
    if off_loopback and token_sha256 is None:
        LOGGER.warning("admin: listening off loopback without admin.token_sha256: /status is "
                       "refused "
                       "(403) until it is set; /metrics, /healthz, /readyz are served")
    respond = partial(_respond, metrics, status, allowed_host_names(listeners, allowed_hosts),
                      token_sha256, off_loopback, authorize=authorize)

    async def handle(conn: HttpConnection, req: Request) -> None:
        try:
            reply = respond(req)
        except Exception:
            LOGGER.exception("admin: %s %s failed", req.method, req.path)
            reply = (500, TEXT, b"internal error\n", [])
        LOGGER.debug("admin: %s %s -> %d", req.method, req.path, reply[0])
        code, content_type, body, extra = reply
        # after a refusal the request stream is not trustworthy (404, 405, 503 are ordinary)
        conn.respond(code, body, content_type, [("cache-control", "no-store"), *extra],
                     close=code >= 400 and code not in (404, 405, 503))

    # the connections served, oldest first: each one's connection and cancel scope
    served: dict[object, tuple[HttpConnection, trio.CancelScope]] = {}

    async def handler(stream: trio.SocketStream) -> None:
        if len(served) >= ADMIN_CONNECTIONS and not _evict_oldest(served):
            return  # all of them are writing a response: closed at once
        key = object()
        with trio.CancelScope() as scope:
            try:
                conn = HttpConnection(stream, MAX_BODY_BYTES, max_head=max_head_bytes,
                                      request_timeout=read_timeout, head_timeout=read_timeout)
                served[key] = (conn, scope)
                await serve_connection(conn, handle, idle_timeout=read_timeout, name="admin")
            finally:
                served.pop(key, None)

    await serve_listeners(handler, listeners, handler_nursery=handler_nursery,
                          task_status=task_status)


def _evict_oldest(served: dict[object, tuple[HttpConnection, trio.CancelScope]]) -> bool:
    """Make room for a new admin connection beyond :data:`ADMIN_CONNECTIONS`: close the oldest
    one that is not writing a response (an idle keep-alive, or one whose request has not
    arrived).  Idle connections (any local process may open them) then cannot keep a health
    check from being answered; the fds stay bounded.  False: every one is writing."""
    for key, (conn, scope) in served.items():
        if conn.io.held == 0:
            del served[key]
            scope.cancel()
            return True
    return False


def probe(status: Callable[[], GatewayStatus], req: Request) -> Reply:
    """The answer to ``/healthz`` or ``/readyz`` (any ``Host``; nothing to hide): liveness,
    and readiness with the reasons it is not ready."""
    if req.method not in ALLOWED_METHODS:
        return 405, TEXT, b"method not allowed\n", [("allow", ", ".join(ALLOWED_METHODS))]
    if req.path == "/healthz":
        return 200, TEXT, b"ok\n", []
    snap = status()
    if snap.ready:
        return 200, TEXT, b"ready\n", []
    why = "; ".join(snap.not_ready_because()) or "not ready"
    return 503, TEXT, f"{why}\n".encode(), []


def status_refusal(authorization: str | None, token_sha256: str | None,
                   off_loopback: bool) -> Reply | None:
    """Whether ``/status`` is refused to a request with this ``Authorization`` header: None
    (served), 401 (the token is required and missing or wrong; the SHA-256 of the presented
    token is compared with ``token_sha256`` in constant time), or 403 (off loopback and no
    ``admin.token_sha256`` configured: nothing could be accepted)."""
    if token_sha256 is None:
        if off_loopback:
            return 403, TEXT, (b"/status is not served off loopback without admin.token_sha256 "
                               b"(it shows backend stderr)\n"), []
        return None
    scheme, _, presented = (authorization or "").strip().partition(" ")
    digest = hashlib.sha256(presented.strip().encode("latin-1")).hexdigest()
    if (scheme.lower() == "bearer" and presented.strip()
        and hmac.compare_digest(digest, token_sha256.lower())):
        return None
    return 401, TEXT, b"a bearer token is required (admin.token_sha256)\n", [
        ("www-authenticate", 'Bearer realm="mcp-gateway admin"')]


def _respond(
    metrics: GatewayMetrics,
    status: Callable[[], GatewayStatus],
    hosts: frozenset[str],
    token_sha256: str | None,
    off_loopback: bool,
    req: Request,
    authorize: Callable[[str], tuple[int, str]] | None = None,
) -> Reply:
    path = req.path
    if path in PROBES:
        return probe(status, req)
    asked = path.startswith(AUTHORIZE) and authorize is not None
    if path not in HOST_CHECKED and not asked:
        return 404, TEXT, b"not found\n", []
    allowed = ("POST",) if asked else ALLOWED_METHODS
    if req.method not in allowed:
        return 405, TEXT, b"method not allowed\n", [("allow", ", ".join(allowed))]
    if not req.host_in(hosts):
        LOGGER.warning("admin: %s refused: Host %r not allowed (admin.allowed_hosts)", path,
                       req.header(b"host"))
        return 421, TEXT, b"Host not allowed\n", []
    origin = req.header(b"origin")
    if origin is not None:
        LOGGER.warning("admin: %s refused: a browser page (Origin %.100r) asked for it",
                       path, origin)
        return 403, TEXT, b"Origin not allowed\n", []
    if path == "/metrics":
        body, content_type = metrics.exposition(req.header(b"accept"))
        return 200, content_type, body, []
    refused = status_refusal(req.header(b"authorization"), token_sha256, off_loopback)
    if refused is not None:
        LOGGER.warning("admin: %s refused (%d): %s", path, refused[0],
                       "no admin.token_sha256 off loopback" if refused[0] == 403
                       else "no valid bearer token")
        return refused
    if asked:
        assert authorize is not None
        code, text = authorize(path[len(AUTHORIZE):])
        return code, TEXT, (text + "\n").encode(), []
    snap = status()
    doc = dataclasses.asdict(snap)
    doc["ready"] = snap.ready
    return 200, "application/json", msgspec.json.encode(doc) + b"\n", []
