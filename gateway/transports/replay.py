"""SSE event ids and the replay log of a legacy Streamable HTTP session (2025-03-26 …
2025-11-25): what a ``GET`` with ``Last-Event-ID`` resumes.

Theory of operation: every event written on one of a session's SSE streams carries an id
``<stream>-<seq>``: ``stream`` names the stream (0 is the session's GET stream, 1, 2, … its POST
streams in the order they opened), ``seq`` counts every id the session handed out, so an id is
unique within the session and tells which stream it belongs to (the spec: "globally unique
across all streams within that session", "SHOULD encode sufficient information to identify
the originating stream").  :class:`ReplayLog` keeps the events of all of a session's streams,
oldest first, at most ``max_bytes`` of messages; recording one pushes the oldest out, and the
highest ``seq`` pushed out is remembered (:attr:`ReplayLog.floor`): a resumption from an id
below it may have missed events, which the caller logs.  Pure: no I/O, no clock, no trio.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

#: Longest ``Last-Event-ID`` value looked at (two decimal numbers and a dash).
MAX_ID_LENGTH = 41


class Entry(NamedTuple):
    stream: int
    seq: int
    message: bytes
    final: bool  # the response that ends its stream


def format_id(stream: int, seq: int) -> bytes:
    return b"%d-%d" % (stream, seq)


def parse_id(value: str) -> tuple[int, int] | None:
    """``(stream, seq)`` of an event id this module made, else None."""
    if len(value) > MAX_ID_LENGTH:
        return None
    stream, dash, seq = value.strip().partition("-")
    # ASCII digits only ("²".isdigit() is true too)
    if not (dash and stream.isascii() and stream.isdigit() and seq.isascii() and seq.isdigit()):
        return None
    return int(stream), int(seq)


class ReplayLog:
    """The events sent on a session's SSE streams, bounded in bytes (see the module text)."""

    __slots__ = ("bytes", "entries", "floor", "max_bytes", "seq")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: deque[Entry] = deque()
        self.bytes = 0
        self.seq = 0  # the last id handed out
        self.floor = 0  # the highest seq pushed out of the log

    def next_seq(self) -> int:
        """A new id's ``seq`` (an event not kept: a priming event)."""
        self.seq += 1
        return self.seq

    def record(self, stream: int, message: bytes, final: bool) -> tuple[int, int]:
        """Keep ``message`` as the next event of ``stream``.

        Returns:
            ``(seq, delta)``: its id's ``seq`` and the change in bytes held (negative when older
            events were pushed out; a message larger than the whole log is not kept).
        """
        seq = self.next_seq()
        n = len(message)
        if n > self.max_bytes:
            self.floor = seq
            return seq, 0
        delta = n
        while self.entries and self.bytes + n > self.max_bytes:
            old = self.entries.popleft()
            self.bytes -= len(old.message)
            delta -= len(old.message)
            self.floor = old.seq
        self.entries.append(Entry(stream, seq, message, final))
        self.bytes += n
        return seq, delta

    def after(self, stream: int, seq: int) -> list[Entry]:
        """The kept events of ``stream`` sent after id ``seq``, oldest first."""
        return [e for e in self.entries if e.stream == stream and e.seq > seq]

    def clear(self) -> int:
        """Forget everything; the bytes that were held."""
        n, self.bytes = self.bytes, 0
        self.entries.clear()
        return n
