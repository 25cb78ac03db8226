"""The hand-written RFC 6455 server framing (sans-IO): what wsproto's client sends, split at
every byte, comes out as the same messages; every refusal has its close code."""

from __future__ import annotations

import os
import struct

import pytest
from wsproto.frame_protocol import FrameProtocol, Opcode

from gateway.protocol.wsframing import Fault, ServerFramer, close_frame, text_header, unmask


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bytes | None = None, rsv: int = 0,
          length: int | None = None) -> bytes:
    """One client frame, masked with ``mask`` (random by default)."""
    mask = os.urandom(4) if mask is None else mask
    n = len(payload) if length is None else length
    head = bytes([(0x80 if fin else 0) | rsv | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    return head + mask + unmask(payload, mask)


def test_messages_survive_any_split_and_fragmentation() -> None:
    big = ("é" * 40_000).encode()  # > 64 KiB: a 64-bit length, non-ASCII UTF-8
    wire = (frame(1, b'{"a":1}') + frame(9, b"hi") + frame(1, b"[1,", fin=False) + frame(10, b"")
            + frame(0, b"2,", fin=False) + frame(9, b"") + frame(0, b"3]") + frame(1, big)
            + frame(1, b""))
    for step in (1, 2, 3, 7, 100, 65536, len(wire)):
        f = ServerFramer(1 << 20)
        got: list[bytes] = []
        for i in range(0, len(wire), step):
            got += f.feed(wire[i:i + step])
        assert got == [b'{"a":1}', b"[1,2,3]", big, b""]
        assert f.replies == [b"\x8a\x02hi", b"\x8a\x00"]  # a pong per ping, payload echoed
        assert f.fault is None and not f.partial


def test_refusals_and_their_close_codes() -> None:
    cases: list[tuple[bytes, Fault]] = [
        (b"\x81\x01x", Fault.PROTOCOL_ERROR),  # not masked
        (frame(1, b"x", rsv=0x40), Fault.PROTOCOL_ERROR),
        (frame(3, b"x"), Fault.PROTOCOL_ERROR),
        (frame(0, b"x"), Fault.PROTOCOL_ERROR),  # a continuation with nothing to continue
        (frame(1, b"x", fin=False) + frame(1, b"y"), Fault.PROTOCOL_ERROR),
        (frame(9, b"p", fin=False), Fault.PROTOCOL_ERROR),
        (frame(9, b"p" * 126), Fault.PROTOCOL_ERROR),
        (frame(8, b"\x03"), Fault.PROTOCOL_ERROR),
        (frame(8, struct.pack("!H", 1005)), Fault.PROTOCOL_ERROR),
        (b"\x81\xff" + b"\x80" + b"\0" * 7 + b"\0\0\0\0", Fault.PROTOCOL_ERROR),  # 64-bit top bit
        (frame(2, b"{}"), Fault.UNSUPPORTED_DATA),
        (frame(1, b"\xc3\x28"), Fault.INVALID_PAYLOAD),
        (frame(1, b"\xc3", fin=False) + frame(0, b"\x28"), Fault.INVALID_PAYLOAD),
        (frame(8, struct.pack("!H", 1000) + b"\xff"), Fault.INVALID_PAYLOAD),
    ]
    for wire, fault in cases:
        f = ServerFramer(1000)
        assert f.feed(frame(1, b"before") + wire + frame(1, b"after")) == [b"before"], wire
        assert f.fault is fault and fault.value in (1002, 1003, 1007), wire


def test_a_message_is_refused_by_the_header_that_takes_it_over_the_limit() -> None:
    f = ServerFramer(1000)
    # the header alone (no payload yet) of a frame declaring 2^63-1 bytes
    assert f.feed(b"\x81\xff" + struct.pack("!Q", 2**63 - 1) + b"\0\0\0\0") == []
    assert f.fault is Fault.MESSAGE_TOO_BIG and f.declared == 2**63 - 1
    f = ServerFramer(1000)
    assert f.feed(frame(1, b"a" * 600, fin=False) + frame(0, b"b" * 401, length=401)[:8]) == []
    assert f.fault is Fault.MESSAGE_TOO_BIG and f.declared == 1001
    # after a refusal, frame boundaries are still followed: the peer's close is found
    f.feed(b"b" * 401 + frame(1, b"dropped") + frame(8, struct.pack("!H", 1000) + b"bye"))
    assert f.peer_close == (1000, "bye")
    f = ServerFramer(1000)
    assert f.feed(frame(1, b"a" * 1000)) == [b"a" * 1000]  # exactly at the limit
    assert f.feed(frame(8, b"")) == [] and f.peer_close == (None, "")


def test_frames_written_are_what_a_client_parses() -> None:
    client = FrameProtocol(client=True, extensions=[])
    for size in (0, 125, 126, 65535, 65536, 200_000):
        payload = b"x" * size
        client.receive_bytes(text_header(size) + payload)
        (got,) = list(client.received_frames())
        assert got.opcode is Opcode.TEXT and got.message_finished and len(got.payload) == size
    client.receive_bytes(close_frame(1009, "oversize"))
    (got,) = list(client.received_frames())
    assert got.opcode is Opcode.CLOSE and got.payload == (1009, "oversize")


@pytest.mark.parametrize("size", [1, 3, 4, 5, 1000])
def test_unmask_matches_bytewise_xor(size: int) -> None:
    data, mask = os.urandom(size), os.urandom(4)
    assert unmask(data, mask) == bytes(b ^ mask[i % 4] for i, b in enumerate(data))
