"""The WebSocket listener (subprotocol ``mcp``, one JSON-RPC message per text frame).

Theory of operation: a thin shell over the sans-IO ``wsproto`` state machine, read and written
directly by the connection's own tasks.  (trio-websocket, which the bridge uses as a client,
puts a reader task and a channel between the socket and the caller: one more task switch per
message, measured at about 150 µs of CPU per call on this path.)  Control frames are answered
from :meth:`WebSocketStream.receive`; writes share a lock that is taken without a checkpoint when
free.

Origin check: an upgrade with an ``Origin`` header that is not in ``allowed_origins`` gets HTTP
403 (browsers open cross-origin WebSockets without CORS, so loopback alone does not protect a
local gateway); with several ``Origin`` headers every one must be allowed.  Connection cap: a
slot of ``slots`` (``max_connections``) is taken when the TCP connection is accepted, before the
handshake, and held until the connection ends (a half-open handshake holds one for at most
:data:`HANDSHAKE_TIMEOUT`).  A connection beyond the cap gets HTTP 503 as soon as its request line
is readable, within :data:`REFUSE_WAIT`; at most :data:`REFUSING_MAX` such refusals are under way
at once, beyond that the TCP connection is closed at once.  Host check: an
upgrade whose ``Host`` is not a loopback name, the bound address or in ``allowed_hosts`` gets
HTTP 421 (DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name).

Frames: MCP over WebSocket is one JSON-RPC message per *text* frame.  A message over
``max_message_bytes`` raises :class:`~gateway.errors.MessageTooLarge` (the connection answers
-32600 and closes with 1009); the partial message is never buffered past the limit.  A binary
frame raises :class:`~gateway.errors.UnsupportedMessage` (-32600, then close 1003); a text frame
that is not UTF-8 raises :class:`~gateway.errors.InvalidFramePayload` (close 1007, no answer);
other frame-level protocol errors close with the code wsproto names (1002).  A frame whose
*header* declares more than ``max_message_bytes`` (with the fragments before it) is refused as
soon as the header is read (:class:`_FrameLimit`, a wsproto extension that is never negotiated:
only its header hook is used), without waiting for its payload.  A message must be complete
within :data:`gateway.limits.INCOMPLETE_MESSAGE_TIMEOUT` seconds of the read that started it
(-32600 ``incomplete_message``, then close 1008).  A close after a write that was cut off
mid-frame drops the TCP connection instead of sending a close frame into the middle of a frame.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import Extension
from wsproto.frame_protocol import CloseReason as WsCloseReason
from wsproto.frame_protocol import Opcode, RsvBits
from wsproto.utilities import RemoteProtocolError

from gateway import limits
from gateway.config import host_allowed
from gateway.errors import (
    CloseReason,
    InvalidFramePayload,
    MessageTooLarge,
    TransportClosed,
    UnsupportedMessage,
)
from gateway.limits import ConnectionSlots
from gateway.transports.lines import read_chunk
from gateway.transports.listeners import Accepted, SlottedListener, allowed_host_names

LOGGER = logging.getLogger(__name__)

SUBPROTOCOL = "mcp"
#: Bound on the opening handshake.
HANDSHAKE_TIMEOUT = 10.0
#: Bound on the closing handshake (waiting for the peer's close frame).
CLOSE_WAIT = 2.0
#: Bound on turning away a connection beyond ``max_connections`` with a 503.
REFUSE_WAIT = 1.0
#: Refusals under way at once; a connection beyond the cap past this many is closed at once.
REFUSING_MAX = 64
_AT_CAP_BODY = b"too many connections (max_connections)\n"
_AT_CAP = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(_AT_CAP_BODY), _AT_CAP_BODY))
_RECEIVE = 65536
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_CLOSE_CODES = {
    CloseReason.OVERSIZE: 1009,
    CloseReason.OVERFLOW: 1008,
    CloseReason.SHUTDOWN: 1001,
    CloseReason.ERROR: 1011,
    CloseReason.UNSUPPORTED_DATA: 1003,
    CloseReason.INVALID_DATA: 1007,
    CloseReason.INCOMPLETE: 1008,
}
#: wsproto's close code for an invalid UTF-8 text frame (RFC 6455 §7.4.1).
_INVALID_PAYLOAD = 1007


class _FrameLimit(Extension):
    """wsproto's hook on each frame header, used to refuse a message by its declared length.

    Never negotiated (no client offers this name, and ``accept`` says no): wsproto calls the
    hooks of every extension given to ``AcceptConnection``.  ``in_frame``: a frame's header has
    been read and its payload is not complete yet.
    """

    name = "x-mcp-gateway-frame-limit"
    _NO_RSV = RsvBits(False, False, False)

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.message = 0  # declared bytes of the data message being received
        self.declared = 0  # set when that passes the limit
        self.in_frame = False

    def enabled(self) -> bool:
        return True

    def offer(self) -> bool:
        return False

    def frame_inbound_header(self, proto: object, opcode: Opcode, rsv: RsvBits,
                             payload_length: int) -> WsCloseReason | RsvBits:
        self.in_frame = True
        if opcode.iscontrol():
            return self._NO_RSV
        self.message = self.message + payload_length if opcode is Opcode.CONTINUATION else payload_length
        if self.message > self.limit:
            self.declared = self.message
            return WsCloseReason.MESSAGE_TOO_BIG
        return self._NO_RSV

    def frame_inbound_complete(self, proto: object, fin: bool) -> None:
        self.in_frame = False


class WebSocketStream:
    """An accepted WebSocket connection as a :class:`~gateway.connection.MessageStream`."""

    def __init__(self, stream: trio.SocketStream, ws: WSConnection, max_message: int,
                 frame_limit: _FrameLimit | None = None) -> None:
        self._stream = stream
        self._ws = ws
        self._max = max_message
        self._frame_limit = frame_limit if frame_limit is not None else _FrameLimit(max_message)
        self._deadline: float | None = None  # for the partial message held, if any
        self._messages: deque[bytes] = deque()
        self._parts: list[bytes] = []
        self._size = 0
        self._lock = trio.Lock()
        self._broken = False  # a write was interrupted mid-frame
        self._closed = False
        self._failed: int | None = None  # close code for a frame wsproto could not parse
        self._close_reply = b""  # our answer to the peer's close frame, until it is written

    async def receive(self) -> bytes:
        while not self._messages:
            if self._closed:
                raise TransportClosed("closed")
            partial = bool(self._parts) or self._frame_limit.in_frame  # a message is partly read
            if partial and self._deadline is None:
                self._deadline = trio.current_time() + limits.INCOMPLETE_MESSAGE_TIMEOUT
            data = await read_chunk(self._stream, _RECEIVE, self._deadline if partial else None)
            try:
                self._ws.receive_data(data)
                await self._handle_events()
            except RemoteProtocolError as exc:
                raise TransportClosed(f"WebSocket protocol error: {exc}") from None
        return self._messages.popleft()

    async def _handle_events(self) -> None:
        for event in self._ws.events():
            if isinstance(event, BytesMessage):
                self._parts, self._size = [], 0
                raise UnsupportedMessage("binary WebSocket frames are not supported: send each "
                                         "JSON-RPC message as one text frame")
            if isinstance(event, TextMessage):
                part = event.data.encode()
                self._size += len(part)
                if self._size > self._max:
                    size, self._parts, self._size = self._size, [], 0
                    raise MessageTooLarge(size, self._max)
                self._parts.append(part)
                if event.message_finished:
                    self._messages.append(self._parts[0] if len(self._parts) == 1 else b"".join(self._parts))
                    self._parts, self._size = [], 0
                    self._deadline = None  # a partial message after it starts with this read
            elif isinstance(event, Ping):
                await self._write(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                if self._ws.state is ConnectionState.OPEN and self._frame_limit.declared:
                    # refused by its header (the close, 1009, follows the -32600 answer)
                    self._parts, self._size = [], 0
                    raise MessageTooLarge(self._frame_limit.declared, self._max)
                if self._ws.state is ConnectionState.OPEN:
                    # wsproto's way to report a frame it could not parse: no close frame came in,
                    # the close (with event.code) is ours to send.
                    self._failed = event.code
                    self._closed = True
                    self._messages.clear()
                    if event.code == _INVALID_PAYLOAD:
                        raise InvalidFramePayload(f"invalid WebSocket frame: {event.reason}")
                    raise TransportClosed(f"WebSocket protocol error: {event.reason}")
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    # wsproto counts it as sent now; if this write is cancelled (the writer saw
                    # the close and ended the connection), aclose() still sends it
                    self._close_reply = self._ws.send(event.response())
                    await self._write(self._close_reply)
                    self._close_reply = b""
                self._closed = True
                if not self._messages:
                    raise TransportClosed(f"closed by the client ({event.code})")

    async def _write(self, data: bytes) -> None:
        try:
            self._lock.acquire_nowait()  # free (the usual case): no checkpoint, no task switch
        except trio.WouldBlock:
            await self._lock.acquire()
        sent = 0
        try:
            view = memoryview(data)
            while sent < len(data):  # trio: a cancelled send() sent nothing, so `sent` is exact
                sent += await self._stream.socket.send(view[sent:])
        except _BROKEN as exc:
            raise TransportClosed(str(exc)) from None
        except trio.Cancelled:
            if 0 < sent < len(data):
                self._broken = True  # cut off mid-frame: no close frame may follow
            raise
        finally:
            self._lock.release()

    async def _await_close_reply(self) -> None:
        """Read (and drop) what the peer still sends until its close frame: closing the socket
        with unread data would reset it and lose our close frame (and the error before it)."""
        while self._ws.state is not ConnectionState.CLOSED:
            try:
                data = await self._stream.receive_some(_RECEIVE)
            except _BROKEN:
                return
            if not data:
                return
            try:
                self._ws.receive_data(data)
                for _event in self._ws.events():
                    pass
            except RemoteProtocolError:
                return

    async def send(self, data: bytes) -> None:
        await self.send_batch([data])

    async def send_batch(self, messages: list[bytes]) -> None:
        if self._closed or self._ws.state is not ConnectionState.OPEN:
            raise TransportClosed("closed")
        await self._write(b"".join([self._ws.send(TextMessage(data=m.decode())) for m in messages]))

    async def aclose(self, reason: str) -> None:
        if not self._broken and self._close_reply:  # the peer waits for it to finish closing
            with trio.move_on_after(CLOSE_WAIT):
                try:
                    await self._write(self._close_reply)
                except TransportClosed:
                    pass
        elif not self._broken and self._ws.state is ConnectionState.OPEN:
            code = self._failed or _CLOSE_CODES.get(reason, 1000)
            with trio.move_on_after(CLOSE_WAIT):
                try:
                    await self._write(self._ws.send(CloseConnection(code=code, reason=reason)))
                    await self._await_close_reply()
                except TransportClosed:
                    pass
        self._closed = True
        try:
            await self._stream.aclose()
        except _BROKEN:
            pass


def origin_allowed(headers: Sequence[tuple[bytes, bytes]], allowed: Sequence[str]) -> bool:
    """Every ``Origin`` header is in ``allowed`` (none at all: not a browser, allowed)."""
    return all(value.decode("latin-1") in allowed
               for name, value in headers if name.lower() == b"origin")


async def _refuse(stream: trio.abc.Stream, ws: WSConnection, status: int, text: str) -> None:
    body = f"{text}\n".encode()
    reject = RejectConnection(status_code=status, has_body=True, headers=[
        (b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())])
    await stream.send_all(ws.send(reject) + ws.send(RejectData(data=body)))


async def _refuse_at_cap(stream: trio.SocketStream) -> None:
    """503 for a connection beyond ``max_connections``, once its request line is readable
    (bounded by the caller); then wait for the peer to close, so that closing does not reset the
    connection under the answer."""
    data = b""
    while b"\n" not in data and len(data) < _RECEIVE:
        chunk = await stream.receive_some(_RECEIVE)
        if not chunk:
            return
        data += chunk
    await stream.send_all(_AT_CAP)
    await stream.send_eof()
    while await stream.receive_some(_RECEIVE):
        pass


async def _close_tcp(stream: trio.SocketStream) -> None:
    with trio.move_on_after(1.0):
        try:
            await stream.aclose()
        except _BROKEN:
            pass


async def _handshake(stream: trio.abc.Stream, allowed_origins: Sequence[str],
                     allowed_hosts: frozenset[str], frame_limit: _FrameLimit) -> WSConnection | None:
    """Run the HTTP upgrade; returns the open connection, or None after refusing it."""
    ws = WSConnection(ConnectionType.SERVER)
    while True:
        data = await stream.receive_some(_RECEIVE)
        if not data:
            return None
        try:
            ws.receive_data(data)
            events = list(ws.events())
        except RemoteProtocolError as exc:
            LOGGER.info("websocket upgrade refused: %s", exc)
            await stream.send_all(ws.send(exc.event_hint or RejectConnection(status_code=400)))
            return None
        for event in events:
            if not isinstance(event, Request):
                continue
            if not host_allowed(event.host, allowed_hosts):
                LOGGER.warning("websocket upgrade refused: Host %r not allowed", event.host)
                await _refuse(stream, ws, 421, "Host not allowed")
                return None
            if not origin_allowed(event.extra_headers, allowed_origins):
                LOGGER.warning("websocket upgrade refused: Origin not allowed")
                await _refuse(stream, ws, 403, "Origin not allowed")
                return None
            sub = SUBPROTOCOL if SUBPROTOCOL in event.subprotocols else None
            await stream.send_all(ws.send(AcceptConnection(subprotocol=sub, extensions=[frame_limit])))
            return ws


async def serve_websocket(
    listeners: list[trio.SocketListener],
    on_connection: Callable[[WebSocketStream], Awaitable[None]],
    *,
    allowed_origins: Sequence[str],
    allowed_hosts: Sequence[str] = (),
    max_message: int,
    handler_nursery: trio.Nursery,
    slots: ConnectionSlots | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept WebSocket connections on ``listeners`` until cancelled.

    Connections run in ``handler_nursery``, so cancelling this task (stop accepting) does not
    cancel live connections.  ``allowed_hosts``: ``Host`` names accepted besides the loopback
    names and the bound address.  With ``slots``, each connection holds one from its accept
    until it ends.
    """
    hosts = allowed_host_names(listeners, allowed_hosts)
    refusing = 0

    async def handler(accepted: Accepted) -> None:
        nonlocal refusing
        stream = accepted.stream
        try:
            if not accepted.admitted:  # beyond max_connections (already counted)
                if refusing < REFUSING_MAX:
                    refusing += 1
                    try:
                        with trio.move_on_after(REFUSE_WAIT):
                            await _refuse_at_cap(stream)
                    except _BROKEN:
                        pass
                    finally:
                        refusing -= 1
                await _close_tcp(stream)
                return
            ws = None
            frame_limit = _FrameLimit(max_message)
            with trio.move_on_after(HANDSHAKE_TIMEOUT):
                try:
                    ws = await _handshake(stream, allowed_origins, hosts, frame_limit)
                except _BROKEN:
                    ws = None
                except Exception:  # a bug in the upgrade must end this connection only
                    LOGGER.exception("websocket upgrade failed")
                    ws = None
            if ws is None:
                await _close_tcp(stream)
                return
            await on_connection(WebSocketStream(stream, ws, max_message, frame_limit))
        finally:
            if accepted.admitted and slots is not None:
                slots.release()

    await trio.serve_listeners(handler, [SlottedListener(lst, slots, "websocket") for lst in listeners],
                               handler_nursery=handler_nursery, task_status=task_status)
