"""The daemon: wires config, hub, listeners, admin, systemd and signals into one nursery tree.

Nurseries nest by lifetime (outermost lives longest): observability (admin, watchdog, lag
probe) → hub (backends) → connections (``handler_nursery``) → listeners.  A stop is a lame
duck first (:func:`lame_duck`: ``/readyz`` 503, serving on for ``drain_delay``), then the drain
(:func:`_drain`): the WebSocket and unix listeners close, live connections drain until
``drain_grace`` and are then closed; backends stop last, in the spec's order, and every child
is reaped before ``run`` returns.

Signals are received from the moment ``run`` starts (before ``READY=1``): SIGHUP reloads,
SIGTERM stops with the lame duck, SIGINT (or a second SIGTERM) without it.  Tests drive the
same paths through :class:`Control`.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

import msgspec
import trio

from gateway import __version__, config, errors, limits
from gateway.auth.authenticator import Authenticator, Unauthorized
from gateway.auth.peer import peer_principal
from gateway.auth.principal import Principal
from gateway.backend import http as http_backend
from gateway.backend import process
from gateway.backend.connector import Connector
from gateway.backend.pool import default_connector
from gateway.config import BackendConfig, GatewayConfig
from gateway.core import connection
from gateway.core.session import ClientSession
from gateway.errors import CloseReason, ConfigError
from gateway.events import EventBus, ReloadFinished, ServerRequestOutcome
from gateway.hub import Hub
from gateway.limits import CapReached
from gateway.ops import fdlimit, systemd
from gateway.ops.admin import probe as admin_probe
from gateway.ops.admin import serve_admin
from gateway.ops.audit import AuditLog
from gateway.ops.metrics import GatewayMetrics
from gateway.protocol import jsonrpc
from gateway.protocol.catalog import CatalogConflict
from gateway.protocol.policy import suggested_rules
from gateway.protocol.supervision import State
from gateway.status import ListenerStatus
from gateway.transports import listeners as ls
from gateway.transports import tls
from gateway.transports.endpoint import Endpoint, Sessions, serve_http
from gateway.transports.lines import LineStream
from gateway.transports.peercred import peer_credentials
from gateway.transports.streamable import HttpSession
from gateway.transports.websocket import Refused, WebSocketStream, serve_websocket

LOGGER = logging.getLogger(__name__)

#: After the drain grace, closing the remaining connections may take this long.
CLOSE_TIMEOUT = 3.0
#: A drained connection is closed once it has sent no request for this long: a request sent
#: as the client got its last answer is refused (retryable) then, not lost in the close.
SETTLE = 0.25
#: Seconds the spans still queued at exit may take to export.
TELEMETRY_FLUSH = 5.0

if TYPE_CHECKING:
    from gateway.ops.telemetry import Telemetry


class StartupError(Exception):
    """The daemon cannot start (message says why and how to fix it)."""


@dataclass
class Bound:
    """Where the daemon listens (ports resolved, for tests binding port 0)."""

    websocket_port: int | None = None
    http_port: int | None = None
    unix_path: str | None = None
    admin_port: int | None = None


class Embedding(Protocol):
    """The daemon run inside another program's process (tests): its backends reach the
    connectors ``connector`` chooses, and it serves the message streams :meth:`serve` hands
    over beside its listeners.  Chosen in code (``run(..., embed=...)``), never by config."""

    def connector(self, name: str, cfg: BackendConfig) -> Connector: ...

    async def serve(self, hub: Hub, metrics: GatewayMetrics,
                    handler: Callable[[connection.MessageStream], Awaitable[None]],
                    handler_nursery: trio.Nursery, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start each attached stream's ``handler`` in ``handler_nursery`` until cancelled (the
        drain closes it with the WebSocket and unix listeners)."""
        ...


class Command(enum.Enum):
    """What :meth:`Control.next` tells the daemon to do."""

    RELOAD = enum.auto()
    STOP = enum.auto()


