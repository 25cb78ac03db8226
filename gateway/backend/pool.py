"""A configured backend: its instances, its lists, its resource subscriptions.

The sharing mode decides which instance serves a call: ``shared`` multiplexes every
connection's calls (server→client requests routed only when the attribution set proves the
owner); ``affine`` gives an instance to one connection at a time while it has calls there
(FIFO hand-over); ``per-session`` starts a child per connection, ``per-principal`` one per
authenticated principal (its environment or upstream credentials its own).  The lists come from
instance 0 (the probe in the per-session and per-principal modes) and survive restarts: calls
to a restarting or draining instance go elsewhere or wait up to ``restart_wait``, then fail
``backend_unavailable``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, cast

import trio

from gateway import errors
from gateway.auth.principal import Principal
from gateway.backend import client, credentials
from gateway.backend.authcode import AuthorizationCode
from gateway.backend.child import ChildConnection, Owner
from gateway.backend.connector import Connector
from gateway.backend.http import HttpConnector
from gateway.backend.instance import Instance, InstanceHost
from gateway.backend.principalauth import PrincipalAuthorizationCode
from gateway.backend.stdio import StdioConnector
from gateway.backend.tokenexchange import TokenExchangeSource
from gateway.config import BackendConfig
from gateway.events import ListsChanged, QueueWaited
from gateway.protocol import mrtr
from gateway.protocol.catalog import BackendLists
from gateway.protocol.supervision import State
from gateway.status import BackendStatus, InstanceStatus
from gateway.wakeup import Wakeup

LOGGER = logging.getLogger(__name__)

#: Calls of a backend remembered as ones that asked their caller for input (see ``askers``).
MAX_ASKERS = 1024


def _running(inst: Instance) -> ChildConnection | None:
    """The child of ``inst`` that takes new calls (running, not draining for a recycle)."""
    return inst.serving()


class _Waiter:
    __slots__ = ("granted", "inst", "session")

    def __init__(self, session: Owner) -> None:
        self.session = session
        self.granted = trio.Event()
        self.inst: Instance | None = None


class _Held:
    """A principal's instance: the principal as last seen calling, and when the latest
    credential it called with expires (trio time; inf: never)."""

    __slots__ = ("dropped", "expires_at", "inst", "principal")

    def __init__(self, inst: Instance, principal: Principal) -> None:
        self.inst = inst
        self.principal = principal
        self.expires_at = math.inf
        self.dropped = trio.Event()  # the principal was removed (a reload), or the backend stops


class Parking(Protocol):
    """Bridged flows parked at a child (gateway.core.bridge): what a shared backend asks before it
    sends a call that may ask its caller for input."""

    park_limit: float

    def parked_since(self, owner: Owner) -> float | None: ...
    def was_preempted(self, owner: Owner) -> bool: ...
    def preempt(self, owner: Owner, child: ChildConnection) -> None: ...


#: Chooses a backend's connector from its name and config.
ConnectorFactory = Callable[[str, BackendConfig], Connector]


def _credential_source(name: str, cfg: BackendConfig
                       ) -> credentials.PrincipalCredentials | None:
    """A per-principal remote's credential source: token exchange, each principal's
    authorization code flow, or ``token_files`` (None: the backend's own identity)."""
    if cfg.credentials != "per-principal":
        return None
    if cfg.token_exchange is not None:
        return TokenExchangeSource(name, cfg.token_exchange)
    if cfg.oauth is not None and cfg.oauth.grant == "authorization_code":
        return PrincipalAuthorizationCode(name, cfg.url, cfg.oauth)
    return credentials.TokenFiles(cfg.token_files) if cfg.token_files else None


def default_connector(name: str, cfg: BackendConfig) -> Connector:
    """The connector a backend's config asks for: ``http`` (its ``url``) or ``stdio`` (its
    ``command``)."""
    if cfg.url:
        return HttpConnector(cfg, name=name)
    return StdioConnector(cfg)


def _principal_key(owner: Owner) -> str | None:
    """The key of the principal a session (the core's) is authenticated as, if any."""
    principal = getattr(owner, "principal", None)
    return principal.key if isinstance(principal, Principal) else None


class BackendHost(InstanceHost, Protocol):
    """What a backend is given from above (by the hub); its news go out on ``bus``."""

    restart_wait: float


class Backend:
    def __init__(self, name: str, cfg: BackendConfig, prefix: str, host: BackendHost,
                 connector: Connector | None = None) -> None:
        self.name = name
        self.cfg = cfg
        self.prefix = prefix
        self.host = host
        # how its instances reach the upstream (default: the one its config asks for)
        self.connector = connector if connector is not None else default_connector(name, cfg)
        self.declared = frozenset(cfg.declare)
        self.lists = BackendLists()
        self.lists_ready = trio.Event()
        self.instances: list[Instance] = []
        self.subscriptions: dict[str, set[Owner]] = {}
        self._nursery: trio.Nursery | None = None
        self._stopping = False
        self.log_level: str | None = None  # what a new child is set to (the hub keeps it current)
        self.restarting = False  # stopped by a reload that starts it again with a changed config
        self._released = Wakeup()  # a client call ended (wakes drain)
        # an instance changed state, or an affine waiter was granted or let go (wakes the
        # affine waiters); replaced each time
        self._changed = trio.Event()
        self._waiters: deque[_Waiter] = deque()
        self._own: dict[Owner, Instance] = {}
        #: the sharing mode ("per-principal" also when a remote's credentials are per-principal)
        self.mode = cfg.owned_sharing
        # per-principal: the instance of each principal (by Principal.key), and the remote's
        # per-principal credential source (None: the backend's own identity)
        self._held: dict[str, _Held] = {}
        self.credentials = _credential_source(name, cfg)
        # A child of this backend spoke the modern era: every later one must too (a restart, a
        # per-session child), else it fails to start (never a silent downgrade to legacy).
        self.modern_seen = False
        self._session_index = 0
        # shared: the bridge's parked flows (set by the hub), and the calls (tool name, else
        # method) seen asking their caller for input: such a call waits for a parked flow of
        # another caller to be resumed or preempted before it goes (see _acquire_unparked)
        self.parking: Parking | None = None
        self.askers: dict[str, None] = {}
        # shared: the calls that waited in _acquire_unparked and went, by caller, until they
        # end: the other waiters let one go at a time (released together, their requests
        # would all be refused as unattributable, the preemption they waited for wasted)
        self._ushered: dict[Owner, ChildConnection] = {}

    @property
    def attribution_matters(self) -> bool:
        """Whether this backend's server→client requests are ever forwarded by attribution."""
        if self.mode == "per-session":
            return False  # the owner is fixed per child
        return bool(self.declared & {"elicitation", "sampling"})

    @property
    def authorization_code(self) -> AuthorizationCode | None:
        """The operator-authorized flow of a remote with ``oauth.grant = "authorization_code"``
        (one shared identity); None for any other backend."""
        auth = self.connector.auth if isinstance(self.connector, HttpConnector) else None
        return auth if isinstance(auth, AuthorizationCode) else None

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the instances and supervise them until :meth:`stop`."""
        count = 1 if self.mode in ("per-session", "per-principal") else self.cfg.instances
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for index in range(count):
                inst = Instance(self, index)
                self.instances.append(inst)
                await nursery.start(inst.run)
            task_status.started()
        self._nursery = None

    def snapshot(self, now: float) -> BackendStatus:
        """This backend and its instances as ``/status`` and the gauges see them."""
        lists = self.lists
        return BackendStatus(self.name, self.cfg.required, self.mode,
                             tuple(i.snapshot(now) for i in self.instances), len(lists.tools),
                             len(lists.prompts), len(lists.resources), len(lists.templates),
                             self.cfg.protocol_mode, self.modern_seen, self.connector.kind,
                             self._token_status(),
                             self.credentials.status()
                             if isinstance(self.credentials, TokenExchangeSource) else None)

    def _token_status(self) -> dict[str, Any] | None:
        if isinstance(self.credentials, PrincipalAuthorizationCode):  # each principal's own
            return self.credentials.status()
        auth = self.connector.auth if isinstance(self.connector, HttpConnector) else None
        return auth.status() if auth is not None else None

    async def first_start(self) -> None:
        """Return once the lists are in, or the first instance's first start failed (BACKOFF or
        FATAL) or waits for an authorization (AUTHORIZING); the caller bounds the wait."""
        inst = self.instances[0]
        # lists_ready is set in the same step as the RUNNING transition
        while not self.lists_ready.is_set() and inst.state not in (State.BACKOFF, State.FATAL,
                                                                   State.AUTHORIZING):
            await inst.state_changed()

    async def settled(self) -> InstanceStatus:
        """Wait until the first instance runs or has given up (FATAL); its snapshot then."""
        inst = self.instances[0]
        while inst.state not in (State.RUNNING, State.FATAL):
            await inst.state_changed()
        return inst.snapshot(trio.current_time())

    def live_pids(self) -> set[int]:
        """The pids of this backend's children that have not been reaped yet."""
        return {pid for i in self.instances
                if i.link is not None and (pid := i.link.pid) is not None}

    async def set_level(self, level: str) -> None:
        """``logging/setLevel`` on every running child (a refusal is logged, not raised)."""
        for inst in self.instances:
            child = inst.child
            if child is None:
                continue
            try:
                await client.set_level(child, level, timeout=self.cfg.request_timeout)
            except errors.GatewayError as exc:
                LOGGER.info("backend %s: logging/setLevel failed: %s", inst.name, exc)

    def inflight(self) -> int:
        """Client calls in flight on this backend's children (gateway-internal ones excluded)."""
        return sum(i.child.calls_in_flight() for i in self.instances if i.child is not None)

    def _wake_waiters(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _let_go(self) -> None:
        """Stopping: every affine waiter stops waiting (and fails with backend_unavailable)."""
        for waiter in self._waiters:
            waiter.granted.set()
        self._wake_waiters()

    async def drain(self, grace: float) -> None:
        """Take no new calls and wait (at most ``grace`` seconds) for the calls in flight."""
        self._stopping = True
        self._let_go()
        with trio.move_on_after(grace):
            while self.inflight():
                await self._released.wait()

    def stop(self) -> None:
        self._stopping = True
        for inst in self.instances:
            inst.request_stop()
        for held in self._held.values():  # their reapers end too
            held.dropped.set()
        self._let_go()

    async def stopped(self) -> None:
        for inst in list(self.instances):
            await inst.stopped.wait()

    def refresh(self) -> None:
        """A reload kept this backend: its connectors read their header values again, its
        per-principal credential source its files."""
        self.connector.refresh()
        if self.credentials is not None:
            self.credentials.refresh()
        for held in self._held.values():
            if held.inst.connector is not self.connector:
                held.inst.connector.refresh()

    def reset(self) -> None:
        for inst in self.instances:
            if inst.state is State.FATAL:
                inst.reset()

    # ---- choosing an instance ---------------------------------------------------------------

    def learn_asker(self, key: str) -> None:
        """A call known by ``key`` asked its caller for input (bounded: the oldest is forgotten)."""
        if key not in self.askers:
            if len(self.askers) >= MAX_ASKERS:
                del self.askers[next(iter(self.askers))]
            self.askers[key] = None

    def waits_for_parked(self, key: str) -> bool:
        """Whether a call known by ``key`` must not go to a shared child where another
        caller's bridged flow is parked (it asked for input before: so might it now)."""
        return self.parking is not None and self.mode == "shared" and key in self.askers

    def _parked_at(self, child: ChildConnection, session: Owner
                   ) -> tuple[dict[Owner, float], bool]:
        """Other callers' parked flows at ``child`` (when each parked), and whether a preempted
        one's call is still there (given up, not answered yet) or another waiter's call went
        there ahead of this one (until it ends or parks)."""
        parking = self.parking
        assert parking is not None
        parked: dict[Owner, float] = {}
        # another waiter's call went there first: it ends or parks before the next one goes
        leaving = any(c is child and s is not session for s, c in self._ushered.items())
        for owner in child.attribution():
            if owner is session:
                continue
            since = parking.parked_since(owner)
            if since is not None:
                parked[owner] = since
            elif self._ushered.get(owner) is child:
                continue  # (going ahead: counted above)
            elif parking.was_preempted(owner) and not child.calls_of(owner):
                leaving = True
        return parked, leaving

    def pick_now(self, session: Owner, *, asks: bool = False, principal: Principal | None = None
                 ) -> tuple[Instance, ChildConnection] | None:
        """An instance that takes a call of ``session`` right now, per the sharing mode, or None
        when the call would have to wait (then :meth:`acquire` waits for one).  ``asks``: the
        call may ask for input (:meth:`waits_for_parked`): in ``shared`` mode it takes no
        instance where another caller's flow is parked.  ``principal``: the caller's (the
        per-principal mode's key)."""
        if self._stopping:
            return None
        if self.mode == "per-principal":
            held = self._held.get(principal.key) if principal is not None else None
            child = _running(held.inst) if held is not None else None
            if held is None or child is None:
                return None
            assert principal is not None
            self._touch(held, principal)
            return held.inst, child
        if self.mode == "shared":
            if len(self.instances) == 1 and not asks:  # one instance: no load to compare
                only = self.instances[0]
                child = only.serving()
                return (only, child) if child is not None else None
            best: tuple[int, Instance, ChildConnection] | None = None
            for candidate in self.instances:
                child = candidate.serving()
                if child is not None and asks and self._parked_at(child, session) != ({}, False):
                    continue
                if child is not None:
                    load = child.router.load
                    if best is None or load < best[0]:
                        best = (load, candidate, child)
            return (best[1], best[2]) if best is not None else None
        if self.mode == "per-session":
            inst = self._own.get(session)
            child = _running(inst) if inst is not None else None
            if inst is None or child is None:
                return None
            inst.last_used = trio.current_time()
            return inst, child
        if self._waiters:  # affine: first come, first served
            return None
        inst = self._free_for(session)
        if inst is None:
            return None
        inst.owner = session
        child = _running(inst)
        assert child is not None
        return inst, child

    async def acquire(self, session: Owner, *, asks: bool = False,
                      principal: Principal | None = None) -> tuple[Instance, ChildConnection]:
        """An instance and its running child for a call of ``session``, per the sharing mode
        (``asks``, ``principal``: see :meth:`pick_now`).

        Raises:
            BackendUnavailable: not running within ``restart_wait`` (FATAL: at once).
            Overloaded: affine queue full or timed out; per-session or per-principal cap.
            Denied: per-principal, and no principal or no credentials for it.
        """
        if self._stopping:
            raise self._gone()
        picked = self.pick_now(session, asks=asks, principal=principal)
        if picked is not None:
            return picked
        if self.mode == "per-principal":
            return await self._acquire_principal(session, principal)
        if asks and self.mode == "shared" and self.parking is not None:
            return await self._acquire_unparked(session)
        if self.mode == "affine":
            return await self._acquire_affine(session)
        if self.mode == "per-session":
            return await self._acquire_own(session)
        inst = self.instances[0]
        return inst, await inst.wait_ready(self.host.restart_wait)

    async def _acquire_unparked(self, session: Owner) -> tuple[Instance, ChildConnection]:
        """A shared instance where no other caller's flow is parked, for a call that may ask
        for input: a flow parked there ``shared_park_limit`` seconds or more is preempted (the
        call would otherwise be refused its input as unattributable), one parked for less is
        waited for (its client may retry in time).  Waiters go one at a time: the next when
        the one before ends or parks (``_ushered``).  Bounded: after the limit plus
        ``cancel_grace`` (a child that does not answer a given-up call) the call goes anyway,
        and attribution decides as always."""
        parking = self.parking
        assert parking is not None
        started = trio.current_time()
        give_up_at = started + parking.park_limit + self.cfg.cancel_grace
        while True:
            if self._stopping:
                raise self._gone()
            now = trio.current_time()
            picked = self.pick_now(session, asks=now < give_up_at)
            if picked is not None:
                if now > started:
                    self.host.bus.emit(QueueWaited(self.name, now - started))
                self._ushered[session] = picked[1]  # until release(): see _parked_at
                return picked
            running = [(inst, child) for inst in self.instances
                       if (child := _running(inst)) is not None]
            if not running:  # (not running: as for any call)
                inst = self.instances[0]
                await inst.wait_ready(self.host.restart_wait)
                continue
            wake = give_up_at
            for _inst, child in running:
                parked, leaving = self._parked_at(child, session)
                decision = mrtr.park_wait(parked, leaving, now, parking.park_limit)
                if decision is None:
                    continue
                for owner in decision.preempt:
                    parking.preempt(owner, child)
                wake = min(wake, decision.until)
            if self.pick_now(session, asks=True) is not None:
                continue
            # woken by a call that ends or an answer that frees the attribution set
            with trio.move_on_at(wake):
                await self._released.wait()

    def _gone(self) -> errors.BackendUnavailable:
        if self.restarting:  # the reload starts a new one: trying again soon will work
            return errors.BackendUnavailable(
                f"backend {self.name!r} is being restarted by a reload", backend=self.name,
                retryable=True)
        return errors.BackendUnavailable(f"backend {self.name!r} is being removed",
                                         backend=self.name, retryable=False)

    def owners(self, inst: Instance, child: ChildConnection,
               cause: int | None = None) -> set[Owner]:
        """Who may receive a server→client request from ``child`` (see gateway.core.ownership):
        the owner of ``cause`` when it came on that call's own answer stream (exact, whatever
        the sharing mode; nobody once that call is over or given up), else the attribution
        set."""
        if cause is not None:
            call = child.router.pending.get(cause)
            owner = (call.owner if call is not None and not call.internal
                     and call.abandoned_at is None else None)
            if owner is None:
                return set()
            owner = cast(Owner, owner)
            return {owner} if not owner.closed.is_set() else set()
        if self.mode == "per-session":
            owner = inst.owner
            return {owner} if owner is not None and not owner.closed.is_set() else set()
        return child.attribution()

    def release(self, inst: Instance, session: Owner) -> None:
        """A call of ``session`` on ``inst`` ended (affine: maybe hand the instance over)."""
        inst.calls_changed()
        mode = self.mode
        if mode == "affine":
            self._settle(inst)
        elif mode in ("per-session", "per-principal"):
            inst.last_used = trio.current_time()
        self._ushered.pop(session, None)
        self._released.set()

    def flow_parked(self) -> None:
        """A bridged call of this backend parked: a waiter behind it re-reads when it parked."""
        self._released.set()

    # affine: an instance serves one connection while that connection has calls in its
    # attribution set; FIFO hand-over, and a holder gets no new calls once someone else waits.

    def _settle(self, inst: Instance) -> None:
        child = inst.child
        if inst.owner is not None and (child is None or not child.attribution()):
            inst.owner = None
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            waiter = self._waiters[0]
            inst = self._free_for(waiter.session)
            if inst is None:
                return
            self._waiters.popleft()
            inst.owner = waiter.session
            waiter.inst = inst
            waiter.granted.set()
            self._wake_waiters()

    def _free_for(self, session: Owner) -> Instance | None:
        for inst in self.instances:
            if _running(inst) is not None and inst.owner is session:
                return inst
        for inst in self.instances:
            child = _running(inst)
            if child is not None and inst.owner is None and not child.attribution():
                return inst
        return None

    async def _acquire_affine(self, session: Owner) -> tuple[Instance, ChildConnection]:
        """Wait for an instance (:meth:`pick_now` found none free for ``session``)."""
        if all(i.state is State.FATAL for i in self.instances):
            raise errors.BackendUnavailable(f"backend {self.name!r} is failing (crash loop)",
                                            backend=self.name, retryable=False)
        if len(self._waiters) >= self.cfg.queue_size:
            raise errors.Overloaded(
                f"backend {self.name!r}: {len(self._waiters)} calls already wait for an instance",
                backend=self.name,
            )
        waiter = _Waiter(session)
        self._waiters.append(waiter)
        started = trio.current_time()
        # None while some instance runs; else since when none has (restart_wait bounds that)
        down_since: float | None = None
        try:
            # Woken by a grant (a holder's last call left its attribution set: released,
            # answered late, purged after cancel_grace) and by every instance state change.
            with trio.move_on_after(self.cfg.queue_timeout):
                while not waiter.granted.is_set():
                    now = trio.current_time()
                    if any(_running(i) for i in self.instances):
                        down_since = None
                    elif down_since is None:
                        down_since = now
                    if all(i.state is State.FATAL for i in self.instances) or (
                            down_since is not None and now - down_since >= self.host.restart_wait):
                        break  # not running: backend_unavailable below, not a queue timeout
                    changed = self._changed
                    with trio.move_on_at(math.inf if down_since is None
                                         else down_since + self.host.restart_wait):
                        await changed.wait()
        except BaseException:
            if waiter.inst is not None:  # granted, but the caller went away: hand it on
                self._settle(waiter.inst)
            raise
        finally:
            # (drop_session may have removed it already: its session ended while it waited)
            if not waiter.granted.is_set() and waiter in self._waiters:
                self._waiters.remove(waiter)
        self.host.bus.emit(QueueWaited(self.name, trio.current_time() - started))
        inst = waiter.inst
        child = _running(inst) if inst is not None else None
        if inst is None or child is None:
            if inst is not None:
                inst.owner = None
                self._grant()
            if self._stopping:
                raise self._gone()
            if all(i.state is State.FATAL for i in self.instances):
                raise errors.BackendUnavailable(f"backend {self.name!r} is failing (crash loop)",
                                                backend=self.name, retryable=False)
            if not any(_running(i) for i in self.instances):
                raise errors.BackendUnavailable(
                    f"backend {self.name!r} is not running after waiting "
                    f"{self.host.restart_wait:g}s",
                    backend=self.name, retryable=True,
                )
            raise errors.Overloaded(
                f"backend {self.name!r}: no instance became free within "
                f"{self.cfg.queue_timeout:g}s",
                backend=self.name,
            )
        return inst, child

    # per-session: a dedicated child per connection, started on first use, capped.

    def own_child(self, session: Owner) -> ChildConnection | None:
        """The running per-session child of ``session``, if it has one."""
        inst = self._own.get(session)
        return _running(inst) if inst is not None else None

    async def _acquire_own(self, session: Owner) -> tuple[Instance, ChildConnection]:
        inst = self._own.get(session)
        if inst is None:
            if session.closed.is_set():
                raise errors.BackendUnavailable("the connection is closing", backend=self.name,
                                                retryable=False)
            if len(self._own) >= self.cfg.max_sessions:
                raise errors.Overloaded(
                    f"backend {self.name!r}: {self.cfg.max_sessions} per-session children already "
                    "run (max_sessions)", backend=self.name,
                )
            assert self._nursery is not None
            self._session_index += 1
            inst = Instance(self, self._session_index, label=f"s{self._session_index}")
            inst.owner = session
            self._own[session] = inst
            self.instances.append(inst)
            # No checkpoint between registering the instance and starting its supervisor and
            # reaper: a call cancelled right here must not leave an unsupervised entry behind.
            self._nursery.start_soon(inst.run)
            self._nursery.start_soon(self._reap_own, inst)
            wait = self.cfg.start_timeout + 1.0
        else:
            wait = self.host.restart_wait
        inst.last_used = trio.current_time()
        return inst, await inst.wait_ready(wait)

    async def _reap_own(self, inst: Instance) -> None:
        """Stop a per-session child when its connection closes or it idles too long."""
        session = inst.owner
        assert session is not None
        while not inst.stopped.is_set():
            idle_at = inst.last_used + self.cfg.idle_timeout
            if inst.child is not None and inst.child.attribution():
                idle_at = max(idle_at, trio.current_time() + 1.0)  # busy: look again later
            with trio.move_on_at(idle_at):
                await session.closed.wait()
            if session.closed.is_set():
                break
            busy = inst.child is not None and inst.child.attribution()
            if not busy and trio.current_time() >= inst.last_used + self.cfg.idle_timeout:
                LOGGER.info("backend %s: per-session child idle for %gs, stopping it", inst.name,
                            self.cfg.idle_timeout)
                break
        self._own.pop(session, None)
        inst.request_stop()
        await inst.stopped.wait()
        if inst in self.instances:
            self.instances.remove(inst)

    # per-principal: a child (or remote session) per authenticated principal, started on first
    # use, capped, stopped when idle, when its credential expires or the principal is removed.

    def _touch(self, held: _Held, principal: Principal) -> None:
        """A call of ``principal`` goes to its instance: used now; its latest credential's
        expiry (wall clock) counts from now on trio's clock."""
        now = trio.current_time()
        held.inst.last_used = now
        held.principal = principal
        held.inst.principal_label = principal.label
        connector = held.inst.connector
        if isinstance(connector, (HttpConnector, StdioConnector)):
            connector.principal = principal  # (its source sees the current one)
        if principal.expires is not None:
            at = now + max(0.0, principal.expires - time.time())
            held.expires_at = at if math.isinf(held.expires_at) else max(held.expires_at, at)

    def _principal_connector(self, principal: Principal) -> Connector:
        """The connector of ``principal``'s own instance."""
        if isinstance(self.connector, HttpConnector):
            return self.connector.for_principal(principal, self.credentials)
        if isinstance(self.connector, StdioConnector):
            return self.connector.for_principal(principal)
        return self.connector  # (a test's in-process connector)

    async def _check_credentials(self, principal: Principal) -> None:
        """Refuse a principal whose environment file or upstream credentials cannot be had,
        before an instance is started for it.

        Raises:
            Denied / BackendUnavailable: :func:`gateway.backend.credentials.call_error`.
        """
        try:
            if self.cfg.env_files and not self.cfg.url:
                credentials.read_env_file(self.cfg.env_files, principal)
            if self.credentials is not None:
                await self.credentials.headers(principal)
        except credentials.CredentialsUnavailable as exc:
            raise credentials.call_error(exc, self.name) from None

    async def _acquire_principal(self, session: Owner, principal: Principal | None
                                 ) -> tuple[Instance, ChildConnection]:
        if principal is None:
            raise errors.Denied(
                f"backend {self.name!r} runs an instance per authenticated principal; this "
                "caller is not authenticated", backend=self.name)
        key = principal.key
        held = self._held.get(key)
        if held is None:
            if session.closed.is_set():
                raise errors.BackendUnavailable("the connection is closing", backend=self.name,
                                                retryable=False)
            self._check_cap()  # (before any upstream token is asked for it)
            await self._check_credentials(principal)
            held = self._held.get(key)  # (another call of it may have started one meanwhile)
        if held is None:
            if self._stopping:
                raise self._gone()
            try:
                self._check_cap()
            except errors.Overloaded:
                if self.credentials is not None:
                    self.credentials.forget(key)  # (others took the places meanwhile)
                raise
            assert self._nursery is not None
            self._session_index += 1
            inst = Instance(self, self._session_index, label=f"p{self._session_index}")
            inst.connector = self._principal_connector(principal)
            inst.principal_key = key
            held = self._held[key] = _Held(inst, principal)
            self.instances.append(inst)
            # No checkpoint between registering the instance and starting its supervisor and
            # reaper (as for per-session).
            self._nursery.start_soon(inst.run)
            self._nursery.start_soon(self._reap_principal, held)
            wait = self.cfg.start_timeout + 1.0
        else:
            wait = self.host.restart_wait
        self._touch(held, principal)
        return held.inst, await held.inst.wait_ready(wait)

    def _check_cap(self) -> None:
        """Raises Overloaded: ``max_sessions`` per-principal instances run."""
        if len(self._held) >= self.cfg.max_sessions:
            raise errors.Overloaded(
                f"backend {self.name!r}: {self.cfg.max_sessions} per-principal instances "
                "already run (max_sessions)", backend=self.name)

    async def _reap_principal(self, held: _Held) -> None:
        """Stop a principal's instance when it idles ``idle_timeout``, when the latest
        credential it was called with expires, or when the principal is removed; its cached
        upstream tokens are forgotten."""
        inst = held.inst
        why = "stopped"
        while not inst.stopped.is_set():
            now = trio.current_time()
            if now >= held.expires_at:
                why = "its principal's credential expired"
                break
            busy = inst.child is not None and inst.child.attribution()
            idle_at = inst.last_used + self.cfg.idle_timeout
            if not busy and now >= idle_at:
                why = f"idle for {self.cfg.idle_timeout:g}s"
                break
            with trio.move_on_at(min(max(idle_at, now + 1.0) if busy else idle_at,
                                     held.expires_at)):
                await held.dropped.wait()
            if held.dropped.is_set():
                why = "the backend stops" if self._stopping else "its principal was removed"
                break
        LOGGER.info("backend %s: stopping the per-principal instance: %s", inst.name, why)
        key = inst.principal_key
        assert key is not None
        if self._held.get(key) is held:
            del self._held[key]
        if self.credentials is not None:
            self.credentials.forget(key)
        inst.request_stop()
        await inst.stopped.wait()
        if inst in self.instances:
            self.instances.remove(inst)

    def drop_principals(self, keep: Callable[[Principal], bool],
                        keep_grants: Callable[[Principal], bool] | None = None) -> int:
        """Stop the instances of the principals ``keep`` refuses (a reload removed them or
        their credential); how many.  The upstream grants (refresh tokens) of those
        ``keep_grants`` refuses (default ``keep``) are deleted too."""
        dropped = [held for held in self._held.values() if not keep(held.principal)]
        for held in dropped:
            held.dropped.set()
        if isinstance(self.credentials, PrincipalAuthorizationCode):
            self.credentials.drop_unless(keep_grants or keep)
        return len(dropped)

    # ---- hooks from instances ---------------------------------------------------------------

    def on_state_changed(self, inst: Instance) -> None:
        self._wake_waiters()

    def on_draining_changed(self, inst: Instance) -> None:
        """``inst`` began or ended a drain: waiters look again (affine: it may be free now)."""
        self._wake_waiters()
        if self.cfg.sharing == "affine" and not inst.draining:
            self._grant()

    def on_instance_ready(self, inst: Instance) -> None:
        # (per-principal: the probe's alone; a principal's lists are its own)
        if inst is self.instances[0] or (not self.lists_ready.is_set()
                                         and self.mode != "per-principal"):
            self._take_lists(inst)
        if self.cfg.sharing == "affine":
            self._grant()

    def on_lists_changed(self, inst: Instance) -> None:
        if inst is self.instances[0]:
            self._take_lists(inst)

    def _take_lists(self, inst: Instance) -> None:
        self.lists = BackendLists(
            tools=list(inst.lists.tools),
            prompts=list(inst.lists.prompts),
            resources=list(inst.lists.resources),
            templates=list(inst.lists.templates),
        )
        self.lists_ready.set()
        self.host.bus.emit(ListsChanged(self.name))

    def on_settled(self, inst: Instance) -> None:
        self._released.set()  # (a given-up call answered: wakes _acquire_unparked)
        if self.cfg.sharing == "affine":
            self._settle(inst)

    def on_instance_down(self, inst: Instance, child: ChildConnection) -> None:
        if self.cfg.sharing == "affine":
            inst.owner = None

    # ---- resource subscriptions (one upstream subscription per URI per instance) -----------------
    # per-principal: a subscription goes to the subscriber's principal's instance alone (the
    # probe gets none), and is let go there when that principal's last session lets go.

    def _scope(self, session: Owner) -> str | None:
        """Whose instances a subscription of ``session`` goes to: its principal's key in the
        per-principal mode (None: every instance)."""
        if self.mode != "per-principal":
            return None
        return _principal_key(session) or ""

    def _wanted(self, uri: str, scope: str | None) -> bool:
        holders = self.subscriptions.get(uri, ())
        if scope is None:
            return bool(holders)
        return any(_principal_key(h) == scope for h in holders)

    def subscribed_uris(self, inst: Instance | None = None) -> list[str]:
        """The URIs subscribed to; with ``inst``: those it is to be subscribed to."""
        if inst is None or self.mode != "per-principal":
            return sorted(self.subscriptions)
        key = inst.principal_key
        return [] if key is None else sorted(u for u in self.subscriptions if self._wanted(u, key))

    async def subscribe(self, session: Owner, uri: str) -> None:
        scope = self._scope(session)
        first = not self._wanted(uri, scope)
        self.subscriptions.setdefault(uri, set()).add(session)
        if first:
            await self._upstream(uri, "resources/subscribe", scope)

    async def unsubscribe(self, session: Owner, uri: str) -> None:
        if self._release_subscription(session, uri):
            await self._upstream(uri, "resources/unsubscribe", self._scope(session))

    def drop_session(self, session: Owner) -> None:
        if self._waiters:
            for waiter in [w for w in self._waiters if w.session is session]:
                self._waiters.remove(waiter)
        if self.cfg.sharing == "affine":
            for inst in self.instances:
                if inst.owner is session:
                    self._settle(inst)
        if self.subscriptions:
            for uri in [u for u, s in self.subscriptions.items() if session in s]:
                self.drop_subscription(session, uri)

    def drop_subscription(self, session: Owner, uri: str) -> None:
        """``session`` no longer holds ``uri`` (without waiting: the upstream unsubscribe, when
        it was the last holder, runs in the background)."""
        if self._release_subscription(session, uri):
            if self._nursery is not None and not self._stopping:
                # In the background: a wedged backend must not hold up the closing
                # connection's (shielded) cleanup, and with it a drain, for request_timeout.
                self._nursery.start_soon(self._unsubscribe_unless_wanted, uri,
                                         self._scope(session))

    def _release_subscription(self, session: Owner, uri: str) -> bool:
        """``session`` lets go of ``uri``; True when it was the last holder of its scope
        (unsubscribe upstream)."""
        holders = self.subscriptions.get(uri)
        if holders is None or session not in holders:
            return False
        holders.discard(session)
        if not holders:
            del self.subscriptions[uri]
        return not self._wanted(uri, self._scope(session))

    async def _unsubscribe_unless_wanted(self, uri: str, scope: str | None) -> None:
        if not self._wanted(uri, scope):  # nobody subscribed again meanwhile
            await self._upstream(uri, "resources/unsubscribe", scope)

    async def _upstream(self, uri: str, method: str, scope: str | None = None) -> None:
        for inst in self.instances:
            if scope is not None and inst.principal_key != scope:
                continue  # another principal's instance, or the probe
            child = inst.child
            if child is not None and child.closed is None:
                with trio.move_on_after(self.cfg.request_timeout):
                    try:
                        await inst.subscribe(child, uri, method)
                    except errors.GatewayError as exc:
                        LOGGER.warning("backend %s: %s %s failed: %s", inst.name, method, uri, exc)
