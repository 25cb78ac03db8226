"""A configured backend: its instances, its lists, its resource subscriptions.

Sharing modes decide which instance serves a call:

* ``shared`` — every connection's calls are multiplexed onto the instance(s); server→client
  requests are routed only when the attribution set proves the owner.
* ``affine`` — an instance serves one connection at a time while that connection has calls in
  its attribution set (see :mod:`gateway.backend.affinity`).
* ``per-session`` — each connection gets its own child, started on first use.

The backend's catalog lists come from instance 0 (the *probe* in per-session mode) and survive
restarts: a backend that is restarting keeps its tools listed, its calls wait up to
``restart_wait`` and then fail with a retryable ``backend_unavailable``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import trio
from msgspec import Raw, UnsetType

from gateway import errors
from gateway.backend.child import ChildConnection
from gateway.backend.instance import Instance
from gateway.config import BackendConfig
from gateway.events import EventBus
from gateway.protocol.catalog import BackendLists
from gateway.protocol.supervision import State

if TYPE_CHECKING:
    from gateway.session import ClientSession

LOGGER = logging.getLogger(__name__)


class BackendHost(Protocol):
    """What a backend needs from the hub."""

    bus: EventBus
    server_name: str
    max_message_bytes: int
    restart_wait: float

    def wanted_log_level(self, backend: str) -> str | None: ...
    def on_lists_changed(self, backend: Backend) -> None: ...
    def on_resource_updated(self, instance: Instance, params: Raw | UnsetType) -> None: ...
    def on_log_message(self, instance: Instance, params: Raw | UnsetType) -> None: ...
    def on_elicitation_complete(self, instance: Instance, params: Raw | UnsetType) -> None: ...
    async def on_server_request(self, instance: Instance, child: ChildConnection, id: int | str,
                                method: str, params: Raw | UnsetType) -> None: ...
    def on_server_request_cancelled(self, instance: Instance, child: ChildConnection,
                                    request_id: int | str) -> None: ...
    def on_instance_down(self, instance: Instance, child: ChildConnection) -> None: ...
    def reap(self) -> None: ...


class Backend:
    def __init__(self, name: str, cfg: BackendConfig, prefix: str, host: BackendHost) -> None:
        self.name = name
        self.cfg = cfg
        self.prefix = prefix
        self.host = host
        self.declared = frozenset(cfg.declare)
        self.lists = BackendLists()
        self.lists_ready = trio.Event()
        self.instances: list[Instance] = []
        self.subscriptions: dict[str, set[ClientSession]] = {}
        self._nursery: trio.Nursery | None = None
        self._stopping = False

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the instances and supervise them until :meth:`stop`."""
        count = 1 if self.cfg.sharing == "per-session" else self.cfg.instances
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for index in range(count):
                inst = Instance(self, index)
                self.instances.append(inst)
                await nursery.start(inst.run)
            task_status.started()
        self._nursery = None

    def stop(self) -> None:
        self._stopping = True
        for inst in self.instances:
            inst.request_stop()

    async def stopped(self) -> None:
        for inst in list(self.instances):
            await inst.stopped.wait()

    def reset(self) -> None:
        for inst in self.instances:
            if inst.state is State.FATAL:
                inst.reset()

    # ---- choosing an instance ---------------------------------------------------------------

    async def acquire(self, session: ClientSession) -> tuple[Instance, ChildConnection]:
        """An instance and its running child for a call of ``session``.

        Raises:
            BackendUnavailable: not running within ``restart_wait`` (FATAL: at once).
        """
        if self._stopping:
            raise errors.BackendUnavailable(
                f"backend {self.name!r} is being removed", backend=self.name, retryable=False
            )
        best: tuple[int, Instance, ChildConnection] | None = None
        for inst in self.instances:
            child = inst.child
            if inst.state in (State.RUNNING, State.UNHEALTHY) and child is not None and child.closed is None:
                load = len(child.pending)
                if best is None or load < best[0]:
                    best = (load, inst, child)
        if best is not None:
            return best[1], best[2]
        inst = self.instances[0]
        return inst, await inst.wait_ready(self.host.restart_wait)

    # ---- hooks from instances ---------------------------------------------------------------

    def on_instance_state(self, inst: Instance) -> None:
        pass

    def on_instance_ready(self, inst: Instance) -> None:
        if inst is self.instances[0] or not self.lists_ready.is_set():
            self._take_lists(inst)

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
        self.host.on_lists_changed(self)

    def on_instance_down(self, inst: Instance, child: ChildConnection) -> None:
        self.host.on_instance_down(inst, child)

    # ---- resource subscriptions (one upstream subscription per URI per instance) -----------------

    def subscribed_uris(self) -> list[str]:
        return sorted(self.subscriptions)

    async def subscribe(self, session: ClientSession, uri: str) -> None:
        holders = self.subscriptions.setdefault(uri, set())
        first = not holders
        holders.add(session)
        if first:
            await self._upstream(uri, "resources/subscribe")

    async def unsubscribe(self, session: ClientSession, uri: str) -> None:
        holders = self.subscriptions.get(uri)
        if holders is None or session not in holders:
            return
        holders.discard(session)
        if not holders:
            del self.subscriptions[uri]
            await self._upstream(uri, "resources/unsubscribe")

    async def drop_session(self, session: ClientSession) -> None:
        for uri in [u for u, s in self.subscriptions.items() if session in s]:
            await self.unsubscribe(session, uri)

    async def _upstream(self, uri: str, method: str) -> None:
        for inst in self.instances:
            child = inst.child
            if child is not None and child.closed is None:
                with trio.move_on_after(self.cfg.request_timeout):
                    try:
                        await inst.subscribe(child, uri, method)
                    except errors.GatewayError as exc:
                        LOGGER.warning("backend %s: %s %s failed: %s", inst.name, method, uri, exc)
