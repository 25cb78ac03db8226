"""Request heads on real sockets: over 16 KiB is 431 however it arrives (one write of a 40 KiB
header line, or of 2,000 small headers) on ``/mcp``, the admin listener and the WebSocket
upgrade; a connection without a complete head gives its ``max_connections`` slot back after
``HEAD_TIMEOUT`` (lowered here; 408 unless HTTP and nothing sent), WebSocket and HTTP alike."""

from __future__ import annotations

import pytest
import trio
from helpers import UPGRADE, fixture_backend, http_json, make_config, run_gateway, wait_status

from gateway import limits

pytestmark = pytest.mark.system

LONG_LINE = b"x-big: " + b"a" * (40 * 1024) + b"\r\n"
MANY = b"".join(b"x-h%d: v\r\n" % i for i in range(2000))


async def answer_to(port: int | None, data: bytes) -> bytes:
    """Send ``data`` in one write; what comes back until the server closes."""
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        with trio.move_on_after(5):
            while chunk := await stream.receive_some(65536):
                got += chunk
    return got


async def test_heads_over_16_kib_in_one_write_get_431_on_every_listener() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            get = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            upgrade = UPGRADE[:-2]  # without the empty line that ends it
            for extra in (LONG_LINE, MANY):
                for port, head in ((gw.bound.http_port, get), (gw.bound.admin_port, get),
                                   (gw.bound.websocket_port, upgrade)):
                    answer = await answer_to(port, head + extra + b"\r\n")
                    assert answer.startswith(b"HTTP/1.1 431 "), (port, len(extra), answer[:80])
            # the same heads under the limit are served
            served = await answer_to(gw.bound.http_port, get + b"connection: close\r\n\r\n")
            assert served.startswith(b"HTTP/1.1 200 ")
            assert (await answer_to(gw.bound.websocket_port, UPGRADE)).startswith(b"HTTP/1.1 101 ")


async def test_a_connection_without_a_complete_head_frees_its_slot_after_head_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "HEAD_TIMEOUT", 0.5, raising=False)
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            admin = gw.bound.admin_port
            streams = []
            for port, sent in ((gw.bound.http_port, b""), (gw.bound.websocket_port, b""),
                               (gw.bound.http_port, b"POST /mcp HTTP/1.1\r\n"),
                               (gw.bound.websocket_port, UPGRADE[:40])):
                assert port is not None
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(sent)
                streams.append(stream)
            start = trio.current_time()
            await wait_status(admin, lambda st: st["connection_slots"] == 4)
            answers = []
            for stream in streams:  # each is closed by the gateway
                got = b""
                with trio.fail_after(5):
                    while chunk := await stream.receive_some(65536):
                        got += chunk
                await stream.aclose()
                answers.append(got.split(b"\r\n", 1)[0])
            # an HTTP connection that sent nothing is closed without an answer; the rest get 408
            assert answers == [b"", *[b"HTTP/1.1 408 Request Timeout"] * 3], answers
            took = trio.current_time() - start
            assert took < 3.0, took  # not 60 s (HTTP idle) nor 10 s (the upgrade's old bound)
            await wait_status(admin, lambda st: st["connection_slots"] == 0)
            assert (await http_json(admin, "/status"))["connection_slots"] == 0
