"""The admin HTTP listener: ``/metrics``, ``/healthz``, ``/readyz`` and ``/status``.

A deliberately small HTTP/1.1 server on trio and h11 (sans-IO), meant for loopback or a
management interface: no auth, no TLS, GET/HEAD only.  Each connection is one task in the
handler nursery; requests on it are served one after the other (keep-alive, pipelining via
h11's buffer), ``Connection: close`` is honoured by h11.  Every read of a request (including
the idle wait between keep-alive requests) and every write is bounded by a timeout, the request
head by ``max_head_bytes`` (431) and the body by :data:`MAX_BODY_BYTES` (413).

DNS rebinding: a browser page whose name resolves to 127.0.0.1 may read same-origin responses,
so ``/status`` (backend stderr) and ``/metrics`` answer only a ``Host`` that is a loopback name,
the bound address or in ``allowed_hosts`` (else 421).  ``/healthz`` and ``/readyz`` answer any
``Host`` (load balancers probe by address or by their own name) and reveal nothing.  A request
for ``/status`` or ``/metrics`` that carries an ``Origin`` header comes from a browser page
(scrapers and curl send none): 403.
"""

from __future__ import annotations

import dataclasses
import http
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import h11
import msgspec
import trio

from gateway.config import host_allowed
from gateway.transports.listeners import allowed_host_names

if TYPE_CHECKING:
    from gateway.ops.metrics import GatewayMetrics
    from gateway.status import GatewayStatus

LOGGER = logging.getLogger(__name__)

READ_TIMEOUT = 10.0  # a scraper sends its whole request at once; slower peers are dropped
WRITE_TIMEOUT = 10.0  # a /metrics body is small; a peer that does not read it is dropped
MAX_HEAD_BYTES = 16 * 1024  # request line + headers; browsers and Prometheus send < 2 KiB
MAX_BODY_BYTES = 64 * 1024  # GET/HEAD carry no body; tolerate a small one, refuse more
RECEIVE_SIZE = 64 * 1024
ALLOWED_METHODS = ("GET", "HEAD")
HOST_CHECKED = ("/metrics", "/status")  # what a rebound browser page must not read
TEXT = "text/plain; charset=utf-8"

Response = tuple[int, str, bytes, list[tuple[str, str]]]  # status, content type, body, headers


