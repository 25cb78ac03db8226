"""The WebSocket listener (subprotocol ``mcp``, one JSON-RPC message per text frame).

Origin check: an upgrade whose ``Origin`` header is present and not in ``allowed_origins`` gets
HTTP 403 (browsers open cross-origin WebSockets without CORS, so loopback alone does not protect
a local gateway).  Size limit: a message over ``max_message_bytes`` gets a -32600 error
(``data.reason = "message_too_large"``) and the connection is closed; a frame over twice the
limit is cut off by the WebSocket layer itself (close code 1009, no JSON-RPC error).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio
import trio_websocket
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from gateway.errors import MessageTooLarge, TransportClosed

LOGGER = logging.getLogger(__name__)

SUBPROTOCOL = "mcp"
#: Bound on the opening handshake and on the closing handshake.
HANDSHAKE_TIMEOUT = 10.0


class WebSocketStream:
    def __init__(self, ws: WebSocketConnection, max_message: int) -> None:
        self._ws = ws
        self._max = max_message

    async def receive(self) -> bytes:
        try:
            message = await self._ws.get_message()
        except ConnectionClosed as exc:
            raise TransportClosed(str(exc.reason)) from None
        data = message.encode() if isinstance(message, str) else message
        if len(data) > self._max:
            raise MessageTooLarge(len(data), self._max)
        return data

    async def send(self, data: bytes) -> None:
        try:
            await self._ws.send_message(data.decode())
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise TransportClosed(str(exc)) from None

    async def send_batch(self, messages: list[bytes]) -> None:
        for data in messages:  # one frame per message
            await self.send(data)

    async def aclose(self, reason: str) -> None:
        code = {"oversize": 1009, "overflow": 1008, "shutdown": 1001, "error": 1011}.get(reason, 1000)
        try:
            await self._ws.aclose(code, reason)
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


def origin_allowed(headers: Sequence[tuple[bytes, bytes]], allowed: Sequence[str]) -> bool:
    for name, value in headers:
        if name.lower() == b"origin":
            return value.decode("latin-1") in allowed
    return True  # no Origin: not a browser


async def serve_websocket(
    listeners: list[trio.SocketListener],
    on_connection: Callable[[WebSocketStream], Awaitable[None]],
    *,
    allowed_origins: Sequence[str],
    max_message: int,
    handler_nursery: trio.Nursery,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept WebSocket connections on ``listeners`` until cancelled.

    Connections run in ``handler_nursery``, so cancelling this task (stop accepting) does not
    cancel live connections.
    """

    async def handler(request: WebSocketRequest) -> None:
        if not origin_allowed(request.headers, allowed_origins):
            LOGGER.warning("websocket upgrade refused: Origin not allowed")
            await request.reject(403, body=b"Origin not allowed\n")
            return
        sub = SUBPROTOCOL if SUBPROTOCOL in request.proposed_subprotocols else None
        ws = await request.accept(subprotocol=sub)
        await on_connection(WebSocketStream(ws, max_message))

    server = trio_websocket.WebSocketServer(
        handler,
        listeners,
        handler_nursery=handler_nursery,
        max_message_size=2 * max_message,
        receive_buffer_size=65536,
        connect_timeout=HANDSHAKE_TIMEOUT,
        disconnect_timeout=HANDSHAKE_TIMEOUT,
    )
    await server.run(task_status=task_status)
