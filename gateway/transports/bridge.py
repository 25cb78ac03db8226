"""``mcp-gateway connect``: a stdio bridge so stdio-only MCP clients can use the gateway.

stdin lines go to the gateway, the gateway's messages come out on stdout, one per line.  A unix
socket target speaks the same framing, so bytes are copied through untouched; an http(s)://
target is reached as a Streamable HTTP client (:mod:`gateway.transports.bridge_http`).  The bridge
exits when either side closes.
"""

from __future__ import annotations

import ssl
import sys
from urllib.parse import urlsplit

import trio
import trio_websocket

from gateway.errors import MessageTooLarge, TransportClosed
from gateway.transports.lines import LineStream
from gateway.transports.websocket import SUBPROTOCOL


class _ClientWebSocket:
    """The bridge's side of a WebSocket (trio-websocket client), as a message stream."""

    def __init__(self, ws: trio_websocket.WebSocketConnection, limit: int) -> None:
        self._ws = ws
        self._limit = limit

    async def receive(self) -> bytes:
        try:
            message = await self._ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            if exc.reason is not None and exc.reason.code == 1009:  # the library's own limit
                raise MessageTooLarge(None, self._limit) from None
            raise TransportClosed(str(exc.reason)) from None
        return message.encode() if isinstance(message, str) else message

    async def send(self, data: bytes) -> None:
        try:
            await self._ws.send_message(data.decode())
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError,
                trio.ClosedResourceError) as exc:
            raise TransportClosed(str(exc)) from None


async def _copy(source: trio.abc.ReceiveStream, sink: trio.abc.SendStream,
                done: trio.CancelScope) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    done.cancel()


async def bridge(url: str, max_message: int, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
    """Copy messages between stdio and ``url`` until either side closes; ``token`` is sent as
    ``Authorization: Bearer`` (WebSocket upgrade, every HTTP request; not on a unix socket,
    whose peer credentials authenticate it); ``ssl_context`` verifies an https/wss server
    (default: the system CAs, or ``SSL_CERT_FILE``)."""
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    stdout = trio.lowlevel.FdStream(sys.stdout.fileno())
    stdio = trio.StapledStream(stdout, stdin)
    if url.startswith("unix:"):
        sock = await trio.open_unix_socket(url.removeprefix("unix:"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_copy, stdin, sock, nursery.cancel_scope)
            nursery.start_soon(_copy, sock, stdout, nursery.cancel_scope)
        return
    if url.startswith(("http://", "https://")):
        from gateway.transports.bridge_http import HttpBridge

        http = HttpBridge(url, LineStream(stdio, max_message), max_message, token=token,
                          ssl_context=ssl_context)
        await http.run()
        if http.failed:
            raise OSError(http.failed[0])
        return
    if not url.startswith(("ws://", "wss://")):
        raise OSError(f"unsupported URL {url!r} (use ws://HOST:PORT/, http://HOST:PORT/mcp or "
                      "unix:/path)")
    if url.startswith("wss://"):
        ssl_context = ssl_context or ssl.create_default_context()
        await _check_tls(url, ssl_context)
    local = LineStream(stdio, max_message)
    failed: list[str] = []
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else None
    try:
        async with trio_websocket.open_websocket_url(
            url, ssl_context, subprotocols=[SUBPROTOCOL], max_message_size=2 * max_message,
            receive_buffer_size=65536, extra_headers=headers,
        ) as ws:
            remote = _ClientWebSocket(ws, 2 * max_message)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, local, remote, nursery.cancel_scope, failed)
                nursery.start_soon(_pump, remote, local, nursery.cancel_scope, failed)
    except trio_websocket.ConnectionRejected as exc:
        raise OSError(_rejected(exc.status_code, exc.body)) from None
    except trio_websocket.HandshakeError as exc:
        raise OSError(f"WebSocket handshake failed: {exc}") from None
    if failed:
        raise OSError(failed[0])


def _rejected(status: int, body: bytes | None) -> str:
    """What a refused WebSocket upgrade says: its status and body text (one line), and for
    401 the option that sends a token."""
    text = " ".join((body or b"").decode("utf-8", "replace").split())[:200]
    hint = " (use --token-file)" if status == 401 else ""
    return f"HTTP {status}: {text or 'refused'}{hint}"


async def _check_tls(url: str, ssl_context: ssl.SSLContext) -> None:
    """A TLS handshake with ``ssl_context`` (the system CAs, ``SSL_CERT_FILE``, or --ca-file)
    before the WebSocket is opened, so a certificate that does not verify is an error naming why
    at once (trio-websocket's client would wait for its connect timeout and say nothing)."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise OSError(f"no host in {url!r}")
    stream = await trio.open_ssl_over_tcp_stream(parts.hostname, parts.port or 443,
                                                 ssl_context=ssl_context)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        raise OSError(f"TLS with {parts.netloc}: {exc.__cause__ or exc}") from None
    finally:
        await trio.aclose_forcefully(stream)


async def _pump(source: LineStream | _ClientWebSocket, sink: LineStream | _ClientWebSocket,
                done: trio.CancelScope, failed: list[str]) -> None:
    """Copy messages one way until either side closes; a message over the limit ends the bridge
    with an error (the other side would otherwise wait for an answer that never comes)."""
    try:
        while True:
            await sink.send(await source.receive())
    except TransportClosed:
        pass
    except MessageTooLarge as exc:
        failed.append(f"{exc} (--max-message-bytes)")
    done.cancel()
