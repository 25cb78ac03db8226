"""Inbound bounds: reader backpressure, batch answers under the byte limits, the connection slot
taken at accept, WebSocket frames refused by their header and messages that never complete.
Real sockets, real fixture child."""

from __future__ import annotations

import json
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
    cfg = make_config(fixture_backend("fx"), gateway=f"max_message_bytes = {2 * MIB}\noutbound_bytes = {2 * MIB}")
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
            await client.notify("notifications/cancelled", {"requestId": "slow"})  # no answer for it
            await client.wait_for(lambda: all(f"b{i}" in client.responses for i in range(4)))
            answers = [client.responses[f"b{i}"] for i in range(4)]
            assert sorted(len(text_of(a)) for a in answers if "result" in a) == [size, size]
            errors = [a["error"] for a in answers if "error" in a]
            assert [(e["code"], e["data"]) for e in errors] == [(-32006, {"reason": "overloaded", "limit": 2 * MIB})] * 2
            assert "slow" not in client.responses and not client.closed
            await wait_status(port, lambda st: st["buffered_bytes"] == 0)
            assert text_of(await client.call("fx__echo", {"message": "still here"})) == "still here"


async def test_half_open_websocket_handshakes_hold_a_slot_and_the_cap_refuses_at_once(tmp_path: Path) -> None:
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
            await wait_status(port, lambda st: st["connection_slots"] == 2 and st["connections"] == {})
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
