"""Fair admission of client calls to one child.  Sans-IO.

Theory of operation: a child serves calls from many connections.  Without a bound, one client
that keeps a hundred calls in flight puts a hundred calls ahead of everyone else's in the
child's own queue.  :class:`FairQueue` bounds the calls in flight to the child; beyond the
bound, calls wait in one FIFO per owner, and a freed slot goes to the owners in turn
(round-robin), so a light client waits for at most one call of each other waiting client, not
for all of a heavy client's calls.

The queue holds opaque items (the shell's wake-up handles); it never blocks and knows no clock.
Every :meth:`try_admit` that returned True, and every item :meth:`release` handed out, is one
slot in flight until the shell calls :meth:`release` for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

O = TypeVar("O", bound=Hashable)  # noqa: E741 - the owner of a call (a connection)
T = TypeVar("T")  # what the shell wakes when a queued call is admitted


class FairQueue(Generic[O, T]):
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.inflight = 0
        self._queues: dict[O, deque[T]] = {}  # insertion order is the round-robin order
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Calls queued for a slot."""
        return self._waiting

    def try_admit(self) -> bool:
        """Take a slot now if one is free and nobody is queued for it."""
        if self.inflight < self.limit and not self._waiting:
            self.inflight += 1
            return True
        return False

    def enqueue(self, owner: O, item: T) -> None:
        """Queue ``item`` (of ``owner``) for the next slot its turn gets."""
        self._queues.setdefault(owner, deque()).append(item)
        self._waiting += 1

    def withdraw(self, owner: O, item: T) -> bool:
        """Take a queued item out (its caller gave up).  False: it was not queued (already
        admitted, so the caller holds a slot it must release)."""
        queue = self._queues.get(owner)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        self._waiting -= 1
        if not queue:
            del self._queues[owner]
        return True

    def release(self) -> T | None:
        """A call in flight ended: its slot goes to the next owner in turn, whose item is
        returned (the shell wakes it; it now holds the slot), or is freed (None)."""
        if not self._waiting:
            self.inflight = max(0, self.inflight - 1)
            return None
        owner = next(iter(self._queues))
        queue = self._queues.pop(owner)
        item = queue.popleft()
        self._waiting -= 1
        if queue:
            self._queues[owner] = queue  # to the back of the round
        return item

    def drain(self) -> list[T]:
        """Admit every queued item at once (the child is gone: each will find out and release)."""
        items = [item for queue in self._queues.values() for item in queue]
        self._queues.clear()
        self._waiting = 0
        self.inflight += len(items)
        return items
