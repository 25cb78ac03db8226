"""The write side of a client connection: what a :class:`~gateway.core.session.ClientSession` writes
through, and the bounded queue of what its transport could not take at once.

Theory of operation: a message for a client is written straight to its transport
(:meth:`MessageWriter.write_nowait`, synchronous) when nothing is queued toward that client: no
task, no channel, no task switch.  Only when something is already queued, or the transport did
not take it all, does it wait: in the session's :class:`Outbox` (messages not yet handed to the
transport) or held by the transport itself (the rest of messages it was handed).  The
connection's flusher task (``gateway.core.connection._writer``) is woken only then; it waits for the
transport with :meth:`MessageWriter.flush` and hands it the queued messages in batches, until
nothing is queued and the next message goes straight out again.  Order is kept because a message
is written directly only when nothing at all is queued or held before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from gateway.protocol.jsonrpc import Goes, Route
from gateway.wakeup import Wakeup

__all__ = ["Goes", "MessageWriter", "Outbox", "Route"]


class MessageWriter(Protocol):
    """The write side of a message transport."""

    def write_nowait(self, messages: list[bytes], route: Route | None = None) -> bool:
        """Frame ``messages`` and write them, in order after anything held, as far as the
        transport takes them now; hold the rest.  Never blocks.  ``route``: the routing hint
        of the one message, when the core knows it (a transport of one stream ignores it).

        Returns:
            True when nothing is held afterwards (all written).

        Raises:
            TransportClosed: the peer is gone or the transport is closing.
        """
        ...

    def write_one(self, data: bytes, route: Route | None) -> bool:
        """One message, as ``write_nowait([data], route)`` (the usual answer: no list)."""
        ...

    async def flush(self) -> None:
        """Write what is held, waiting for the peer as needed.  Cancelling it loses nothing.

        Raises:
            TransportClosed: the peer is gone or the transport is closing.
        """
        ...


class Outbox:
    """Messages queued toward one client and not handed to its transport yet (at most
    ``capacity``).  :meth:`receive_nowait` and :meth:`receive` take one, like a trio memory
    channel's ends."""

    __slots__ = ("_items", "_wakeup", "capacity", "on_wake")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[bytes] = deque()
        self._wakeup = Wakeup()
        # Called once, at the first put or wake: a connection without a flusher task of its own
        # (connection.open_direct) starts one then.
        self.on_wake: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, data: bytes) -> bool:
        """Queue ``data``; False (and nothing queued) when ``capacity`` messages are queued."""
        if len(self._items) >= self.capacity:
            return False
        self._items.append(data)
        self.wake()
        return True

    def wake(self) -> None:
        """Wake the task in :meth:`wait` (something else needs flushing)."""
        self._wakeup.set()
        if self.on_wake is not None:
            start, self.on_wake = self.on_wake, None
            start()

    async def wait(self) -> None:
        """Until the next :meth:`put` or :meth:`wake`."""
        await self._wakeup.wait()

    def take(self, max_count: int, max_bytes: int) -> tuple[list[bytes], int]:
        """The oldest messages, at least one if any: up to ``max_count``, stopping once they
        reach ``max_bytes``; and their total size."""
        items = self._items
        batch: list[bytes] = []
        size = 0
        while items and len(batch) < max_count and size < max_bytes:
            data = items.popleft()
            batch.append(data)
            size += len(data)
        return batch, size

    def receive_nowait(self) -> bytes:
        try:
            return self._items.popleft()
        except IndexError:
            raise trio.WouldBlock from None

    async def receive(self) -> bytes:
        while not self._items:
            await self._wakeup.wait()
        return self._items.popleft()

    def clear(self) -> None:
        self._items.clear()
