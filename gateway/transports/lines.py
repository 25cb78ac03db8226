"""A :class:`~gateway.connection.MessageStream` over any byte stream, one message per line
(the MCP stdio framing), used by the unix socket listener and the stdio bridge.

A line must be complete (its newline read) within
:data:`gateway.limits.INCOMPLETE_MESSAGE_TIMEOUT` seconds of the read that started it, else
:class:`~gateway.errors.IncompleteMessage`; the deadline is armed only while a partial line is
held, so reading whole lines costs nothing more.
"""

from __future__ import annotations

import trio

from gateway import limits
from gateway.errors import IncompleteMessage, MessageTooLarge, TransportClosed
from gateway.protocol.framing import LineFramer, Oversize

_RECEIVE_CHUNK = 65536
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


async def read_chunk(stream: trio.abc.ReceiveStream, size: int, deadline: float | None) -> bytes:
    """The next bytes from ``stream`` (a message transport's one read).  With ``deadline`` (a
    message is partly read) they must come by then, else :class:`IncompleteMessage`; a library
    error or the end of the stream is :class:`TransportClosed`."""
    try:
        if deadline is None:
            data = await stream.receive_some(size)
        else:
            data = b""
            with trio.move_on_at(deadline) as scope:
                data = await stream.receive_some(size)
            if scope.cancelled_caught:
                raise IncompleteMessage("a message was not completed within "
                                        f"{limits.INCOMPLETE_MESSAGE_TIMEOUT:g} seconds")
    except _BROKEN as exc:
        raise TransportClosed(str(exc)) from None
    if not data:
        raise TransportClosed("end of stream")
    return data


class LineStream:
    def __init__(self, stream: trio.abc.Stream, max_message: int) -> None:
        self._stream = stream
        self._framer = LineFramer(max_message)
        self._max = max_message
        self._ready: list[bytes | Oversize] = []
        self._pos = 0
        self._deadline: float | None = None  # for the partial line held, if any

    async def receive(self) -> bytes:
        while self._pos >= len(self._ready):
            if self._framer.partial and self._deadline is None:
                self._deadline = trio.current_time() + limits.INCOMPLETE_MESSAGE_TIMEOUT
            data = await read_chunk(self._stream, _RECEIVE_CHUNK,
                                    self._deadline if self._framer.partial else None)
            self._ready = self._framer.feed(data)
            self._pos = 0
            if self._ready:
                self._deadline = None  # a partial line left now started in this read
        frame = self._ready[self._pos]
        self._pos += 1
        if isinstance(frame, Oversize):
            raise MessageTooLarge(frame.size, self._max)
        return frame

    async def send(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise TransportClosed(str(exc)) from None

    async def send_batch(self, messages: list[bytes]) -> None:
        try:
            await self._stream.send_all(b"".join([m + b"\n" for m in messages]))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise TransportClosed(str(exc)) from None

    async def aclose(self, reason: str) -> None:
        try:
            await self._stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
