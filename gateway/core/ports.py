"""What the core reads of the objects around it: narrow, read-only interfaces.

The dispatcher (``gateway.core``) never imports the hub.  Each module names what it needs as a
``typing.Protocol`` built from the three below (plus the core's own services), and the hub, the
composition object, implements them all:

* :class:`CatalogView` — the merged catalog and the policy that filters it per caller;
* :class:`BackendDirectory` — the running backends (pick one now, or wait for it) and what the
  backends must hear of the sessions (log levels, roots, a session gone);
* :class:`Lifecycle` — draining, the drain grace over, and the wake-up of whoever waits for the
  connections to empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.backend.pool import Backend
    from gateway.config import GatewayConfig
    from gateway.core.policy import Policy
    from gateway.core.session import ClientSession
    from gateway.protocol.catalog import Catalog


class CatalogView(Protocol):
    """The merged catalog, the config it was built under and the policy applied per caller."""

    @property
    def cfg(self) -> GatewayConfig: ...
    @property
    def server_name(self) -> str: ...
    @property
    def catalog(self) -> Catalog: ...
    @property
    def policy(self) -> Policy: ...

    def backend_name_for_uri(self, uri: str) -> str:
        """The backend serving ``uri`` (raises ResourceNotFound)."""
        ...

    def advertised_capabilities(self) -> dict[str, Any]: ...


class BackendDirectory(Protocol):
    """The running backends, by name."""

    async def backend(self, name: str) -> Backend:
        """The backend ``name``, waiting for a reload's restart of it (raises
        BackendUnavailable)."""
        ...

    def backend_now(self, name: str) -> Backend | None:
        """The backend ``name`` when it can take a call without waiting, else None."""
        ...

    def log_levels_changed(self) -> None:
        """A session's log level changed: the backends log at the lowest one wanted."""
        ...

    def roots_changed(self, session: ClientSession) -> None: ...
    def session_closed(self, session: ClientSession) -> None: ...


class Lifecycle(Protocol):
    """Where the daemon is in its life, as the core needs it."""

    @property
    def draining(self) -> bool:
        """New requests are refused (-32005 ``shutdown``, retryable)."""
        ...

    @property
    def calls_cut_off(self) -> bool:
        """The drain grace is over: cancelled calls are answered -32005 ``shutdown``."""
        ...

    def connections_changed(self) -> None:
        """A connection closed or, once draining, its last call in flight ended."""
        ...
