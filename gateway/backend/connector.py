"""The connector seam: how an instance reaches its upstream, apart from what it says to it.

A :class:`Connector` (one per backend: ``stdio`` spawns a child, ``http`` reaches a remote
server, ``memory`` runs a scripted fake in-process) opens a :class:`Link` per generation.  A link
carries whole messages both ways (framing and I/O are its business) and ends in its own way
(:meth:`Link.close`); the upstream session (:class:`gateway.backend.child.ChildConnection`, the
:class:`Receiver`) holds the router, the era and the envelope, and supervision
(:mod:`gateway.backend.instance`) is the same for every kind.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway import errors
from gateway.events import EventBus
from gateway.limits import Account
from gateway.protocol.framing import Oversize, OversizeEnd


class OpenFailed(Exception):
    """A link could not be opened (``starved``: for lack of the gateway's own resources, such
    as file descriptors; retried without counting toward FATAL; ``transient``: what it needs
    first, not the upstream itself, cannot be reached now (a remote's authorization server):
    retried the same way; ``authorize``: an operator must authorize the gateway first, awaited
    by the instance in AUTHORIZING)."""

    def __init__(self, message: str, *, starved: bool = False, transient: bool = False,
                 authorize: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(message)
        self.starved = starved
        self.transient = transient
        self.authorize = authorize


@dataclass(slots=True)
class LinkContext:
    """What an instance gives each link it opens."""

    backend: str
    instance: str
    bus: EventBus
    max_line: int  # max_message_bytes: a longer incoming message is dropped
    buffers: Account  # the write queue's bytes, on the daemon-wide budget
    max_queued: int = sys.maxsize  # outbound_bytes: the write queue's bound
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))  # diagnostics (stderr)


@dataclass(frozen=True, slots=True)
class LinkEnd:
    """How a link ended, for ``last_exit`` and the ``BackendExited`` event."""

    detail: str  # "exit code 1", "signal 9", "connection reset", ...
    crashed: bool  # ended abnormally (a non-zero exit, a lost connection)
    returncode: int | None = None  # a process's exit code (negative: the signal)
    ended_by: str | None = None  # what the stop had to do ("sigterm", "sigkill"), if anything
    expired: bool = False  # the remote ended the session (HTTP 404): a new one is opened at once
    unauthorized: bool = False  # the remote wants an authorization first: the next open waits


class Receiver(Protocol):
    """The upstream session a link delivers to (never blocks).

    ``cause``: the gateway id of the request whose own answer stream carried the message (an
    HTTP POST's), when the transport says so; a server→client request with a cause belongs to
    that call's owner.  ``failed``: that request's answer cannot come any more.
    """

    def message(self, data: bytes, cause: int | None = None) -> None: ...  # one whole message
    def oversize(self, frame: Oversize) -> None: ...  # one over max_line: dropped
    def oversize_end(self, frame: OversizeEnd) -> None: ...  # where that one ended
    def undelivered(self, gids: list[int], error: errors.GatewayError) -> None: ...
    def failed(self, gid: int, error: errors.GatewayError) -> None: ...
    def ended(self) -> None: ...  # the upstream's side ended: nothing more arrives


class Link(Protocol):
    """One generation's connection to the upstream.

    ``send`` never waits: it writes at once when it can (the stdio pipe's fast path) or queues
    within ``max_queued`` bytes (``buffers``), and raises ``NotDelivered`` once the link is known
    closed (``closed``).  :meth:`run` carries messages until cancelled and tells the receiver
    when the upstream's side ends; :meth:`close` ends the link (shielded, every wait bounded,
    idempotent) and says how it ended.
    """

    kind: str  # "stdio", "http", "memory"
    closed: errors.GatewayError | None  # why nothing can be sent any more
    buffers: Account
    max_queued: int
    last_error: str | None  # the last transport failure seen, for /status

    @property
    def pid(self) -> int | None: ...  # the process serving it while not reaped (stdio only)
    @property
    def origin(self) -> str | None: ...  # where it goes, credentials never included

    def send(self, data: bytes, gid: int | None = None) -> None: ...
    def fits(self, size: int) -> bool: ...  # whether a new request of size bytes may be sent
    def fail(self, error: errors.GatewayError) -> None: ...  # closed now: the queue dropped
    async def run(self, receiver: Receiver) -> None: ...
    async def close(self) -> LinkEnd: ...


class Connector(Protocol):
    """Opens a backend's links, one per generation (a process, a session, a fake)."""

    @property
    def kind(self) -> str: ...
    @property
    def origin(self) -> str | None: ...  # where its links go (no credentials), if not a process

    def refresh(self) -> None: ...  # a reload: read what it reads at open again (credentials)

    async def open(self, ctx: LinkContext) -> Link:
        """A new link, ready to carry the handshake.

        Raises:
            OpenFailed: nothing was opened (a spawn or connect failed).
        """
        ...
