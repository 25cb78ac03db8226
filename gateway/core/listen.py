"""``subscriptions/listen`` on a modern (2026-07-28) connection: the open listens and what they
are sent (the wire shapes are in :mod:`gateway.protocol.subscriptions`).

A listen is a request that stays in flight in a task of its connection: :func:`listen`
subscribes the URIs it can route (through the backend's reference-counted subscriptions),
registers a :class:`Listen`, acknowledges the honoured subset and waits.  The hub hands
:class:`Listens` each catalog change and each resource update, and each goes, tagged with the
listen's id, to the listens that asked for it and may see it.  A listen ends when its HTTP
stream closes (no answer), when it is cancelled on a byte stream (:meth:`Listens.end`), or when
the gateway drains (:meth:`Listens.end_all`); its URIs are released then.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import trio
from msgspec import Raw, UnsetType

from gateway import errors
from gateway.core.policy import caller_of
from gateway.core.ports import BackendDirectory, CatalogView, Lifecycle
from gateway.protocol import subscriptions
from gateway.protocol.era import Era
from gateway.protocol.subscriptions import Filter, RequestId

if TYPE_CHECKING:
    from gateway.backend.pool import Backend
    from gateway.core.request import Request
    from gateway.core.session import ClientSession
    from gateway.limits import PrincipalCaps

LOGGER = logging.getLogger(__name__)
UPDATED = "notifications/resources/updated"


class ListenPorts(CatalogView, BackendDirectory, Lifecycle, Protocol):
    """What a listen needs: the caller's catalog view, the backends of the resources it names,
    whether the daemon drains, the open listens and the principals' caps."""

    @property
    def listens(self) -> Listens: ...
    @property
    def caps(self) -> PrincipalCaps: ...


class Listen:
    """One open ``subscriptions/listen`` request."""

    __slots__ = ("ended", "filter", "id", "session")

    def __init__(self, session: ClientSession, id: RequestId, filter: Filter) -> None:
        self.session = session
        self.id = id
        self.filter = filter
        self.ended = trio.Event()  # set: answer with the closing result


class Listens:
    """The open listens of every connection."""

    def __init__(self) -> None:
        self._open: dict[ClientSession, dict[RequestId, Listen]] = {}

    def __len__(self) -> int:
        return sum(len(listens) for listens in self._open.values())

    def add(self, listen: Listen) -> None:
        self._open.setdefault(listen.session, {})[listen.id] = listen

    def remove(self, listen: Listen) -> None:
        listens = self._open.get(listen.session)
        if listens is not None and listens.get(listen.id) is listen:
            del listens[listen.id]
            if not listens:
                del self._open[listen.session]

    def wants_uri(self, session: ClientSession, uri: str) -> bool:
        """Whether another open listen of ``session`` still subscribes to ``uri`` itself."""
        return any(uri in listen.filter.uris for listen in self._open.get(session, {}).values())

    def list_changed(self, kind: str, sessions: set[ClientSession]) -> None:
        """The list ``kind`` (tools, prompts or resources) changed as ``sessions`` see it."""
        method = f"notifications/{kind}/list_changed"
        for session, listens in list(self._open.items()):
            if session not in sessions:
                continue
            for listen in list(listens.values()):
                if kind in listen.filter.kinds:
                    session.send(subscriptions.tagged(method, Raw(b"{}"), listen.id))

    def resource_updated(self, session: ClientSession, uri: str, params: Raw | UnsetType) -> None:
        """A backend reported ``uri`` updated and ``session`` holds a subscription it concerns."""
        for listen in list(self._open.get(session, {}).values()):
            if listen.filter.wants_uri(uri):
                session.send(subscriptions.tagged(UPDATED, params, listen.id))

    def end(self, session: ClientSession, request_id: RequestId) -> bool:
        """The client cancelled ``request_id``: if it is a listen, it ends with its result."""
        listen = self._open.get(session, {}).get(request_id)
        if listen is None:
            return False
        listen.ended.set()
        return True

    def end_all(self) -> None:
        """The gateway drains: every listen ends with its result."""
        for listens in self._open.values():
            for listen in listens.values():
                listen.ended.set()


async def listen(ports: ListenPorts, session: ClientSession, req: Request) -> Raw:
    """Serve one ``subscriptions/listen`` until it ends.  A listen counts as a request in flight
    on its connection (``max_inflight_per_connection``), and a principal has at most
    ``max_listens`` open (-32006 beyond)."""
    if session.era is not Era.MODERN:
        raise errors.MethodNotFound("subscriptions/listen exists in protocol version 2026-07-28 "
                                    "only; this connection speaks a legacy revision")
    wanted = subscriptions.parse_filter(req.params)
    principal = session.principal
    counted = ports.caps.acquire("max_listens", None if principal is None else principal.name)
    held: list[tuple[Backend, str]] = []
    this = Listen(session, req.id, Filter(wanted.kinds))
    try:
        for uri in wanted.uris:
            try:
                if ports.policy.active:
                    ports.policy.check(uri, caller_of(session), "resource")
                backend = await ports.backend(ports.backend_name_for_uri(uri))
            except errors.GatewayError as exc:  # not honoured: left out of the acknowledgement
                LOGGER.debug("connection %s: listen %r: %s", session.conn_id, req.id, exc,
                             extra=session.log_fields)
                continue
            held.append((backend, uri))
            await backend.subscribe(session, uri)
        this.filter = Filter(wanted.kinds, tuple(uri for _, uri in held))
        ports.listens.add(this)
        session.send(subscriptions.acknowledged(this.filter, req.id))
        if ports.draining:  # began while it subscribed: end_all has run already
            this.ended.set()
        await this.ended.wait()
        return subscriptions.closing_result(req.id)
    finally:
        counted.release()
        ports.listens.remove(this)
        for backend, uri in held:
            if not ports.listens.wants_uri(session, uri):
                backend.drop_subscription(session, uri)
