"""The WebSocket transport itself: ping/pong, fragmented messages, clean close, subprotocol."""

from __future__ import annotations

import json

import pytest
import trio
import trio_websocket
from helpers import fixture_backend, make_config, run_gateway
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

pytestmark = pytest.mark.system


async def test_ping_fragments_subprotocol_and_close() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw:
            port = gw.bound.websocket_port
            assert port is not None
            # trio-websocket: the subprotocol is accepted and a ping is answered with a pong
            async with trio_websocket.open_websocket_url(gw.url, subprotocols=["mcp"]) as ws:
                assert ws.subprotocol == "mcp"
                with trio.fail_after(5):
                    await ws.ping(b"are-you-there")
            # a raw wsproto client: one request split over three fragments, then a clean close
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                client = WSConnection(ConnectionType.CLIENT)
                await stream.send_all(
                    client.send(Request(host="127.0.0.1", target="/", subprotocols=["mcp"])))
                events: list[object] = []

                async def pump() -> None:
                    while True:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        client.receive_data(data)
                        events.extend(client.events())
                        if any(isinstance(e, CloseConnection) for e in events):
                            return
                        if any(isinstance(e, TextMessage) for e in events) or (
                                any(isinstance(e, AcceptConnection) for e in events) and not sent):
                            return

                sent = False
                await pump()
                assert isinstance(events[0], AcceptConnection) and events[0].subprotocol == "mcp"
                msg = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                    "protocolVersion": "2025-11-25", "capabilities": {}}})
                thirds = [msg[: len(msg) // 3], msg[len(msg) // 3 : 2 * len(msg) // 3],
                          msg[2 * len(msg) // 3 :]]
                for i, part in enumerate(thirds):
                    await stream.send_all(
                        client.send(TextMessage(data=part, message_finished=i == 2)))
                sent = True
                events.clear()
                await pump()
                reply = json.loads(next(e.data for e in events if isinstance(e, TextMessage)))
                assert reply["id"] == 1 and reply["result"]["protocolVersion"] == "2025-11-25"
                events.clear()
                await stream.send_all(client.send(CloseConnection(code=1000, reason="bye")))
                await pump()
                closes = [e for e in events if isinstance(e, CloseConnection)]
                assert closes and closes[0].code == 1000  # the gateway answered the close
