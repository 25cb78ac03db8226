"""The WebSocket listener (subprotocol ``mcp``, one JSON-RPC message per text frame).

wsproto runs the HTTP upgrade only (:func:`_handshake`); after it the connection is a
:class:`~gateway.protocol.wsframing.ServerFramer` over a
:class:`~gateway.transports.rawio.SocketIO`.  The framer is hand-written: cheaper per message
than the libraries, and it decides exactly when a refusal happens.  Reading is the connection's
reader task (pings answered in :meth:`WebSocketStream.receive`); writing is synchronous
(:meth:`WebSocketStream.write_nowait`), what the socket does not take held for
:meth:`WebSocketStream.flush`.  Before an upgrade is accepted come a connection slot (503 beyond
the cap), a bounded head (431), the ``Host`` (421: DNS rebinding), the ``Origin`` (403:
browsers open cross-origin WebSockets without CORS) and, with ``[auth]``, a principal (401).
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, RejectConnection, RejectData, Request
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
from gateway.protocol.wsframing import Fault, ServerFramer, close_frame, text_header
from gateway.transports import tls
from gateway.transports.http import MAX_HEAD_BYTES
from gateway.transports.listeners import (
    Accepted,
    SlottedListener,
    allowed_host_names,
    serve_listeners,
)
from gateway.transports.rawio import stream_io

if TYPE_CHECKING:
    from gateway.protocol.jsonrpc import Route

LOGGER = logging.getLogger(__name__)

SUBPROTOCOL = "mcp"
#: Bound on the closing handshake (waiting for the peer's close frame).
CLOSE_WAIT = 2.0
#: Bound on turning away a connection beyond ``max_connections`` with a 503.
REFUSE_WAIT = 1.0
_AT_CAP_BODY = b"too many connections (max_connections)\n"
_AT_CAP = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(_AT_CAP_BODY), _AT_CAP_BODY))
#: What a connection gets whose upgrade request is not whole by ``HEAD_TIMEOUT``: a client sees
#: why at once instead of waiting for its own timeout (trio-websocket's waits 60 s on a close).
_HEAD_TIMEOUT_BODY = b"upgrade request not completed in time\n"
_HEAD_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                   b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY))
_RECEIVE = 65536
#: The frame header of a text message of each size below 126 bytes.
_SMALL_HEADERS = [text_header(n) for n in range(126)]
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_CLOSE_CODES: dict[str, int] = {  # by reason: aclose gets a CloseReason or a plain str
    CloseReason.OVERSIZE: 1009,
    CloseReason.OVERFLOW: 1008,
    CloseReason.SHUTDOWN: 1012,  # service restart: reconnect (to another replica)
    CloseReason.ERROR: 1011,
    CloseReason.UNSUPPORTED_DATA: 1003,
    CloseReason.INVALID_DATA: 1007,
    CloseReason.INCOMPLETE: 1008,
    CloseReason.UNAUTHORIZED: 1008,
}
#: Authenticates an upgrade: given its Host and Authorization headers, the principal (None:
#: authentication not configured) or raises Refused (answered with its status and headers).
Authenticate = Callable[[str | None, str | None], Awaitable[object]]


#: Admits an authenticated upgrade's principal (raises Refused, e.g. at a per-principal cap);
#: returns what gives its place back when the connection ends.
Admit = Callable[[object], Callable[[], None]]


class Refused(Exception):
    """An upgrade turned away with ``status`` and ``headers`` (e.g. 401 + WWW-Authenticate)."""

    def __init__(self, status: int, text: str, headers: Sequence[tuple[bytes, bytes]] = (),
                 content_type: bytes = b"text/plain") -> None:
        super().__init__(text)
        self.status = status
        self.headers = list(headers)
        self.content_type = content_type


class WebSocketStream:
    """An accepted WebSocket connection as a :class:`~gateway.core.connection.MessageStream`.

    :meth:`receive` raises :class:`~gateway.errors.MessageTooLarge` as soon as a frame header
    takes a message past ``max_message`` (-32600, close 1009),
    :class:`~gateway.errors.UnsupportedMessage` for a binary frame (-32600, close 1003) and
    :class:`~gateway.errors.InvalidFramePayload` for text that is not UTF-8 (close 1007); other
    protocol errors close with 1002.  Messages before the faulty frame are handed out first.  A
    message must be complete within :data:`gateway.limits.INCOMPLETE_MESSAGE_TIMEOUT` of the read
    that started it (``incomplete_message``, close 1008).
    """

    def __init__(self, stream: trio.abc.Stream, max_message: int) -> None:
        self._io = stream_io(stream)  # a TLS connection's SSLStream: through the stream
        self._framer = ServerFramer(max_message)
        self._max = max_message
        self._ready: list[bytes] = []
        self._pos = 0
        self._deadline: float | None = None  # for the partial message held, if any
        self._error: Exception | None = None  # raised once the messages before it are handed out
        self._failed: int | None = None  # close code for a frame that could not be parsed
        self._close_reply: bytes | None = None  # our answer to the peer's close frame
        self._closed = False
        self.principal: object = None  # who authenticated on the upgrade (gateway.auth)

    @property
    def buffered(self) -> int:
        """Messages held from reads already made (:meth:`receive` hands them out without one)."""
        return len(self._ready) - self._pos

    async def receive(self) -> bytes:
        while self._pos >= len(self._ready):
            if self._error is not None:
                raise self._error
            framer = self._framer
            partial = framer.partial
            if partial and self._deadline is None:
                self._deadline = trio.current_time() + limits.INCOMPLETE_MESSAGE_TIMEOUT
            data = await self._io.read(self._deadline if partial else None)
            self._ready = framer.feed(data)
            self._pos = 0
            if self._ready:
                self._deadline = None  # a partial message left now started in this read
            if framer.replies:
                replies, framer.replies = framer.replies, []
                if not self._io.write(replies):
                    await self._io.flush()
            if framer.fault is not None or framer.peer_close is not None:
                self._error = self._stop()
        message = self._ready[self._pos]
        self._pos += 1
        return message

    def _stop(self) -> Exception:
        """The exception that ends the reading, from the framer's fault or the peer's close."""
        framer = self._framer
        fault = framer.fault
        # refused by its header (the close, 1009, follows the -32600 answer)
        if fault is Fault.MESSAGE_TOO_BIG:
            return MessageTooLarge(framer.declared, self._max)
        if fault is Fault.UNSUPPORTED_DATA:
            return UnsupportedMessage("binary WebSocket frames are not supported: send each "
                                      "JSON-RPC message as one text frame")
        if fault is Fault.INVALID_PAYLOAD:
            self._failed = int(fault)
            return InvalidFramePayload(f"invalid WebSocket frame: {framer.detail}")
        if fault is Fault.PROTOCOL_ERROR:
            self._failed = int(fault)
            return TransportClosed(f"WebSocket protocol error: {framer.detail}")
        assert framer.peer_close is not None
        code, reason = framer.peer_close
        self._close_reply = close_frame(code, reason)
        return TransportClosed(f"closed by the client ({code})")

    def write_nowait(self, messages: list[bytes], route: Route | None = None) -> bool:
        if len(messages) == 1:
            return self.write_one(messages[0], route)
        if self._closed:
            raise TransportClosed("closed")
        parts: list[bytes] = []
        for data in messages:
            parts.append(text_header(len(data)))
            parts.append(data)
        return self._io.write(parts)

    def write_one(self, data: bytes, route: Route | None) -> bool:
        if self._closed:
            raise TransportClosed("closed")
        n = len(data)
        return self._io.write_pair(_SMALL_HEADERS[n] if n < 126 else text_header(n), data)

    async def flush(self) -> None:
        await self._io.flush()

    async def _await_close_reply(self) -> None:
        """Read (and drop) what the peer still sends until its close frame: closing the socket
        with unread data would reset it and lose our close frame (and the error before it)."""
        framer = self._framer
        framer.closing()
        while framer.peer_close is None and not framer.dead:
            try:
                framer.feed(await self._io.read())
            except TransportClosed:
                return
            framer.replies.clear()

    async def aclose(self, reason: str) -> None:
        """Close: our close frame only at a frame boundary (nothing held), else drop TCP; the
        answer to the peer's own close frame goes behind what is held."""
        if not self._closed:
            self._closed = True
            frame = None
            if self._close_reply is not None:  # the peer waits for it to finish closing
                frame = self._close_reply
            elif not self._io.held:
                frame = close_frame(self._failed or _CLOSE_CODES.get(reason, 1000), reason)
            if frame is not None:
                with trio.move_on_after(CLOSE_WAIT):
                    try:
                        if not self._io.write([frame]):
                            await self._io.flush()
                        if self._close_reply is None:
                            await self._await_close_reply()
                    except TransportClosed:
                        pass
        await self._io.aclose()


