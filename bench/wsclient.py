"""A lean RFC 6455 WebSocket client for the bench: text messages out, messages in, one trio socket.

:func:`connect` writes the opening handshake by hand (``Sec-WebSocket-Key``, version 13, the
subprotocols asked for) and checks the answer: ``101``, ``Upgrade``/``Connection``, the
``Sec-WebSocket-Accept`` of the key, a subprotocol only among those offered, no extension.
:class:`WsClient` then sends each message as one masked text frame (a fresh random mask per
frame) and :meth:`WsClient.run` parses the server's frames from a buffer: 7/16/64-bit lengths,
continuation frames joined, pings answered with pongs, a close answered and the connection ended,
anything the RFC forbids (a masked or reserved-bit frame, a bad control frame, a stray
continuation, invalid UTF-8, a message over ``max_message``) failing it with the matching close
code.  After the handshake the socket is a plain non-blocking one: a read or write is tried first
and waits (``trio.lowlevel.wait_readable``/``wait_writable``) only when it would block; a frame the
socket did not take whole is finished under :attr:`WsClient.lock`, which later frames then queue
on, so frames never interleave.  ``ws://`` only (the bench is loopback).
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import trio

_apply_mask: Callable[[bytes, bytes], bytes] | None
try:  # optional C helper; the XOR of two ints below is exact, only slower on big payloads
    from websockets.speedups import apply_mask as _apply_mask
except ImportError:  # pragma: no cover - depends on the environment
    _apply_mask = None

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_HEAD = 16384  # the server's handshake answer
MAX_MESSAGE = 16 * 2**20
RECV = 65536
#: Close codes a peer may send (RFC 6455 section 7.4; 1004-1006 and 1015 never go on the wire).
PEER_CODES = (frozenset(range(1000, 1004)) | frozenset(range(1007, 1015))
              | frozenset(range(3000, 5000)))
_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class WsError(Exception):
    """The handshake failed, or a message could not be sent (the connection is closed)."""


class _Fail(Exception):
    """The server broke the protocol: the client fails the connection with ``code``."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


_pool = b""
_at = 0


def fresh_mask() -> bytes:
    """Four bytes from the OS's random source (read 4 KiB at a time)."""
    global _pool, _at
    if _at + 4 > len(_pool):
        _pool, _at = os.urandom(4096), 0
    _at += 4
    return _pool[_at - 4:_at]