async def serve_admin(
    listeners: list[trio.SocketListener],
    metrics: GatewayMetrics,
    status: Callable[[], GatewayStatus],
    *,
    handler_nursery: trio.Nursery | None = None,
    allowed_hosts: Sequence[str] = (),
    read_timeout: float = READ_TIMEOUT,
    max_head_bytes: int = MAX_HEAD_BYTES,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin endpoints on ``listeners`` until cancelled.

    Start it with ``await nursery.start(serve_admin, ...)``; the listeners are returned once
    accepting (read the bound port from ``listeners[0].socket.getsockname()``).

    Args:
        listeners: bound listeners; this function closes them when it returns.
        metrics: rendered on ``GET /metrics`` with content negotiation on ``Accept``.
        status: the snapshot for ``/readyz`` and ``/status``; called in the trio thread.
        handler_nursery: where connection tasks run (default: an internal nursery).
        allowed_hosts: ``Host`` names ``/status`` and ``/metrics`` answer besides the loopback
            names and the bound address (``admin.allowed_hosts``).
        read_timeout: seconds to receive a complete request (also the keep-alive idle limit).
        max_head_bytes: the largest request head accepted (larger ones get a 431).
        task_status: reports the listeners once accepting.

    Error handling:
        Nothing a client does escapes its connection task: protocol errors get a 4xx and a
        close, failures in a route a 500, anything else is logged and the connection closed.
    """
    hosts = allowed_host_names(listeners, allowed_hosts)
    handler = partial(
        _serve_connection, partial(_respond, metrics, status, hosts), read_timeout, max_head_bytes
    )
    await trio.serve_listeners(
        handler, listeners, handler_nursery=handler_nursery, task_status=task_status
    )


def _respond(
    metrics: GatewayMetrics,
    status: Callable[[], GatewayStatus],
    hosts: frozenset[str],
    method: str,
    target: str,
    host: str | None,
    accept: str | None,
    origin: str | None = None,
) -> Response:
    path = target.split("?", 1)[0]
    if path not in ("/metrics", "/healthz", "/readyz", "/status"):
        return 404, TEXT, b"not found\n", []
    if method not in ALLOWED_METHODS:
        return 405, TEXT, b"method not allowed\n", [("allow", ", ".join(ALLOWED_METHODS))]
    if path in HOST_CHECKED and not host_allowed(host, hosts):
        LOGGER.warning("admin: %s refused: Host %r not allowed (admin.allowed_hosts)", path, host)
        return 421, TEXT, b"Host not allowed\n", []
    if path in HOST_CHECKED and origin is not None:
        LOGGER.warning("admin: %s refused: a browser page (Origin %.100r) asked for it", path, origin)
        return 403, TEXT, b"Origin not allowed\n", []
    if path == "/healthz":
        return 200, TEXT, b"ok\n", []
    if path == "/metrics":
        body, content_type = metrics.exposition(accept)
        return 200, content_type, body, []
    snap = status()
    if path == "/readyz":
        if snap.ready:
            return 200, TEXT, b"ready\n", []
        why = "; ".join(snap.not_ready_because()) or "not ready"
        return 503, TEXT, f"{why}\n".encode(), []
    doc = dataclasses.asdict(snap)
    doc["ready"] = snap.ready
    return 200, "application/json", msgspec.json.encode(doc) + b"\n", []


Respond = Callable[[str, str, str | None, str | None, str | None], Response]  # method, target, host, accept, origin


async def _serve_connection(
    respond: Respond,
    read_timeout: float,
    max_head_bytes: int,
    stream: trio.SocketStream,
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes)
    try:
        async with stream:
            while await _serve_one(respond, conn, stream, read_timeout):
                conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        LOGGER.debug("admin connection lost: %s", exc)
    except Exception:  # the one catch-all per connection
        LOGGER.exception("admin connection failed")


async def _serve_one(
    respond: Respond,
    conn: h11.Connection,
    stream: trio.SocketStream,
    read_timeout: float,
) -> bool:
    """Read one request and answer it; True when the connection can carry another."""
    try:
        with trio.fail_after(read_timeout):
            request = await _read_request(conn, stream)
    except trio.TooSlowError:
        if conn.their_state is h11.IDLE and not conn.trailing_data[0]:
            LOGGER.debug("admin: closing idle connection")  # no 408 on an idle keep-alive
        else:
            await _send(conn, stream, False, (408, TEXT, b"request timeout\n", []))
        return False
    except h11.RemoteProtocolError as exc:
        LOGGER.debug("admin: bad request: %s", exc)
        reply = f"{http.HTTPStatus(exc.error_status_hint).phrase.lower()}\n".encode()
        await _send(conn, stream, False, (exc.error_status_hint, TEXT, reply, []))
        return False
    if request is None:
        return False
    method, target = request.method.decode("ascii"), request.target.decode("ascii", "replace")
    accept = ", ".join(v.decode("latin-1") for k, v in request.headers if k == b"accept") or None
    host = next((v.decode("latin-1") for k, v in request.headers if k == b"host"), None)  # h11: one at most
    origin = next((v.decode("latin-1") for k, v in request.headers if k == b"origin"), None)
    try:
        response = respond(method, target, host, accept, origin)
    except Exception:
        LOGGER.exception("admin: %s %s failed", method, target)
        response = (500, TEXT, b"internal error\n", [])
    LOGGER.debug("admin: %s %s -> %d", method, target, response[0])
    if not await _send(conn, stream, method == "HEAD", response):
        return False
    return conn.our_state is h11.DONE and conn.their_state is h11.DONE


async def _read_request(conn: h11.Connection, stream: trio.SocketStream) -> h11.Request | None:
    """The next complete request (its body read and dropped), or None at end of stream."""
    request: h11.Request | None = None
    body_bytes = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(RECEIVE_SIZE))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body_bytes += len(event.data)
            if body_bytes > MAX_BODY_BYTES:
                raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage):
            return request
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _send(
    conn: h11.Connection, stream: trio.SocketStream, head_only: bool, response: Response
) -> bool:
    """Send ``response`` within :data:`WRITE_TIMEOUT`; False if it could not be sent."""
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return False
    status_code, content_type, body, extra = response
    headers = [
        ("content-type", content_type),
        ("content-length", str(len(body))),
        ("cache-control", "no-store"),
        *extra,
    ]
    if status_code >= 400 and status_code not in (404, 405, 503):
        headers.append(("connection", "close"))  # the request stream is not trustworthy now
    reason = http.HTTPStatus(status_code).phrase
    data = conn.send(h11.Response(status_code=status_code, headers=headers, reason=reason))
    if not head_only:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    with trio.move_on_after(WRITE_TIMEOUT) as scope:
        await stream.send_all(data)
    if scope.cancelled_caught:
        conn.send_failed()
        LOGGER.debug("admin: peer did not read the response; closing")
        return False
    return True
