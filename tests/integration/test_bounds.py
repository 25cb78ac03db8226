"""Memory and connection bounds: ``outbound_bytes`` per connection, ``buffered_bytes_total``
daemon-wide, ``max_connections`` across WebSocket and unix.  Real sockets, real fixture child."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket
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

from gateway import events

pytestmark = pytest.mark.system

MIB = 1 << 20


@asynccontextmanager
async def own_ws(port: int | None,
                 queue: int = 1) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """An initialized WebSocket on a TCP stream this test owns and closes (trio-websocket's
    client leaves its socket open when the server starts the close).  With ``queue = 1`` and
    nobody calling ``get_message``, it is a client that never reads."""
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream, trio.open_nursery() as nursery:
        ws = await trio_websocket.wrap_client_stream(
            nursery, stream, "127.0.0.1", "/", subprotocols=["mcp"], max_message_size=8 * MIB,
            message_queue_size=queue)
        await ws.send_message(
            json.dumps({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"}}}))
        assert json.loads(await ws.get_message())["id"] == "init"
        await ws.send_message(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        try:
            yield ws
        finally:
            nursery.cancel_scope.cancel()


def call(id: Any, tool: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                       "params": {"name": tool, "arguments": arguments}})


async def test_client_that_never_reads_is_cut_off_at_outbound_bytes_and_its_bytes_are_released(
) -> None:
    # 40 answers of 1 MB: far more than the socket buffers hold, far fewer than outbound_queue
    # (512 messages), so only the byte bound can cut this client off.
    cfg = make_config(fixture_backend("fx"),
                      gateway=f"max_message_bytes = {2 * MIB}\noutbound_bytes = {2 * MIB}")
    calls, size = 40, 1_000_000
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw, connect(gw.url) as bystander:
            port = gw.bound.admin_port
            async with own_ws(gw.bound.websocket_port) as ws:
                for i in range(calls):
                    await ws.send_message(call(i, "fx__big", {"size": size}))
                await gw.events.wait(events.ConnectionClosed, transport="websocket",
                                     reason="overflow")
                assert text_of(await bystander.call("fx__echo",
                                                    {"message": "still served"})) == "still served"
                await wait_status(port, lambda st: st["buffered_bytes"] == 0)
                # reading now: what the socket buffers held, then the end (never all 40)
                got = 0
                with pytest.raises(trio_websocket.ConnectionClosed):
                    while True:
                        m = json.loads(await ws.get_message())
                        assert len(text_of(m)) == size
                        got += 1
                assert got < calls
            st = await gw.status_until(lambda st: st["connections"] == {"websocket": 1})
            assert st["buffered_bytes"] == 0


async def test_at_buffered_bytes_total_requests_get_overloaded_and_the_biggest_holder_is_closed(
) -> None:
    cfg = make_config(fixture_backend("fx"), gateway=f"""
max_message_bytes = {2 * MIB}
outbound_bytes = {2 * MIB}
buffered_bytes_total = {3 * MIB}
""")
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw, own_ws(gw.bound.websocket_port) as holder, \
                connect(gw.url) as other:
            port = gw.bound.admin_port
            # The holder's two slow calls carry 1 MB each, held until they are answered (and,
            # for a moment, once more in the child's write queue).
            held = 0
            for i in range(2):
                msg = call(f"slow{i}", "fx__sleep", {"seconds": 60, "message": "p" * 1_000_000})
                await holder.send_message(msg)
                held += len(msg)
                # settled: the call is at the child (in flight there) and its write queue drained
                await wait_status(port, lambda st, want=held, n=i + 1: st["buffered_bytes"] == want
                                  and st["backends"][0]["instances"][0]["inflight"] == n)
            # 1.2 MB more would pass the total: refused at once, never started, and the
            # connection holding the most (the holder) is closed
            r = await other.call("fx__echo", {"message": "e" * 1_200_000})
            assert r["error"]["code"] == -32006
            assert r["error"]["data"] == {"reason": "overloaded", "limit": 3 * MIB}
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await holder.get_message()  # the close, and no answer to its slow calls
            await wait_status(port, lambda st: st["buffered_bytes"] == 0)
            # its bytes are released: a 1.2 MB answer fits again
            assert len(text_of(await other.call("fx__big", {"size": 1_200_000}))) == 1_200_000
            assert closed.value.reason.code == 1008 and closed.value.reason.reason == "overflow"
            await gw.events.wait(events.ConnectionClosed, transport="websocket",
                                 reason="overflow")
            await wait_status(port, lambda st: st["buffered_bytes"] == 0)
            assert text_of(await other.call("fx__echo", {"message": "served"})) == "served"


async def test_max_connections_refuses_websocket_with_503_and_unix_at_once(tmp_path: Path) -> None:
    sock = tmp_path / "gw.sock"
    cfg = make_config(fixture_backend("fx"), gateway="max_connections = 2", unix=str(sock))
    refused = "mcp_gateway_client_connections_refused_total"
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as second:
            port = gw.bound.admin_port
            async with connect(gw.url) as first:
                status, body = await upgrade_status(gw.bound.websocket_port)
                assert status == 503 and b"max_connections" in body
                unix = await trio.open_unix_socket(str(sock))
                async with unix:
                    assert await unix.receive_some(65536) == b""  # closed at once
                assert await metric(port, refused, transport="websocket",
                                    reason="max_connections") == 1
                assert await metric(port, refused, transport="unix", reason="max_connections") == 1
                assert text_of(await first.call("fx__echo", {"message": "served"})) == "served"
            # the closed event is emitted in the same step that frees the slot
            await gw.events.wait(events.ConnectionClosed, transport="websocket",
                                 reason="client_closed")
            unix = await trio.open_unix_socket(str(sock))
            async with unix:  # accepted in the freed slot, and served
                await unix.send_all(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n')
                assert json.loads(await unix.receive_some(65536))["id"] == 1
            assert text_of(await second.call("fx__echo", {"message": "still"})) == "still"
            assert await metric(port, refused, transport="websocket", reason="max_connections") == 1
            assert await metric(port, refused, transport="unix", reason="max_connections") == 1
