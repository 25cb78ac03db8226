"""A :class:`~gateway.core.connection.MessageStream` over any byte stream, one message per line
(the MCP stdio framing), used by the unix socket listener and the stdio bridge.

A line must be complete (its newline read) within
:data:`gateway.limits.INCOMPLETE_MESSAGE_TIMEOUT` seconds of the read that started it, else
:class:`~gateway.errors.IncompleteMessage`; the deadline is armed only while a partial line is
held, so reading whole lines costs nothing more.

Writes go through :mod:`gateway.transports.rawio`: straight to a socket when nothing is held
(:meth:`LineStream.write_nowait`), the rest by :meth:`LineStream.flush`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from gateway import limits
from gateway.errors import MessageTooLarge
from gateway.protocol.framing import LineFramer, Oversize, OversizeEnd
from gateway.transports.rawio import SocketIO, StreamIO

if TYPE_CHECKING:
    from gateway.protocol.jsonrpc import Route

_NEWLINE = b"\n"


class LineStream:
    def __init__(self, stream: trio.abc.Stream, max_message: int) -> None:
        self._io = SocketIO(stream) if isinstance(stream, trio.SocketStream) else StreamIO(stream)
        self._framer = LineFramer(max_message)
        self._max = max_message
        self._ready: list[bytes | Oversize | OversizeEnd] = []
        self._pos = 0
        self._deadline: float | None = None  # for the partial line held, if any

    @property
    def buffered(self) -> int:
        """Lines held from reads already made (:meth:`receive` hands them out without one)."""
        return len(self._ready) - self._pos

    async def receive(self) -> bytes:
        while self._pos >= len(self._ready):
            partial = self._framer.partial
            if partial and self._deadline is None:
                self._deadline = trio.current_time() + limits.INCOMPLETE_MESSAGE_TIMEOUT
            data = await self._io.read(self._deadline if partial else None)
            self._ready = self._framer.feed(data)
            self._pos = 0
            if self._ready:
                self._deadline = None  # a partial line left now started in this read
        frame = self._ready[self._pos]
        self._pos += 1
        if type(frame) is bytes:
            return frame
        assert not isinstance(frame, bytes)  # Oversize (an OversizeEnd needs report_end)
        raise MessageTooLarge(frame.size, self._max)

    def write_nowait(self, messages: list[bytes], route: Route | None = None) -> bool:
        if len(messages) == 1:
            return self._io.write_pair(messages[0], _NEWLINE)
        parts: list[bytes] = []
        for m in messages:
            parts.append(m)
            parts.append(_NEWLINE)
        return self._io.write(parts)

    def write_one(self, data: bytes, route: Route | None) -> bool:
        return self._io.write_pair(data, _NEWLINE)

    async def flush(self) -> None:
        await self._io.flush()

    async def send(self, data: bytes) -> None:
        if not self.write_nowait([data]):
            await self._io.flush()

    async def aclose(self, reason: str) -> None:
        await self._io.aclose()
