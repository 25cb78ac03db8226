"""The client write path (issue 8): answers go straight to the socket when nothing is queued, the
rest is held or queued and flushed in order; a close frame is only ever written at a frame
boundary.  Real sockets, real fixture child, clients that read slowly or not at all."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import fixture_backend, make_config, run_gateway, wait_status
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

MIB = 1 << 20

pytestmark = pytest.mark.system


def call(id: Any, tool: str, arguments: dict[str, Any],
         meta: dict[str, Any] | None = None) -> bytes:
    params: dict[str, Any] = {"name": tool, "arguments": arguments}
    if meta is not None:
        params["_meta"] = meta
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                       "params": params}).encode()


INIT = json.dumps({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "t", "version": "0"}}}).encode()


def masked_text(payload: bytes) -> bytes:
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else (b"\xfe" + struct.pack("!H", n) if n < 65536
                                               else b"\xff" + struct.pack("!Q", n))
    return b"\x81" + size + b"\0\0\0\0" + payload  # mask key zero: the payload as is


async def ws_open(port: int | None) -> tuple[trio.SocketStream, WSConnection]:
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host="127.0.0.1", target="/", subprotocols=["mcp"])))
    while True:
        ws.receive_data(await stream.receive_some(65536))
        if any(isinstance(e, AcceptConnection) for e in ws.events()):
            return stream, ws


async def ws_initialize(stream: trio.SocketStream, ws: WSConnection) -> None:
    """Initialize, and wait for the answer (a call sent with it could be handled first)."""
    await stream.send_all(masked_text(INIT))
    while True:
        ws.receive_data(await stream.receive_some(65536))
        if any(isinstance(e, TextMessage) for e in ws.events()):
            return


async def ws_read_all(stream: trio.SocketStream,
                      ws: WSConnection) -> tuple[list[dict[str, Any]], int | None]:
    """Every message until the close frame (its code) or the end of the stream (None); wsproto
    raises on any byte that is not a well-formed frame."""
    got: list[dict[str, Any]] = []
    parts: list[str] = []
    while True:
        try:
            data = await stream.receive_some(1 << 20)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            return got, None
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, TextMessage):
                parts.append(event.data)
                if event.message_finished:
                    got.append(json.loads("".join(parts)))
                    parts = []
            elif isinstance(event, CloseConnection):
                return got, event.code


async def test_a_slow_unix_reader_gets_every_message_whole_and_in_order(tmp_path: Path) -> None:
    # A 3 MB answer (far beyond the socket buffers: written in part, the rest held), then a
    # call whose 200 progress notifications and answer queue behind it: all arrive, whole, in
    # the order they were sent, and nothing stays charged.
    sock = tmp_path / "gw.sock"
    cfg = make_config(fixture_backend("fx"), unix=str(sock))
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw:
            port = gw.bound.admin_port
            stream = await trio.open_unix_socket(str(sock))
            async with stream:
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                await stream.send_all(INIT + b"\n")
                init = await stream.receive_some(65536)
                assert init.endswith(b"\n") and json.loads(init)["id"] == "init"
                await stream.send_all(call("big", "fx__big", {"size": 3_000_000}) + b"\n")
                await wait_status(port, lambda st: st["outbound_messages_queued"] > 0)
                await stream.send_all(call("p", "fx__progress", {"steps": 200, "delay": 0},
                                           meta={"progressToken": "tok"}) + b"\n")
                await wait_status(port, lambda st: st["client_requests_in_flight"] == 0)
                buf, got = b"", []
                while "p" not in [m.get("id") for m in got]:
                    # slowly: a read only once the gateway has written all it could
                    await trio.testing.wait_all_tasks_blocked()
                    data = await stream.receive_some(65536)
                    assert data
                    buf += data
                    *lines, buf = buf.split(b"\n")
                    got += [json.loads(line) for line in lines]
            assert [m.get("id") for m in got if "id" in m] == ["big", "p"]
            big = next(m for m in got if m.get("id") == "big")
            assert len(big["result"]["content"][0]["text"]) == 3_000_000
            progress = [m["params"]["progress"] for m in got
                        if m.get("method") == "notifications/progress"]
            assert progress == list(range(1, 201))
            assert [m.get("id") for m in got].index("p") == len(got) - 1
            await wait_status(port, lambda st: st["buffered_bytes"] == 0
                              and st["outbound_messages_queued"] == 0
                              and st["connection_slots"] == 0)


async def test_a_client_that_stops_reading_mid_frame_never_gets_a_close_frame_inside_it() -> None:
    # Answers of 1 MB to a client that does not read: one is cut off mid-frame by the full socket;
    # the byte bound closes the connection.  Read afterwards, the stream is whole frames and then
    # its end (a close frame written into the frame's payload would be a protocol error here).
    cfg = make_config(fixture_backend("fx"),
                      gateway=f"max_message_bytes = {2 * MIB}\noutbound_bytes = {2 * MIB}")
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw:
            port = gw.bound.admin_port
            stream, ws = await ws_open(gw.bound.websocket_port)
            async with stream:
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                await ws_initialize(stream, ws)
                for i in range(8):
                    await stream.send_all(masked_text(call(i, "fx__big", {"size": 1_000_000})))
                await wait_status(port, lambda st: st["connections"] == {}
                                  and st["buffered_bytes"] == 0)
                got, code = await ws_read_all(stream, ws)
            assert all(len(m["result"]["content"][0]["text"]) == 1_000_000 for m in got)
            assert len(got) < 8
            # the close frame only if nothing was cut off; else the TCP connection just ends
            assert code in (1008, None)


async def test_the_answer_to_a_peer_close_goes_behind_the_rest_of_a_held_frame() -> None:
    # The client asks for an 8 MB answer (more than the socket buffers hold), then sends its
    # close frame without reading: the gateway finishes the frame it started before answering
    # the close.
    cfg = make_config(fixture_backend("fx"), gateway=f"max_message_bytes = {16 * MIB}\n"
                      f"outbound_bytes = {16 * MIB}\nbuffered_bytes_total = {64 * MIB}")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            port = gw.bound.admin_port
            stream, ws = await ws_open(gw.bound.websocket_port)
            async with stream:
                await ws_initialize(stream, ws)
                await stream.send_all(masked_text(call("big", "fx__big", {"size": 8_000_000})))
                await wait_status(port, lambda st: st["outbound_messages_queued"] > 0)
                await stream.send_all(b"\x88\x82\0\0\0\0" + struct.pack("!H", 1000))
                # the close is read (the gateway is idle again) while the answer is still held
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                got, code = await ws_read_all(stream, ws)
            assert [m["id"] for m in got] == ["big"]
            assert len(got[0]["result"]["content"][0]["text"]) == 8_000_000
            assert code == 1000
