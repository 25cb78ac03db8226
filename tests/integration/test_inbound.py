"""Inbound bounds: reader backpressure, batch answers under the byte limits, the connection slot
taken at accept, WebSocket frames refused by their header and messages that never complete.
Real sockets, real fixture child."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import (
    connect,
    fixture_backend,
    make_config,
    metric,
    run_gateway,
    text_of,
    upgrade_status,
    wait_status,
)
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from gateway import limits

MIB = 1 << 20

pytestmark = pytest.mark.system


async def read_lines(stream: trio.SocketStream, want: int) -> list[dict[str, Any]]:
    """Read newline-delimited messages until ``want`` arrived or the stream ends."""
    buf, out = b"", []
    while len(out) < want:
        data = await stream.receive_some(1 << 20)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        out += [json.loads(line) for line in lines if line]
    return out


async def test_a_burst_of_pipelined_requests_is_answered_in_full(tmp_path: Path) -> None:
    # 600 requests in one write: more than outbound_queue (512) answers queued at once if the
    # reader handled them all before the writer ran
    sock = tmp_path / "gw.sock"
    cfg = make_config(fixture_backend("fx"), unix=str(sock))
    burst = 600
    with trio.fail_after(30):
        async with run_gateway(cfg):
            stream = await trio.open_unix_socket(str(sock))
            async with stream:
                await stream.send_all(b"".join(
                    b'{"jsonrpc":"2.0","id":%d,"method":"nosuch"}\n' % i for i in range(burst)))
                got = await read_lines(stream, burst)
                assert sorted(m["id"] for m in got) == list(range(burst))
                # every one answered: unknown method, or (beyond the in-flight cap) overloaded
                assert {m["error"]["code"] for m in got} <= {-32601, -32006}
                await stream.send_all(b'{"jsonrpc":"2.0","id":"p","method":"ping"}\n')
                assert (await read_lines(stream, 1))[0]["id"] == "p"


async def test_batch_answers_are_charged_and_those_past_outbound_bytes_become_overloaded() -> None:
    # four answers of 700 kB and a slow call: the finished answers wait for the slow one, charged
    # to the connection; only two fit in outbound_bytes (2 MiB), the other two are -32006
    cfg = make_config(fixture_backend("fx"),
                      gateway=f"max_message_bytes = {2 * MIB}\noutbound_bytes = {2 * MIB}")
    size = 700_000
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, version="2025-03-26") as client:
            port = gw.bound.admin_port
            batch: list[dict[str, Any]] = [{"jsonrpc": "2.0", "id": f"b{i}", "method": "tools/call",
                      "params": {"name": "fx__big", "arguments": {"size": size}}} for i in range(4)]
            batch.append({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
                          "params": {"name": "fx__sleep", "arguments": {"seconds": 60}}})
            await client.send(batch)
            # all four answered and held, charged (two results, two small errors)
            await wait_status(port, lambda st: st["buffered_bytes"] > 2 * size
                              and st["backends"][0]["instances"][0]["inflight"] == 1)
            # no answer for it
            await client.notify("notifications/cancelled", {"requestId": "slow"})
            await client.wait_for(lambda: all(f"b{i}" in client.responses for i in range(4)))
            answers = [client.responses[f"b{i}"] for i in range(4)]
            assert sorted(len(text_of(a)) for a in answers if "result" in a) == [size, size]
            errors = [a["error"] for a in answers if "error" in a]
            assert [(e["code"], e["data"])
                    for e in errors] == [(-32006, {"reason": "overloaded", "limit": 2 * MIB})] * 2
            assert "slow" not in client.responses and not client.closed
            await wait_status(port, lambda st: st["buffered_bytes"] == 0)
            assert text_of(await client.call("fx__echo", {"message": "still here"})) == "still here"


async def test_half_open_websocket_handshakes_hold_a_slot_and_the_cap_refuses_at_once(
    tmp_path: Path) -> None:
    sock = tmp_path / "gw.sock"
    cfg = make_config(fixture_backend("fx"), gateway="max_connections = 2", unix=str(sock))
    refused = "mcp_gateway_client_connections_refused_total"
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            port, ws_port = gw.bound.admin_port, gw.bound.websocket_port
            assert ws_port is not None
            half_open = [await trio.open_tcp_stream("127.0.0.1", ws_port) for _ in range(2)]
            for stream in half_open:  # a request line, and nothing more
                await stream.send_all(b"GET / HTTP/1.1\r\n")
            # both hold a slot from their accept, before any handshake
            await wait_status(port,
                              lambda st: st["connection_slots"] == 2 and st["connections"] == {})
            status, body = await upgrade_status(ws_port)  # a complete upgrade: no slot left
            assert status == 503 and b"max_connections" in body
            unix = await trio.open_unix_socket(str(sock))
            async with unix:
                assert await unix.receive_some(65536) == b""  # closed at once
            assert await metric(port, refused, transport="websocket", reason="max_connections") == 1
            assert await metric(port, refused, transport="unix", reason="max_connections") == 1
            for stream in half_open:  # the handshake ends without an upgrade: slot released
                await stream.aclose()
            await wait_status(port, lambda st: st["connection_slots"] == 0)
            async with connect(gw.url) as client:
                assert text_of(await client.call("fx__echo", {"message": "served"})) == "served"


async def raw_ws(port: int | None) -> tuple[trio.SocketStream, WSConnection]:
    """A WebSocket handshake done by hand: frames can then be written as raw bytes."""
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host="127.0.0.1", target="/", subprotocols=["mcp"])))
    while True:
        ws.receive_data(await stream.receive_some(65536))
        if any(isinstance(e, AcceptConnection) for e in ws.events()):
            return stream, ws


async def until_close(stream: trio.SocketStream,
                      ws: WSConnection) -> tuple[list[dict[str, Any]], int]:
    """The messages received until the server's close frame, and its code."""
    got: list[dict[str, Any]] = []
    while True:
        ws.receive_data(await stream.receive_some(65536))
        for event in ws.events():
            if isinstance(event, TextMessage):
                got.append(json.loads(event.data))
            elif isinstance(event, CloseConnection):
                return got, event.code


