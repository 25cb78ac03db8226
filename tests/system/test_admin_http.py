"""The admin HTTP server on a real loopback socket: routes, keep-alive, limits and timeouts."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from gateway.events import EventBus, RequestStarted
from gateway.ops.admin import serve_admin
from gateway.ops.metrics import GatewayMetrics
from gateway.status import BackendStatus, GatewayStatus, InstanceStatus

pytestmark = [pytest.mark.system]

READ_TIMEOUT = 0.5


@dataclass
class Server:
    port: int
    snapshot: GatewayStatus
    bus: EventBus = field(default_factory=EventBus)
    broken: bool = False

    def status(self) -> GatewayStatus:
        if self.broken:
            raise RuntimeError("status exploded")
        return self.snapshot


def snapshot(state: str = "RUNNING", **kw: object) -> GatewayStatus:
    inst = InstanceStatus("time/0", state, None, 0, None, None, (), 0)
    return GatewayStatus(
        "1.2.3",
        (BackendStatus("time", True, "shared", (inst,), 1, 0, 0, 0),),
        {"websocket": 1},
        listeners_bound=True,
        **kw,
    )


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    srv = Server(listeners[0].socket.getsockname()[1], snapshot())
    metrics = GatewayMetrics(srv.bus, srv.status, version="1.2.3")
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_admin(
                listeners, metrics, srv.status, read_timeout=READ_TIMEOUT, task_status=task_status
            )
        )
        with trio.fail_after(20):
            yield srv
        nursery.cancel_scope.cancel()


class Client:
    """A minimal HTTP/1.1 client on h11 over one trio stream (for keep-alive checks)."""

    def __init__(self, stream: trio.SocketStream, host: str = "127.0.0.1") -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)
        self.host = host

    async def request(
        self, method: str, target: str, *headers: tuple[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        if self.conn.our_state is h11.DONE:
            self.conn.start_next_cycle()
        req = h11.Request(method=method, target=target, headers=[("host", self.host), *headers])
        await self.stream.send_all(self.conn.send(req) + self.conn.send(h11.EndOfMessage()))
        response, body = None, b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert response is not None
                hdrs = {k.decode(): v.decode() for k, v in response.headers}
                return response.status_code, hdrs, body


async def get(
    port: int, target: str, method: str = "GET", *headers: tuple[str, str], host: str = "127.0.0.1"
) -> tuple[int, dict[str, str], bytes]:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        return await Client(stream, host).request(method, target, *headers)


async def read_until_eof(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


async def test_metrics_parse_and_negotiate(server: Server) -> None:
    server.bus.emit(RequestStarted("c1", "tools/call", "time"))
    status, headers, body = await get(server.port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    assert samples[("mcp_gateway_inflight_requests", (("backend", "time"),))] == 1
    assert samples[("mcp_gateway_backend_up",
                    (("backend", "time"), ("connector", "stdio"), ("required", "true")))] == 1
    status, headers, body = await get(
        server.port, "/metrics", "GET", ("accept", "application/openmetrics-text; version=1.0.0")
    )
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    status, headers, body = await get(server.port, "/metrics", "HEAD")
    assert status == 200 and int(headers["content-length"]) > 0 and body == b""


async def test_health_ready_and_status(server: Server) -> None:
    assert (await get(server.port, "/healthz"))[::2] == (200, b"ok\n")
    assert (await get(server.port, "/readyz?verbose"))[::2] == (200, b"ready\n")
    server.snapshot = snapshot("BACKOFF", draining=True)
    status, _, body = await get(server.port, "/readyz")
    assert status == 503 and body == b"draining; backend time not running\n"
    server.snapshot = GatewayStatus("1.2.3", ())
    assert (await get(server.port, "/readyz"))[::2] == (503, b"listeners not bound\n")
    status, headers, body = await get(server.port, "/status")
    doc = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert doc["ready"] is False and doc["version"] == "1.2.3" and doc["backends"] == []
    server.snapshot = snapshot()
    doc = json.loads((await get(server.port, "/status"))[2])
    assert doc["ready"] is True and doc["connections"] == {"websocket": 1}
    assert doc["backends"][0]["instances"][0]["state"] == "RUNNING"


async def test_errors_404_405_500(server: Server) -> None:
    assert (await get(server.port, "/nope"))[0] == 404
    status, headers, _ = await get(server.port, "/metrics", "POST")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    server.broken = True
    assert (await get(server.port, "/status"))[0] == 500
    server.broken = False
    assert (await get(server.port, "/status"))[0] == 200  # the server survived


async def test_keep_alive_and_connection_close(server: Server) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        client = Client(stream)
        for target in ("/healthz", "/readyz", "/metrics", "/nope"):
            assert (await client.request("GET", target))[0] in (200, 404)
        status, headers, _ = await client.request("GET", "/healthz", ("connection", "close"))
        assert status == 200 and headers["connection"] == "close"
        assert await read_until_eof(stream) == b""


async def test_urllib_client(server: Server) -> None:
    def fetch(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    assert await trio.to_thread.run_sync(fetch, "/healthz") == (200, b"ok\n")
    server.snapshot = snapshot(draining=True)
    assert await trio.to_thread.run_sync(fetch, "/readyz") == (503, b"draining\n")


async def test_silent_client_is_dropped_after_the_timeout(server: Server) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        start = trio.current_time()
        with trio.fail_after(READ_TIMEOUT * 10):
            assert await read_until_eof(stream) == b""  # closed without an unsolicited 408
        assert trio.current_time() - start >= READ_TIMEOUT * 0.9


async def test_partial_request_gets_408(server: Server) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n")
        with trio.fail_after(READ_TIMEOUT * 10):
            assert (await read_until_eof(stream)).startswith(b"HTTP/1.1 408 ")


async def test_oversized_head_and_garbage(server: Server) -> None:
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20000)
        assert (await read_until_eof(stream)).startswith(b"HTTP/1.1 431 ")
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
        await stream.send_all(b"\x16\x03\x01 not http at all\r\n\r\n")
        assert (await read_until_eof(stream)).startswith(b"HTTP/1.1 400 ")
    assert (await get(server.port, "/healthz"))[0] == 200


async def test_status_and_metrics_answer_only_loopback_or_bound_host_names(server: Server) -> None:
    """DNS rebinding: a page on attacker.example (resolving to 127.0.0.1) sends its own name."""
    for host in ("127.0.0.1", f"127.0.0.1:{server.port}", "localhost", f"LocalHost:{server.port}",
                 "[::1]", f"[::1]:{server.port}"):
        for path in ("/status", "/metrics"):
            assert (await get(server.port, path, host=host))[0] == 200, (host, path)
    for host in ("attacker.example", f"attacker.example:{server.port}", "127.0.0.2",
                 "localhost.attacker.example"):
        for path in ("/status", "/metrics", "/status?x"):
            status, _, body = await get(server.port, path, host=host)
            assert (status, body) == (421, b"Host not allowed\n"), (host, path)
        # probes answer whatever name the load balancer uses
        assert (await get(server.port, "/healthz", host=host))[0] == 200
        assert (await get(server.port, "/readyz", host=host))[0] == 200
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:  # two Host headers
        await stream.send_all(b"GET /status HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                              b"Host: attacker.example\r\n\r\n")
        assert (await read_until_eof(stream)).startswith(b"HTTP/1.1 400 ")  # h11 refuses it
    for origin in ("http://attacker.example", "null", f"http://127.0.0.1:{server.port}"):
        async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:  # from a page
            await stream.send_all(f"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: {origin}\r\n"
                                  "Connection: close\r\n\r\n".encode())
            assert (await read_until_eof(stream)).startswith(b"HTTP/1.1 403 "), origin
    async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:  # HTTP/1.0, no Host
        await stream.send_all(b"GET /status HTTP/1.0\r\n\r\n")
        assert (await read_until_eof(stream)).startswith(b"HTTP/1.1 421 ")


async def test_admin_allowed_hosts_and_the_bound_address() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    srv = Server(port, snapshot())
    metrics = GatewayMetrics(srv.bus, srv.status, version="1.2.3")
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve_admin(
            listeners, metrics, srv.status, allowed_hosts=["Gateway.Example.Internal:9477"],
            task_status=task_status))
        with trio.fail_after(20):
            assert (await get(port, "/status", host="gateway.example.internal"))[0] == 200
            assert (await get(port, "/metrics", host="gateway.example.internal:80"))[0] == 200
            assert (await get(port, "/status", host="other.example.internal"))[0] == 421
        nursery.cancel_scope.cancel()