def frame(first: int, payload: bytes, mask: bytes) -> bytes:
    """A client frame: ``first`` (FIN, opcode), the masked length, ``mask``, the masked payload."""
    n = len(payload)
    if n < 126:
        head = bytes((first, 0x80 | n))
    elif n < 65536:
        head = bytes((first, 0xFE)) + n.to_bytes(2, "big")
    else:
        head = bytes((first, 0xFF)) + n.to_bytes(8, "big")
    if not n:
        return head + mask
    if _apply_mask is not None:
        return head + mask + _apply_mask(payload, mask)
    key = (mask * ((n + 3) // 4))[:n]
    return head + mask + (int.from_bytes(payload, "little")
                          ^ int.from_bytes(key, "little")).to_bytes(n, "little")


async def connect(url: str, subprotocols: list[str] | None = None, *,
                  max_message: int = MAX_MESSAGE) -> WsClient:
    """Open ``url`` (``ws://host:port/path``) and run the opening handshake; :class:`WsError` if
    the server does not accept it as RFC 6455 says."""
    parts = urlsplit(url)
    if parts.scheme != "ws" or not parts.hostname:
        raise WsError(f"not a ws:// URL: {url!r}")
    port = parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    family, kind, proto, _, addr = (await trio.socket.getaddrinfo(
        parts.hostname, port, type=socket.SOCK_STREAM))[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.connect(addr)
        key = base64.b64encode(os.urandom(16))
        head = (f"GET {target} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key.decode()}\r\nSec-WebSocket-Version: 13\r\n")
        if subprotocols:
            head += f"Sec-WebSocket-Protocol: {', '.join(subprotocols)}\r\n"
        await _send_all(sock, (head + "\r\n").encode())
        buf = b""
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise WsError(f"handshake answer head over {MAX_HEAD} bytes")
            data = await sock.recv(RECV)
            if not data:
                raise WsError("connection closed during the handshake")
            buf += data
        if end > MAX_HEAD:
            raise WsError(f"handshake answer head over {MAX_HEAD} bytes")
        lines = buf[:end].decode("latin-1").split("\r\n")
        status = lines[0].split(" ", 2)
        if len(status) < 2 or not status[0].startswith("HTTP/1.") or status[1] != "101":
            raise WsError(f"handshake refused: {lines[0]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, colon, v = line.partition(":")
            if not colon:
                raise WsError(f"bad header line in the handshake answer: {line!r}")
            k = k.strip().lower()
            headers[k] = f"{headers[k]}, {v.strip()}" if k in headers else v.strip()
        if headers.get("upgrade", "").lower() != "websocket":
            raise WsError(f"handshake answer Upgrade is {headers.get('upgrade')!r}")
        if "upgrade" not in [t.strip().lower() for t in headers.get("connection", "").split(",")]:
            raise WsError(f"handshake answer Connection is {headers.get('connection')!r}")
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
        if headers.get("sec-websocket-accept") != accept:
            raise WsError("handshake answer Sec-WebSocket-Accept does not match the key")
        chosen = headers.get("sec-websocket-protocol")
        if chosen is not None and chosen not in (subprotocols or []):
            raise WsError(f"the server chose a subprotocol not offered: {chosen!r}")
        if "sec-websocket-extensions" in headers:
            raise WsError("the server chose an extension, none was offered")
    except BaseException:
        sock.close()
        raise
    plain = socket.socket(fileno=sock.detach())
    plain.setblocking(False)
    return WsClient(plain, buf[end + 4:], chosen, max_message)


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    sent = await sock.send(data)
    if sent < len(data):
        view = memoryview(data)[sent:]
        while view:
            view = view[await sock.send(view):]


async def _drain(sock: socket.socket, view: memoryview) -> None:
    """All of ``view`` on the non-blocking ``sock``, as it takes it."""
    while view:
        await trio.lowlevel.wait_writable(sock)
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            pass


class WsClient:
    """One open connection: :meth:`send` messages, :meth:`run` (one task) reads until it ends."""

    def __init__(self, sock: socket.socket, buf: bytes, subprotocol: str | None,
                 max_message: int = MAX_MESSAGE) -> None:
        self.sock = sock
        self.subprotocol = subprotocol
        self.max_message = max_message
        self.lock = trio.Lock()  # held while a frame is partly written, and by the frames after it
        self.closed: str | None = None  # why it ended, once it has
        self.done = trio.Event()  # run() has returned (the socket is closed)
        self._buf = buf
        self._close_sent = False

    async def send(self, data: bytes) -> None:
        """One text message (UTF-8 ``data``)."""
        if self.closed is not None or self._close_sent:
            raise WsError(f"connection closed: {self.closed or 'closing'}")
        try:
            await self._write(frame(0x81, data, fresh_mask()))
        except _ERRORS as exc:
            raise WsError(f"connection failed: {exc}") from None

    async def _write(self, data: bytes) -> None:
        """One whole frame: at once when no other frame is partway and the socket takes it all,
        else after the frames before it, under :attr:`lock`."""
        lock = self.lock
        if lock.locked():
            async with lock:
                await _drain(self.sock, memoryview(data))
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            lock.acquire_nowait()  # free: nothing awaited since locked() said so
            try:
                await _drain(self.sock, memoryview(data)[sent:])
            finally:
                lock.release()

    async def _control(self, first: int, payload: bytes) -> None:
        await self._write(frame(first, payload, fresh_mask()))

    async def _send_close(self, code: int) -> None:
        if not self._close_sent:
            self._close_sent = True
            await self._control(0x88, code.to_bytes(2, "big") if code else b"")

    async def run(self, deliver: Callable[[bytes], object]) -> str:
        """Hand each message to ``deliver`` (bytes: text as UTF-8) until the connection ends;
        returns why (also in :attr:`closed`), and closes the socket."""
        try:
            why = await self._frames(deliver)
        except _Fail as fail:
            why = f"client failed the connection: {fail.code} {fail}"
            try:
                await self._send_close(fail.code)
            except _ERRORS:
                pass
        except _ERRORS as exc:
            why = f"1006 connection failed: {exc!r}"
        finally:
            self.close_socket()
            self.done.set()
        self.closed = why
        return why

    async def _frames(self, deliver: Callable[[bytes], object]) -> str:
        parts: list[bytes] = []  # received bytes not parsed yet, joined once ``need`` are there
        have = need = len(self._buf)
        if self._buf:
            parts.append(self._buf)
        fragments: list[bytes] = []  # the unfinished message's payloads
        frag_size = 0
        frag_op = 0  # its opcode (0: none)
        max_message = self.max_message
        sock = self.sock
        reads = 0
        while True:
            if have >= need and have:
                buf = parts[0] if len(parts) == 1 else b"".join(parts)
                n = len(buf)
                pos = 0
                need = 0
                while n - pos >= 2:
                    b0 = buf[pos]
                    b1 = buf[pos + 1]
                    if b1 & 0x80:
                        raise _Fail(1002, "masked frame from the server")
                    if b0 & 0x70:
                        raise _Fail(1002, "reserved bits set (no extension negotiated)")
                    length = b1
                    hdr = 2
                    if length == 126:
                        if n - pos < 4:
                            break
                        length = int.from_bytes(buf[pos + 2:pos + 4], "big")
                        hdr = 4
                        if length < 126:
                            raise _Fail(1002, "16-bit length not minimal")
                    elif length == 127:
                        if n - pos < 10:
                            break
                        length = int.from_bytes(buf[pos + 2:pos + 10], "big")
                        hdr = 10
                        if length < 65536 or length >> 63:
                            raise _Fail(1002, "64-bit length not minimal or over 2^63")
                    opcode = b0 & 0x0F
                    if opcode >= 8:
                        if not b0 & 0x80 or length > 125:
                            raise _Fail(1002, "control frame fragmented or over 125 bytes")
                    elif frag_size + length > max_message:
                        raise _Fail(1009, f"message over {max_message} bytes")
                    end = pos + hdr + length
                    if n < end:
                        need = end - pos
                        break
                    payload = buf[pos + hdr:end]
                    pos = end
                    if opcode == 1 or opcode == 2:
                        if frag_op:
                            raise _Fail(1002, "new message before the fragmented one ended")
                        if b0 & 0x80:
                            if opcode == 1 and not payload.isascii():
                                _utf8(payload)
                            deliver(payload)
                        else:
                            frag_op, fragments, frag_size = opcode, [payload], length
                    elif opcode == 0:
                        if not frag_op:
                            raise _Fail(1002, "continuation frame without a message")
                        fragments.append(payload)
                        frag_size += length
                        if b0 & 0x80:
                            message = b"".join(fragments)
                            if frag_op == 1 and not message.isascii():
                                _utf8(message)
                            frag_op, fragments, frag_size = 0, [], 0
                            deliver(message)
                    elif opcode == 8:
                        return await self._peer_close(payload)
                    elif opcode == 9:
                        await self._control(0x8A, payload)
                    elif opcode != 10:  # a pong needs nothing
                        raise _Fail(1002, f"unknown opcode {opcode}")
                rest = buf[pos:]
                parts = [rest] if rest else []
                have = len(rest)
            try:
                data = sock.recv(RECV)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data:
                return "1006 connection ended without a close frame"
            reads += 1
            if reads % 64 == 0:  # a server that always has more: let other tasks run meanwhile
                await trio.lowlevel.checkpoint()
            parts.append(data)
            have += len(data)

    async def _peer_close(self, payload: bytes) -> str:
        if len(payload) == 1:
            raise _Fail(1002, "close frame with a 1-byte payload")
        code = int.from_bytes(payload[:2], "big") if payload else 0
        if payload and code not in PEER_CODES:
            raise _Fail(1002, f"close code {code} not allowed on the wire")
        reason = _utf8(payload[2:])
        if not self._close_sent:
            try:
                await self._send_close(code)
            except _ERRORS:
                pass
        return f"{code} {reason}".rstrip() if code else "1005 no status code"

    async def aclose(self, code: int = 1000) -> None:
        """Send a close frame (once), wait up to 2 s for the server's, then close the socket."""
        if self.closed is None:
            try:
                await self._send_close(code)
            except _ERRORS:
                pass
            with trio.move_on_after(2):
                await self.done.wait()
        self.close_socket()

    def close_socket(self) -> None:
        """Close the socket; a task waiting on it gets ``trio.ClosedResourceError``."""
        if self.sock.fileno() != -1:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()


def _utf8(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise _Fail(1007, "text not valid UTF-8") from None