class Control:
    """Reload/stop triggers, fed by signals in production and by tests directly.

    Nothing is queued, so nothing can overflow however many signals arrive: stop is a level
    (once requested it stays requested and wins over any reload), reload a pending flag (any
    number of requests while a reload runs cause exactly one more reload after it).  A stop
    either waits out ``gateway.drain_delay`` first (``lame_duck``: SIGTERM, see
    :func:`lame_duck`) or not (SIGINT, tests); a second stop of either kind ends the wait.
    """

    def __init__(self) -> None:
        self.stopping = trio.Event()
        self.stopped_at = 0.0  # trio time of the first stop request
        self.hurry = trio.Event()  # skip (the rest of) drain_delay
        self._reload_pending = False
        self._wake = trio.Event()

    def reload(self) -> None:
        self._reload_pending = True
        self._wake.set()

    def stop(self, *, lame_duck: bool = False) -> None:
        if not lame_duck or self.stopping.is_set():
            self.hurry.set()
        if not self.stopping.is_set():
            self.stopped_at = trio.current_time()
            self.stopping.set()
        self._wake.set()

    async def until_drain(self, delay: float) -> None:
        """Wait until the drain may begin: ``delay`` seconds after the first stop request, or
        at once when asked to hurry (a second stop, or a stop that wanted no delay)."""
        if self.hurry.is_set() or trio.current_time() >= self.stopped_at + delay:
            return  # no checkpoint: the caller begins the drain in the same step
        with trio.move_on_at(self.stopped_at + delay):
            await self.hurry.wait()

    async def next(self) -> Command:
        """Wait for the next command: STOP as soon as a stop was requested, else RELOAD."""
        while True:
            if self.stopping.is_set():
                return Command.STOP
            if self._reload_pending:
                self._reload_pending = False
                return Command.RELOAD
            await self._wake.wait()
            self._wake = trio.Event()


def _status_line(hub: Hub) -> str:
    st = hub.status()
    up = sum(1 for b in st.backends if any(i.state == State.RUNNING for i in b.instances))
    clients = sum(st.connections.values())
    return (f"STATUS={'draining' if st.draining else 'serving'}; "
            f"{up}/{len(st.backends)} backends up; {clients} clients")


