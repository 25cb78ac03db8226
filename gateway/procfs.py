"""What the gateway reads from Linux procfs, in one place: process state, parent and group,
this process's children, resident memory.

Plain functions over files (no trio, nothing cached).  Each takes the procfs mount as ``proc``
(tests may point it elsewhere) and skips a process that exits while it is being read.  Off
Linux, or under ``ProcSubset=pid``, the scans find nothing and :func:`group_rss` says None.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from typing import NamedTuple

PROC = "/proc"
PAGE_SIZE = mmap.PAGESIZE


class Stat(NamedTuple):
    """The fields of ``/proc/<pid>/stat`` the gateway uses."""

    pid: int
    state: str  # one letter: R, S, D, T, Z (zombie), …
    ppid: int
    pgrp: int


def stat(pid: int, proc: str = PROC) -> Stat | None:
    """``pid``'s stat, or None when there is no such process (any more)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return Stat(pid, rest[0].decode(errors="replace"), int(rest[1]), int(rest[2]))
    except (IndexError, ValueError):
        return None


def pids(proc: str = PROC) -> list[int]:
    """Every pid in ``proc``.

    Raises:
        OSError: ``proc`` cannot be listed.
    """
    with os.scandir(proc) as it:
        return [int(e.name) for e in it if e.name.isdigit()]


def stats(proc: str = PROC) -> Iterator[Stat]:
    """The stat of every process (a full scan: not for hot paths; empty if ``proc`` is
    unreadable)."""
    try:
        everyone = pids(proc)
    except OSError:
        return
    for pid in everyone:
        st = stat(pid, proc)
        if st is not None:
            yield st


def group_members(pgid: int, proc: str = PROC) -> list[int]:
    """Live processes (not zombies) whose process group is ``pgid``."""
    return [st.pid for st in stats(proc) if st.pgrp == pgid and st.state != "Z"]


def children(proc: str = PROC) -> set[int]:
    """Pids of this process's children, from ``self/task/*/children`` (no scan of every process)."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"{proc}/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"{proc}/self/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def _rss(pid: int, proc: str) -> int:
    with open(f"{proc}/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


def group_rss(pgids: Iterable[int], proc: str = PROC) -> dict[int, int] | None:
    """Resident bytes summed over every process whose process group id is in ``pgids``.

    A backend child is spawned as a process-group leader, so its group also holds whatever it
    forked (an ``npx`` wrapper's node server, a shell's children).  A pgid with no member in its
    group (a child that is not a group leader) falls back to that single process's RSS.

    Returns None when ``proc`` cannot be read (not Linux, ``ProcSubset=pid``).
    """
    totals = dict.fromkeys(pgids, 0)
    try:
        everyone = pids(proc)
    except OSError:
        return None
    found: set[int] = set()
    for pid in everyone:
        st = stat(pid, proc)
        if st is None or st.pgrp not in totals:
            continue
        found.add(st.pgrp)
        try:
            totals[st.pgrp] += _rss(pid, proc)
        except (OSError, ValueError, IndexError):  # the process exited while we looked
            continue
    for pgid in totals.keys() - found:
        try:
            totals[pgid] = _rss(pgid, proc)
        except (OSError, ValueError, IndexError):
            pass
    return totals
