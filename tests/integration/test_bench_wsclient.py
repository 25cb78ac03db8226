"""The bench's lean WebSocket client (bench/wsclient.py): against a wsproto server (fragments, a
ping between them, 16- and 64-bit lengths, masks, frames kept whole when the socket is full, the
close handshake), against raw servers that break the handshake or the framing, and as
bench/run.py's ``WsConn`` against the gateway."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Awaitable, Callable

import pytest
import trio
from helpers import fixture_backend, load_bench, make_config, run_gateway
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    Pong,
    Request,
    TextMessage,
)

pytestmark = pytest.mark.system



br = load_bench("run")
wsclient = br.wsclient


async def serve_once(handler: Callable[[trio.SocketStream], Awaitable[None]],
                     nursery: trio.Nursery) -> str:
    """A one-connection server on 127.0.0.1 running ``handler``; its ws:// URL."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]

    async def once() -> None:
        async with listener:
            stream = await listener.accept()
        async with stream:
            await handler(stream)

    nursery.start_soon(once)
    return f"ws://127.0.0.1:{port}/"


class WsprotoServer:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.SERVER)
        self.raw: list[bytes] = []  # what the client wrote, as read

    async def send(self, *events: object) -> None:
        await self.stream.send_all(b"".join(self.ws.send(e) for e in events))  # type: ignore[arg-type]

    async def next_event(self) -> object:
        while True:
            for event in self.ws.events():
                return event
            data = await self.stream.receive_some(65536)
            assert data, "the client closed the TCP connection first"
            self.raw.append(data)
            self.ws.receive_data(data)

    async def next_message(self) -> str:
        """A whole text message (wsproto hands a long one over in pieces)."""
        parts = []
        while True:
            event = await self.next_event()
            assert isinstance(event, TextMessage), event
            parts.append(event.data)
            if event.message_finished:
                return "".join(parts)


BIG_SENDS = 5


def big_message(i: int) -> str:
    return str(i) * (i % 2 * 3 * 2**20 + 10)  # 3 MiB and 10-byte messages, alternating


async def test_fragments_ping_lengths_masks_and_the_close_handshake() -> None:
    got: dict[str, object] = {}

    async def server(stream: trio.SocketStream) -> None:
        s = WsprotoServer(stream)
        req = await s.next_event()
        assert isinstance(req, Request) and req.subprotocols == ["mcp"]
        await s.send(AcceptConnection(subprotocol="mcp"))
        first = await s.next_event()
        second = await s.next_event()
        got["in"] = [first, second]
        got["raw"] = b"".join(s.raw)
        got["big"] = sorted([await s.next_message() for _ in range(BIG_SENDS)])
        await s.send(TextMessage(data="ab", message_finished=False), Ping(payload=b"p1"),
                     TextMessage(data="cé", message_finished=False),
                     TextMessage(data="d" * 300, message_finished=True),
                     BytesMessage(data=b"x" * 70000))
        got["pong"] = await s.next_event()
        await s.send(CloseConnection(code=1001, reason="bye"))
        got["close"] = await s.next_event()

    messages: list[bytes] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await serve_once(server, nursery)
            client = await wsclient.connect(url, ["mcp"])
            assert client.subprotocol == "mcp"
            nursery.start_soon(client.run, messages.append)
            for _ in range(2):
                await client.send(b"hello")
            async with trio.open_nursery() as senders:  # more than the socket takes at once
                for i in range(BIG_SENDS):
                    senders.start_soon(client.send, big_message(i).encode())
            await client.done.wait()
    first, second = got["in"]  # type: ignore[misc]
    assert isinstance(first, Message) and first.data == "hello"
    assert isinstance(second, Message) and second.data == "hello"
    raw = got["raw"]
    assert isinstance(raw, bytes)
    after = raw.split(b"\r\n\r\n", 1)[1]  # what followed the handshake request
    frames = after[:11], after[11:22]  # two masked 5-byte text frames: 2 + 4 + 5 bytes each
    assert frames[0][:2] == frames[1][:2] == b"\x81\x85"
    assert frames[0][2:] != frames[1][2:]  # a fresh mask, so the same text looks different
    assert got["big"] == sorted(big_message(i) for i in range(BIG_SENDS))  # whole, none mixed
    assert messages == [("abcé" + "d" * 300).encode(), b"x" * 70000]
    pong = got["pong"]
    assert isinstance(pong, Pong) and pong.payload == b"p1"
    close = got["close"]
    assert isinstance(close, CloseConnection) and close.code == 1001
    assert client.closed == "1001 bye"