async def _signals(control: Control,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    # SIGUSR1/SIGUSR2 have no meaning here, but their default action ends the process: a stray
    # `kill -USR1` must not take the gateway down, so they are received and logged.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                   signal.SIGUSR1, signal.SIGUSR2) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGHUP:
                control.reload()
            elif signum in (signal.SIGUSR1, signal.SIGUSR2):
                LOGGER.warning("ignoring %s: it means nothing to the gateway",
                               signal.Signals(signum).name)
            else:  # SIGTERM (systemd, a load balancer's orchestrator): lame duck first
                control.stop(lame_duck=signum == signal.SIGTERM)


async def run(
    cfg: GatewayConfig,
    *,
    config_path: str | None = None,
    control: Control | None = None,
    handle_signals: bool = False,
    subreaper: bool = False,
    embed: Embedding | None = None,
    bus: EventBus | None = None,
    task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the gateway until stopped.

    Args:
        cfg: the validated configuration.
        config_path: re-read on reload (without it, reload keeps the running config).
        control: reload/stop triggers (created when not given).
        handle_signals: receive SIGHUP/SIGTERM/SIGINT, ignore SIGUSR1/SIGUSR2 (``mcp-gateway run``).
        subreaper: become a child subreaper and reap orphaned backend descendants.
        embed: run inside a test: its connectors, its in-process streams (see :class:`Embedding`).
        bus: the event bus to emit on (a new one when not given; tests pass theirs to watch it).
        task_status: reports :class:`Bound` once listeners are bound and required backends run.

    Raises:
        StartupError: listeners cannot be bound, a required backend fails, a name conflict or
            a sensitive tool without a policy rule.
    """
    control = control or Control()
    cfg = fit_connections(cfg, fdlimit.raise_soft_limit())
    tls_context = _tls_context(cfg)
    if subreaper:
        process.become_subreaper()
    bus = bus if bus is not None else EventBus()
    hub = Hub(cfg, bus, subreaper=subreaper,
              connectors=default_connector if embed is None else embed.connector)
    try:
        hub.authn = Authenticator(cfg)  # reads auth.tokens_file
    except ConfigError as exc:
        raise StartupError("; ".join(exc.errors)) from None
    hub.authn.bus = bus
    audit_log = None
    if cfg.audit.enabled:
        try:
            audit_log = hub.audit = AuditLog(cfg.audit, bus)
        except ConfigError as exc:
            raise StartupError("; ".join(exc.errors)) from None
    metrics = GatewayMetrics(bus, hub.status, version=__version__,
                             max_tool_latency_series=cfg.admin.tool_latency_series)
    telemetry = _telemetry(cfg)
    if telemetry is not None:
        hub.tracer = telemetry
        metrics.registry.register(telemetry.drops)
        http_backend.message_headers = telemetry.message_headers
    fds = {name: fd for fd, name in systemd.listen_fds_with_names().items()}
    bound = Bound()
    async with trio.open_nursery() as outer:
        if handle_signals:
            await outer.start(_signals, control)
        outer.start_soon(systemd.run_watchdog)
        outer.start_soon(hub.authn.start)  # the OAuth keys (JWTs wait for this first fetch)
        outer.start_soon(metrics.run_lag_probe)
        if audit_log is not None:  # written until the very end (the drain's calls too)
            await outer.start(audit_log.run)
        if cfg.admin.listen is not None or "admin" in fds:
            admin_listeners = await _admin_listeners(cfg, fds)
            await outer.start(partial(serve_admin, allowed_hosts=cfg.admin.allowed_hosts,
                                      token_sha256=cfg.admin.token_sha256,
                                      authorize=hub.begin_authorization),
                              admin_listeners, metrics, hub.status)
            bound.admin_port = ls.bound_port(admin_listeners)
        try:
            async with trio.open_nursery() as hub_nursery:
                hub.catalog_held = True  # merged once, by _boot_checks
                await hub_nursery.start(hub.run)
                await _wait_for_backends(hub, cfg)
                _boot_checks(hub)
                async with trio.open_nursery() as conns:
                    accept: list[trio.CancelScope] = []  # the listeners the drain closes
                    await conns.start(_serve_listeners, hub, cfg, fds, conns, accept, bound,
                                      tls_context)
                    if embed is not None:
                        await conns.start(_closable, accept, partial(
                            embed.serve, hub, metrics, partial(_serve_embedded, hub), conns))
                    systemd.notify("READY=1", _status_line(hub))
                    LOGGER.info("mcp-gateway %s ready: websocket port %s, unix %s, admin port %s, "
                                "http port %s", __version__, bound.websocket_port, bound.unix_path,
                                bound.admin_port, bound.http_port)
                    task_status.started(bound)
                    await _control_loop(hub, control, config_path, tls_context, accept)
                    await lame_duck(hub, control)
                    await _drain(hub, accept, conns)
                await hub.stop_backends()
                hub_nursery.cancel_scope.cancel()
        finally:
            hub.draining = True  # however run ends, the daemon is going down: not ready
            with trio.CancelScope(shield=True):
                if hub.backends:
                    with trio.move_on_after(15):
                        await hub.stop_backends()
                hub.reap()
            metrics.close()
            if telemetry is not None:
                http_backend.message_headers = None
                with trio.CancelScope(shield=True), trio.move_on_after(TELEMETRY_FLUSH):
                    await trio.to_thread.run_sync(telemetry.shutdown, abandon_on_cancel=True)
            outer.cancel_scope.cancel()
    LOGGER.info("mcp-gateway stopped")


def _telemetry(cfg: GatewayConfig) -> Telemetry | None:
    """The daemon's tracer when ``[telemetry] enabled`` (the ``otel`` extra imported then)."""
    if not cfg.telemetry.enabled:
        return None
    try:
        from gateway.ops import telemetry
    except ImportError as exc:
        raise StartupError(f"telemetry.enabled: the otel extra is not installed ({exc})") from None
    try:
        return telemetry.Telemetry(cfg.telemetry, service_name=cfg.gateway.name,
                                   base_dir=cfg.base_dir)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def fit_connections(cfg: GatewayConfig, fd_limit: int) -> GatewayConfig:
    """``cfg`` with the ``max_connections`` that fits the open-files limit ``fd_limit`` beside
    what the daemon needs for the rest (:func:`gateway.limits.fit_connections`): the default
    lowered with a warning, or :class:`StartupError` for an explicit value that does not fit."""
    fit = limits.fit_connections(cfg.gateway.max_connections, fd_limit, config.fd_reserve(cfg))
    if fit.refusal is not None:
        raise StartupError(fit.refusal)
    if fit.warning is not None:
        LOGGER.warning("%s", fit.warning)
    return msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(
        cfg.gateway, max_connections=fit.max_connections))


def _tls_context(cfg: GatewayConfig) -> ssl.SSLContext | None:
    """The client listeners' TLS context (``listen.tls_cert`` + ``listen.tls_key``), loaded once."""
    if cfg.listen.tls_cert is None or cfg.listen.tls_key is None:
        return None
    try:
        return tls.server_context(cfg.listen.tls_cert, cfg.listen.tls_key)
    except tls.TlsError as exc:
        raise StartupError(str(exc)) from None


async def _admin_listeners(cfg: GatewayConfig, fds: dict[str, int]) -> list[trio.SocketListener]:
    if "admin" in fds:
        listener = ls.adopt_listener(fds["admin"])
        if not cfg.admin.allow_non_loopback:
            try:
                ls.check_loopback(listener, "admin socket from systemd", (
                    "admin.allow_non_loopback = true (/status shows backend stderr: set "
                    "admin.token_sha256 too)",))
            except ls.ListenerError as exc:
                raise StartupError(str(exc)) from None
        return [listener]
    assert cfg.admin.listen is not None
    host, port = config.parse_host_port(cfg.admin.listen)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise StartupError(f"admin.listen: cannot listen on {cfg.admin.listen}: "
                           f"{exc.strerror or exc}") from None
    return listeners


async def _wait_for_backends(hub: Hub, cfg: GatewayConfig) -> None:
    """Wait for the first start of every backend; a required one that cannot start fails boot."""
    longest = max((b.start_timeout for b in cfg.backends.values()), default=1.0)
    with trio.move_on_after(longest + 1.0):
        await hub.wait_started()
    for name, b in cfg.backends.items():
        if not b.required:
            continue
        backend = hub.backends[name]
        if b.url:  # a remote not running within start_timeout: unreachable, not a crash loop
            with trio.move_on_after(b.start_timeout):
                await backend.settled()
            first = backend.instances[0].snapshot(trio.current_time())
            if first.state != State.RUNNING.value:
                raise StartupError(f"required backend {name!r} ({b.url}) did not start within "
                                   f"start_timeout ({b.start_timeout:g}s): "
                                   f"{first.last_exit or first.last_error or first.state}")
            continue
        first = await backend.settled()
        if first.state == State.FATAL:  # not running: the tail is the last child's
            raise StartupError(
                f"required backend {name!r} failed to start: {first.last_exit}; "
                + (" | ".join(first.stderr_tail[-3:]) or "no stderr output")
            )


def _boot_checks(hub: Hub) -> None:
    hub.catalog_held = False  # from now on each backend's new lists rebuild it
    try:
        hub.rebuild_catalog(strict=True)
    except CatalogConflict as exc:
        raise StartupError(str(exc)) from None
    unruled = hub.policy.unruled_sensitive()
    if unruled:
        raise StartupError(
            f"sensitive tool(s) {', '.join(unruled)} (destructiveHint or listed as sensitive) have "
            "no [policy] rule naming them; add a rule for each to the config, e.g.:\n\n"
            + suggested_rules(unruled)
        )


async def _serve_listeners(hub: Hub, cfg: GatewayConfig, fds: dict[str, int], conns: trio.Nursery,
                           accept: list[trio.CancelScope], bound: Bound,
                           tls_context: ssl.SSLContext | None,
                           task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the client listeners until ``conns`` is cancelled; the WebSocket and unix socket
    listeners put their cancel scope into ``accept`` (the drain closes them at its start)."""
    max_msg = cfg.gateway.max_message_bytes
    try:
        await _accept(hub, cfg, fds, conns, accept, bound, max_msg, tls_context, task_status)
    finally:
        hub.listeners_bound = False  # not ready from the moment nothing is accepted any more


async def _accept(hub: Hub, cfg: GatewayConfig, fds: dict[str, int], conns: trio.Nursery,
                  accept: list[trio.CancelScope], bound: Bound, max_msg: int,
                  tls_context: ssl.SSLContext | None, task_status: trio.TaskStatus[None]) -> None:
    hosts = config.client_allowed_hosts(cfg)
    origins = config.client_allowed_origins(cfg)
    exposed: list[ListenerStatus] = []
    async with trio.open_nursery() as nursery:
        if "websocket" in fds or cfg.listen.websocket is not None:
            ws_listeners = await _tcp_listeners(fds, "websocket", cfg.listen.websocket, cfg)
            bound.websocket_port = ls.bound_port(ws_listeners)
            exposed += _listener_status("websocket", ws_listeners, cfg, tls_context is not None)

            async def on_ws(stream: WebSocketStream) -> None:
                def bind(session: ClientSession) -> None:
                    principal = stream.principal
                    assert principal is None or isinstance(principal, Principal)
                    session.principal = principal
                    if principal is not None and principal.expires is not None:
                        conns.start_soon(_close_at_expiry, session, principal.expires)
                await connection.serve(hub, stream, "websocket", bind=bind)

            await nursery.start(_closable, accept, lambda task_status: serve_websocket(
                ws_listeners, on_ws, allowed_origins=origins, allowed_hosts=hosts,
                max_message=max_msg, handler_nursery=conns, slots=hub.slots,
                authenticate=partial(_ws_authenticate, hub), admit=partial(_ws_admit, hub),
                tls_context=tls_context, task_status=task_status))
        if "http" in fds or cfg.listen.http is not None:
            http_listeners = await _tcp_listeners(fds, "http", cfg.listen.http, cfg)
            bound.http_port = ls.bound_port(http_listeners)
            if hub.authn is not None:  # a WebSocket 401 points at this listener's metadata
                hub.authn.http_port = bound.http_port
            exposed += _listener_status("http", http_listeners, cfg, tls_context is not None)

            async def serve_session(session: HttpSession) -> None:
                await connection.serve(hub, session, "http", bind=session.bind)

            sessions = Sessions(serve_session, conns, max_sessions=cfg.listen.http_max_sessions,
                                idle_timeout=cfg.listen.http_session_idle_timeout,
                                tag=hub.bridge.codec.replica_id, caps=hub.caps)
            endpoint = Endpoint(sessions, hosts=ls.allowed_host_names(http_listeners, hosts),
                                allowed_origins=origins,
                                max_json_depth=cfg.gateway.max_json_depth,
                                ports=frozenset(ls.bound_port([lst]) for lst in http_listeners),
                                probes=partial(admin_probe, hub.status), bridge=hub.bridge,
                                authn=hub.authn)
            endpoint.direct = lambda stream: connection.Direct(hub, stream, conns, "http",
                                                               stream.bind)
            endpoint.core = hub
            endpoint.traced = hub.tracer is not None
            endpoint.redirect_path = cfg.listen.redirect_path
            endpoint.redirect = hub.redirected
            await nursery.start(lambda task_status: serve_http(
                http_listeners, endpoint, max_message=max_msg, handler_nursery=conns,
                slots=hub.slots, tls_context=tls_context, task_status=task_status))
        if "unix" in fds or cfg.listen.unix is not None:
            if "unix" in fds:
                unix_listener = ls.adopt_listener(fds["unix"])
                bound.unix_path = str(unix_listener.socket.getsockname())
            else:
                assert cfg.listen.unix is not None
                try:
                    unix_listener = await ls.open_unix(cfg.listen.unix,
                                                       int(cfg.listen.unix_mode, 8))
                except ls.ListenerError as exc:
                    raise StartupError(str(exc)) from None
                bound.unix_path = cfg.listen.unix
            exposed.append(ListenerStatus("unix", str(bound.unix_path), loopback=True, tls=False,
                                          auth_configured=cfg.auth.configured))

            async def on_unix(accepted: ls.Accepted) -> None:
                try:
                    if not accepted.admitted:
                        with trio.move_on_after(1.0):
                            await accepted.stream.aclose()  # max_connections: closed at once
                        return
                    principal = await _peer_principal(accepted.stream, hub.principal_names)
                    try:
                        counted = hub.caps.acquire("max_connections",
                                                   None if principal is None else principal.name)
                    except CapReached as exc:  # the -32006 on the line, then closed
                        with trio.move_on_after(1.0):
                            await accepted.stream.send_all(_error_line(exc))
                            await accepted.stream.aclose()
                        return
                    try:
                        await connection.serve(hub, LineStream(accepted.stream, max_msg), "unix",
                                               bind=partial(_bind_principal, principal))
                    finally:
                        counted.release()
                finally:
                    if accepted.admitted:
                        hub.slots.release()

            await nursery.start(_closable, accept, lambda task_status: ls.serve_listeners(
                on_unix, [ls.SlottedListener(unix_listener, hub.slots, "unix")],
                handler_nursery=conns, task_status=task_status))
        hub.listeners = tuple(exposed)
        hub.listeners_bound = True
        task_status.started()


async def _serve_embedded(hub: Hub, stream: connection.MessageStream) -> None:
    await connection.serve(hub, stream, "memory")


async def _closable(scopes: list[trio.CancelScope], serve: Callable[..., Awaitable[object]],
                    task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED) -> None:
    """Run listener ``serve`` in a cancel scope of its own, put into ``scopes``."""
    with trio.CancelScope() as scope:
        scopes.append(scope)
        await serve(task_status=task_status)


async def _peer_principal(stream: trio.SocketStream,
                          configured: frozenset[str]) -> Principal | None:
    """The unix socket peer's user as a principal (SO_PEERCRED; the user database is read in
    a thread: NSS may be slow); None when the platform gives no credentials."""
    creds = peer_credentials(stream)
    if creds is None:
        return None
    _pid, uid, gid = creds
    return await trio.to_thread.run_sync(peer_principal, uid, gid, configured)


def _bind_principal(principal: Principal | None, session: ClientSession) -> None:
    session.principal = principal


async def _ws_authenticate(hub: Hub, host: str | None,
                           authorization: str | None) -> Principal | None:
    """A WebSocket upgrade's principal, or :class:`Refused` 401 with the challenge."""
    authn = hub.authn
    assert authn is not None
    try:
        return await authn.authenticate(authorization)
    except Unauthorized as exc:
        authn.refused("websocket", "websocket upgrade", exc.kind)
        header = authn.challenge(host, exc, websocket=True)
        raise Refused(401, str(exc), [(b"www-authenticate", header.encode())]) from None


def _ws_admit(hub: Hub, principal: object) -> Callable[[], None]:
    """Count a WebSocket connection toward its principal's ``max_connections``; at the cap the
    upgrade is refused 503 with the -32006 error as its body."""
    assert principal is None or isinstance(principal, Principal)
    try:
        name = None if principal is None else principal.name
        return hub.caps.acquire("max_connections", name).release
    except CapReached as exc:
        raise Refused(503, _error_line(exc).decode().rstrip("\n"),
                      content_type=b"application/json") from None


def _error_line(exc: errors.GatewayError) -> bytes:
    """``exc`` as a JSON-RPC error without an id (no request was read), one line."""
    return jsonrpc.encode_error(None, exc.code, exc.message, exc.error_data()) + b"\n"


async def _close_at_expiry(session: ClientSession, expires: float) -> None:
    """A WebSocket opened with a JWT ends when the token does (close 1008): a connection
    must not outlive its credential; the client reconnects with a fresh token."""
    with trio.move_on_at(trio.current_time() + max(0.0, expires - time.time())):
        await session.closed.wait()
        return
    LOGGER.info("connection %s: its token expired; closing it", session.conn_id,
                extra=session.log_fields)
    session.close(CloseReason.UNAUTHORIZED)


def close_revoked(hub: Hub) -> int:
    """After a reload: close every connection and HTTP session whose principal lost its
    credential (or that has none while authentication is now configured).  A WebSocket is
    closed with 1008; an HTTP session ends, and its client's next request gets 401 (its token
    no longer authenticates) or 404 (the session is gone).  Their per-principal instances
    stop and their upstream tokens are forgotten; their refresh tokens are deleted only when the
    principal itself is gone (not when a reload rotated its token)."""
    authn = hub.authn
    if authn is None:
        return 0
    closed = 0
    for session in list(hub.sessions):
        if not authn.still_valid(session.principal, session.transport):
            label = session.principal.label if session.principal is not None else "-"
            LOGGER.warning("reload: closing connection %s (%s, principal %s): its credential is no "
                           "longer configured", session.conn_id, session.transport, label,
                           extra=session.log_fields)
            session.close(CloseReason.UNAUTHORIZED)
            closed += 1
    for backend in hub.backends.values():  # their per-principal instances stop
        backend.drop_principals(lambda p: authn.still_valid(p, "http"), authn.still_named)
    return closed


async def _tcp_listeners(fds: dict[str, int], name: str, address: str | None,
                         cfg: GatewayConfig) -> list[trio.SocketListener]:
    """The listeners of client listener ``name``: adopted from systemd (fd name ``name``) or
    bound to ``address``; off loopback only as the boot guards allow (checked on the address
    really bound, see :mod:`gateway.guards`)."""
    problems = config.client_exposure_problems(cfg)
    try:
        if name in fds:
            listeners = [ls.adopt_listener(fds[name])]
            ls.check_loopback(listeners[0], f"{name} socket from systemd", problems)
            return listeners
        assert address is not None
        host, port = config.parse_host_port(address)
        return await ls.open_tcp(host, port, f"listen.{name}", problems)
    except ls.ListenerError as exc:
        raise StartupError(str(exc)) from None


def _listener_status(name: str, listeners: list[trio.SocketListener], cfg: GatewayConfig,
                     encrypted: bool) -> list[ListenerStatus]:
    """``/status`` rows of client listener ``name``: where it is bound and how it is guarded."""
    out = []
    for lst in listeners:
        host, port = (str(part) for part in lst.socket.getsockname()[:2])
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        out.append(ListenerStatus(name, address, loopback=config.is_loopback(host), tls=encrypted,
                                  auth_configured=cfg.auth.configured,
                                  behind_proxy=cfg.listen.behind_proxy,
                                  public_url=cfg.listen.public_url))
    return out


async def _control_loop(hub: Hub, control: Control, config_path: str | None,
                        tls_context: ssl.SSLContext | None = None,
                        accept: list[trio.CancelScope] | None = None) -> None:
    """Reload on request until a stop is requested; a reload running then may finish within
    ``drain_delay`` (the lame duck), and is cancelled when the drain begins.

    A cancelled reload leaves nothing unowned: every backend it was draining, stopping or
    starting is still in ``hub.backends`` (or already stopped), so the shutdown path stops and
    reaps it like any other.
    """
    while await control.next() is Command.RELOAD:
        finished = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_when_stopping, hub, control, nursery.cancel_scope, accept)
            await reload(hub, config_path, tls_context)
            finished = True
            nursery.cancel_scope.cancel()
        if not finished:
            LOGGER.warning("reload abandoned: stop requested while it ran")


