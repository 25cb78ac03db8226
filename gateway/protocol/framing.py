"""Newline-delimited JSON framing (the stdio transport, and the gateway's unix socket).

``LineFramer.feed(data)`` returns the complete frames in ``data`` (without the newline; blank
lines and a trailing ``\\r`` are dropped).  A frame that grows past ``max_frame`` bytes is not
buffered: the framer yields one :class:`Oversize` marker for it and discards its bytes up to the
next newline, so a peer that sends one huge line cannot make the gateway buffer it.  With
``report_end=True`` the framer also yields an :class:`OversizeEnd` when that line's newline
arrives, carrying its last bytes (a reply that writes its ``id`` last can still be matched).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes of an oversize frame kept for diagnosis (e.g. to find the id of a reply).
HEAD = 256


@dataclass(frozen=True, slots=True)
class Oversize:
    size: int  # bytes seen when the frame crossed the limit (at least limit + 1)
    head: bytes = b""  # its first HEAD bytes


@dataclass(frozen=True, slots=True)
class OversizeEnd:
    size: int  # bytes of the whole frame (without its newline)
    tail: bytes  # its last HEAD bytes


class LineFramer:
    def __init__(self, max_frame: int, *, report_end: bool = False) -> None:
        self._max = max_frame
        self._buf = bytearray()
        self._discarding = False
        self._report_end = report_end
        self._skipped = 0  # bytes of the oversize frame being discarded
        self._tail = b""  # its last HEAD bytes so far

    @property
    def partial(self) -> bool:
        """Bytes of a frame whose newline has not arrived yet are held."""
        return bool(self._buf)

    def feed(self, data: bytes) -> list[bytes | Oversize | OversizeEnd]:
        last = len(data) - 1
        if (0 < last <= self._max and data[0] > 32 and data[last - 1] != 13 and not self._buf
                and not self._discarding and data.find(b"\n") == last):
            # One whole line, nothing held (the usual read): it starts with a byte that is not
            # blank and does not end in "\r", so it is its own frame.
            return [data[:last]]
        out: list[bytes | Oversize | OversizeEnd] = []
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            chunk = data[start:nl]
            start = nl + 1
            if self._discarding:
                self._discarding = False
                if self._report_end:
                    out.append(OversizeEnd(self._skipped + len(chunk),
                                           (self._tail + chunk)[-HEAD:]))
                continue
            if self._buf:
                self._buf += chunk
                frame = bytes(self._buf)
                self._buf.clear()
            else:
                frame = chunk
            if frame.endswith(b"\r"):
                frame = frame[:-1]
            if len(frame) > self._max:
                out.append(Oversize(len(frame), frame[:HEAD]))
                if self._report_end:
                    out.append(OversizeEnd(len(frame), frame[-HEAD:]))
                continue
            if frame.strip():
                out.append(frame)
        rest = data[start:]
        if not rest:
            return out
        if self._discarding:
            self._skipped += len(rest)
            if self._report_end:
                self._tail = (self._tail + rest[-HEAD:])[-HEAD:]
            return out
        self._buf += rest
        if len(self._buf) > self._max:
            out.append(Oversize(len(self._buf), bytes(self._buf[:HEAD])))
            self._skipped, self._tail = len(self._buf), bytes(self._buf[-HEAD:])
            self._buf.clear()
            self._discarding = True
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)
