"""One supervised backend instance: open a link, handshake, serve, restart with backoff, stop.

:meth:`Instance.run` loops over generations: the backend's connector opens a link (a spawned
child for ``stdio``), MCP handshake (``start_timeout``), fetch the lists, re-subscribe held
resources, serve until the upstream's side ends, health probes fail or a stop is requested.
Then every call in flight fails with :class:`~gateway.errors.BackendExited`, the link is closed
(a child stopped in the spec's order), and the
:class:`~gateway.protocol.supervision.Supervision` table decides between BACKOFF and FATAL
(each transition an event).  An open that fails for lack of resources (EMFILE) or for a passing
cause (an authorization server down) backs off without counting toward FATAL; one that needs an
operator's authorization waits in AUTHORIZING until it is given.  A *recycle* restarts a healthy
child the gateway chose to replace (a cancelled call left unanswered past ``cancel_grace``):
drained first (no new calls), then restarted at once, never counted as a failure.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import trio
from msgspec import Raw, UnsetType

from gateway import errors
from gateway.backend import client
from gateway.backend.child import ChildConnection, ChildHandlers, Owner
from gateway.backend.connector import Connector, Link, LinkContext, LinkEnd, OpenFailed
from gateway.config import BackendConfig
from gateway.events import (
    BackendExited,
    BackendStarted,
    BackendStateChanged,
    EventBus,
    ExitKind,
    News,
)
from gateway.limits import ByteBudget
from gateway.protocol import era, jsonrpc
from gateway.protocol.catalog import BackendLists
from gateway.protocol.era import Era
from gateway.protocol.supervision import RestartPolicy, State, Supervision, Transition
from gateway.status import InstanceStatus
from gateway.wakeup import Wakeup

LOGGER = logging.getLogger(__name__)
#: The states in which an instance takes new calls.
_SERVING = frozenset({State.RUNNING, State.UNHEALTHY})

#: Seconds before a modern child's ``subscriptions/listen`` that ended is opened again;
#: doubled up to :data:`LISTEN_RETRY_MAX` while it keeps ending sooner than that.
LISTEN_RETRY = 1.0
LISTEN_RETRY_MAX = 30.0
#: stderr lines kept for /status after a crash.
STDERR_TAIL = 20


class DownReason(enum.StrEnum):
    """Why a child generation ended, as the supervisor, ``last_exit`` and the error of the
    calls it fails say it (a ``StrEnum``: those texts carry the value)."""

    EXITED = "exited"  # its stdout closed (it exited, or closed it)
    STOPPED = "stopped"  # a stop was requested
    START_FAILED = "start failed"  # the hand-shake failed or timed out
    SPAWN_FAILED = "spawn failed"  # the process could not be started
    STARVED = "spawn failed for lack of resources"  # EMFILE, ENOMEM…: retried, never FATAL
    UNHEALTHY = "unhealthy"  # health pings missed
    # drained and restarted: a cancelled call left unanswered past cancel_grace
    RECYCLED = "recycled"
    EXPIRED = "session expired"  # the remote ended the session (HTTP 404): renewed at once
    UNAUTHORIZED = "awaiting authorization"  # an operator must authorize (AUTHORIZING)


#: The exit kind (``BackendExited.reason``) of a generation the gateway ended; one that ended
#: on its own (``EXITED``) is ``exited`` or ``crashed`` by its exit code.
EXIT_KINDS = {
    DownReason.STOPPED: ExitKind.STOPPED,
    DownReason.START_FAILED: ExitKind.START_FAILED,
    DownReason.UNHEALTHY: ExitKind.UNHEALTHY,
    DownReason.RECYCLED: ExitKind.RECYCLED,
    DownReason.EXPIRED: ExitKind.EXPIRED,
    DownReason.UNAUTHORIZED: ExitKind.UNAUTHORIZED,
}


#: A child's notifications the core fans out to clients (as :class:`ChildNotified` on the bus).
FANNED_OUT = frozenset({"notifications/resources/updated", "notifications/message",
                        "notifications/elicitation/complete"})


@dataclass(frozen=True, slots=True)
class ChildNotified(News):
    """A child sent one of the notifications in :data:`FANNED_OUT`."""

    instance: Instance
    method: str
    params: Raw | UnsetType


class ServerRequests(Protocol):
    """Who decides a child's server→client request at once: the core's ownership (the hub
    wires it in).  ``owners``: the attribution set as it was when the request arrived."""

    def route(self, inst: Instance, child: ChildConnection, child_id: int | str, method: str,
              params: Raw | UnsetType, owners: set[Owner]) -> None: ...
    def child_cancelled(self, child: ChildConnection, child_id: int | str) -> None: ...


class InstanceHost(Protocol):
    """What an instance is given from above the backend layer (by the hub): the bus its news go
    out on, the byte budget and limits, and who decides its child's requests to clients."""

    bus: EventBus
    budget: ByteBudget  # the child write queues' bytes are charged here
    server_name: str
    max_message_bytes: int
    max_json_depth: int
    outbound_bytes: int

    @property
    def ownership(self) -> ServerRequests: ...


