"""TLS on the client listeners (HTTPS /mcp and wss://, end to end), and the admin
token that ``/status`` needs (off loopback, or wherever it is configured)."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
import trio_websocket
from helpers import (
    HTTP_HEADERS,
    HTTP_INIT,
    ROOT,
    Client,
    fixture_backend,
    http_exchange,
    make_config,
    run_gateway,
)
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from tlsutil import make_certs

from gateway import config, events
from gateway.events import EventBus
from gateway.ops import admin
from gateway.ops.admin import serve_admin
from gateway.ops.metrics import GatewayMetrics
from gateway.status import GatewayStatus
from gateway.transports import tls

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore::ResourceWarning",
                                         "ignore::pytest.PytestUnraisableExceptionWarning")]

H, INIT = HTTP_HEADERS, HTTP_INIT


async def _closed_without_answer(port: int, send: bytes) -> bytes:
    """Connect in clear, send ``send``; what arrives before the gateway closes the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    async with stream:
        if send:
            await stream.send_all(send)
        try:
            while chunk := await stream.receive_some(65536):
                got += chunk
        except trio.BrokenResourceError:  # reset: closed with our bytes unread
            pass
    return got


async def test_tls_https_and_wss_end_to_end(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    certs = make_certs(tmp_path)
    path = tmp_path / "gw.toml"
    path.write_text(
        f"""[listen]\nwebsocket = "127.0.0.1:0"\nhttp = "127.0.0.1:0"\ntls_cert = "{certs.cert}"
tls_key = "{certs.key}"\npublic_url = "https://gw.example.com/mcp"
[admin]\nlisten = "127.0.0.1:0"\n"""
                    + fixture_backend())
    cfg = config.load(path.read_text(), base_dir=ROOT)
    monkeypatch.setattr(tls, "HANDSHAKE_TIMEOUT", 0.5)
    ctx = certs.client_context()
    async with run_gateway(cfg, config_path=str(path)) as gw:
        http_port, ws_port = gw.bound.http_port, gw.bound.websocket_port
        assert http_port and ws_port
        # HTTPS POST to /mcp with the CA trusted; then by the public name (Host + Origin allowed)
        async with httpx.AsyncClient(verify=ctx) as c:
            r = await c.post(f"https://127.0.0.1:{http_port}/mcp", headers=H, json=INIT)
            assert r.status_code == 200, r.text
            assert r.json()["result"]["serverInfo"]["name"] == "mcp-gateway"
            r = await c.post(f"https://127.0.0.1:{http_port}/mcp", json=INIT, headers={
                **H, "host": "gw.example.com", "origin": "https://gw.example.com"})
            assert r.status_code == 200, r.text
            r = await c.post(f"https://127.0.0.1:{http_port}/mcp", json=INIT, headers={
                **H, "host": "evil.example.com"})
            assert r.status_code == 403
        # the official SDK over https: a session, an SSE stream with progress, its DELETE
        progress: list[float] = []

        async def on_progress(p: float, total: float | None, message: str | None) -> None:
            progress.append(p)

        with trio.fail_after(20):
            async with httpx.AsyncClient(verify=ctx) as c, \
                    streamable_http_client(f"https://localhost:{http_port}/mcp",
                                           http_client=c) as (read, write, _), \
                    ClientSession(read, write) as session:
                await session.initialize()
                result = await session.call_tool("fx__progress", {"steps": 3},
                                                 progress_callback=on_progress)
                assert not result.isError and progress == [1, 2, 3]
        # wss:// upgrade, a whole MCP exchange over it
        async with trio_websocket.open_websocket_url(f"wss://localhost:{ws_port}/", ssl_context=ctx,
                                                     subprotocols=["mcp"]) as ws:
            client = Client(ws)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._reader)
                assert (await client.initialize())["result"]["protocolVersion"] == "2025-11-25"
                answer = await client.call("fx__echo", {"message": "over TLS"})
                assert "over TLS" in json.dumps(answer["result"])
                nursery.cancel_scope.cancel()
        # plain HTTP to the TLS ports: closed, no HTTP answer; the daemon goes on
        plain = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 2\r\n\r\n{}"
        with trio.fail_after(5):
            assert not (await _closed_without_answer(http_port, plain)).startswith(b"HTTP/")
            assert not (await _closed_without_answer(ws_port, plain)).startswith(b"HTTP/")
        # a TLS handshake that never comes is cut off after HANDSHAKE_TIMEOUT (its slot freed)
        for port in (http_port, ws_port):
            start = trio.current_time()
            with trio.fail_after(5):
                assert await _closed_without_answer(port, b"") == b""
            assert trio.current_time() - start >= 0.4
        async with httpx.AsyncClient(verify=ctx) as c:
            r = await c.post(f"https://localhost:{http_port}/mcp", headers=H, json=INIT)
            assert r.status_code == 200
            r = await c.get(f"https://localhost:{http_port}/readyz")
            assert r.status_code == 200
        status = await http_exchange(gw.bound.admin_port, "/status")
        rows = {row["name"]: row for row in json.loads(status[2])["listeners"]}
        assert rows["http"]["tls"] and rows["websocket"]["tls"] and rows["http"]["loopback"]
        assert (rows["http"]["auth_configured"] is False
                and rows["http"]["public_url"] == "https://gw.example.com/mcp")
        # a renewed certificate (another CA here) is picked up by a reload, no restart
        (tmp_path / "renewed").mkdir()
        renewed = make_certs(tmp_path / "renewed")
        certs.cert.write_bytes(renewed.cert.read_bytes())
        certs.key.write_bytes(renewed.key.read_bytes())
        mark = gw.events.count
        gw.control.reload()
        await gw.events.wait(events.ReloadFinished, success=True, since=mark)
        async with httpx.AsyncClient(verify=renewed.client_context()) as c:
            r = await c.get(f"https://localhost:{http_port}/healthz")
        assert r.status_code == 200
        with pytest.raises(httpx.ConnectError):  # the old CA no longer verifies it
            async with httpx.AsyncClient(verify=ctx) as c:
                await c.get(f"https://localhost:{http_port}/healthz")


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None: there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent: it only picks a source address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


