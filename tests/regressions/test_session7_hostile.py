"""Hostile checks of the forwarded-call fast paths, the WebSocket upgrade's head timeout and
the remote path's refusals, with real sockets and processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from fixtures.remote_server import RemoteServer
from fixtures.token_server import CodeAuthServer, Net, ProtectedRemote
from helpers import (
    ROOT,
    UPGRADE,
    connect,
    fixture_backend,
    make_config,
    run_gateway,
    text_of,
    wait_status,
)
from memharness import memory_config, running
from tlsutil import make_certs

from gateway import config, limits
from gateway.backend import http

AS = "http://127.0.0.1:9000"
URL = "http://localhost:8080/mcp"

FAST_RESTART = "{ backoff_initial = 0.05, backoff_max = 0.2, max_restarts = 100, window = 60.0 }"


def remote(port: int) -> str:
    return (f'[backends.ev]\nurl = "http://127.0.0.1:{port}/mcp"\nstart_timeout = 10.0\n'
            f"restart = {FAST_RESTART}\n")


async def test_each_4xx_to_a_call_fails_it_with_its_status_429_retryable() -> None:
    # A remote's 4xx without a JSON-RPC error fails that call -32001 with the status, not
    # retryable, except 429 (the remote says it did not run it: retryable even for tools/call);
    # a 404 to a request carrying the session ends that session (-32004, retryable).
    server = RemoteServer()
    got: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        cfg = make_config(remote(server.port))
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                for status in (401, 403, 404, 405, 413, 429):
                    assert text_of(await c.call("ev__echo", {"n": 1})) == '{"n": 1}'
                    server.refuse["tools/call"] = [status]
                    got[status] = (await c.call("ev__echo", {"n": status}))["error"]
        nursery.cancel_scope.cancel()
    for status in (401, 403, 405, 413, 429):
        error = got[status]
        assert error["code"] == -32001 and error["data"]["status"] == status, error
        assert error["data"]["retryable"] is (status == 429), error
    assert got[404]["code"] == -32004 and got[404]["data"]["retryable"] is True, got[404]


class _OddSecretExpiry(CodeAuthServer):
    """Registers clients with a secret whose ``client_secret_expires_at`` is ``raw`` (JSON)."""

    raw = b"0"

    def __call__(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Any:
        if method == "POST" and target == "/register":
            self.registered.append(f"client-{len(self.registered) + 1}")
            return 201, [("content-type", "application/json")], (
                b'{"client_id": "%s", "client_secret": "s", "client_secret_expires_at": %s}'
                % (self.registered[-1].encode(), self.raw))
        return super().__call__(method, target, headers, body)


@pytest.mark.trio
@pytest.mark.parametrize("raw", [b'"4102444800"', b"-5", b"1" + b"0" * 400, b"1e400", b"NaN",
                                 b"true", b"null", b"[1]"])
async def test_a_registration_with_an_odd_secret_expiry_is_taken_as_never_expiring(
        autojump_clock: object, tmp_path: Any, raw: bytes) -> None:
    # RFC 7591's client_secret_expires_at as a string, negative, beyond a float, infinite, NaN,
    # a bool, null or an array: the client is kept (never expiring), the backend authorizes.
    auth = _OddSecretExpiry(AS)
    auth.raw = raw
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth,
                            "localhost:8080": ProtectedRemote(URL, AS, lambda t: t in auth.issued)})
        cfg = memory_config(f'[backends.r]\nurl = "{URL}"\nprefix = ""\n[backends.r.oauth]\n'
                            'grant = "authorization_code"\n', gateway=f'state_dir = "{tmp_path}"')
        connector = http.HttpConnector(cfg.backends["r"], opener=net.open, name="r")
        async with running(cfg, connectors={"r": connector}) as h:
            await h.until(lambda: h.instance("r")["state"] == "AUTHORIZING")
            status, url = h.hub.begin_authorization("r")
            assert status == 200, url
            assert (await h.hub.complete_authorization(auth.authorize(url)))[0] == 200
            await h.until(lambda: h.instance("r")["state"] == "RUNNING")
            assert auth.registered == ["client-1"]
            async with h.connect() as c:
                assert (await c.call("echo", timeout=5))["result"]["content"][0]["text"] == "ok"
        nursery.cancel_scope.cancel()


async def _trickle(stream: trio.abc.Stream, head: bytes, every: float) -> bytes:
    """Send ``head`` a byte every ``every`` seconds until the server answers; its answer."""
    got = b""

    async def send() -> None:
        for i in range(len(head)):
            try:
                await stream.send_all(head[i:i + 1])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            await trio.sleep(every)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        try:
            while chunk := await stream.receive_some(65536):
                got += chunk
        except trio.BrokenResourceError:
            pass
        nursery.cancel_scope.cancel()
    return got


@pytest.mark.parametrize("secure", [False, True])
async def test_a_slow_loris_upgrade_gets_408_at_the_head_timeout_and_its_slot_back(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, secure: bool) -> None:
    # An upgrade head sent a byte at a time (plain and over TLS), still coming when the head
    # timeout passes: 408 then the close, the slot given back; others are served meanwhile.
    monkeypatch.setattr(limits, "HEAD_TIMEOUT", 1.0, raising=False)
    listen = ""
    ctx = None
    if secure:
        certs = make_certs(tmp_path)
        listen = f'tls_cert = "{certs.cert}"\ntls_key = "{certs.key}"\n'
        ctx = certs.client_context()
    cfg = config.load(f"""[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n{listen}
[admin]\nlisten = "127.0.0.1:0"\n""" + fixture_backend("fx"), base_dir=ROOT)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            port = gw.bound.websocket_port
            assert port is not None
            tcp = await trio.open_tcp_stream("127.0.0.1", port)
            stream: trio.abc.Stream = tcp
            if ctx is not None:
                stream = trio.SSLStream(tcp, ctx, server_hostname="localhost")
                await stream.do_handshake()
            start = trio.current_time()
            async with stream:
                got = await _trickle(stream, UPGRADE, 0.05)
            took = trio.current_time() - start
            assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got[:80]
            assert got.endswith(b"request head not completed in time\n"), got
            assert 0.5 < took < 4.0, took
            await wait_status(gw.bound.admin_port, lambda st: st["connection_slots"] == 0)
            scheme = "wss" if secure else "ws"
            if not secure:  # the listener serves the next client as before
                async with connect(f"{scheme}://127.0.0.1:{port}/") as c:
                    assert text_of(await c.call("fx__echo", {"message": "hi"})) == "hi"
