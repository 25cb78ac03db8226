"""RFC 6455 framing, server side, sans-IO: bytes in, whole text messages out; messages in,
bytes out.

:class:`ServerFramer` is fed what the socket gave and returns the text messages it completed, in
order; everything else it finds is left on the framer for the shell to act on: ``replies``
(pongs to write), ``peer_close`` (the peer's close frame) and ``fault`` (why the connection must
fail, with its close code).  Messages completed before a fault in the same ``feed`` are still
returned, nothing after it is.  A payload that arrives over several reads is kept as chunks
and joined once; unmasking uses ``websockets.speedups.apply_mask`` when importable.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

_apply_mask: Callable[[bytes, bytes], bytes] | None
try:  # optional C helper; the pure-Python XOR below is exact, only slower on big payloads
    from websockets.speedups import apply_mask as _apply_mask
except ImportError:  # pragma: no cover - depends on the environment
    _apply_mask = None

_NO_MASK = b"\0\0\0\0"
_TEXT = 0x1
_FIN_TEXT = 0x80 | _TEXT  # a final text frame's first byte (no reserved bits)
_BINARY = 0x2
_CLOSE = 0x8
_PING = 0x9
_PONG = 0xA
#: Close codes a peer may send (RFC 6455 §7.4; 1004-1006 and 1015 never go on the wire).
_PEER_CODES = (frozenset(range(1000, 1004)) | frozenset(range(1007, 1015))
               | frozenset(range(3000, 5000)))
_SMALL_TEXT_HEADERS = [bytes((0x80 | _TEXT, n)) for n in range(126)]


class Fault(enum.IntEnum):
    """Why the connection fails; the value is the close code to send."""

    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    INVALID_PAYLOAD = 1007
    MESSAGE_TOO_BIG = 1009


def unmask(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    if not n or mask == _NO_MASK:
        return payload
    if _apply_mask is not None:
        return _apply_mask(payload, mask)
    key = (mask * ((n + 3) // 4))[:n]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


def text_header(size: int) -> bytes:
    """The header of an unmasked, final text frame of ``size`` payload bytes."""
    if size < 126:
        return _SMALL_TEXT_HEADERS[size]
    if size < 65536:
        return b"\x81\x7e" + size.to_bytes(2, "big")
    return b"\x81\x7f" + size.to_bytes(8, "big")


def control_frame(opcode: int, payload: bytes = b"") -> bytes:
    return bytes((0x80 | opcode, len(payload))) + payload


def close_frame(code: int | None, reason: str = "") -> bytes:
    """A close frame with ``code`` (None: no status) and ``reason`` cut to fit in 123 bytes."""
    if code is None:
        return control_frame(_CLOSE)
    text = reason.encode()[:123].decode(errors="ignore").encode()  # not cut inside a character
    return control_frame(_CLOSE, code.to_bytes(2, "big") + text)


class ServerFramer:
    """Parses the frames a client sends, strictly, as a server must (RFC 6455 §5).

    Unmasked frames, RSV bits, unknown opcodes, fragmented or oversized control frames, a stray
    continuation, a data frame inside a fragmented message, a 64-bit length with its top bit
    set and invalid close codes fail with 1002; a binary frame with 1003; a text message that
    is not UTF-8 with 1007; a frame whose header takes its message past ``max_message`` with 1009
    at once (the size in ``declared``).  After a 1003, 1007 or 1009 fault, or :meth:`closing`,
    data frames are dropped unread so the peer's close frame is still found; after a 1002
    nothing more is parsed (``dead``)."""

    __slots__ = (
        "_closing",
        "_fragments",
        "_frame",
        "_head",
        "_in_message",
        "_message",
        "_need",
        "_parts",
        "_skip",
        "dead",
        "declared",
        "detail",
        "fault",
        "max_message",
        "peer_close",
        "replies",
    )

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self._head = b""  # bytes of a frame whose header is not complete yet
        self._need = 0  # payload bytes of the current frame still to come
        self._skip = False  # the current frame's payload is dropped
        self._parts: list[bytes] = []  # the current frame's payload so far (masked)
        self._frame: tuple[int, int, bytes] = (0, 0, b"")  # its opcode, FIN bit, mask key
        self._fragments: list[bytes] = []  # the frames of a fragmented text message so far
        self._message = 0  # declared bytes of the data message being received
        self._in_message = False
        self._closing = False  # data frames are dropped unread
        self.replies: list[bytes] = []  # pongs for the shell to write
        self.peer_close: tuple[int | None, str] | None = None
        self.fault: Fault | None = None
        self.detail = ""
        self.declared = 0  # for MESSAGE_TOO_BIG: the message's size by its headers
        self.dead = False  # nothing more is parsed

    @property
    def partial(self) -> bool:
        """A message (or a frame of one) is partly received."""
        return bool(self._head) or self._need > 0 or self._in_message

    def closing(self) -> None:
        """From now on drop data frames unread (our close frame is out)."""
        self._closing = True

    def _fail(self, fault: Fault, detail: str) -> None:
        if self.fault is None:
            self.fault, self.detail = fault, detail
        self._closing = True
        if fault is Fault.PROTOCOL_ERROR:
            self.dead = True

    def feed(self, data: bytes) -> list[bytes]:
        """The text messages completed by ``data``, in order."""
        out: list[bytes] = []
        if self.dead or self.peer_close is not None:
            return out
        if self._need:
            if len(data) < self._need:
                if not self._skip:
                    self._parts.append(data)
                self._need -= len(data)
                return out
            k = self._need
            self._need = 0
            if self._skip:
                self._skip = False
            else:
                self._parts.append(data[:k])
                payload = b"".join(self._parts)
                self._parts = []
                opcode, fin, mask = self._frame
                self._complete(opcode, fin, unmask(payload, mask), out)
            data = data[k:]
        buf = self._head + data if self._head else data
        pos, n = 0, len(buf)
        while n - pos >= 2 and not self.dead and self.peer_close is None:
            b0, b1 = buf[pos], buf[pos + 1]
            if b0 & 0x70:
                self._fail(Fault.PROTOCOL_ERROR, "reserved bits set (no extension was negotiated)")
                break
            if not b1 & 0x80:
                self._fail(Fault.PROTOCOL_ERROR, "a client frame must be masked")
                break
            opcode, fin, length = b0 & 0x0F, b0 & 0x80, b1 & 0x7F
            if length < 126:
                hdr = 6
            elif length == 126:
                if n - pos < 4:
                    break
                length, hdr = int.from_bytes(buf[pos + 2:pos + 4], "big"), 8
            else:
                if n - pos < 10:
                    break
                length, hdr = int.from_bytes(buf[pos + 2:pos + 10], "big"), 14
                if length >> 63:
                    self._fail(Fault.PROTOCOL_ERROR, "a 64-bit frame length with its top bit set")
                    break
            if n - pos < hdr:
                break
            if (b0 == _FIN_TEXT and n - pos - hdr >= length and length <= self.max_message
                    and not self._in_message and not self._closing):
                # The usual frame: a whole, unfragmented text message (what _header and
                # _complete would do with it, without the calls).
                start = pos + hdr
                pos = start + length
                payload = unmask(buf[start:pos], buf[start - 4:start])
                if payload.isascii():
                    out.append(payload)
                else:
                    self._complete(_TEXT, fin, payload, out)  # UTF-8 checked there
                continue
            skip = not self._header(opcode, fin, length)
            if self.dead:
                break
            mask = buf[pos + hdr - 4:pos + hdr]
            start = pos + hdr
            if n - start < length:
                self._need = length - (n - start)
                self._skip = skip
                if not skip:
                    self._parts = [buf[start:]]
                    self._frame = (opcode, fin, mask)
                pos = n
                break
            pos = start + length
            if not skip:
                self._complete(opcode, fin, unmask(buf[start:pos], mask), out)
        self._head = buf[pos:] if pos < n and not self.dead and self.peer_close is None else b""
        return out

    def _header(self, opcode: int, fin: int, length: int) -> bool:
        """Check a frame header; False: its payload is to be dropped (or the framer failed)."""
        if opcode >= 8:
            if opcode > _PONG:
                self._fail(Fault.PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
            elif not fin or length > 125:
                self._fail(Fault.PROTOCOL_ERROR,
                           "a control frame must be final and at most 125 bytes")
            return not self.dead
        if opcode > _BINARY:
            self._fail(Fault.PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
            return False
        if self._closing:
            return False
        if opcode == 0:
            if not self._in_message:
                self._fail(Fault.PROTOCOL_ERROR, "a continuation frame with no message to continue")
                return False
            size = self._message + length
        else:
            if self._in_message:
                self._fail(Fault.PROTOCOL_ERROR, "a new data frame inside a fragmented message")
                return False
            if opcode == _BINARY:
                self._fail(Fault.UNSUPPORTED_DATA, "binary frame")
                return False
            size = length
        if size > self.max_message:
            self.declared = size
            self._fail(Fault.MESSAGE_TOO_BIG, f"a message of {size} bytes")
            return False
        self._message = size
        self._in_message = not fin
        return True

    def _complete(self, opcode: int, fin: int, payload: bytes, out: list[bytes]) -> None:
        if opcode < 8:
            if not fin:
                self._fragments.append(payload)
                return
            if self._fragments:
                self._fragments.append(payload)
                payload = b"".join(self._fragments)
                self._fragments = []
            self._message = 0
            if not payload.isascii():
                try:
                    payload.decode()
                except UnicodeDecodeError as exc:
                    self._fail(Fault.INVALID_PAYLOAD,
                               f"a text message that is not UTF-8 ({exc.reason})")
                    return
            out.append(payload)
        elif opcode == _PING:
            if not self._closing:
                self.replies.append(control_frame(_PONG, payload))
        elif opcode == _CLOSE:
            code: int | None = None
            reason = ""
            if len(payload) == 1:
                self._fail(Fault.PROTOCOL_ERROR, "a close frame with a 1-byte payload")
                return
            if payload:
                code = int.from_bytes(payload[:2], "big")
                if code not in _PEER_CODES:
                    self._fail(Fault.PROTOCOL_ERROR, f"close code {code} is not allowed")
                    return
                try:
                    reason = payload[2:].decode()
                except UnicodeDecodeError:
                    self._fail(Fault.INVALID_PAYLOAD, "a close reason that is not UTF-8")
                    return
            self.peer_close = (code, reason)
