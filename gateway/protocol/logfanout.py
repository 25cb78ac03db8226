"""Who receives a backend's ``notifications/message`` (pure).

A child's log line is about the calls it is serving, so it goes to the sessions with calls in
flight at that child when it arrives (its attribution set); with none in flight, to every legacy
session that may see the backend.  A session whose view (its principal's catalog) holds nothing
of the backend never gets one, and a modern (2026-07-28) request gets one only while it runs at
the child.  An ``affine`` or ``per-session`` child speaks only to its owner.  Each recipient
asked for the line's level or a more verbose one.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Set
from dataclasses import dataclass
from typing import Generic, TypeVar

#: Sharing modes in which an instance has one owner at a time.
OWNED = frozenset({"affine", "per-session"})

S = TypeVar("S", bound=Hashable)


@dataclass(frozen=True, slots=True)
class LogListener(Generic[S]):
    """A session that set a log level: its rank (:data:`gateway.protocol.mcp.LOG_RANK`),
    whether it speaks 2026-07-28, and whether its view includes something of the backend."""

    session: S
    rank: int
    modern: bool
    sees_backend: bool


def log_recipients(rank: int, listeners: Iterable[LogListener[S]], attribution: Set[Hashable],
                   sharing: str, owner: Hashable | None) -> list[S]:
    """The sessions a log line of ``rank`` from one child goes to.

    ``attribution``: the sessions with calls in flight at the child; ``owner``: the session
    holding an ``affine`` or ``per-session`` instance (None: nobody holds it).
    """
    out: list[S] = []
    for lis in listeners:
        if rank < lis.rank or not lis.sees_backend:
            continue
        if sharing in OWNED and lis.session != owner:
            continue
        if lis.modern or attribution:
            if lis.session not in attribution:
                continue
        out.append(lis.session)
    return out
