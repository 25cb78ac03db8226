"""A child's stderr as log lines: split into bounded lines, rate-limited, summarised.  Sans-IO.

A backend flooding stderr must not cost the daemon a core or drown its log: the backend reader
(``gateway.backend.instance``) feeds pipe chunks to a :class:`LineSplitter` and asks a
:class:`LineThrottle` how many of the lines to log; the rest are counted and summarised.
"""

from __future__ import annotations

TRUNCATED = b" [truncated]"
#: C0 controls but tab, and DEL, shown as U+FFFD: a backend must not write terminal escape
#: sequences or NULs into the daemon's log.
_CONTROLS = {c: "\ufffd" for c in (*range(0x09), *range(0x0A, 0x20), 0x7F)}


def printable(line: bytes) -> str:
    """A stderr line as log text: UTF-8 (invalid bytes replaced), control characters replaced,
    trailing whitespace dropped."""
    return line.decode("utf-8", "replace").rstrip().translate(_CONTROLS)


class LineSplitter:
    """Splits a byte stream into lines (without their newline), none longer than ``max_line``.

    A longer line is cut at ``max_line`` bytes and marked with :data:`TRUNCATED`; the rest of it,
    up to its newline, is dropped, so the partial line held between chunks never exceeds
    ``max_line`` either.  Pure: feed it what a pipe gave.
    """

    def __init__(self, max_line: int) -> None:
        self._max = max_line
        self._pending = b""
        self._skipping = False  # inside a line already cut and returned

    def feed(self, data: bytes) -> list[bytes]:
        """The lines ``data`` completes (empty ones included)."""
        head, *rest = data.split(b"\n")
        lines: list[bytes] = []
        if rest:
            if not self._skipping:
                lines.append(self._cut(self._pending + head))
            self._pending, self._skipping = b"", False
            limit = self._max
            lines.extend(p if len(p) <= limit else p[:limit] + TRUNCATED for p in rest[:-1])
            partial = rest[-1]
        elif self._skipping:
            return lines
        else:
            partial = self._pending + head
        if len(partial) > self._max:
            lines.append(self._cut(partial))
            self._pending, self._skipping = b"", True
        else:
            self._pending = partial
        return lines

    def feed_counted(self, data: bytes, keep: int) -> tuple[int, list[bytes]]:
        """Like :meth:`feed`, but only ``(lines completed, the last keep of them)``: a flood of
        short lines costs one count and one bounded split per chunk, not an object per line."""
        completed = data.count(b"\n")
        if completed <= keep + 1:
            lines = self.feed(data)
            return len(lines), lines[-keep:]
        if self._skipping:
            completed -= 1  # the first newline ends a line already returned (cut)
        pieces = data.rsplit(b"\n", keep + 1)
        self._pending, self._skipping = b"", False
        partial = pieces[-1]
        if len(partial) > self._max:
            self._skipping = True
            tail = [self._cut(p) for p in pieces[2:-1]] + [self._cut(partial)]
            completed += 1
        else:
            self._pending = partial
            tail = [self._cut(p) for p in pieces[1:-1]]
        return completed, tail

    def close(self) -> list[bytes]:
        """The last line if the stream ended without a newline."""
        last, self._pending = self._pending, b""
        return [last] if last and not self._skipping else []

    def _cut(self, line: bytes) -> bytes:
        return line if len(line) <= self._max else line[: self._max] + TRUNCATED


class LineThrottle:
    """A token bucket for the log lines of one source, counting what it holds back.

    The bucket refills at ``rate`` lines per second up to ``burst``; lines that find it empty
    are not logged but counted (:attr:`suppressed`).  The first line held back opens a window of
    ``window`` seconds; once it has passed, :meth:`summary` hands out the count (for one summary
    log line) and starts afresh.  ``rate <= 0`` switches the limit off.  Pure: the caller passes
    the time in and does the logging.
    """

    def __init__(self, rate: float, burst: int, window: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.window = window
        self.suppressed = 0
        self._tokens = float(burst)
        self._stamp = now
        self._since: float | None = None

    def admit(self, now: float, lines: int) -> int:
        """How many of ``lines`` new lines may be logged (the first ones); the rest are counted."""
        if self.rate <= 0:
            return lines
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        admitted = min(lines, int(self._tokens))
        self._tokens -= admitted
        if admitted < lines:
            if self._since is None:
                self._since = now
            self.suppressed += lines - admitted
        return admitted

    def due(self) -> float | None:
        """When the pending summary is due (None: nothing held back)."""
        return None if self._since is None else self._since + self.window

    def summary(self, now: float, *, final: bool = False) -> tuple[int, float] | None:
        """``(lines held back, seconds they span)`` once the window has passed (or at once when
        ``final``, e.g. at end of stream), then a fresh window; None when nothing is due."""
        if self._since is None or (not final and now < self._since + self.window):
            return None
        out = (self.suppressed, now - self._since)
        self.suppressed, self._since = 0, None
        return out