async def test_status_needs_the_admin_token() -> None:
    token = "s3cret-admin-token"
    digest = hashlib.sha256(token.encode()).hexdigest()
    # the decision: configured token → always required; off loopback without one → refused
    assert admin.status_refusal(None, None, off_loopback=False) is None
    assert admin.status_refusal(None, None, off_loopback=True)[0] == 403  # type: ignore[index]  # refused: not None
    for header in (None, "Bearer", "Bearer wrong", f"Basic {token}", f"Bearer {token}x"):
        refusal = admin.status_refusal(header, digest, off_loopback=False)
        assert refusal is not None and refusal[0] == 401, header
        assert ("www-authenticate", 'Bearer realm="mcp-gateway admin"') in refusal[3]
    assert admin.status_refusal(f"bearer  {token} ", digest.upper(), off_loopback=True) is None
    # the daemon: the admin listener off loopback when this machine has such an address
    where = _non_loopback_address()
    cfg = make_config(fixture_backend(), extra=f'token_sha256 = "{digest}"\n')
    if where is not None:
        cfg = msgspec.structs.replace(cfg, admin=msgspec.structs.replace(
            cfg.admin, listen=f"{where}:0", allow_non_loopback=True))
    host = where or "127.0.0.1"
    async with run_gateway(cfg) as gw:
        port = gw.bound.admin_port
        code, headers, _ = await http_exchange(port, "/status", host=host)
        assert code == 401 and headers["www-authenticate"].startswith("Bearer")
        assert (await http_exchange(port, "/status", "wrong", host=host))[0] == 401
        code, _, body = await http_exchange(port, "/status", token, host=host)
        assert code == 200 and json.loads(body)["ready"] is True
        for path in ("/metrics", "/healthz", "/readyz"):  # Prometheus and load balancers
            assert (await http_exchange(port, path, host=host))[0] == 200, path
    # off loopback without admin.token_sha256: /status refused, the rest served
    if where is not None:
        listeners = await trio.open_tcp_listeners(0, host=where)
        port = listeners[0].socket.getsockname()[1]
        bus = EventBus()
        snap = GatewayStatus("0", (), listeners_bound=True)
        metrics = GatewayMetrics(bus, lambda: snap, version="0")
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_admin(listeners, metrics, lambda: snap,
                                                                task_status=task_status))
            assert (await http_exchange(port, "/status", token, host=where))[0] == 403
            assert (await http_exchange(port, "/healthz", host=where))[0] == 200
            nursery.cancel_scope.cancel()
        metrics.close()