async def _cancel_when_stopping(hub: Hub, control: Control, scope: trio.CancelScope,
                                accept: list[trio.CancelScope] | None) -> None:
    """A stop while a reload runs: the lame duck begins at once (``/readyz`` 503) and the
    reload may finish within ``drain_delay``; when the drain must begin it is abandoned."""
    await control.stopping.wait()
    _not_ready(hub, control)
    await control.until_drain(hub.cfg.gateway.drain_delay)
    _stop_serving(hub, accept)  # at once, while the reload unwinds
    scope.cancel()


def _read_config(path: str) -> GatewayConfig:
    """The config file at ``path``, read and validated (backend commands looked up)."""
    data = config.read_file(path)
    return config.load(data, base_dir=os.path.dirname(os.path.abspath(path)), check_commands=True)


async def reload(hub: Hub, config_path: str | None,
                 tls_context: ssl.SSLContext | None = None) -> bool:
    """SIGHUP: re-read and validate, keep the old config on error, else apply the diff (and
    load the TLS certificate and key again: a renewed certificate needs no restart)."""
    systemd.notify("RELOADING=1", f"MONOTONIC_USEC={systemd.monotonic_usec()}", "STATUS=reloading")
    if isinstance(hub.audit, AuditLog):
        hub.audit.reload()  # reopened (logrotate) and its key re-read, whatever the config says
    try:
        if config_path is None:
            raise ConfigError(["no config file to reload from"])
        new = await trio.to_thread.run_sync(_read_config, config_path)  # disk: off the loop
        try:
            new = fit_connections(new, fdlimit.soft_limit())
        except StartupError as exc:
            raise ConfigError([str(exc)]) from None
        if hub.authn is not None:
            hub.authn.reconfigure(new)  # reads auth.tokens_file: a bad one fails the reload
    except (OSError, ConfigError) as exc:
        message = "; ".join(exc.errors) if isinstance(exc, ConfigError) else str(exc)
        LOGGER.error("reload failed, keeping the running config: %s", message)
        hub.bus.emit(ReloadFinished(False, message))
        if not hub.lame_duck:  # stopping: STOPPING=1 was sent, no READY=1 after it
            systemd.notify("READY=1", f"STATUS=reload failed: {message[:200]}")
        return False
    if (tls_context is not None and new.listen.tls_cert is not None
            and new.listen.tls_key is not None):
        try:
            tls.reload_into(tls_context, new.listen.tls_cert, new.listen.tls_key)
            LOGGER.info("reload: TLS certificate loaded again from %s", new.listen.tls_cert)
        except tls.TlsError as exc:
            LOGGER.error("reload: %s; the certificate loaded before stays in use", exc)
    old = hub.cfg
    added, removed, changed = config.diff_backends(old, new)
    for section in config.restart_only_changes(old, new):
        LOGGER.warning("reload: %s changed; that takes effect only after a restart", section)
    hub.apply_config(new)
    close_revoked(hub)
    if hub.authn is not None:
        await hub.authn.start()  # OAuth configured by this reload: its keys
    try:
        async with trio.open_nursery() as nursery:  # drain them all at once, each bounded
            for name in removed + changed:
                LOGGER.info("reload: draining and stopping backend %s (%s)", name,
                            "removed" if name in removed else "changed")
                nursery.start_soon(partial(hub.remove_backend, name, drain=new.gateway.drain_grace,
                                           restarting=name in changed))
        for name in changed + added:
            LOGGER.info("reload: starting backend %s", name)
            await hub.add_backend(name, new.backends[name])
    finally:
        hub.restarts_done()
    for name in new.backends:
        if name not in changed and name not in added:
            hub.backends[name].reset()  # unchanged but FATAL: try again
            hub.backends[name].refresh()  # a remote's header values read again
    longest = max((new.backends[n].start_timeout for n in added + changed), default=0.0)
    if added or changed:
        with trio.move_on_after(longest + 1.0):
            await hub.wait_started()
    hub.rebuild_catalog()
    hub.bus.emit(ReloadFinished(True, None, tuple(added), tuple(removed), tuple(changed)))
    LOGGER.info("reload done: added %s, removed %s, changed %s", added or "-", removed or "-",
                changed or "-")
    if not hub.lame_duck:
        systemd.notify("READY=1", _status_line(hub))
    return True


