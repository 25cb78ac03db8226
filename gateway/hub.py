"""The hub: backends, the merged catalog, client sessions, and everything that crosses them.

The hub owns the backends (one :class:`~gateway.backend.pool.Backend` per config entry) and the
core's services, and implements the core's ports (:mod:`gateway.core.ports`).  It subscribes to
the backends' news on the bus: it rebuilds the merged catalog when a backend's lists change
(telling clients ``list_changed`` only when a list really changed) and routes child
notifications to the sessions that should see them (resource updates to subscribers, log
messages by level, elicitation completion to its owner).  A child's server→client requests go
straight to :mod:`gateway.core.ownership` (the backends' ``InstanceHost.ownership``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl

import msgspec
import trio
from msgspec import Raw, UnsetType

from gateway import __version__, errors
from gateway.auth.labels import configured_names
from gateway.backend import process
from gateway.backend.instance import ChildNotified, Instance
from gateway.backend.oauth import TokenFailed
from gateway.backend.pool import Backend, ConnectorFactory, Parking, default_connector
from gateway.backend.principalauth import PrincipalAuthorizationCode
from gateway.config import BackendConfig, GatewayConfig, ItemFilter, redirect_uri
from gateway.core import bridge
from gateway.core.audit import AuditSink
from gateway.core.listen import Listens
from gateway.core.ownership import Ownership
from gateway.core.policy import Caller, Policy, caller_of
from gateway.core.serving import url_elicitation_id
from gateway.core.session import ClientSession
from gateway.core.tracing import Tracer
from gateway.events import BackendExited, CatalogChanged, ConnectionRefused, EventBus, ListsChanged
from gateway.limits import (
    DEFAULT_MAX_CONNECTIONS,
    OPTIONAL_REMOTE_WAIT,
    ByteBudget,
    ConnectionSlots,
    LogBudget,
    PrincipalCaps,
    PrincipalLimit,
    PrincipalLimits,
)
from gateway.protocol import jsonrpc, mcp
from gateway.protocol.catalog import (
    BackendLists,
    Catalog,
    CatalogConflict,
    Exposed,
    Exposure,
    build_catalog,
)
from gateway.protocol.era import Era
from gateway.protocol.logfanout import LogListener, log_recipients
from gateway.protocol.policy import climbs
from gateway.protocol.subscriptions import uri_matches
from gateway.status import GatewayStatus, ListenerStatus
from gateway.wakeup import Wakeup

if TYPE_CHECKING:
    from gateway.auth.authenticator import Authenticator

LOGGER = logging.getLogger(__name__)

#: The longest query the authorization redirect endpoint reads (longer: refused, not cut).
MAX_REDIRECT_QUERY = 8192

#: The routing hint of a notification that relates to no request.
UNRELATED: jsonrpc.Route = (jsonrpc.Goes.UNRELATED, None)


#: The merged lists a ``notifications/<kind>/list_changed`` is about.
LIST_KINDS = {"tools": ("tools",), "prompts": ("prompts",), "resources": ("resources", "templates")}


def exposed(bcfg: BackendConfig) -> Exposed:
    """A backend's ``tools``/``prompts``/``resources`` include/exclude filters."""
    def one(f: ItemFilter) -> Exposure:
        return Exposure(tuple(f.include), tuple(f.exclude))
    return Exposed(one(bcfg.tools), one(bcfg.prompts), one(bcfg.resources))


def principal_limits(cfg: GatewayConfig) -> list[PrincipalLimit]:
    return [PrincipalLimit(lim.principal, lim.max_inflight, lim.calls_per_second, lim.caps)
            for lim in cfg.auth.limits]


def _str_field(params: Raw | UnsetType, key: str) -> str | None:
    """A string field of a child's notification params, or None when absent or malformed."""
    try:
        value = jsonrpc.loads(jsonrpc.params_dict(params)[key])
    except (KeyError, errors.GatewayError, msgspec.DecodeError):
        return None
    return value if isinstance(value, str) else None


