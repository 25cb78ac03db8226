"""A wake-up for tasks that wait for "something changed", free while nobody waits."""

from __future__ import annotations

import trio


class Wakeup:
    """:meth:`wait` returns at the next :meth:`set` after it began.  ``set()`` on a hot path
    (every call that ends) costs an attribute check unless a task is waiting; an event is made
    only for waiters."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: trio.Event | None = None

    def set(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()
