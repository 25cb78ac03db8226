"""A :class:`~gateway.connection.MessageStream` over any byte stream, one message per line
(the MCP stdio framing), used by the unix socket listener and the stdio bridge."""

from __future__ import annotations

import trio

from gateway.errors import MessageTooLarge, TransportClosed
from gateway.protocol.framing import LineFramer, Oversize

_RECEIVE_CHUNK = 65536


class LineStream:
    def __init__(self, stream: trio.abc.Stream, max_message: int) -> None:
        self._stream = stream
        self._framer = LineFramer(max_message)
        self._max = max_message
        self._ready: list[bytes | Oversize] = []
        self._pos = 0

    async def receive(self) -> bytes:
        while self._pos >= len(self._ready):
            try:
                data = await self._stream.receive_some(_RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise TransportClosed(str(exc)) from None
            if not data:
                raise TransportClosed("end of stream")
            self._ready = self._framer.feed(data)
            self._pos = 0
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
