"""An in-memory :class:`~gateway.connection.MessageStream` pair (tests, embedding)."""

from __future__ import annotations

import trio

from gateway.errors import TransportClosed


class MemoryStream:
    def __init__(self, send: trio.MemorySendChannel[bytes], receive: trio.MemoryReceiveChannel[bytes]) -> None:
        self._send = send
        self._receive = receive

    async def receive(self) -> bytes:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
            raise TransportClosed("closed") from None

    async def send(self, data: bytes) -> None:
        try:
            await self._send.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise TransportClosed("closed") from None

    async def send_batch(self, messages: list[bytes]) -> None:
        for data in messages:
            await self.send(data)

    async def aclose(self, reason: str = "") -> None:
        await self._send.aclose()
        await self._receive.aclose()


def memory_stream_pair(buffer: int = 64) -> tuple[MemoryStream, MemoryStream]:
    """Two connected ends: what one sends, the other receives."""
    a_send, b_receive = trio.open_memory_channel[bytes](buffer)
    b_send, a_receive = trio.open_memory_channel[bytes](buffer)
    return MemoryStream(a_send, a_receive), MemoryStream(b_send, b_receive)
