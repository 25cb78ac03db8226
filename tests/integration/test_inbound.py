"""Inbound bounds: reader backpressure, batch answers under the byte limits, the connection slot
taken at accept, WebSocket frames refused by their header and messages that never complete.
Real sockets, real fixture child."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from helpers import fixture_backend, make_config, run_gateway

pytestmark = pytest.mark.system


async def read_lines(stream: trio.SocketStream, want: int) -> list[dict]:
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