class Pool(Protocol):
    """What an instance needs of its backend (:class:`gateway.backend.pool.Backend`)."""

    modern_seen: bool  # a child of it spoke the modern era (set by the instance)
    log_level: str | None  # the lowest level a client wants (set by the hub), for a new child

    @property
    def name(self) -> str: ...
    @property
    def cfg(self) -> BackendConfig: ...
    @property
    def connector(self) -> Connector: ...
    @property
    def host(self) -> InstanceHost: ...
    @property
    def declared(self) -> frozenset[str]: ...
    @property
    def subscriptions(self) -> dict[str, set[Owner]]: ...
    @property
    def attribution_matters(self) -> bool: ...
    def learn_asker(self, key: str) -> None: ...
    def owners(self, inst: Instance, child: ChildConnection,
               cause: int | None = None) -> set[Owner]: ...
    def subscribed_uris(self, inst: Instance | None = None) -> list[str]: ...
    def on_state_changed(self, inst: Instance) -> None: ...
    def on_settled(self, inst: Instance) -> None: ...
    def on_instance_ready(self, inst: Instance) -> None: ...
    def on_instance_down(self, inst: Instance, child: ChildConnection) -> None: ...
    def on_draining_changed(self, inst: Instance) -> None: ...
    def on_lists_changed(self, inst: Instance) -> None: ...