def frame_header(length: int) -> bytes:
    """A masked text frame header (FIN set) declaring ``length`` (> 125) bytes, mask key zero."""
    size = (b"\xfe" + struct.pack("!H", length) if length < 1 << 16
            else b"\xff" + struct.pack("!Q", length))
    return b"\x81" + size + b"\0\0\0\0"


async def test_frames_are_refused_by_their_header_and_messages_must_complete_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "INCOMPLETE_MESSAGE_TIMEOUT", 0.5)
    sock = tmp_path / "gw.sock"
    cfg = make_config(fixture_backend("fx"), gateway=f"max_message_bytes = {MIB}", unix=str(sock))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw:
            port = gw.bound.websocket_port
            # a header declaring 2^63-1 bytes, 1000 of them, then silence: refused at the header
            stream, ws = await raw_ws(port)
            async with stream:
                await stream.send_all(frame_header(2**63 - 1) + b" " * 1000)
                got, code = await until_close(stream, ws)
            assert code == 1009
            assert [(m["id"], m["error"]["code"], m["error"]["data"]["reason"]) for m in got] == [
                (None, -32600, "message_too_large")]
            # a frame within the limit that never completes: refused when the bound passes
            stream, ws = await raw_ws(port)
            async with stream:
                await stream.send_all(frame_header(1000) + b'{"jsonrpc":')
                got, code = await until_close(stream, ws)
            assert code == 1008
            assert [(m["error"]["code"], m["error"]["data"]["reason"]) for m in got] == [
                (-32600, "incomplete_message")]
            # the same for a line on the unix socket
            unix = await trio.open_unix_socket(str(sock))
            async with unix:
                await unix.send_all(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n{"jsonrpc":')
                got = await read_lines(unix, 3)  # the ping's answer, the error, then the end
            assert [m["id"] for m in got] == [1, None]
            assert got[1]["error"]["data"]["reason"] == "incomplete_message"
            st = await wait_status(gw.bound.admin_port, lambda st: st["connection_slots"] == 0)
            assert st["buffered_bytes"] == 0


async def test_a_batch_array_fits_in_max_message_bytes_and_the_bridge_reports_what_it_cannot_pass(
) -> None:
    # A batch's answers are one message: held to max_message_bytes (1 MiB here) as well as to
    # outbound_bytes (16 MiB); the stdio bridge, whose limit is its own --max-message-bytes,
    # said nothing and exited 0 when a message was too big for it (a hostile tester's find).
    cfg = make_config(fixture_backend("fx"), gateway=f"max_message_bytes = {MIB}")
    batch = [{"jsonrpc": "2.0", "id": i, "method": "tools/call",
              "params": {"name": "fx__big", "arguments": {"size": 600_000}}} for i in "abc"]
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url, version="2025-03-26") as client:
                await client.send(batch)
                await client.wait_for(lambda: all(i in client.responses for i in "abc"))
                got = [client.responses[i] for i in "abc"]
                assert sorted("result" in m for m in got) == [False, False, True]  # one fits
                assert all(m["error"]["data"] == {"reason": "overloaded", "limit": MIB}
                           for m in got if "error" in m)
            init = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "b", "version": "0"}}})
            call = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                               "params": {"name": "fx__big", "arguments": {"size": 300_000}}})
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "gateway", "connect", gw.url, "--max-message-bytes",
                 "65536"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out: list[bytes] = []
            err: list[bytes] = []

            async def read(stream: trio.abc.ReceiveStream, into: list[bytes]) -> None:
                while chunk := await stream.receive_some(65536):
                    into.append(chunk)

            async with trio.open_nursery() as nursery:  # stdin stays open: the client waits
                nursery.start_soon(read, proc.stdout, out)
                nursery.start_soon(read, proc.stderr, err)
                await proc.stdin.send_all((init + "\n" + call + "\n").encode())
                await proc.wait()
            await proc.stdin.aclose()
            assert proc.returncode == 1, (proc.returncode, b"".join(err)[-300:])
            assert b'"id":0' in b"".join(out)  # the initialize answer went through
            assert b"exceeds the limit of 131072 bytes (--max-message-bytes)" in b"".join(err)