def _not_ready(hub: Hub, control: Control) -> None:
    """The stop was requested: ``/readyz`` answers 503 from now on (once)."""
    if hub.lame_duck:
        return
    hub.lame_duck = True
    delay = 0.0 if control.hurry.is_set() else hub.cfg.gateway.drain_delay
    systemd.notify("STOPPING=1", f"STATUS=stopping: not ready, draining in {delay:g}s")
    if delay > 0:
        LOGGER.info("stopping: /readyz answers 503; serving as usual for %gs (gateway.drain_delay) "
                    "before the drain", delay)


async def lame_duck(hub: Hub, control: Control) -> None:
    """SIGTERM: ``/readyz`` answers 503 at once, while everything else is served as before for
    ``gateway.drain_delay`` seconds: long enough for a load balancer's health check to take the
    replica out of rotation before anything is refused.  A second SIGTERM, or a SIGINT, ends
    the wait (a stop that did not ask for it, or ``drain_delay = 0``, skips it).  Reloads
    requested meanwhile are not applied: the daemon is going down."""
    _not_ready(hub, control)
    await control.until_drain(hub.cfg.gateway.drain_delay)


def _stop_serving(hub: Hub, accept: list[trio.CancelScope] | None) -> None:
    """The drain begins: new requests are refused from here on, the WebSocket and unix
    listeners close (both at once: a client refused must not get a new connection here)."""
    hub.draining = True
    for scope in accept or ():
        scope.cancel()