class Instance(ChildHandlers):
    def __init__(self, backend: Pool, index: int, *, label: str | None = None) -> None:
        self.backend = backend
        self.cfg = backend.cfg
        self.name = f"{backend.name}/{label if label is not None else index}"
        self.last_used = trio.current_time()
        r = self.cfg.restart
        self.sup = Supervision(RestartPolicy(r.backoff_initial, r.backoff_max, r.max_restarts,
                                             r.window))
        self.child: ChildConnection | None = None
        self.connector = backend.connector
        self.link: Link | None = None  # the current generation's (kept after it ends)
        self.pid: int | None = None  # its process's, when it has one (kept after it ends)
        self.generation = 0
        self.lists = BackendLists()
        self.last_exit: str | None = None
        self.latency: float | None = None  # the current child's last health probe round trip
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.crash_stderr: tuple[str, ...] = ()
        self.owner: Owner | None = None  # per-session / affine holder
        self.principal_key: str | None = None  # per-principal: whose instance it is
        self.principal_label: str | None = None  # and that principal's (bounded) label
        self._state_changed = trio.Event()
        self._stop = trio.Event()
        self._reset = trio.Event()
        self._down: trio.Event | None = None
        self._down_reason: DownReason | None = None
        self._nursery: trio.Nursery | None = None
        # a modern child's subscriptions/listen, while open: cancelled to open it again with
        # the resource subscriptions as they are now
        self._listen_scope: trio.CancelScope | None = None
        self._listener: ChildConnection | None = None  # the child whose listen loop runs
        self._starting: trio.CancelScope | None = None  # the hand-shake of a child being started
        self.stopped = trio.Event()
        # Being drained for a recycle: the pool routes no new call here (see _watch_abandoned).
        self.draining = False
        self._calls_changed = Wakeup()  # a client call on this child ended
        #: Tell it a client call on this instance ended, or an abandoned one left the
        #: attribution set (the wake-up's own ``set``: no call in between).
        self.calls_changed: Callable[[], None] = self._calls_changed.set
        # AUTHORIZING: returns once an operator authorized (the connector's open said so)
        self._authorized: Callable[[], Awaitable[None]] | None = None

    # ---- state ------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self.sup.state

    def _emit(self, t: Transition) -> None:
        pid = self.pid
        alarming = t.new in (State.FATAL, State.BACKOFF, State.UNHEALTHY)
        LOGGER.log(logging.WARNING if alarming else logging.INFO, "backend %s: %s -> %s (%s)",
                   self.name, t.old.value, t.new.value, t.reason,
                   extra={"MCP_BACKEND": self.backend.name})
        self.backend.host.bus.emit(
            BackendStateChanged(self.backend.name, self.name, t.old.value, t.new.value, pid,
                                t.reason)
        )
        self._state_changed.set()
        self._state_changed = trio.Event()
        self.backend.on_state_changed(self)

    def snapshot(self, now: float) -> InstanceStatus:
        """This instance as ``/status`` and the gauges see it (the one view given out)."""
        child, link = self.child, self.link
        return InstanceStatus(
            name=self.name,
            state=self.state.value,
            pid=link.pid if link is not None else None,
            restarts=max(0, self.sup.starts - 1),
            uptime=self.sup.uptime(now),
            last_exit=self.last_exit,
            stderr_tail=tuple(self.stderr_tail) if child is not None else self.crash_stderr,
            inflight=child.router.load if child is not None else 0,
            owner=(getattr(self.owner, "conn_id", None) if self.principal_key is None
                   else self.principal_label),
            recycles=self.sup.recycles,
            draining=self.draining,
            era=child.era.value if child is not None else None,
            protocol_version=child.protocol_version if child is not None else None,
            origin=link.origin if link is not None else self.connector.origin,
            last_error=link.last_error if link is not None else None,
            latency=self.latency if child is not None else None,
        )

    async def state_changed(self) -> None:
        """Return at the next state transition."""
        await self._state_changed.wait()

    def serving(self) -> ChildConnection | None:
        """The child that takes new calls now: running, and not being drained for a recycle."""
        child = self.child
        if (self.sup.state in _SERVING and child is not None
                and child.link.closed is None and not self.draining):
            return child
        return None

    async def wait_ready(self, timeout: float) -> ChildConnection:  # noqa: ASYNC109 - it ends in BackendUnavailable naming the wait, not a cancel
        """The running child, waiting up to ``timeout`` while it (re)starts or drains for a recycle.

        Raises:
            BackendUnavailable: FATAL or stopped (at once), or still not running after ``timeout``.
        """
        with trio.move_on_after(timeout):
            while True:
                child = self.serving()
                if child is not None:
                    return child
                if self.state is State.FATAL or self._stop.is_set():
                    break
                if self.state is State.AUTHORIZING:
                    raise errors.BackendUnavailable(
                        f"backend {self.backend.name!r} awaits an authorization at its remote "
                        f"(mcp-gateway authorize {self.backend.name})",
                        backend=self.backend.name, retryable=True)
                await self._state_changed.wait()
        fatal = self.state is State.FATAL
        raise errors.BackendUnavailable(
            f"backend {self.backend.name!r} is {'failing (crash loop)' if fatal else 'not running'}"
            + ("" if fatal else f" after waiting {timeout:g}s"),
            backend=self.backend.name,
            retryable=not fatal,
        )

    # ---- control ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()
        if self._starting is not None:
            self._starting.cancel()  # a stop does not wait for a child still starting
        if self._down is not None:
            self._down_reason = DownReason.STOPPED
            self._down.set()
        self._reset.set()

    def reset(self) -> None:
        """Leave FATAL and try again (reload of an unchanged but failed backend)."""
        self._reset.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise this instance until :meth:`request_stop`.  Never raises for child failures."""
        task_status.started()
        try:
            while not self._stop.is_set():
                if self.state is not State.STARTING:  # a recycle, a renewal: in STARTING already
                    self._emit(self.sup.start("start" if self.generation == 0 else "restart"))
                reason = await self._run_generation()
                if self._stop.is_set():
                    break
                if reason is DownReason.RECYCLED and self.state in (State.RUNNING, State.UNHEALTHY):
                    # Not a failure: no crash-loop count, no backoff; the next child starts now.
                    self._emit(self.sup.recycled(
                        trio.current_time(), "recycled: a cancelled call was not answered within "
                        f"cancel_grace ({self.cfg.cancel_grace:g}s)"))
                    continue
                if reason is DownReason.EXPIRED and self.state in (State.RUNNING,
                                                                   State.UNHEALTHY):
                    # A new session at once (no backoff, not a failure) unless a renewal began
                    # this one and it was young.
                    t = self.sup.renewed(trio.current_time(), "the remote ended the session: "
                                                              "initializing a new one")
                elif reason is DownReason.STARVED:  # the gateway's lack, not the child's fault
                    t = self.sup.starved(self.last_exit or reason)
                elif reason is DownReason.UNAUTHORIZED:  # not a failure: wait for the operator
                    self._emit(self.sup.authorizing(self.last_exit or reason))
                    wait, self._authorized = self._authorized, None
                    if wait is not None:  # else the next open asks again (and says how)
                        await self._first_of(wait, self._stop.wait)
                    continue
                else:
                    t = self.sup.exited(trio.current_time(), reason)
                self._emit(t)
                if t.new is State.STARTING:
                    continue
                if t.new is State.FATAL:
                    self._reset = trio.Event()
                    await self._reset.wait()
                else:
                    assert t.delay is not None
                    with trio.move_on_after(t.delay):
                        await self._stop.wait()
        finally:
            if self.state is not State.STOPPED:
                if self.state is not State.STOPPING:
                    self._emit(self.sup.stop())
                self._emit(self.sup.stopped())
            self.stopped.set()

    @staticmethod
    async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
        """Return when the first of ``waits`` returns."""
        async with trio.open_nursery() as nursery:
            async def one(wait: Callable[[], Awaitable[object]]) -> None:
                await wait()
                nursery.cancel_scope.cancel()
            for wait in waits:
                nursery.start_soon(one, wait)

    async def _run_generation(self) -> DownReason:
        """Open a link, hand-shake and serve one generation; returns why it ended."""
        self.generation += 1
        self.latency = None
        spawned = trio.current_time()
        host = self.backend.host
        ctx = LinkContext(backend=self.backend.name, instance=self.name, bus=host.bus,
                          max_line=host.max_message_bytes,
                          buffers=host.budget.open(f"child {self.name}"),
                          max_queued=host.outbound_bytes, tail=self.stderr_tail)
        try:
            link = await self.connector.open(ctx)
        except OpenFailed as exc:
            ctx.buffers.close()
            if exc.authorize is not None:
                self.last_exit = f"{DownReason.UNAUTHORIZED}: {exc}"
                self._authorized = exc.authorize
                return DownReason.UNAUTHORIZED
            if exc.starved or exc.transient:  # retried soon, never FATAL
                self.last_exit = (f"{DownReason.STARVED}: {exc}" if exc.starved
                                  else f"{DownReason.SPAWN_FAILED}: {exc}")
                return DownReason.STARVED
            LOGGER.error("backend %s: %s", self.name, exc)
            self.last_exit = f"{DownReason.SPAWN_FAILED}: {exc}"
            return DownReason.SPAWN_FAILED
        self.link = link
        pid = self.pid = link.pid
        self.stderr_tail.clear()
        child = ChildConnection(
            backend=self.backend.name,
            instance=self.name,
            generation=self.generation,
            link=link,
            handlers=self,
            bus=host.bus,
            max_line=host.max_message_bytes,
            max_depth=host.max_json_depth,
            timeout=self.cfg.request_timeout,
            max_inflight=self.cfg.max_inflight,
        )
        def settled() -> None:  # an abandoned call left the attribution set
            self.calls_changed()
            self.backend.on_settled(self)

        down = self._down = trio.Event()

        def ended() -> None:  # nothing more can arrive from the upstream
            if not down.is_set():
                self._down_reason = self._down_reason or DownReason.EXITED
                down.set()
            # No reply can arrive any more: fail the calls waiting for one now, including the
            # handshake's initialize (which would otherwise wait out the whole start_timeout).
            child.fail_all(child.exited_error(self._down_reason or DownReason.EXITED))

        child.on_settled = settled
        child.on_ended = ended
        self._down_reason = None
        exit_reason = DownReason.EXITED
        end: LinkEnd | None = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(link.run, child)
                nursery.start_soon(child.timer_loop)
                try:
                    with (trio.CancelScope() as self._starting,
                          trio.fail_after(self.cfg.start_timeout)):
                        if self._stop.is_set():
                            self._starting.cancel()
                        await self._handshake(child)
                except (errors.GatewayError, trio.TooSlowError, msgspec.ValidationError,
                        msgspec.DecodeError) as exc:
                    if not down.is_set():
                        detail = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
                        LOGGER.error("backend %s: handshake failed: %s", self.name, detail)
                        self._down_reason = DownReason.START_FAILED
                    down.set()
                finally:
                    self._starting = None
                if self._stop.is_set() and not down.is_set():  # stopped while starting
                    self._down_reason = DownReason.STOPPED
                    down.set()
                if not down.is_set():
                    self.child = child
                    self._emit(self.sup.ready(trio.current_time()))
                    host.bus.emit(BackendStarted(self.backend.name, self.name, pid,
                                                 trio.current_time() - spawned))
                    self.backend.on_instance_ready(self)
                    if self.cfg.health.interval > 0:
                        nursery.start_soon(self._health, child, down)
                    nursery.start_soon(self._watch_abandoned, child, down)
                await down.wait()
                exit_reason = self._down_reason or DownReason.EXITED
                # Fail every call in flight at once, before the (bounded) stop ladder.
                child.fail_all(child.exited_error(exit_reason))
                self.child = None
                self.draining = False
                self.backend.on_instance_down(self, child)
                end = await link.close()
                if end.expired and exit_reason is DownReason.EXITED:
                    exit_reason = DownReason.EXPIRED
                if end.unauthorized and not self._stop.is_set():
                    exit_reason = DownReason.UNAUTHORIZED
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self.child = None
            self.draining = False
            with trio.CancelScope(shield=True):
                last = await link.close()  # bounded; kills what is left (a process group)
            end = end or last
            child.fail_all(child.exited_error(exit_reason))
        kind = EXIT_KINDS.get(exit_reason) or (
            ExitKind.CRASHED if end.crashed else ExitKind.EXITED)
        self.last_exit = (f"{exit_reason} ({end.detail})" if end.ended_by is None
                          else f"{exit_reason} ({end.detail}; ended by {end.ended_by})")
        ident = f"pid {pid}" if pid is not None else link.origin or link.kind
        if kind is ExitKind.RECYCLED:
            LOGGER.info("backend %s: %s ended: %s", self.name, ident, self.last_exit,
                        extra={"MCP_BACKEND": self.backend.name})
        elif kind is not ExitKind.STOPPED:
            self.crash_stderr = tuple(self.stderr_tail)
            LOGGER.warning("backend %s: %s ended: %s", self.name, ident, self.last_exit)
        host.bus.emit(BackendExited(self.backend.name, self.name, pid, kind, end.returncode))
        return exit_reason

    def _set_draining(self, draining: bool) -> None:
        self.draining = draining
        # Callers waiting for this instance (wait_ready, affine waiters) look again.
        self._state_changed.set()
        self._state_changed = trio.Event()
        self.backend.on_draining_changed(self)

    async def _watch_abandoned(self, child: ChildConnection, down: trio.Event) -> None:
        """Calls the gateway gave up on (client cancel, timeout) but the child never answered.

        They stay in the attribution set (the child may still be working on them and ask their
        owner something).  Where attribution matters (server→client requests can be forwarded),
        a child that leaves a client's call unanswered past ``cancel_grace`` is *recycled*
        instead of guessing it is done: drained (no new calls; the calls in flight end on their
        own, bounded by their own timeouts; the abandoned entries stay in the set meanwhile, so
        its requests stay fail-closed), then restarted — not a failure.  If the child answers
        the stale call while draining, the drain ends and the child keeps serving.  Elsewhere the
        stale entries are simply forgotten.
        """
        grace = self.cfg.cancel_grace
        while not down.is_set():
            oldest = child.oldest_abandoned()
            if oldest is None:
                await trio.sleep(grace)
                continue
            if trio.current_time() < oldest + grace:
                await trio.sleep_until(oldest + grace)
                continue
            # those given up ``grace`` ago or more, the oldest always among them: at exactly
            # ``oldest + grace`` (a virtual clock), ``now - grace`` may round below it
            cutoff = math.nextafter(max(trio.current_time() - grace, oldest), math.inf)
            if not self.backend.attribution_matters:
                child.purge_abandoned(cutoff)
                continue
            if child.purge_abandoned(cutoff, internal_only=True):
                continue  # internal requests never count for attribution: no recycle for them
            LOGGER.warning("backend %s: a cancelled call was not answered within %gs; recycling "
                           "the child so requests it may still send cannot be misattributed: no "
                           "new calls, waiting for the %d in flight first", self.name, grace,
                           child.calls_in_flight(), extra={"MCP_BACKEND": self.backend.name})
            self._set_draining(True)
            # Calls queued behind the stale ones (which may hold every max_inflight slot) can
            # never reach this child: they go to the next one instead of waiting out their timeout.
            child.perform(child.router.withdraw_queued(errors.NotDelivered(
                f"backend {self.backend.name!r} is being recycled", backend=self.backend.name,
                retryable=True)))
            while not down.is_set():
                stale = child.oldest_abandoned(clients_only=True)
                if stale is None or trio.current_time() < stale + grace:
                    break  # answered late after all: nothing left to misattribute
                if not child.calls_in_flight():
                    LOGGER.info("backend %s: drained, recycling the child", self.name,
                                extra={"MCP_BACKEND": self.backend.name})
                    self._down_reason = DownReason.RECYCLED
                    down.set()
                    return
                await self._calls_changed.wait()
            if down.is_set():
                return
            LOGGER.info("backend %s: the cancelled call was answered late; drain ended, no recycle",
                        self.name, extra={"MCP_BACKEND": self.backend.name})
            self._set_draining(False)

    async def _health(self, child: ChildConnection, down: trio.Event) -> None:
        h = self.cfg.health
        misses = 0
        while not down.is_set():
            await trio.sleep(h.interval)
            sent = trio.current_time()
            try:
                if child.envelope is not None:  # ping is gone in 2026-07-28: discover is as cheap
                    await child.request("server/discover",
                                        jsonrpc.encode_dict({"_meta": child.envelope}),
                                        timeout=h.timeout, internal=True)
                else:
                    await child.request("ping", timeout=h.timeout, internal=True)
            except errors.RemoteError:
                ok = True  # answered (even with an error): the child is alive
            except errors.BackendUnavailable:
                continue  # not sent (a remote's token cannot be had now): nothing learnt
            except (errors.CallTimeout, errors.BackendExited):
                ok = False
            else:
                ok = True
            if ok:
                self.latency = trio.current_time() - sent
                if misses and self.state is State.UNHEALTHY:
                    self._emit(self.sup.healthy())
                misses = 0
                continue
            if down.is_set():
                return
            misses += 1
            if self.state in (State.RUNNING, State.UNHEALTHY):
                self._emit(self.sup.missed_ping())
            if misses >= h.failures:
                LOGGER.error("backend %s: %d pings missed, restarting", self.name, misses)
                self._down_reason = DownReason.UNHEALTHY
                down.set()
                return

    # ---- MCP client side --------------------------------------------------------------------

    async def _handshake(self, child: ChildConnection) -> None:
        host = self.backend.host
        mode = self.cfg.protocol_mode
        if self.backend.modern_seen and mode.startswith("prefer_"):
            mode = "modern_only"  # found modern before: no silent downgrade (see open_child)
        try:
            await client.open_child(child, mode=mode, declare=self.backend.declared,
                                    client_name=host.server_name, timeout=self.cfg.start_timeout)
        except (errors.GatewayError, trio.TooSlowError) as exc:
            if mode != self.cfg.protocol_mode:
                raise errors.BackendProtocolError(
                    f"backend {self.backend.name!r} spoke {era.LATEST_MODERN} before this restart "
                    f"and its server/discover probe failed now ({exc or 'timed out'}); not falling "
                    "back to initialize (a silent downgrade): fix the backend, or reload with "
                    'protocol_mode = "legacy_only" if the change is intended',
                    backend=self.backend.name) from exc
            raise
        if child.era is Era.MODERN:
            self.backend.modern_seen = True
        LOGGER.info("backend %s: opened as %s (%s)", self.name, child.era.value,
                    child.protocol_version, extra={"MCP_BACKEND": self.backend.name})
        for kind in ("tools", "prompts", "resources", "templates"):
            await self._fetch(child, kind)
        if child.era is Era.MODERN:
            self._start_listen(child)
        level = self.backend.log_level
        if level is not None:
            await client.set_level(child, level, timeout=self.cfg.start_timeout)
        for uri in self.backend.subscribed_uris(self):
            await self.subscribe(child, uri)

    def _start_listen(self, child: ChildConnection) -> None:
        if self._nursery is not None:
            self._listener = child
            self._nursery.start_soon(self._listen, child)

    async def _listen(self, child: ChildConnection) -> None:
        """A modern child's list changes and resource updates: one ``subscriptions/listen``
        open while it runs (its notifications are handled like a legacy child's,
        :meth:`on_notification`).  Opened again with the new filter when the resource
        subscriptions change (:meth:`subscribe`), and after it ended (the remote or a proxy
        closed it: nothing is replayed, so the lists are fetched again), later each time it
        ends again within :data:`LISTEN_RETRY_MAX` seconds."""
        try:
            await self._listen_loop(child)
        finally:
            if self._listener is child:
                self._listener = None

    async def _listen_loop(self, child: ChildConnection) -> None:
        delay = LISTEN_RETRY
        while child.closed is None:
            wanted = client.listen_filter(child, self.backend.subscribed_uris(self))
            if not wanted:
                return
            opened = trio.current_time()
            with trio.CancelScope() as scope:
                self._listen_scope = scope
                try:
                    await client.listen(child, wanted)
                    detail = "the backend ended it"
                except errors.RemoteError as exc:  # refused: asking again changes nothing
                    LOGGER.warning("backend %s refused subscriptions/listen: %s; its list changes "
                                   "and resource updates are not seen until it restarts",
                                   self.name, exc, extra={"MCP_BACKEND": self.backend.name})
                    return
                except errors.GatewayError as exc:
                    detail = str(exc)
            self._listen_scope = None
            if scope.cancelled_caught or child.closed is not None:
                continue  # a new filter (or the child is gone)
            if trio.current_time() - opened >= LISTEN_RETRY_MAX:
                delay = LISTEN_RETRY
            LOGGER.warning("backend %s: subscriptions/listen ended (%s); opening it again in "
                           "%gs", self.name, detail, delay,
                           extra={"MCP_BACKEND": self.backend.name})
            await trio.sleep(delay)
            delay = min(2 * delay, LISTEN_RETRY_MAX)
            if child is self.child:
                await self._refresh(child, ("tools", "prompts", "resources", "templates"))

    async def subscribe(self, child: ChildConnection, uri: str,
                        method: str = "resources/subscribe") -> None:
        if child.era is Era.MODERN:  # no resources/subscribe there: the listen's filter says
            if self._listener is child:
                if self._listen_scope is not None:  # opened again with the new filter
                    self._listen_scope.cancel()
            elif child is self.child and child.closed is None:
                self._start_listen(child)  # the first one
            return
        await client.subscribe(child, uri, timeout=self.cfg.request_timeout, method=method)

    async def _fetch(self, child: ChildConnection, kind: str) -> bool:
        """Fetch every page of one list into ``self.lists``; returns whether it changed."""
        items = await client.fetch_list(child, kind, timeout=self.cfg.request_timeout)
        current: object = getattr(self.lists, kind)
        changed = items != current
        setattr(self.lists, kind, items)
        return changed

    async def _refresh(self, child: ChildConnection, kinds: tuple[str, ...]) -> None:
        changed = False
        try:
            for kind in kinds:
                changed |= await self._fetch(child, kind)
        except (errors.GatewayError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            LOGGER.warning("backend %s: refreshing %s failed: %s", self.name, "/".join(kinds), exc)
            return
        if changed:
            self.backend.on_lists_changed(self)

    # ---- traffic from the child that is not a reply -------------------------------------------

    def on_notification(self, child: ChildConnection, method: str, params: Raw | UnsetType) -> None:
        if method.endswith("/list_changed") and self._nursery is not None and child is self.child:
            kind = method.split("/")[1]
            kinds = ("resources", "templates") if kind == "resources" else (kind,)
            if kind in ("tools", "prompts", "resources"):
                self._nursery.start_soon(self._refresh, child, kinds)
        elif method in FANNED_OUT:
            self.backend.host.bus.emit(ChildNotified(self, method, params))
        else:
            LOGGER.debug("backend %s: ignored notification %s", self.name, method)

    def on_request(self, child: ChildConnection, id: int | str, method: str,
                   params: Raw | UnsetType, cause: int | None = None) -> None:
        if method == "ping":
            child.respond(id, jsonrpc.EMPTY_RESULT)
            return
        owners = self.backend.owners(self, child, cause)
        self.backend.host.ownership.route(self, child, id, method, params, owners)

    def on_cancelled(self, child: ChildConnection, request_id: int | str) -> None:
        self.backend.host.ownership.child_cancelled(child, request_id)