def head_size(data: bytes) -> int:
    """Bytes of the request head at the start of ``data``: up to and including the empty line
    that ends it (a bare LF ends a line too, as for h11); all of ``data`` when it has none."""
    end = _HEAD_END.search(data)
    return len(data) if end is None else end.end()


_HEAD_END = re.compile(rb"\n\r?\n")


def origin_allowed(headers: Sequence[tuple[bytes, bytes]], allowed: Sequence[str]) -> bool:
    """Every ``Origin`` header is in ``allowed`` (none at all: not a browser, allowed)."""
    return all(value.decode("latin-1") in allowed
               for name, value in headers if name.lower() == b"origin")


_BAD_HEADER = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 33\r\n"
               b"connection: close\r\n\r\nrequest header is not ASCII text\n")


async def _refuse(stream: trio.abc.Stream, ws: WSConnection, status: int, text: str,
                  headers: Sequence[tuple[bytes, bytes]] = (),
                  content_type: bytes = b"text/plain") -> None:
    body = f"{text}\n".encode()
    reject = RejectConnection(status_code=status, has_body=True, headers=[
        (b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers])
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


_REFUSED = object()


async def _handshake(stream: trio.abc.Stream, allowed_origins: Sequence[str],
                     allowed_hosts: frozenset[str],
                     authenticate: Authenticate | None = None) -> object:
    """Run the HTTP upgrade (wsproto's handshake); :data:`_REFUSED` after refusing it, else
    the principal ``authenticate`` found (None without it)."""
    ws = WSConnection(ConnectionType.SERVER)
    received = b""  # until the request: wsproto bounds a head that arrives in pieces only
    while True:
        data = bytes(await stream.receive_some(_RECEIVE))  # bytes as they are: not copied
        if not data:
            return _REFUSED
        received += data
        try:
            ws.receive_data(data)
            events = list(ws.events())
        except RemoteProtocolError as exc:
            LOGGER.info("websocket upgrade refused: %s", exc)
            await stream.send_all(ws.send(exc.event_hint or RejectConnection(status_code=400)))
            return _REFUSED
        except UnicodeError:  # wsproto decodes Host (IDNA) and its comma headers as ASCII
            LOGGER.info("websocket upgrade refused: a header that is not ASCII")
            await stream.send_all(_BAD_HEADER)
            return _REFUSED
        for event in events:
            if not isinstance(event, Request):
                continue
            if head_size(received) > MAX_HEAD_BYTES:
                LOGGER.info("websocket upgrade refused: request head over %d bytes", MAX_HEAD_BYTES)
                await _refuse(stream, ws, 431, f"request head over {MAX_HEAD_BYTES} bytes")
                return _REFUSED
            if not host_allowed(event.host, allowed_hosts):
                LOGGER.warning("websocket upgrade refused: Host %r not allowed", event.host)
                await _refuse(stream, ws, 421, "Host not allowed")
                return _REFUSED
            if not origin_allowed(event.extra_headers, allowed_origins):
                LOGGER.warning("websocket upgrade refused: Origin not allowed")
                await _refuse(stream, ws, 403, "Origin not allowed")
                return _REFUSED
            principal = None
            if authenticate is not None:
                values = [v.decode("latin-1") for k,
                          v in event.extra_headers if k.lower() == b"authorization"]
                try:
                    principal = await authenticate(event.host,
                                                   ", ".join(values) if values else None)
                except Refused as exc:
                    await _refuse(stream, ws, exc.status, str(exc), exc.headers, exc.content_type)
                    return _REFUSED
            sub = SUBPROTOCOL if SUBPROTOCOL in event.subprotocols else None
            await stream.send_all(ws.send(AcceptConnection(subprotocol=sub)))
            return principal


def _admitting(authenticate: Authenticate | None, admit: Admit | None,
               admitted: list[Callable[[], None]]) -> Authenticate | None:
    """``authenticate``, then ``admit`` the principal; what gives its place back goes into
    ``admitted`` (the connection's, released when it ends)."""
    if authenticate is None or admit is None:
        return authenticate
    authenticated = authenticate

    async def both(host: str | None, authorization: str | None) -> object:
        principal = await authenticated(host, authorization)
        admitted.append(admit(principal))
        return principal
    return both


async def serve_websocket(
    listeners: list[trio.SocketListener],
    on_connection: Callable[[WebSocketStream], Awaitable[None]],
    *,
    allowed_origins: Sequence[str],
    allowed_hosts: Sequence[str] = (),
    max_message: int,
    handler_nursery: trio.Nursery,
    slots: ConnectionSlots | None = None,
    authenticate: Authenticate | None = None,
    admit: Admit | None = None,
    tls_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept WebSocket connections on ``listeners`` until cancelled.

    Connections run in ``handler_nursery``, so cancelling this task (stop accepting) does not
    cancel live connections.  ``allowed_hosts``: ``Host`` names accepted besides the loopback
    names and the bound address.  With ``slots``, each connection holds one from its accept
    until it ends.  With ``authenticate``, every upgrade is authenticated (see
    :data:`Authenticate`) and its principal admitted by ``admit`` (:data:`Admit`, given back
    when the connection ends); the principal is on the stream handed to ``on_connection``.  With
    ``tls_context`` every connection speaks TLS (``wss://``): the TLS handshake comes first
    (:func:`gateway.transports.tls.handshake`), and a connection beyond ``max_connections`` is
    closed at once (a TLS client could not read a plain 503).  Otherwise a connection beyond
    the cap gets 503 as soon as its request line is readable, within :data:`REFUSE_WAIT`, at
    most :data:`gateway.limits.REFUSING_MAX` at once (beyond that, TCP is closed at once).  A
    half-open handshake holds its slot for at most :data:`gateway.limits.HEAD_TIMEOUT`, then is
    answered 408 and closed.
    """
    hosts = allowed_host_names(listeners, allowed_hosts)
    refusing = 0

    async def handler(accepted: Accepted) -> None:
        nonlocal refusing
        stream: trio.abc.Stream = accepted.stream
        admitted: list[Callable[[], None]] = []  # what gives the principal's place back
        try:
            if not accepted.admitted:  # beyond max_connections (already counted)
                if refusing < limits.REFUSING_MAX and tls_context is None:
                    refusing += 1
                    try:
                        with trio.move_on_after(REFUSE_WAIT):
                            await _refuse_at_cap(accepted.stream)
                    except _BROKEN:
                        pass
                    finally:
                        refusing -= 1
                await _close_tcp(accepted.stream)
                return
            head_by = trio.current_time() + limits.HEAD_TIMEOUT  # TLS and upgrade together
            if tls_context is not None:
                secured = await tls.handshake(accepted.stream, tls_context, "websocket", head_by)
                if secured is None:
                    return
                stream = secured
            upgraded: object = _REFUSED
            with trio.move_on_at(head_by) as head_scope:
                try:
                    upgraded = await _handshake(stream, allowed_origins, hosts,
                                                _admitting(authenticate, admit, admitted))
                except _BROKEN:
                    pass
                except Exception:  # a bug in the upgrade must end this connection only
                    LOGGER.exception("websocket upgrade failed")
            if head_scope.cancelled_caught:  # a fresh connection: no keep-alive race to mind
                with trio.move_on_after(REFUSE_WAIT):
                    try:
                        await stream.send_all(_HEAD_TIMED_OUT)
                    except _BROKEN:
                        pass
            if upgraded is _REFUSED:
                if isinstance(stream, trio.SSLStream):
                    await tls.close(stream)
                else:
                    await _close_tcp(accepted.stream)
                return
            ws_stream = WebSocketStream(stream, max_message)
            ws_stream.principal = upgraded
            await on_connection(ws_stream)
        finally:
            for release in admitted:
                release()
            if accepted.admitted and slots is not None:
                slots.release()

    await serve_listeners(handler, [SlottedListener(lst, slots, "websocket") for lst in listeners],
                          handler_nursery=handler_nursery, task_status=task_status)