async def test_a_message_over_the_bound_fails_the_connection_with_1009() -> None:
    got: dict[str, object] = {}

    async def server(stream: trio.SocketStream) -> None:
        s = WsprotoServer(stream)
        assert isinstance(await s.next_event(), Request)
        await s.send(AcceptConnection(),
                     TextMessage(data="a" * 600, message_finished=False),
                     TextMessage(data="a" * 600, message_finished=True))
        got["close"] = await s.next_event()

    messages: list[bytes] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await serve_once(server, nursery)
            client = await wsclient.connect(url, max_message=1000)
            assert client.subprotocol is None
            await client.run(messages.append)
    close = got["close"]
    assert isinstance(close, CloseConnection) and close.code == 1009
    assert messages == []
    assert client.closed is not None and client.closed.startswith("client failed the connection: "
                                                                  "1009")


async def raw_handshake(stream: trio.SocketStream, answer: Callable[[bytes], bytes]) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        head += await stream.receive_some(65536)
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    await stream.send_all(answer(key))


def accept_of(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + wsclient.GUID).digest())


def good_answer(key: bytes) -> bytes:
    return (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept_of(key) + b"\r\n\r\n")


@pytest.mark.parametrize(("answer", "error"), [
    (lambda key: b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n", "refused"),
    (lambda key: good_answer(key).replace(accept_of(key), b"d3Jvbmc="), "Accept"),
    (lambda key: good_answer(key).replace(b"Upgrade: websocket", b"Upgrade: h2c"), "Upgrade"),
    (lambda key: good_answer(key)[:-2] + b"Sec-WebSocket-Protocol: other\r\n\r\n", "subprotocol"),
    (lambda key: good_answer(key)[:-2] + b"Sec-WebSocket-Extensions: x\r\n\r\n", "extension"),
])
async def test_a_bad_handshake_answer_is_refused(answer: Callable[[bytes], bytes],
                                                 error: str) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await serve_once(lambda stream: raw_handshake(stream, answer), nursery)
            with pytest.raises(wsclient.WsError, match=error):
                await wsclient.connect(url, ["mcp"])


@pytest.mark.parametrize(("frames", "code"), [
    (b"\x81\x82abcd" + bytes(a ^ b for a, b in zip(b"hi", b"ab", strict=True)), 1002),  # masked
    (b"\xc1\x02hi", 1002),  # RSV1 without an extension
    (b"\x80\x02hi", 1002),  # a continuation with no message started
    (b"\x01\x01h\x81\x01i", 1002),  # a new message inside a fragmented one
    (b"\x09\x01p", 1002),  # a fragmented ping
    (b"\x83\x00", 1002),  # an unknown opcode
    (b"\x81\x7e\x00\x05hello", 1002),  # a 16-bit length that fits in 7 bits
    (b"\x81\x02\xc3\x28", 1007),  # invalid UTF-8 in a text frame
    (b"\x88\x01\x03", 1002),  # a close frame with a 1-byte payload
])
async def test_a_frame_the_rfc_forbids_fails_the_connection(frames: bytes, code: int) -> None:
    got: list[bytes] = []

    async def server(stream: trio.SocketStream) -> None:
        await raw_handshake(stream, good_answer)
        await stream.send_all(b"\x81\x02ok" + frames)
        data = b""
        while len(data) < 8:  # the client's close frame: 2 + 4 (mask) + 2 (the code)
            more = await stream.receive_some(65536)
            assert more
            data += more
        got.append(data)

    messages: list[bytes] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await serve_once(server, nursery)
            client = await wsclient.connect(url)
            await client.run(messages.append)
    assert messages == [b"ok"]  # what came before the bad frame was delivered
    close = got[0]
    assert close[:2] == b"\x88\x82"
    assert bytes(a ^ b for a, b in zip(close[6:8], close[2:4], strict=True)) == code.to_bytes(2,
                                                                                             "big")
    assert client.closed is not None and f": {code} " in client.closed


async def test_the_bench_ws_conn_calls_through_the_gateway_and_closes_cleanly() -> None:
    cfg = make_config(fixture_backend("fx"))
    backend = br.backend_spec("fixture")
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, trio.open_nursery() as nursery:
            conn = await br.WsConn.open(nursery, gw.url, ["mcp"])
            assert isinstance(conn, br.LeanWsConn) and conn.ws.subprotocol == "mcp"
            await conn.initialize()
            message = "é" * 100 + "x" * 70000  # a 64-bit length each way
            answers = await _gather([conn.request("tools/call", {
                "name": "fx__echo", "arguments": {"message": f"{i}{message}"}}) for i in range(8)])
            for i, resp in enumerate(answers):
                assert br.answer_ok(resp, f"{i}{message}", backend)
            await conn.aclose()
            assert conn.closed is not None and conn.closed.startswith("websocket closed (1000")


async def _gather(calls: list[Awaitable[dict[str, object]]]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = [{} for _ in calls]

    async def one(i: int, call: Awaitable[dict[str, object]]) -> None:
        out[i] = await call

    async with trio.open_nursery() as nursery:
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call)
    return out