class Hub:
    def __init__(self, cfg: GatewayConfig, bus: EventBus, *, subreaper: bool = False,
                 connectors: ConnectorFactory = default_connector) -> None:
        self.cfg = cfg
        self.connectors = connectors  # a backend's connector (stdio; tests give memory ones)
        self.bus = bus
        self.server_name = cfg.gateway.name
        self.max_message_bytes = cfg.gateway.max_message_bytes
        self.max_json_depth = cfg.gateway.max_json_depth
        self.outbound_bytes = cfg.gateway.outbound_bytes  # also bounds each child's write queue
        self.restart_wait = cfg.gateway.restart_wait
        self.backends: dict[str, Backend] = {}
        self.catalog = Catalog()
        # while set, a backend's new lists do not rebuild the catalog: at boot the service merges
        # every backend's first lists once (a rebuild per backend would cost backends × tools)
        self.catalog_held = False
        self.sessions: set[ClientSession] = set()
        self.budget = ByteBudget(cfg.gateway.buffered_bytes_total)  # every queued message's bytes
        self.slots = ConnectionSlots(cfg.gateway.max_connections or DEFAULT_MAX_CONNECTIONS,
                                     self._connection_refused)
        self.ownership = Ownership(bus)
        self.listens = Listens()  # modern clients' subscriptions/listen requests
        self.bridge = bridge.from_config(cfg.gateway)  # era bridging for modern callers
        self.bridge.passthrough = self.targets_modern
        self.bridge.bus = bus
        self.bridge.count_parked = self._count_parked
        self.bridge.on_park = self._flow_parked
        self.policy = Policy(cfg.policy, bus, cfg)
        entries = principal_limits(cfg)  # [[auth.limits]]: calls, and what is held at once
        self.limits = PrincipalLimits(entries)
        self.caps = PrincipalCaps(entries)
        self.principal_names = configured_names(cfg)  # the principal label set
        self.authn: Authenticator | None = None  # set by the service (gateway.auth)
        self.audit: AuditSink | None = None  # the audit log, when on (set by the service)
        self.tracer: Tracer | None = None  # set by the service when [telemetry] enabled
        self.listeners_bound = False
        self.listeners: tuple[ListenerStatus, ...] = ()  # for /status; set once they are bound
        self.lame_duck = False  # SIGTERM: not ready, still serving (gateway.drain_delay)
        self.draining = False  # new requests are refused (-32005 retryable, HTTP 503)
        self.calls_cut_off = False  # drain grace over: cancelled calls are answered -32005 shutdown
        self._connections_changed = Wakeup()
        self._redirect_log = LogBudget()  # refused authorization redirects
        self._subreaper = subreaper
        self._nursery: trio.Nursery | None = None
        self._levels: dict[str, str | None] = {}
        self._catalog_warnings: set[str] = set()
        self._restarting: dict[str, Backend] = {}  # stopped by a reload, about to start again
        # a reload is restarting these: set once the new backend has started (or the restart
        # was given up); calls wait on it instead of failing
        self._replacing: dict[str, trio.Event] = {}
        # the backends' news (gateway.backend): a child's notifications, lists, exits
        bus.subscribe(self._child_notified, ChildNotified)
        bus.subscribe(self._lists_changed_at, ListsChanged)
        bus.subscribe(lambda _: self.reap(), BackendExited)

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every configured backend and serve until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for name, bcfg in self.cfg.backends.items():
                await self.add_backend(name, bcfg)
            task_status.started()
            await trio.sleep_forever()

    def apply_config(self, cfg: GatewayConfig) -> None:
        """Adopt a reloaded config (backends are added/removed by the caller)."""
        self.cfg = cfg
        self.restart_wait = cfg.gateway.restart_wait
        self.budget.limit = cfg.gateway.buffered_bytes_total
        self.slots.limit = cfg.gateway.max_connections or DEFAULT_MAX_CONNECTIONS
        entries = principal_limits(cfg)
        self.limits = self.limits.reconfigured(entries)
        self.caps.reconfigure(entries)
        g = cfg.gateway  # the bridge's bounds (its key and replica id only at a restart)
        self.bridge.ttl, self.bridge.park_limit, self.bridge.max_parked = (
            g.state_ttl, g.shared_park_limit, g.max_parked_flows)
        self.principal_names = configured_names(cfg)
        callers = self._callers()
        before = self._views(self.policy, self.catalog, callers, tuple(LIST_KINDS))
        self.policy = self.policy.reconfigured(cfg)
        self.policy.catalog_changed(self.catalog)
        self._lists_changed(tuple(LIST_KINDS), callers, before)

    async def add_backend(self, name: str, bcfg: BackendConfig) -> Backend:
        """Start a backend (after a reload restart, it takes over its predecessor's lists until
        its own child has listed)."""
        assert self._nursery is not None
        backend = Backend(name, bcfg, self.cfg.prefix_of(name), self,
                          self.connectors(name, bcfg))
        code_flow = backend.authorization_code
        if code_flow is not None:
            code_flow.place(redirect_uri(self.cfg), self.cfg.gateway.state_dir)
        if isinstance(backend.credentials, PrincipalAuthorizationCode):  # each caller's own
            backend.credentials.place(redirect_uri(self.cfg), self.cfg.gateway.state_dir)
        # the owners the pool asks the bridge about are the core's sessions
        backend.parking = cast("Parking", self.bridge)
        backend.log_level = self.wanted_log_level()
        previous = self._restarting.pop(name, None)
        if previous is not None:
            backend.lists = previous.lists
        self.backends[name] = backend
        try:
            await self._nursery.start(backend.run)
        finally:
            self._replaced(name)
        return backend

    async def remove_backend(self, name: str, *, drain: float = 0.0,
                             restarting: bool = False) -> None:
        """Stop a backend: no new calls, in-flight ones get up to ``drain`` seconds, then stop.

        ``restarting``: it comes back (changed config); its lists stay in the catalog until the
        new one has listed its own, so clients see no churn.
        """
        backend = self.backends[name]
        if restarting:
            backend.restarting = True
            self._replacing.setdefault(name, trio.Event())
        if drain > 0:
            await backend.drain(drain)
        backend.stop()
        await backend.stopped()
        del self.backends[name]
        if restarting:
            self._restarting[name] = backend
        else:
            self.rebuild_catalog()

    def _replaced(self, name: str) -> None:
        replacing = self._replacing.pop(name, None)
        if replacing is not None:
            replacing.set()

    def restarts_done(self) -> None:
        """A reload ended (also when cancelled): nothing waits for a restart any more."""
        for name in list(self._replacing):
            self._replaced(name)

    async def stop_backends(self) -> None:
        """Stop every backend in the spec's order, concurrently; returns when all are reaped."""
        for backend in self.backends.values():
            backend.stop()
        for backend in list(self.backends.values()):
            await backend.stopped()
        self.reap()

    async def wait_started(self) -> None:
        """Wait until each backend has its lists or has failed its first start (the caller
        bounds the wait); a remote one that is not ``required`` at most
        :data:`~gateway.limits.OPTIONAL_REMOTE_WAIT` from the call (the network may hold it up
        to its ``start_timeout``; it joins the catalog when it answers)."""
        until = trio.current_time() + OPTIONAL_REMOTE_WAIT
        backends = list(self.backends.values())
        for backend in backends:
            if not backend.cfg.url or backend.cfg.required:
                await backend.first_start()
        with trio.move_on_at(until):
            for backend in backends:
                if backend.cfg.url and not backend.cfg.required:
                    await backend.first_start()

    def reap(self) -> None:
        if self._subreaper:
            process.reap_orphans({pid for b in self.backends.values() for pid in b.live_pids()})

    # ---- connections ------------------------------------------------------------------------

    def connections_changed(self) -> None:
        """A connection closed or, once draining (only the drain waits), its last call in flight
        ended: wake :meth:`wait_connections`."""
        self._connections_changed.set()

    async def wait_connections(self, done: Callable[[], bool]) -> None:
        """Return once ``done()`` holds, checked at each :meth:`connections_changed` (the caller
        bounds the wait)."""
        while not done():
            await self._connections_changed.wait()

    def cut_off_calls(self) -> None:
        """The drain grace is over: cancel every call still running; each is answered -32005
        ``shutdown`` (``retryable: false``, it may have had effects) before its connection
        closes."""
        self.calls_cut_off = True
        for session in self.sessions:
            for call in list(session.inflight.values()):
                call.cancel()

    # ---- catalog ----------------------------------------------------------------------------

    def rebuild_catalog(self, *, strict: bool = False) -> list[str]:
        """Merge the backends' lists; notify clients of each list that changed.

        Raises:
            CatalogConflict: ``strict`` (boot) and two backends expose the same name.
        """
        serving = {**self._restarting, **self.backends}  # a restarting backend keeps its lists
        order = ([n for n in self.cfg.backends if n in serving]
                 + [n for n in serving if n not in self.cfg.backends])
        lists: list[tuple[str, str, BackendLists]] = [
            (name, serving[name].prefix, serving[name].lists) for name in order
        ]
        filters = {name: exposed(serving[name].cfg) for name in order}
        new, warnings = build_catalog(lists, self.cfg.gateway.separator, strict=strict,
                                      exposed=filters)
        for warning in warnings:
            if warning not in self._catalog_warnings:  # say each collision once, not per rebuild
                LOGGER.warning("catalog: %s", warning)
        self._catalog_warnings = set(warnings)
        old = self.catalog
        self.catalog = new
        changed = tuple(
            kind
            for kind, same in (
                ("tools", old.tools == new.tools),
                ("prompts", old.prompts == new.prompts),
                ("resources", old.resources == new.resources and old.templates == new.templates),
            )
            if not same
        )
        if changed:
            callers = self._callers()
            before = self._views(self.policy, old, callers, changed)  # the policy saw ``old``
            self.policy.catalog_changed(new)
            self.bus.emit(CatalogChanged(changed))
            self._lists_changed(changed, callers, before)
        return warnings

    def _callers(self) -> dict[Caller, list[ClientSession]]:
        callers: dict[Caller, list[ClientSession]] = {}
        for session in self.sessions:
            callers.setdefault(caller_of(session), []).append(session)
        return callers

    def _views(self, policy: Policy, catalog: Catalog, callers: dict[Caller, list[ClientSession]],
               kinds: tuple[str, ...]) -> dict[Caller, dict[str, list[dict[str, Any]]]]:
        """Each caller's view of the lists of ``kinds`` (before a change)."""
        return {caller: {name: policy.view(catalog, name, caller)
                         for kind in kinds for name in LIST_KINDS[kind]} for caller in callers}

    def _lists_changed(self, kinds: tuple[str, ...], callers: dict[Caller, list[ClientSession]],
                       before: dict[Caller, dict[str, list[dict[str, Any]]]]) -> None:
        """Tell each connection ``notifications/<kind>/list_changed`` for the lists of ``kinds``
        whose view changed *for it* (its caller's view, :meth:`Policy.view`)."""
        for kind in kinds:
            told: set[ClientSession] = set()
            for caller, sessions in callers.items():
                if any(before[caller][name] != self.policy.view(self.catalog, name, caller)
                       for name in LIST_KINDS[kind]):
                    told.update(sessions)
            if not told:
                continue
            data = jsonrpc.encode_notification(f"notifications/{kind}/list_changed")
            for session in told:
                if session.initialized:
                    session.send(data, UNRELATED)
            self.listens.list_changed(kind, told)

    def _lists_changed_at(self, news: ListsChanged) -> None:
        if news.backend in self.backends and not self.catalog_held:
            self.rebuild_catalog()

    def advertised_capabilities(self) -> dict[str, Any]:
        """A fixed set from the gateway's own features, not the union of what runs right now."""
        return {
            "tools": {"listChanged": True},
            "prompts": {"listChanged": True},
            "resources": {"subscribe": True, "listChanged": True},
            "logging": {},
            "completions": {},
        }

    async def backend(self, name: str) -> Backend:
        """The running backend ``name``.  While a reload restarts it, wait up to ``restart_wait``
        for the new one to be started (:meth:`Backend.acquire` then waits for it to run, as after
        a crash).

        Raises:
            BackendUnavailable: removed by a reload (``retryable: false``), or a restart by
                reload that has not brought it back within ``restart_wait`` (``retryable: true``).
        """
        replaced = self._replacing.get(name)
        if replaced is not None:
            with trio.move_on_after(self.restart_wait):
                await replaced.wait()
        backend = self.backends.get(name)
        if backend is None or name in self._replacing:
            restarting = name in self.cfg.backends
            raise errors.BackendUnavailable(
                f"backend {name!r} is {'restarting after a reload' if restarting else 'removed'}",
                backend=name, retryable=restarting)
        return backend

    def backend_now(self, name: str) -> Backend | None:
        """The running backend ``name`` when it can take a call without waiting (not being
        replaced by a reload), else None: :meth:`backend` then waits or says why not."""
        return self.backends.get(name) if name not in self._replacing else None

    def targets_modern(self, method: str, params: dict[str, Raw]) -> bool:
        """Whether a ``tools/call`` / ``prompts/get`` / ``resources/read`` goes to a backend that
        speaks 2026-07-28: its ``requestState`` is then the child's own, passed through (else it
        is one the gateway signed, see gateway.core.bridge)."""
        try:
            field = "uri" if method == "resources/read" else "name"
            key = jsonrpc.loads(params.get(field, b"null"))
            if method == "tools/call":
                route = self.catalog.tool_routes.get(key)
                name = route.backend if route is not None else None
            elif method == "prompts/get":
                route = self.catalog.prompt_routes.get(key)
                name = route.backend if route is not None else None
            else:
                name = self.backend_name_for_uri(key) if isinstance(key, str) else None
        except (errors.GatewayError, msgspec.DecodeError, TypeError):
            return False
        backend = self.backends.get(name) if name is not None else None
        return backend is not None and backend.modern_seen

    def backend_name_for_uri(self, uri: str) -> str:
        """The backend serving ``uri``: by the catalog, else the only backend with resources.

        Raises:
            ResourceNotFound: none, or several could.
        """
        name = self.catalog.route_resource(uri)
        if name is None:
            candidates = [b.name for b in self.backends.values()
                          if b.lists.resources or b.lists.templates]
            if len(candidates) != 1:
                raise errors.ResourceNotFound(f"resource {uri!r} not found", uri=uri)
            name = candidates[0]
        bcfg = self.cfg.backends.get(name)
        if bcfg is not None:
            resources = bcfg.resources
            filtered = resources.include or resources.exclude
            # filtered: absent; a dot segment could climb out of what an include glob admits
            if not exposed(bcfg).resources.admits(uri) or (filtered and climbs(uri)):
                raise errors.ResourceNotFound(f"resource {uri!r} not found", uri=uri)
        return name

    async def authorize(self, session: ClientSession, tool: str, arguments: Any) -> None:
        await self.policy.authorize(session, tool, arguments)

    # ---- fan-out ----------------------------------------------------------------------------

    def _child_notified(self, news: ChildNotified) -> None:
        if news.method == "notifications/message":
            self._log_message(news.instance, news.params)
        elif news.method == "notifications/resources/updated":
            self._resource_updated(news.instance, news.params)
        else:  # notifications/elicitation/complete
            self._elicitation_complete(news.instance, news.params)

    def _resource_updated(self, instance: Instance, params: Raw | UnsetType) -> None:
        uri = _str_field(params, "uri")
        if uri is None:
            return
        data = jsonrpc.encode_notification("notifications/resources/updated", params)
        targets: set[ClientSession] = set()
        for sub, holders in instance.backend.subscriptions.items():
            if uri_matches(sub, uri):
                targets |= cast("set[ClientSession]", holders)  # the core's sessions
        for session in targets:
            if not _speaks_to(instance, session):
                continue
            if session.era is Era.MODERN:  # held by its listens: to each, tagged
                self.listens.resource_updated(session, uri, params)
            else:
                session.send(data, UNRELATED)

    def _log_message(self, instance: Instance, params: Raw | UnsetType) -> None:
        """A child's log line: to the sessions :func:`~gateway.protocol.logfanout.log_recipients`
        picks (its callers, else those who may see the backend; an owned child: its owner)."""
        level = _str_field(params, "level")
        rank = mcp.LOG_RANK.get(level) if level is not None else None
        if rank is None:
            return
        backend = instance.backend.name
        listeners = [
            LogListener(s, mcp.LOG_RANK[s.log_level], s.era is Era.MODERN,
                        backend in self.policy.backends_seen(self.catalog, caller_of(s)))
            for s in self.sessions if s.log_level is not None and rank >= mcp.LOG_RANK[s.log_level]
            and _speaks_to(instance, s)]
        if not listeners:
            return
        child = instance.child
        attribution = child.router.attribution() if child is not None else set()
        data = jsonrpc.encode_notification("notifications/message", params)
        for session in log_recipients(rank, listeners, attribution, instance.backend.cfg.sharing,
                                      instance.owner):
            session.send(data, (jsonrpc.Goes.OTHER, None))

    def _elicitation_complete(self, instance: Instance, params: Raw | UnsetType) -> None:
        eid = _str_field(params, "elicitationId")
        owner = (self.ownership.elicitation_owner(instance.backend.name, eid,
                                                  instance.principal_key)
                 if eid is not None else None)
        if owner is not None:
            owner.notify("notifications/elicitation/complete", params)

    def wanted_log_level(self) -> str | None:
        levels = [s.log_level for s in self.sessions if s.log_level is not None]
        return min(levels, key=mcp.LOG_RANK.__getitem__) if levels else None

    def log_levels_changed(self) -> None:
        level = self.wanted_log_level()
        for backend in self.backends.values():
            backend.log_level = level  # a new child starts at it
        if self._nursery is None:
            return
        for backend in self.backends.values():
            if self._levels.get(backend.name) != level and level is not None:
                self._levels[backend.name] = level
                self._nursery.start_soon(backend.set_level, level)

    # ---- sessions ---------------------------------------------------------------------------

    def roots_changed(self, session: ClientSession) -> None:
        """A client's roots changed: tell its own per-session children (elsewhere roots come
        from config, so other backends have nothing to re-read)."""
        for backend in self.backends.values():
            child = backend.own_child(session)
            if child is not None and "roots" in backend.declared:
                try:
                    child.post(jsonrpc.encode_notification("notifications/roots/list_changed"))
                except errors.NotDelivered:
                    pass

    def session_opened(self, session: ClientSession) -> None:
        self.sessions.add(session)

    def session_left(self, session: ClientSession) -> None:
        self.sessions.discard(session)

    def session_closed(self, session: ClientSession) -> None:
        self.ownership.forget_session(session)
        if session.log_level is not None:  # a new child starts at the level still wanted
            level = self.wanted_log_level()
            for backend in self.backends.values():
                backend.log_level = level
        for backend in list(self.backends.values()):
            backend.drop_session(session)

    def _flow_parked(self, name: str) -> None:
        backend = self.backends.get(name)
        if backend is not None:
            backend.flow_parked()

    def _count_parked(self, owner: ClientSession) -> Callable[[], None]:
        """A bridged flow parks: one of its principal's ``max_parked_flows`` (CapReached at it)."""
        principal = owner.principal
        name = None if principal is None else principal.name
        return self.caps.acquire("max_parked_flows", name).release

    def _connection_refused(self, transport: str) -> None:
        LOGGER.warning("refused a %s connection: %d connections open (max_connections)",
                       transport, self.slots.used)
        self.bus.emit(ConnectionRefused(transport, "max_connections"))

    # ---- status -----------------------------------------------------------------------------

    def begin_authorization(self, name: str) -> tuple[int, str]:
        """``mcp-gateway authorize NAME``: the URL an operator opens (200), or why not."""
        backend = self.backends.get(name)
        code_flow = None if backend is None else backend.authorization_code
        if code_flow is None:
            return 404, f"no backend {name!r} with oauth.grant = 'authorization_code'"
        try:
            return 200, code_flow.begin()
        except TokenFailed as exc:
            return 409, exc.detail

    async def redirected(self, query: str, cookie: str | None
                         ) -> tuple[int, str, str, tuple[tuple[str, str], ...]]:
        """``listen.redirect_path``: a per-principal backend's authorize page (``start``) or
        redirect back (its ``state``, bound to the browser's cookie), else the shared flows'
        redirect back (:meth:`complete_authorization`).  A query over :data:`MAX_REDIRECT_QUERY`
        bytes is refused whole (414), never cut: nothing is used up."""
        if len(query) > MAX_REDIRECT_QUERY:
            return 414, f"refused: a query over {MAX_REDIRECT_QUERY} bytes", \
                "text/plain; charset=utf-8", ()
        params = _query_params(query)
        if params is None:
            return 400, "refused: a parameter given twice", "text/plain; charset=utf-8", ()
        start, state = params.get("start"), params.get("state", "")
        for backend in self.backends.values():
            source = backend.credentials
            if not isinstance(source, PrincipalAuthorizationCode):
                continue
            page = None
            if start is not None and source.owns_start(start):
                page = source.start_page(start, params.get("consent"), cookie)
            elif start is None and source.owns_state(state):
                page = await source.complete(params, cookie)
                if page.authorized is not None:  # the callers told -32042 hear it is done
                    eid = url_elicitation_id(page.authorized)
                    for session in list(self.sessions):
                        session.url_completed(eid)
            if page is not None:
                return page.status, page.body, page.content_type, page.headers
        if start is not None:
            return 400, "refused: unknown, used or expired authorization link", \
                "text/plain; charset=utf-8", ()
        status, said = await self._complete_shared(params)
        return status, said, "text/plain; charset=utf-8", ()

    async def complete_authorization(self, query: str) -> tuple[int, str]:
        """The authorization server's redirect back (``listen.redirect_path``): its ``state``
        names the backend; the code is exchanged there.  Anything else is refused."""
        if len(query) > MAX_REDIRECT_QUERY:
            return 400, f"refused: a query longer than {MAX_REDIRECT_QUERY} characters"
        params = _query_params(query)
        if params is None:
            return 400, "refused: a parameter given twice"
        return await self._complete_shared(params)

    async def _complete_shared(self, params: dict[str, str]) -> tuple[int, str]:
        """:meth:`complete_authorization` of a query read already."""
        state = params.get("state", "")
        for name, backend in self.backends.items():
            code_flow = backend.authorization_code
            if code_flow is not None and code_flow.owns(state):
                try:
                    await code_flow.complete(params)
                except TokenFailed as exc:
                    self._redirect_refused(f"backend {name}: authorization refused: "
                                           f"{exc.detail}")
                    return 400, f"refused: {exc.detail}"
                LOGGER.info("backend %s: authorized", name)
                return 200, f"backend {name} is authorized; this page may be closed"
        self._redirect_refused("an authorization redirect with an unknown or used state: refused")
        return 400, "refused: unknown or already used state"

    def _redirect_refused(self, line: str) -> None:
        """A refused redirect (anyone can send one): logged rate-limited."""
        self._redirect_log.warn(
            LOGGER, trio.current_time(),
            "%d more refused authorization redirects in the last %.0fs not logged", "%s", line)

    def status(self) -> GatewayStatus:
        """The daemon right now, built from the snapshots the backends publish."""
        now = trio.current_time()
        backends = tuple(b.snapshot(now) for b in self.backends.values())
        connections: dict[str, int] = {}
        for s in self.sessions:
            connections[s.transport] = connections.get(s.transport, 0) + 1
        return GatewayStatus(
            version=__version__,
            backends=backends,
            connections=connections,
            listeners_bound=self.listeners_bound,
            draining=self.draining,
            stopping=self.lame_duck or self.draining,
            pending_server_requests=self.ownership.open + self.policy.pending_count(),
            buffered_bytes=self.budget.total,
            client_requests_in_flight=sum(len(s.inflight) for s in self.sessions),
            outbound_messages_queued=sum(s.queued for s in self.sessions),
            connection_slots=self.slots.used,
            auth=self.authn.status(self.cfg) if self.authn is not None else {},
            listeners=self.listeners,
        )


def _speaks_to(instance: Instance, session: ClientSession) -> bool:
    """Whether ``instance``'s news may reach ``session``: a per-principal instance's only its
    principal's sessions."""
    return not instance.backend.cfg.per_principal or (
        session.principal is not None and session.principal.key == instance.principal_key)


def _query_params(query: str) -> dict[str, str] | None:
    """A redirect's query parameters, or None when one is given twice."""
    pairs = parse_qsl(query, keep_blank_values=True)
    params = dict(pairs)
    return params if len(params) == len(pairs) else None


__all__ = ["CatalogConflict", "Hub"]