async def _drain(hub: Hub, accept: list[trio.CancelScope], conns: trio.Nursery) -> None:
    """Stop accepting, let in-flight calls finish until the grace deadline, close.

    While draining, a connection keeps reading (answers to the prompts of its calls and its
    cancellations still arrive) and answers each new request at once with -32005 ``shutdown``
    (``retryable: true``: it never started; over HTTP a 503 with ``Retry-After``, see
    :class:`~gateway.transports.endpoint.Endpoint`).  The HTTP listener goes on accepting, so
    a bridged call's retry (``requestState``) can still reach its waiting child, and so a load
    balancer gets a 503 to retry elsewhere.  A call still running when ``drain_grace`` ends
    has its prompts cancelled and is answered -32005 ``shutdown`` with ``retryable: false``
    (it may have had effects); only then is the connection closed (WebSocket 1012, EOF).
    """
    grace = hub.cfg.gateway.drain_grace
    _stop_serving(hub, accept)
    hub.listens.end_all()  # each answered with its closing result, not left to the grace
    systemd.notify("STATUS=draining")
    LOGGER.info("draining: %d connections, grace %gs", len(hub.sessions), grace)

    def no_calls() -> bool:
        return not any(s.inflight for s in hub.sessions)

    with trio.move_on_after(grace):
        await hub.wait_connections(no_calls)
    late = sum(len(s.inflight) for s in hub.sessions)
    with trio.move_on_after(CLOSE_TIMEOUT):
        for session in list(hub.sessions):  # backend prompts and consent prompts alike
            for req in list(session.server_requests.values()):  # the owner is told
                session.cancel_request(req, ServerRequestOutcome.SHUTDOWN,
                                       "the gateway is shutting down")
        if late:
            LOGGER.warning("drain grace over: %d calls still running get -32005 shutdown", late)
            hub.cut_off_calls()
            await hub.wait_connections(no_calls)
        await _close_settled(hub)
        await hub.wait_connections(lambda: not hub.sessions)
    for session in list(hub.sessions):
        session.close(CloseReason.SHUTDOWN)
    conns.cancel_scope.cancel()


async def _close_settled(hub: Hub) -> None:
    """Close each connection (reason ``shutdown``: WebSocket 1012, unix EOF) once it has sent
    no request for :data:`SETTLE` seconds: a client looping calls sends its next request as
    its last answer arrives; that one gets its -32005 ``retryable`` answer instead of a close
    it could not tell from a crash.  (Whatever a client sends after the close was never
    started either.)  The caller bounds it (a client that never stops sending)."""
    quiet_from = trio.current_time()
    while True:
        now = trio.current_time()
        waiting = []
        for session in list(hub.sessions):
            if max(quiet_from, session.refused_at) + SETTLE > now:
                waiting.append(session)
            else:
                session.close(CloseReason.SHUTDOWN)
        if not waiting:
            return
        await trio.sleep_until(min(max(quiet_from, s.refused_at) for s in waiting) + SETTLE)
