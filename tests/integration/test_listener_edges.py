"""Edges of the client listener (issue 7): WebSocket frame types, invalid UTF-8, repeated
``Origin`` headers, ``Host`` checks against DNS rebinding, and a second ``initialize``."""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
import pytest
import trio
from helpers import connect, fixture_backend, make_config, run_gateway, text_of
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import Opcode

pytestmark = pytest.mark.system


class RawClient:
    """A wsproto client on a real socket, for frames the usual clients refuse to send."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.events: list[Event] = []
        self.eof = False

    async def upgrade(self, host: str = "127.0.0.1",
                      headers: list[tuple[bytes, bytes]] | None = None) -> Event:
        await self.stream.send_all(self.ws.send(Request(host=host, target="/", subprotocols=["mcp"],
                                                        extra_headers=headers or [])))
        return await self.next(AcceptConnection, RejectConnection)

    async def next(self, *kinds: type) -> Any:
        """The next event of one of ``kinds`` (those before it are kept in ``events``)."""
        with trio.fail_after(10):
            while True:
                for i, e in enumerate(self.events):
                    if isinstance(e, kinds):
                        return self.events.pop(i)
                if self.eof:
                    raise EOFError(f"no {kinds} before end of stream; got {self.events}")
                data = await self.stream.receive_some(65536)
                if not data:
                    self.eof = True
                    continue
                self.ws.receive_data(data)
                self.events.extend(self.ws.events())

    async def send_text(self, obj: Any) -> None:
        await self.stream.send_all(self.ws.send(TextMessage(data=json.dumps(obj))))

    async def send_raw_frame(self, opcode: Opcode, payload: bytes) -> None:
        """One final, masked frame built by hand (wsproto would encode text as UTF-8)."""
        assert len(payload) < 126
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        await self.stream.send_all(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked)

    async def reject_body(self) -> bytes:
        body = b""
        while True:
            event = await self.next(RejectData)
            body += event.data
            if event.body_finished:
                return body


async def open_raw(port: int | None) -> RawClient:
    assert port is not None
    return RawClient(await trio.open_tcp_stream("127.0.0.1", port))


INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "t", "version": "0"}}}


async def test_binary_frame_gets_an_error_then_close_1003() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            client = await open_raw(gw.bound.websocket_port)
            async with client.stream:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.send_text(INIT)
                assert json.loads((await client.next(TextMessage)).data)["id"] == 1
                await client.stream.send_all(client.ws.send(BytesMessage(data=json.dumps(
                    {"jsonrpc": "2.0", "id": 2, "method": "ping"}).encode())))
                error = json.loads((await client.next(TextMessage)).data)
                assert error["error"]["code"] == -32600, error
                assert error["error"]["data"]["reason"] == "binary_frame"
                close = await client.next(CloseConnection)
                assert close.code == 1003


async def test_invalid_utf8_text_frame_closes_with_1007() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            client = await open_raw(gw.bound.websocket_port)
            async with client.stream:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.send_raw_frame(Opcode.TEXT,
                                            b'{"jsonrpc": "2.0", "id": 1, "method": "\xff\xfe"}')
                close = await client.next(CloseConnection)
                assert close.code == 1007
                assert not [e for e in client.events if isinstance(e, TextMessage)]  # no answer


async def test_every_origin_header_must_be_allowed() -> None:
    cfg = make_config(fixture_backend("fx"))
    cfg = msgspec.structs.replace(cfg, listen=msgspec.structs.replace(
        cfg.listen, allowed_origins=["https://good.example"]))
    good, evil = (b"origin", b"https://good.example"), (b"origin", b"https://evil.example")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            for headers, accepted in (([good], True), ([good, evil], False), ([evil, good], False),
                                      ([good, good], True), ([evil], False)):
                client = await open_raw(gw.bound.websocket_port)
                async with client.stream:
                    event = await client.upgrade(headers=headers)
                    assert isinstance(event, AcceptConnection) is accepted, (headers, event)
                    if not accepted:
                        assert event.status_code == 403


async def test_upgrade_host_must_be_loopback_bound_or_allowed() -> None:
    cfg = make_config(fixture_backend("fx"))
    cfg = msgspec.structs.replace(cfg, listen=msgspec.structs.replace(
        cfg.listen, allowed_hosts=["gw.example.internal"]))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            port = gw.bound.websocket_port
            for host, accepted in ((f"127.0.0.1:{port}", True), ("localhost", True),
                                   (f"[::1]:{port}", True), (f"LOCALHOST:{port}", True),
                                   ("gw.example.internal:1", True),
                                   (f"rebind.attacker.example:{port}", False),
                                   ("127.0.0.2", False)):
                client = await open_raw(port)
                async with client.stream:
                    event = await client.upgrade(host=host)
                    assert isinstance(event, AcceptConnection) is accepted, (host, event)
                    if not accepted:
                        assert event.status_code == 421
                        assert await client.reject_body() == b"Host not allowed\n"


async def test_second_initialize_is_refused_and_the_revision_stays() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, version="2025-11-25") as c:
            r = await c.request("initialize", {"protocolVersion": "2025-03-26", "capabilities": {},
                                               "clientInfo": {"name": "t", "version": "0"}})
            assert "result" not in r, r
            assert r["error"]["code"] == -32600
            assert r["error"]["data"]["reason"] == "already_initialized"
            assert "2025-11-25" in r["error"]["message"]
            # Still 2025-11-25: batches (2025-03-26 only) stay refused, and the connection serves.
            await c.send([{"jsonrpc": "2.0", "id": "b1", "method": "ping"}])
            refused = await c.wait_for(lambda: [m for m in c.received if m.get("id") is None
                                                and "error" in m])
            assert refused[0]["error"]["code"] == -32600
            assert text_of(await c.call("fx__echo", {"message": "still open"})) == "still open"
