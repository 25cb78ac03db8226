"""Server-sent events, read: the ``data`` of each event of a ``text/event-stream`` body.

:class:`SseDecoder` is fed the body as it arrives, cut anywhere, and returns the data of each
event completed (``data:`` lines joined with LF; events without data, such as a priming event's
empty ``data:``, and comments are skipped).  Lines end with CRLF, LF or CR.  An event of more
than ``limit`` bytes, or growing past it, raises :class:`EventTooLarge`: the buffer never holds
more (the stream cannot be read on after that: its reader closes it).  It keeps what resuming
the stream needs: the last event id (:attr:`SseDecoder.last_id`, an id of printable ASCII within
:data:`MAX_EVENT_ID` bytes; another makes the stream not resumable) and the ``retry`` field
(:attr:`SseDecoder.retry`, milliseconds), both carried over from a stream it resumes.
"""

from __future__ import annotations

import re

#: An event id kept for resuming (sent back as ``Last-Event-ID``): its most bytes.
MAX_EVENT_ID = 256
_PRINTABLE = re.compile(rb"[\x20-\x7e]*")
#: An event of the common shape, read in one match: an ``event`` line, an ``id`` (without a
#: NUL) and one ``data`` line, each but the data optional, in that order (another shape goes
#: line by line).
_COMMON = re.compile(rb"(?:event:[^\n]*\n)?(?:id: ?([^\n\0]*)\n)?data: ?([^\n]*)")


class EventTooLarge(Exception):
    """An event grew past the limit before it ended."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"an event of more than {limit} bytes ({size} seen)")
        self.size = size
        self.limit = limit


class SseDecoder:
    """Splits a ``text/event-stream`` into events' data, within ``limit`` bytes per event."""

    def __init__(self, limit: int, last_id: str | None = None, retry: int | None = None
                 ) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._scan = 0  # where an event's end may begin in _buf: what came before was searched
        self._after_cr = False  # a CR ended the last chunk: an LF next is its CRLF's
        self._given = last_id  # the id of the stream this one resumes
        self._id: bytes | None = None  # the last ``id`` field's value (None: none yet)
        self.retry = retry  # the last ``retry`` field, in milliseconds

    @property
    def last_id(self) -> str | None:
        """The last event id seen (None: not resumable), judged when read: an id too long or
        not printable ASCII cannot be sent back."""
        value = self._id
        if value is None:
            return self._given
        ok = len(value) <= MAX_EVENT_ID and _PRINTABLE.fullmatch(value) is not None
        return value.decode("ascii") if ok and value else None

    def _field(self, line: bytes) -> None:
        """Note an ``id`` or ``retry`` field (an id with a NUL is ignored, as SSE says; one too
        long or not printable ASCII cannot be sent back: not resumable)."""
        if line.startswith(b"id:"):
            value = line[3:].removeprefix(b" ")
            if b"\0" not in value:
                self._id = value
        elif line.startswith(b"retry:"):
            value = line[6:].removeprefix(b" ")
            if value.isdigit() and len(value) <= 9:
                self.retry = int(value)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of every event ``chunk`` completes, in order.

        Raises:
            EventTooLarge: the event being read is over ``limit`` bytes.
        """
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
            self._after_cr = False
        if not chunk:  # nothing (more): an empty chunk does not forget a CR just before it
            return []
        self._after_cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf
        # nothing held back: the chunk is read where it is, and only its unfinished tail kept
        text: bytes | bytearray = chunk
        if buf:
            buf += chunk
            text = buf
        out: list[bytes] = []
        start = 0
        at = self._scan  # (past it: after an event found)
        while (end := text.find(b"\n\n", at)) >= 0:
            if end - start > self.limit:  # whole in what came, but over the limit too
                buf.clear()
                self._scan = 0
                raise EventTooLarge(end - start, self.limit)
            common = _COMMON.fullmatch(text, start, end)
            if common is not None:
                at = start = end + 2
                if common[1] is not None:
                    self._id = common[1]
                if common[2].strip():
                    out.append(common[2])
                continue
            event = bytes(text[start:end])
            at = start = end + 2
            data: list[bytes] = []
            for line in event.split(b"\n"):  # each line once, its fields in order
                if line.startswith(b"data:"):
                    data.append(line[5:].removeprefix(b" "))
                elif line.startswith((b"id:", b"retry:")):
                    self._field(line)
            if len(data) == 1:
                if data[0].strip():
                    out.append(data[0])
            elif any(line.strip() for line in data):
                out.append(b"\n".join(data))
        if text is buf:
            del buf[:start]
        elif start < len(chunk):
            buf += chunk[start:] if start else chunk
        self._scan = max(0, len(buf) - 1)
        if len(buf) > self.limit:
            size = len(buf)
            buf.clear()
            self._scan = 0
            raise EventTooLarge(size, self.limit)
        return out
