#!/usr/bin/env python3
"""mcp-gateway benchmark: the gateway side by side with a direct stdio pipe and peer gateways.

    .venv/bin/python bench/run.py [--calls 2000] [--clients 16] [--inflight 4] [--json out.json]

One run measures, with the same stdio backend (the test fixture's ``echo``, or server-everything's
with ``--backend everything``):

* direct stdio: the backend's own pipe, ``clients`` logical clients pipelining calls over it;
* mcp-gateway over WebSocket and over its unix socket (newline-delimited JSON-RPC): ``clients``
  connections, sequential calls, then ``inflight`` calls in flight per connection;
* single-client sequential latency: direct, gateway ``shared`` backend, gateway ``affine`` backend;
* restart-to-ready: kill -9 the backend child, time until /status says RUNNING and until the
  first successful call (5 runs, median);
* mcp-gateway over Streamable HTTP (``/mcp``): legacy sessions, and the stateless 2026-07-28 shape,
  with a lean keep-alive HTTP/1.1 client (plain trio sockets; ``--no-http`` skips every HTTP row);
* peers: supergateway 4.0.0 (stdio -> WebSocket, and stdio -> Streamable HTTP, stateful) and
  mcp-proxy 0.13.0 (stdio -> Streamable HTTP), installed by ``scripts/setup-bench``.

Every server binds 127.0.0.1 (checked on the real sockets of each process tree, /proc/net/tcp*),
every load loop is bounded by a call count and a wall-clock cap, and every child process is
stopped (process group, then any recorded descendant) also when the run fails or is interrupted.
See bench/README.md for what each row means and the caveats.
"""

from __future__ import annotations

import abc
import argparse
import datetime
import itertools
import json
import math
import os
import platform
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import trio
import trio_websocket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "bench")
if BENCH_DIR not in sys.path:  # its sibling modules, also when run.py is imported by path
    sys.path.insert(0, BENCH_DIR)

import wsclient  # noqa: E402

OUT_DIR = os.path.join(BENCH_DIR, "out")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "fixture_server.py")
EVERYTHING = os.path.join(ROOT, ".deps", "node", "node_modules", "@modelcontextprotocol",
                          "server-everything", "dist", "index.js")
SUPERGATEWAY = os.path.join(ROOT, ".deps", "bench", "node", "node_modules", "supergateway", "dist",
                            "index.js")
MCP_PROXY = os.path.join(ROOT, ".deps", "bench", "venv-mcpproxy", "bin", "mcp-proxy")
PRELOAD = os.path.join(BENCH_DIR, "loopback-preload.cjs")
FLOOR = os.path.join(BENCH_DIR, "floor.py")
PROTOCOL = "2025-06-18"  # spoken by every path under test
CLK_TCK = os.sysconf("SC_CLK_TCK")
FLOOD_INFLIGHT = 8 * 16  # calls the fairness scenario's flooding connection keeps in flight
REQUEST_TIMEOUT = 30.0  # one call; a slower answer counts as an error
START_TIMEOUT = 30.0  # a server process until it accepts connections

ENCODE = msgspec.json.Encoder().encode
DECODE = msgspec.json.decode


class BenchError(Exception):
    """A path under test could not be set up or misbehaved (reported, never faked)."""


# ==== backends ===================================================================================


@dataclass(frozen=True)
class BackendSpec:
    name: str
    argv: list[str]
    tool: str  # the backend's own tool name

    def expected(self, message: str) -> str:
        return f"Echo: {message}" if self.name == "everything" else message


def backend_spec(which: str) -> BackendSpec:
    if which == "fixture":
        return BackendSpec("fixture", [sys.executable, FIXTURE], "echo")
    if not os.path.isfile(EVERYTHING):
        raise SystemExit(f"bench: {EVERYTHING} is missing: run scripts/setup first")
    node = shutil.which("node") or "node"
    return BackendSpec("everything", [node, EVERYTHING, "stdio"], "echo")


# ==== processes: start, account CPU, check binds, clean up ========================================


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()  # fields from "state" on (3rd field of stat)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a live process (all its threads; not its reaped children)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0, 0.0
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                parent[int(entry)] = int(fields[1])
    out: list[int] = []
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        frontier.extend(kids)
    return out


def _parse_addr(hexaddr: str) -> str:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def listening_sockets(pids: list[int]) -> list[str]:
    """host:port of every listening TCP socket held open by ``pids``."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                out.append(_parse_addr(cols[1]))
    return out


def is_loopback_addr(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1",
                                               "::ffff:127.0.0.1") or host.startswith("::ffff:127.")


def assert_loopback_only(root: int, what: str) -> list[str]:
    addrs = listening_sockets([root, *descendants(root)])
    bad = [a for a in addrs if not is_loopback_addr(a)]
    if bad:
        raise BenchError(
            f"{what} listens beyond loopback ({', '.join(bad)}): stopped, not measured")
    return addrs


def gateway_env() -> dict[str, str]:
    """This environment with this tree first on ``PYTHONPATH``: ``python -m gateway`` runs this
    tree's gateway (a worktree's, too), whatever is installed."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, *[x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]]))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Every process the bench starts, so that all of them are stopped whatever happens."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.running: dict[int, str] = {}  # pid -> name (each is a process-group leader)
        self.seen: dict[int, dict[int, int]] = {}  # leader -> {descendant pid: its start time}

    def popen(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: str = ROOT) -> subprocess.Popen[bytes]:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "wb")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    cwd=cwd, env=env, start_new_session=True)
        finally:
            log.close()
        self.running[proc.pid] = name
        return proc

    def adopt(self, pid: int, name: str) -> None:
        self.running[pid] = name

    def remember_tree(self, pid: int) -> None:
        """Record ``pid``'s descendants now (a backend may leave its tree before we stop it)."""
        known = self.seen.setdefault(pid, {})
        for child in descendants(pid):
            started = start_time(child)
            if started is not None:
                known[child] = started

    def stop(self, pid: int, grace: float = 5.0) -> None:
        """SIGTERM the process group, wait (bounded), SIGKILL it, then any recorded descendant."""
        self.running.pop(pid, None)
        self.remember_tree(pid)
        tree = self.seen.pop(pid, {})
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
            if not alive(pid):
                break
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + wait
            while alive(pid) and time.monotonic() < deadline:
                _reap(pid)
                time.sleep(0.02)
        # A zombie leader of a multi-threaded process can be reaped only once all its threads are
        # gone: wait for that (bounded), so that no zombie is left behind for init.
        deadline = time.monotonic() + 2.0
        while not _reap(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        for child, started in tree.items():
            # Only a process we saw in our tree (same pid *and* start time: never a reused pid).
            if alive(child) and child not in self.running and start_time(child) == started:
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop_all(self) -> None:
        for pid in list(self.running):
            self.stop(pid, grace=3.0)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _reap(pid: int) -> bool:
    """Collect ``pid`` if it has ended; True once it is gone (or was never our child)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


# ==== JSON-RPC clients ===========================================================================


class Conn(abc.ABC):
    """A JSON-RPC client connection with any number of requests in flight (unique ids)."""

    protocol = PROTOCOL  # the version its initialize asks for

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.closed: str | None = None  # why the connection ended, once it has

    @abc.abstractmethod
    async def request(self, method: str, params: Any = None,
                      timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]: ...  # noqa: ASYNC109 - one request's deadline (the implementations' own wait), passed by keyword

    @abc.abstractmethod
    async def notify(self, method: str, params: Any = None) -> None: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def initialize(self) -> dict[str, Any]:
        resp = await self.request("initialize", {"protocolVersion": self.protocol,
                                                 "capabilities": {},
                                                 "clientInfo": {"name": "mcp-gateway-bench",
                                                                "version": "1"}})
        if "result" not in resp:
            raise BenchError(f"initialize failed: {resp.get('error')}")
        await self.notify("notifications/initialized")
        return resp


class StreamConn(Conn):
    """A connection over one message stream: requests are matched to replies by id."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[int, list[Any]] = {}
        self._lock = trio.Lock()
        # The floor row: the forwarder's `cat` sends each request back as it was; the echoed
        # request (same id, same message) is the answer.
        self.echo_mode = False

    @abc.abstractmethod
    async def _send(self, data: bytes) -> None: ...

    async def request(self, method: str, params: Any = None,
                      timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:  # noqa: ASYNC109 - one request's deadline (its own wait), passed by keyword
        if self.closed is not None:
            raise BenchError(f"connection closed: {self.closed}")
        rid = next(self._ids)
        slot: list[Any] = [trio.Event(), None]
        self._pending[rid] = slot
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        try:
            await self._send_message(ENCODE(msg))
            with trio.fail_after(timeout):
                await slot[0].wait()
        finally:
            self._pending.pop(rid, None)
        if slot[1] is None:
            raise BenchError(f"connection closed: {self.closed}")
        return slot[1]

    async def notify(self, method: str, params: Any = None) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        await self._send_message(ENCODE(msg))

    async def _send_message(self, data: bytes) -> None:
        """One message out, never interleaved with another's bytes."""
        async with self._lock:
            await self._send(data)

    def _deliver(self, data: bytes | str) -> None:
        try:
            msg = DECODE(data)
        except msgspec.DecodeError:
            return
        for m in msg if isinstance(msg, list) else [msg]:
            # a response (requests/notifications ignored)
            if isinstance(m, dict) and ("method" not in m or self.echo_mode):
                slot = self._pending.get(m.get("id"))  # type: ignore[arg-type]  # any id: unknown ones miss
                if slot is not None:
                    slot[1] = m
                    slot[0].set()

    def _close(self, why: str) -> None:
        self.closed = why
        for slot in self._pending.values():
            slot[0].set()


class WsConn(StreamConn):
    """JSON-RPC over a WebSocket, one message per text frame: :meth:`open` builds the client
    ``--ws-client`` chose (``client``): the lean one (bench/wsclient.py) or trio-websocket's."""

    client = "lean"  # or "trio-websocket"

    @classmethod
    async def open(cls, nursery: trio.Nursery, url: str, subprotocols: list[str] | None) -> WsConn:
        impl = cls if cls is not WsConn else (
            LeanWsConn if WsConn.client == "lean" else TrioWsConn)
        return await impl._open(nursery, url, subprotocols)

    @classmethod
    @abc.abstractmethod
    async def _open(cls, nursery: trio.Nursery, url: str,
                    subprotocols: list[str] | None) -> WsConn: ...


class LeanWsConn(WsConn):
    """The lean client: a hand-written RFC 6455 client on one trio socket (bench/wsclient.py)."""

    def __init__(self, ws: wsclient.WsClient) -> None:
        super().__init__()
        self.ws = ws

    @classmethod
    async def _open(cls, nursery: trio.Nursery, url: str,
                    subprotocols: list[str] | None) -> WsConn:
        try:
            ws = await wsclient.connect(url, subprotocols, max_message=16 * 2**20)
        except wsclient.WsError as exc:
            raise BenchError(f"websocket handshake: {exc}") from None
        conn = cls(ws)
        nursery.start_soon(conn._reader)
        return conn

    async def _reader(self) -> None:
        self._close(f"websocket closed ({await self.ws.run(self._deliver)})")

    async def _send_message(self, data: bytes) -> None:
        await self._send(data)  # the client keeps its frames whole itself

    async def _send(self, data: bytes) -> None:
        try:
            await self.ws.send(data)
        except wsclient.WsError as exc:
            self._close(f"websocket closed ({self.ws.closed or exc})")
            raise BenchError(self.closed) from None

    async def aclose(self) -> None:
        with trio.move_on_after(2):
            await self.ws.aclose()
        self.ws.close_socket()


class TrioWsConn(WsConn):
    """trio-websocket's client (wsproto underneath), ``--ws-client trio-websocket``."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        super().__init__()
        self.ws = ws

    @classmethod
    async def _open(cls, nursery: trio.Nursery, url: str,
                    subprotocols: list[str] | None) -> WsConn:
        ws = await trio_websocket.connect_websocket_url(
            nursery, url, subprotocols=subprotocols, max_message_size=16 * 2**20,
            receive_buffer_size=65536)
        conn = cls(ws)
        nursery.start_soon(conn._reader)
        return conn

    async def _reader(self) -> None:
        try:
            while True:
                self._deliver(await self.ws.get_message())
        except trio_websocket.ConnectionClosed as exc:
            self._close(f"websocket closed ({exc.reason})")

    async def _send(self, data: bytes) -> None:
        try:
            await self.ws.send_message(data.decode())
        except trio_websocket.ConnectionClosed as exc:
            self._close(f"websocket closed ({exc.reason})")
            raise BenchError(self.closed) from None

    async def aclose(self) -> None:
        with trio.move_on_after(2):
            await self.ws.aclose()


class LineConn(StreamConn):
    """Newline-delimited JSON-RPC over a byte stream (unix socket, a child's stdin/stdout)."""

    def __init__(self, send: trio.abc.SendStream, receive: trio.abc.ReceiveStream) -> None:
        super().__init__()
        self.send_stream = send
        self.receive_stream = receive

    @classmethod
    def start(cls, nursery: trio.Nursery, send: trio.abc.SendStream,
              receive: trio.abc.ReceiveStream) -> LineConn:
        conn = cls(send, receive)
        nursery.start_soon(conn._reader)
        return conn

    async def _reader(self) -> None:
        buf = b""
        try:
            while data := await self.receive_stream.receive_some(65536):
                buf += data
                if b"\n" in buf:
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.strip():
                            self._deliver(line)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        self._close("end of stream")

    async def _send(self, data: bytes) -> None:
        try:
            await self.send_stream.send_all(data + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._close(f"write failed: {exc}")
            raise BenchError(self.closed) from None

    async def aclose(self) -> None:
        for s in {id(self.send_stream): self.send_stream,
                  id(self.receive_stream): self.receive_stream}.values():
            with trio.move_on_after(2):
                await s.aclose()


MODERN = "2026-07-28"  # the stateless Streamable HTTP shape: no initialize, no session
MODERN_META = {"io.modelcontextprotocol/protocolVersion": MODERN,
               "io.modelcontextprotocol/clientCapabilities": {}}
NAME_PARAM = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}  # -> Mcp-Name


class _StaleLink(BenchError):
    """A reused keep-alive connection was closed by the server before it answered (an idle
    timeout): the request never reached it, so it is sent again on a fresh connection."""


class _HttpLink:
    """One keep-alive HTTP/1.1 connection on a plain trio socket, one request at a time.

    The body of an answer is read only as far as needed (an SSE stream up to the response);
    the rest of it (``mode`` not None) is read and dropped before the next request is sent."""

    __slots__ = ("answers", "buf", "dead", "left", "mode", "need_crlf", "sock")

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.buf = b""
        self.mode: str | None = None  # the unread body: "length" (left bytes), "chunked", "close"
        self.left = 0  # "length": bytes of the body left; "chunked": of the current chunk
        self.need_crlf = False  # "chunked": the CRLF after a chunk's data is still to come
        self.dead = False  # the server closes it (Connection: close, or a body up to EOF)
        self.answers = 0  # answer heads read on it so far

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[await self.sock.send(view):]

    async def _recv(self) -> bytes:
        data = await self.sock.recv(65536)
        if not data:
            self.dead = True
        return data

    async def read_head(self) -> tuple[int, dict[str, str]]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            data = await self._recv()
            if not data:
                if self.answers and not self.buf:
                    raise _StaleLink("keep-alive connection closed by the server while idle")
                raise BenchError("HTTP connection closed by the server before an answer")
            self.buf += data
        lines = self.buf[:end].decode("latin-1").split("\r\n")
        self.buf = self.buf[end + 4:]
        self.answers += 1
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        status = int(lines[0].split(" ", 2)[1])
        if headers.get("connection", "").lower() == "close":
            self.dead = True
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.mode, self.left, self.need_crlf = "chunked", 0, False
        elif "content-length" in headers:
            self.mode, self.left = "length", int(headers["content-length"])
        elif status in (204, 304) or 100 <= status < 200:
            self.mode = None
        else:
            self.mode, self.dead = "close", True
        return status, headers

    def _take(self) -> tuple[bytes, bool]:
        """The body bytes now in the buffer, and whether the body is complete."""
        if self.mode == "length":
            take = self.buf[:self.left]
            self.buf = self.buf[len(take):]
            self.left -= len(take)
            return take, self.left == 0
        if self.mode == "close":
            take, self.buf = self.buf, b""
            return take, False
        out = []
        while True:  # chunked
            if self.left:
                take = self.buf[:self.left]
                self.buf = self.buf[len(take):]
                self.left -= len(take)
                out.append(take)
                if self.left:
                    break
                self.need_crlf = True
            if self.need_crlf:
                if len(self.buf) < 2:
                    break
                self.buf = self.buf[2:]
                self.need_crlf = False
            i = self.buf.find(b"\r\n")
            if i < 0:
                break
            size = int(self.buf[:i].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk, then trailers (none expected) and an empty line
                j = self.buf.find(b"\r\n\r\n", i)
                if j < 0:
                    break
                self.buf = self.buf[j + 4:]
                return b"".join(out), True
            self.buf = self.buf[i + 2:]
            self.left = size
        return b"".join(out), False

    async def body_piece(self) -> tuple[bytes, bool]:
        """The next piece of the body (waiting for one), and whether the body is complete."""
        data, done = self._take()
        while not data and not done:
            got = await self._recv()
            if not got:
                if self.mode != "close":
                    raise BenchError("HTTP connection closed by the server in the middle of a body")
                done = True
                break
            self.buf += got
            data, done = self._take()
        if done:
            self.mode = None
        return data, done

    async def read_body(self) -> bytes:
        parts = []
        while self.mode is not None:
            parts.append((await self.body_piece())[0])
        return b"".join(parts)

    def close(self) -> None:
        self.sock.close()


class HttpConn(Conn):
    """Streamable HTTP with a lean keep-alive HTTP/1.1 client (plain trio sockets, not httpx, which
    alone burns over 1 ms of CPU per call): ``POST /mcp``, Content-Length bodies, a JSON answer or
    an SSE stream read until the response arrives.

    Legacy shape (``modern=False``): ``initialize`` mints a session (``Mcp-Session-Id``), sent on
    every later request with ``MCP-Protocol-Version``; ``aclose`` DELETEs it.  Modern shape
    (2026-07-28): no initialize, no session; each request carries ``_meta`` (protocol version,
    client capabilities) and the headers ``MCP-Protocol-Version``, ``Mcp-Method`` and ``Mcp-Name``.

    One client holds up to ``max_links`` keep-alive connections, opened as needed (one per call in
    flight: the ``N × 1`` rows use one per client, the ``N × 4`` rows four per client)."""

    def __init__(self, port: int, path: str = "/mcp", *, modern: bool = False,
                 max_links: int = 1, protocol: str = PROTOCOL) -> None:
        super().__init__()
        self.protocol = protocol
        self.port = port
        self.path = path
        self.modern = modern
        self.session: str | None = None
        self._idle: list[_HttpLink] = []
        self._slots = trio.Semaphore(max_links)
        self._head = b""
        self._set_head()
        # keep-alive check: one per call in flight, unless the server closes them
        self.links_opened = 0
        self.answers = {"json": 0, "sse": 0}  # how the responses came
        self.stale_retries = 0  # requests sent again: an idle keep-alive connection had been closed

    def _set_head(self) -> None:
        head = (f"POST {self.path} HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\n"
                "accept: application/json, text/event-stream\r\ncontent-type: application/json\r\n")
        if self.modern:
            head += f"mcp-protocol-version: {MODERN}\r\n"
        elif self.session is not None:
            head += (f"mcp-session-id: {self.session}\r\n"
                     f"mcp-protocol-version: {self.protocol}\r\n")
        self._head = head.encode()

    async def _link(self) -> _HttpLink:
        if self._idle:
            return self._idle.pop()
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        try:
            sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
            await sock.connect(("127.0.0.1", self.port))
        except BaseException:
            sock.close()
            raise
        self.links_opened += 1
        return _HttpLink(sock)

    async def _exchange(self, link: _HttpLink, head: bytes, body: bytes,
                        rid: Any) -> dict[str, Any] | None:
        if link.mode is not None:  # the rest of the previous answer's body
            await link.read_body()
        await link.send(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        status, headers = await link.read_head()
        if self.session is None and not self.modern and "mcp-session-id" in headers:
            self.session = headers["mcp-session-id"]
            self._set_head()
        if status == 202:
            await link.read_body()
            return None
        if status != 200:
            raise BenchError(f"HTTP {status}: {(await link.read_body())[:200]!r}")
        if not headers.get("content-type", "").startswith("text/event-stream"):
            self.answers["json"] += 1
            return DECODE(await link.read_body())
        self.answers["sse"] += 1
        pending = b""  # an SSE stream: events until the one that carries our response
        while True:
            data, done = await link.body_piece()
            pending += data
            if b"\r" in pending:
                pending = pending.replace(b"\r\n", b"\n")
            while (i := pending.find(b"\n\n")) >= 0:
                event, pending = pending[:i], pending[i + 2:]
                lines = [ln[5:] for ln in event.split(b"\n") if ln.startswith(b"data:")]
                if not lines:
                    continue
                payload = b"\n".join(ln[1:] if ln.startswith(b" ") else ln for ln in lines)
                try:
                    m = DECODE(payload)
                except msgspec.DecodeError:
                    continue
                if isinstance(m, dict) and "method" not in m and m.get("id") == rid:
                    return m
            if done:
                raise BenchError("SSE stream ended without the response")

    async def _post(self, head: bytes, msg: dict[str, Any]) -> dict[str, Any] | None:
        body = ENCODE(msg)
        async with self._slots:
            while True:
                link = await self._link()
                clean = False
                try:
                    out = await self._exchange(link, head, body, msg.get("id"))
                    clean = not link.dead
                    return out
                except _StaleLink:
                    self.stale_retries += 1
                    continue
                except OSError as exc:
                    if link.answers and isinstance(exc, (ConnectionResetError,
                                                         BrokenPipeError)) and not link.buf:
                        self.stale_retries += 1  # the same: reset while idle, before our request
                        continue
                    raise BenchError(f"HTTP connection failed: {exc}") from None
                finally:
                    if clean:
                        self._idle.append(link)
                    else:  # an error, a timeout in the middle of an answer, or the server closes it
                        link.close()

    async def request(self, method: str, params: Any = None,
                      timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:  # noqa: ASYNC109 - one request's deadline (its own wait), passed by keyword
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": next(self._ids), "method": method}
        head = self._head
        if self.modern:
            params = {**(params or {}), "_meta": MODERN_META}
            extra = f"mcp-method: {method}\r\n"
            if method in NAME_PARAM and NAME_PARAM[method] in params:
                extra += f"mcp-name: {params[NAME_PARAM[method]]}\r\n"
            head += extra.encode()
        if params is not None:
            msg["params"] = params
        with trio.fail_after(timeout):
            resp = await self._post(head, msg)
        if resp is None:
            raise BenchError(f"{method}: answered 202, no response")
        return resp

    async def notify(self, method: str, params: Any = None) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        with trio.fail_after(REQUEST_TIMEOUT):
            await self._post(self._head, msg)

    async def initialize(self) -> dict[str, Any]:
        if self.modern:  # stateless: nothing to set up
            return {}
        resp = await super().initialize()
        if self.session is None:
            raise BenchError("initialize answered without an Mcp-Session-Id")
        return resp

    @staticmethod
    def summary(label: str, conns: list[Conn]) -> str:
        """A note: connections opened and how the answers came, over all of ``conns``."""
        hc = [c for c in conns if isinstance(c, HttpConn)]
        return (f"{label}: {len(hc)} clients opened {sum(c.links_opened for c in hc)} HTTP "
                "connections in all "
                f"(keep-alive); answers: {sum(c.answers['json'] for c in hc)} JSON, "
                f"{sum(c.answers['sse'] for c in hc)} SSE; {sum(c.stale_retries for c in hc)} "
                "requests sent again "
                f"on a fresh connection because the server had closed an idle one")

    async def aclose(self) -> None:
        with trio.move_on_after(2):
            if self.session is not None:  # end the session (supergateway: stops its child)
                head = (f"DELETE {self.path} HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\n"
                        f"mcp-session-id: {self.session}\r\n"
                        f"mcp-protocol-version: {self.protocol}\r\n").encode()
                try:
                    link = await self._link()
                    self._idle.append(link)
                    if link.mode is not None:
                        await link.read_body()
                    await link.send(head + b"content-length: 0\r\n\r\n")
                    await link.read_head()
                    await link.read_body()
                except (OSError, BenchError):  # best effort: ending the session is a courtesy
                    pass
                self.session = None
        self.drop_links()

    def drop_links(self) -> None:
        """Close the idle keep-alive connections (a session stays open: ``aclose`` ends it)."""
        for link in self._idle:
            link.close()
        self._idle.clear()


# ==== measuring ==================================================================================


def answer_ok(resp: dict[str, Any], message: str, backend: BackendSpec) -> bool:
    """The echo call's answer carries the message (for the floor: the echoed request itself)."""
    try:
        if "method" in resp:  # only an echo-mode connection delivers these
            return resp["params"]["arguments"]["message"] == message
        return resp["result"]["content"][0]["text"] == backend.expected(message)
    except (KeyError, IndexError, TypeError):
        return False


def pct(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile, in microseconds."""
    if not sorted_ns:
        return float("nan")
    return sorted_ns[max(0, math.ceil(q * len(sorted_ns)) - 1)] / 1000


@dataclass
class LoadResult:
    path: str  # what was measured
    group: str  # "direct" | "mcp-gateway" | "peer"
    clients: int
    inflight: int
    requested: int
    ok: int = 0
    errors: int = 0
    elapsed: float = 0.0
    calls_per_s: float = 0.0
    p50_us: float = float("nan")
    p99_us: float = float("nan")
    mean_us: float = float("nan")
    # proxy / backend / bench client (user+system), and "<that> sys": the system part alone
    cpu_us_per_call: dict[str, float] = field(default_factory=dict)
    other_load: float | None = None  # cores busy with processes outside this bench meanwhile
    # resident memory (MiB) at the end of the round, per label of cpu_pids (all its processes
    # summed), and "<label> procs": how many processes that was; rows: the largest over the rounds
    rss_mib: dict[str, float] = field(default_factory=dict)
    call_bound_hit: bool = False  # it ended on the call bound (`requested`) before `--seconds`
    rounds: list[dict[str, Any]] = field(default_factory=list)  # each of the --repeat rounds
    first_error: str | None = None
    ratio_vs_direct: float | None = None
    p50_vs_direct: float | None = None


def system_busy_seconds() -> float:
    """CPU time all processes of the machine have used (user+nice+system+irq+softirq+steal)."""
    with open("/proc/stat") as f:
        cols = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = cols
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def _cpu_snapshot(pids: dict[str, Callable[[], list[int]]]) -> dict[str, float]:
    """CPU seconds so far: per label (user+system, and the system part as "<label> sys")."""
    snap: dict[str, float] = {}
    for label, get in pids.items():
        times = [cpu_seconds(p) for p in get()]
        snap[label] = sum(u + s for u, s in times)
        snap[f"{label} sys"] = sum(s for _, s in times)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    snap["bench client"] = ru.ru_utime + ru.ru_stime
    snap["bench client sys"] = ru.ru_stime
    snap["_system"] = system_busy_seconds()
    return snap


async def run_load(conns: list[Conn], *, inflight: int, calls: int, cap: float, tool: str,
                   backend: BackendSpec, cpu_pids: dict[str, Callable[[], list[int]]] | None = None,
                   result: LoadResult | None = None) -> LoadResult:
    """``len(conns) * inflight`` workers issue echo calls (each worker waits for its answer before
    the next) for ``cap`` seconds, or until ``calls`` calls were issued, whichever first."""
    res = result or LoadResult("", "", len(conns), inflight, calls)
    lat: list[int] = []
    issued = 0
    deadline = trio.current_time() + cap
    perf = time.perf_counter_ns

    async def worker(conn: Conn, wid: int) -> None:
        nonlocal issued
        while issued < calls and trio.current_time() < deadline:
            issued += 1
            message = f"bench {wid} {issued}"
            t0 = perf()
            try:
                resp = await conn.request("tools/call",
                                          {"name": tool, "arguments": {"message": message}})
            except (BenchError, trio.TooSlowError) as exc:
                res.errors += 1
                res.first_error = res.first_error or f"{type(exc).__name__}: {exc}"
                if conn.closed is not None:
                    return
                continue
            t1 = perf()
            ok = answer_ok(resp, message, backend)
            if ok:
                res.ok += 1
                lat.append(t1 - t0)
            else:
                res.errors += 1
                res.first_error = res.first_error or f"bad answer: {json.dumps(resp)[:300]}"

    before = _cpu_snapshot(cpu_pids or {})
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, conn in enumerate(conns):
            for d in range(inflight):
                nursery.start_soon(worker, conn, i * inflight + d)
    res.elapsed = time.perf_counter() - started
    after = _cpu_snapshot(cpu_pids or {})
    res.call_bound_hit = issued >= calls
    res.calls_per_s = res.ok / res.elapsed if res.elapsed > 0 else 0.0
    lat.sort()
    if lat:
        res.p50_us, res.p99_us = pct(lat, 0.50), pct(lat, 0.99)
        res.mean_us = statistics.fmean(lat) / 1000
    ours = sum(after[k] - before[k] for k in after if k != "_system" and not k.endswith(" sys"))
    if res.elapsed > 0:
        res.other_load = max(0.0, (after["_system"] - before["_system"] - ours) / res.elapsed)
    if res.ok:
        res.cpu_us_per_call = {k: round((after[k] - before[k]) / res.ok * 1e6, 1) for k in after
                               if k != "_system"}
    for label, get in (cpu_pids or {}).items():
        sizes = [rss_of(p) for p in get()]
        sizes = [x for x in sizes if x is not None]
        res.rss_mib[label] = round(sum(sizes) / 2**20, 1)
        res.rss_mib[f"{label} procs"] = len(sizes)
    return res


def rss_of(pid: int) -> int | None:
    """VmRSS in bytes, or None for a process that is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def median_of_rounds(runs: list[LoadResult]) -> LoadResult:
    """One row from the --repeat rounds: every figure is the median of that figure over the rounds
    (calls/s, p50, p99, each CPU per call, other load); the rounds themselves are kept."""
    first = runs[0]
    res = LoadResult(first.path, first.group, first.clients, first.inflight, first.requested)
    res.ok = sum(r.ok for r in runs)
    res.errors = sum(r.errors for r in runs)
    res.first_error = next((r.first_error for r in runs if r.first_error), None)
    res.elapsed = sum(r.elapsed for r in runs)
    res.calls_per_s = _median([r.calls_per_s for r in runs])
    res.p50_us = _median([r.p50_us for r in runs])
    res.p99_us = _median([r.p99_us for r in runs])
    res.mean_us = _median([r.mean_us for r in runs])
    loads = [r.other_load for r in runs if r.other_load is not None]
    res.other_load = statistics.median(loads) if loads else None
    keys = {k for r in runs for k in r.cpu_us_per_call}
    res.cpu_us_per_call = {
        k: round(_median([r.cpu_us_per_call.get(k, float("nan")) for r in runs]), 1)
        for k in sorted(keys)}
    res.call_bound_hit = any(r.call_bound_hit for r in runs)
    res.rss_mib = {k: max(r.rss_mib.get(k, 0) for r in runs)
                   for k in sorted({k for r in runs for k in r.rss_mib})}
    res.rounds = [{"ok": r.ok, "errors": r.errors, "elapsed": round(r.elapsed, 3),
                   "calls_per_s": round(r.calls_per_s, 1),
                   "p50_us": r.p50_us, "p99_us": r.p99_us, "cpu_us_per_call": r.cpu_us_per_call,
                   "other_load": r.other_load, "call_bound_hit": r.call_bound_hit,
                   "rss_mib": r.rss_mib}
                  for r in runs]
    return res


async def measure(label: str, group: str, conns: list[Conn], args: argparse.Namespace, *,
                  inflight: int,
                  tool: str, backend: BackendSpec,
                  cpu_pids: dict[str, Callable[[], list[int]]]) -> LoadResult:
    """A throughput row: a short warm-up, then --repeat rounds of --seconds each (bounded by
    --calls), reported as the median of each figure over the rounds."""
    n = args.calls
    warm = max(len(conns) * inflight, min(n // 5, 5000))
    await run_load(conns, inflight=inflight, calls=warm, cap=min(0.5, args.seconds), tool=tool,
                   backend=backend)
    runs = []
    for _ in range(args.repeat):
        res = LoadResult(label, group, len(conns), inflight, n)
        await run_load(conns, inflight=inflight, calls=n, cap=args.seconds, tool=tool,
                       backend=backend, cpu_pids=cpu_pids, result=res)
        runs.append(res)
    res = median_of_rounds(runs)
    proxy_cpu = res.cpu_us_per_call.get("proxy")
    status = (f"{res.calls_per_s:8.0f} calls/s  p50 {res.p50_us:8.0f} us  p99 {res.p99_us:8.0f} us"
              + (f"  proxy CPU {proxy_cpu:5.0f} us/call" if proxy_cpu is not None else "")
              + f"  (other load {res.other_load or 0:.1f} cores)")
    print(f"  {label:<44} {len(conns):>2}x{inflight:<2} {status}"
          + (f"  errors {res.errors} ({res.first_error})" if res.errors else "")
          + ("  [call bound hit]" if res.call_bound_hit else ""), file=sys.stderr, flush=True)
    return res


async def sequential(conn: Conn, tool: str, backend: BackendSpec, calls: int,
                     cap: float) -> list[int]:
    """One client, one call at a time: the latencies (ns) of the successful calls."""
    out: list[int] = []
    deadline = trio.current_time() + cap
    for i in range(calls):
        if trio.current_time() >= deadline:
            break
        message = f"seq {i}"
        t0 = time.perf_counter_ns()
        try:
            resp = await conn.request("tools/call",
                                      {"name": tool, "arguments": {"message": message}})
        except (BenchError, trio.TooSlowError):
            continue
        t1 = time.perf_counter_ns()
        if answer_ok(resp, message, backend):
            out.append(t1 - t0)
    return out


@dataclass
class SeqResult:
    path: str
    calls: int
    p50_us: float  # the median over the rounds of each round's p50 (likewise p99, mean)
    p99_us: float
    mean_us: float
    rounds_p50_us: list[float] = field(default_factory=list)


def seq_result(path: str, rounds: list[list[int]]) -> SeqResult:
    """``rounds``: the latencies (ns) of each round; every figure is the median over the rounds."""
    rounds = [sorted(r) for r in rounds if r]
    p50s = [pct(r, 0.5) for r in rounds]
    return SeqResult(path, sum(len(r) for r in rounds), _median(p50s),
                     _median([pct(r, 0.99) for r in rounds]),
                     _median([statistics.fmean(r) / 1000 for r in rounds]),
                     [round(x, 1) for x in p50s])


# ==== small HTTP GET (admin /status) ============================================================


async def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:  # noqa: ASYNC109 - one request's deadline (trio.fail_after inside), passed by keyword
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                  "\r\n".encode())
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def wait_port(port: int, proc: subprocess.Popen[bytes], what: str,
                    timeout: float = START_TIMEOUT) -> None:  # noqa: ASYNC109 - a start-up deadline, checked between polls of a child process
    deadline = trio.current_time() + timeout
    while True:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited during start-up (code {proc.returncode})")
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            if trio.current_time() > deadline:
                raise BenchError(
                    f"{what} did not listen on 127.0.0.1:{port} within {timeout:g}s") from None
            await trio.sleep(0.05)
        else:
            await stream.aclose()
            return


# ==== the paths under test ======================================================================


HANDSHAKE_LISTS = ("tools/list", "prompts/list", "resources/list", "resources/templates/list")


async def spawn_to_ready(backend: BackendSpec, procs: Procs) -> float:
    """ms from spawning the backend to the answer of the last list request of the handshake the
    gateway does (initialize, initialized, the four lists): the floor of any restart."""
    t0 = time.perf_counter()
    proc = await trio.lowlevel.open_process(backend.argv, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, cwd=ROOT,
                                            start_new_session=True)
    procs.adopt(proc.pid, "direct-spawn")
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stdin is not None and proc.stdout is not None
            conn = LineConn.start(nursery, proc.stdin, proc.stdout)
            with trio.fail_after(START_TIMEOUT):
                await conn.initialize()
                for method in HANDSHAKE_LISTS:
                    await conn.request(method)
            elapsed = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
    finally:
        procs.stop(proc.pid)
    return elapsed * 1000


async def bench_direct(args: argparse.Namespace, backend: BackendSpec, procs: Procs,
                       results: list[LoadResult], singles: list[SeqResult],
                       spawns: list[float]) -> None:
    """The limit: the backend's own stdio pipe, one process, logical clients pipelining on it."""
    print("direct stdio", file=sys.stderr, flush=True)
    for _ in range(args.restarts):
        spawns.append(await spawn_to_ready(backend, procs))
    if spawns:
        print(f"  spawn -> handshake done, median {statistics.median(spawns):.1f} ms",
              file=sys.stderr, flush=True)
    stderr_log = open(os.path.join(procs.log_dir, "direct-backend.log"), "wb")  # noqa: ASYNC230 - set-up on a local file, before any measurement
    proc = await trio.lowlevel.open_process(backend.argv, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE,
                                            stderr=stderr_log, cwd=ROOT, start_new_session=True)
    stderr_log.close()
    procs.adopt(proc.pid, "direct-backend")
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stdin is not None and proc.stdout is not None
            conn = LineConn.start(nursery, proc.stdin, proc.stdout)
            with trio.fail_after(START_TIMEOUT):
                await conn.initialize()
            cpu = {"backend": lambda: [proc.pid]}
            await sequential(conn, backend.tool, backend, 200, args.max_seconds)  # warm-up
            singles.append(seq_result("direct stdio", [
                await sequential(conn, backend.tool, backend, args.single_calls, args.max_seconds)
                for _ in range(args.repeat)]))
            # N logical clients on one pipe: the same Conn, ids unique across all of them.
            clients = [conn] * args.clients
            for inflight in (1, args.inflight):
                results.append(await measure("direct stdio (one pipe)", "direct", clients, args,
                                             inflight=inflight, tool=backend.tool, backend=backend,
                                             cpu_pids=cpu))
            await conn.aclose()
            nursery.cancel_scope.cancel()
    finally:
        procs.stop(proc.pid)


def gateway_config(backend: BackendSpec, ws_port: int, admin_port: int, unix_path: str,
                   max_inflight: int | None = None, http_port: int | None = None,
                   telemetry: str | None = None) -> str:
    argv = backend.argv
    bound = "" if max_inflight is None else f"max_inflight = {max_inflight}\n"

    restart = ("restart = { backoff_initial = 0.005, backoff_max = 0.005, max_restarts = 1000, "
               "window = 60.0 }")

    def table(name: str, extra: str = "") -> str:
        return (f"[backends.{name}]\ncommand = {json.dumps(argv[0])}\n"
                f"args = {json.dumps(argv[1:])}\n"
                f"required = true\n{bound}{extra}\n")

    return f"""# written by bench/run.py
[gateway]
name = "mcp-gateway-bench"
# the fairness flood keeps {FLOOD_INFLIGHT} in flight
max_inflight_per_connection = {FLOOD_INFLIGHT * 2}

[listen]
websocket = "127.0.0.1:{ws_port}"
http = "{'' if http_port is None else f'127.0.0.1:{http_port}'}"
unix = "{unix_path}"
unix_mode = "0600"

[admin]
listen = "127.0.0.1:{admin_port}"

{table("fx")}
{table("fxa", 'sharing = "affine"')}
{table("rs", restart)}
""" + ("" if telemetry is None else  # every call traced, exported to ``telemetry``
       f'[telemetry]\nenabled = true\nendpoint = "{telemetry}"\nsample_ratio = 1.0\n')


async def gateway_status(admin: int) -> dict[str, Any]:
    code, body = await http_get(admin, "/status")
    if code != 200:
        raise BenchError(f"/status answered {code}")
    return json.loads(body)


def fx_instances(status: dict[str, Any], backend: str = "fx") -> list[list[Any]]:
    """[pid, state] of each instance of ``backend`` in /status."""
    for b in status["backends"]:
        if b["name"] == backend:
            return [[i.get("pid"), i.get("state")] for i in b["instances"]]
    raise BenchError(f"backend {backend} not in /status")


def instance_of(status: dict[str, Any], backend: str) -> dict[str, Any]:
    for b in status["backends"]:
        if b["name"] == backend:
            return b["instances"][0]
    raise BenchError(f"backend {backend} not in /status")


async def start_duration(admin: int, backend: str) -> tuple[float, float]:
    """(sum, count) of mcp_gateway_backend_start_duration_seconds for ``backend``, from /metrics."""
    _code, body = await http_get(admin, "/metrics")
    total = count = 0.0
    for line in body.decode().splitlines():
        if f'backend="{backend}"' in line:
            if line.startswith("mcp_gateway_backend_start_duration_seconds_sum"):
                total = float(line.rsplit(" ", 1)[1])
            elif line.startswith("mcp_gateway_backend_start_duration_seconds_count"):
                count = float(line.rsplit(" ", 1)[1])
    return total, count


@dataclass
class RestartRun:
    gone_ms: float  # kill -> /status no longer shows the killed child RUNNING
    starting_ms: float | None  # kill -> STARTING with a new pid first seen (after the backoff)
    running_ms: float  # kill -> RUNNING with a new pid
    first_call_ms: float  # kill -> first successful echo call
    failed_calls: int  # attempts answered with an error before that
    errors_seen: list[str]
    gateway_start_ms: float | None = None  # the gateway's own spawn -> handshake done (its metric)


async def restart_run(admin: int, conn: Conn, tool: str, backend: BackendSpec) -> RestartRun:
    metric_before = await start_duration(admin, "rs")
    old_pid = instance_of(await gateway_status(admin), "rs")["pid"]
    if not old_pid:
        raise BenchError("restart backend has no pid in /status")
    marks: dict[str, float] = {}
    failed = 0
    errors_seen: list[str] = []
    t0 = 0.0

    async def poll_status() -> None:
        while True:
            try:
                inst = instance_of(await gateway_status(admin), "rs")
            except (OSError, BenchError, trio.TooSlowError, ValueError):
                inst = {"state": "?", "pid": None}
            now = time.perf_counter()
            if "gone" not in marks and not (inst["state"] == "RUNNING" and inst["pid"] == old_pid):
                marks["gone"] = now
            if ("starting" not in marks and inst["state"] == "STARTING"
                and inst["pid"] not in (None, old_pid)):
                marks["starting"] = now
            if inst["state"] == "RUNNING" and inst["pid"] not in (None, old_pid):
                marks["running"] = now
                return
            await trio.sleep(0.005)

    async def first_call() -> None:
        nonlocal failed
        i = 0
        while True:
            i += 1
            message = f"restart {i}"
            try:
                resp = await conn.request("tools/call",
                                          {"name": tool, "arguments": {"message": message}})
            except (BenchError, trio.TooSlowError) as exc:
                raise BenchError(f"restart: client connection failed: {exc}") from None
            try:
                if resp["result"]["content"][0]["text"] == backend.expected(message):
                    marks["call"] = time.perf_counter()
                    return
            except (KeyError, IndexError, TypeError):
                pass
            failed += 1
            reason = (resp.get("error") or {}).get("data",
                                                   {}).get("reason") or str(resp.get("error"))[:80]
            if reason not in errors_seen:
                errors_seen.append(reason)
            await trio.sleep(0.001)

    with trio.fail_after(30):
        t0 = time.perf_counter()
        os.kill(old_pid, signal.SIGKILL)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_status)
            nursery.start_soon(first_call)
    ms = {k: (v - t0) * 1000 for k, v in marks.items()}
    run = RestartRun(ms["gone"], ms.get("starting"), ms["running"], ms["call"], failed, errors_seen)
    metric_after = await start_duration(admin, "rs")
    if metric_after[1] == metric_before[1] + 1:
        run.gateway_start_ms = (metric_after[0] - metric_before[0]) * 1000
    return run


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (VmRSS of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS for pid {pid}")


@dataclass
class IdleResult:
    wanted: int
    opened: int = 0
    rss_before: int = 0
    rss_open: int = 0  # with all of them open and initialised, after 1 s
    rss_closed: int = 0  # 1 s after closing them again
    first_error: str | None = None

    @property
    def added_mib(self) -> float:
        return (self.rss_open - self.rss_before) / 2**20


async def idle_connections(url: str, pid: int, n: int) -> IdleResult:
    """Open ``n`` WebSocket connections (each initialised, then idle), read the gateway's RSS
    before and with them, close them."""
    res = IdleResult(n)
    conns: list[WsConn] = []
    limit = trio.Semaphore(32)

    async def open_one(nursery: trio.Nursery) -> None:
        async with limit:
            try:
                with trio.fail_after(30):
                    c = await WsConn.open(nursery, url, ["mcp"])
                    conns.append(c)
                    await c.initialize()
                res.opened += 1
            except (BenchError, OSError, trio.TooSlowError, trio_websocket.HandshakeError) as exc:
                res.first_error = res.first_error or f"{type(exc).__name__}: {exc}"

    async def close_one(c: WsConn) -> None:
        async with limit:
            await c.aclose()

    res.rss_before = rss_bytes(pid)
    with trio.fail_after(180):
        async with trio.open_nursery() as readers:
            async with trio.open_nursery() as opening:
                for _ in range(n):
                    opening.start_soon(open_one, readers)
            await trio.sleep(1.0)
            res.rss_open = rss_bytes(pid)
            async with trio.open_nursery() as closing:
                for c in conns:
                    closing.start_soon(close_one, c)
            readers.cancel_scope.cancel()
    await trio.sleep(1.0)
    res.rss_closed = rss_bytes(pid)
    return res


@dataclass
class FairRound:
    alone_p50_us: float
    alone_p99_us: float
    flood_p50_us: float
    flood_p99_us: float
    alone_calls: int
    flood_calls: int  # the light connection's calls during the flood
    flood_ok: int  # the flooding connection's successful calls meanwhile
    flood_errors: int
    flood_calls_per_s: float


async def fairness(nursery: trio.Nursery, url: str, tool: str, flood_tool: str,
                   flood_args: dict[str, Any],
                   backend: BackendSpec, args: argparse.Namespace,
                   inflight: int) -> list[FairRound]:
    """A light connection's sequential echo calls alone, then while a second connection keeps
    ``inflight`` calls in flight on the same shared backend; --repeat rounds, interleaved."""
    light = await WsConn.open(nursery, url, ["mcp"])
    heavy = await WsConn.open(nursery, url, ["mcp"])
    await light.initialize()
    await heavy.initialize()
    phase = max(1.0, args.seconds / 2)
    await sequential(light, tool, backend, 200, args.max_seconds)  # warm-up
    out: list[FairRound] = []
    for _ in range(args.repeat):
        alone = sorted(await sequential(light, tool, backend, args.calls, phase))
        stop = trio.Event()
        ok = errors = 0

        async def flood_worker(stop: trio.Event = stop,
                               deadline: float = trio.current_time() + phase + 30) -> None:
            nonlocal ok, errors
            while not stop.is_set() and trio.current_time() < deadline:
                try:
                    resp = await heavy.request("tools/call",
                                               {"name": flood_tool, "arguments": flood_args})
                except (BenchError, trio.TooSlowError):
                    errors += 1
                    if heavy.closed is not None:
                        return
                    continue
                if "result" in resp and not resp["result"].get("isError"):
                    ok += 1
                else:
                    errors += 1

        async with trio.open_nursery() as flood:
            for _ in range(inflight):
                flood.start_soon(flood_worker)
            await trio.sleep(0.2)  # let the flood build up
            ok0, t0 = ok, time.perf_counter()
            flooded = sorted(await sequential(light, tool, backend, args.calls, phase))
            rate = (ok - ok0) / (time.perf_counter() - t0)
            stop.set()  # the workers end after their current call: no reply is left behind
        out.append(FairRound(pct(alone, 0.5), pct(alone, 0.99), pct(flooded, 0.5),
                             pct(flooded, 0.99), len(alone), len(flooded), ok, errors, rate))
        r = out[-1]
        print(f"  fairness: light p50 {r.alone_p50_us:6.0f} us alone, {r.flood_p50_us:6.0f} us "
              "under the flood "
              f"({r.flood_calls_per_s:.0f} flood calls/s, {errors} errors)", file=sys.stderr,
              flush=True)
    await light.aclose()
    await heavy.aclose()
    return out


def speedscope_top(path: str, n: int = 15) -> list[tuple[str, float, float]]:
    """(function, own %, total %) of the top ``n`` functions by own samples in a py-spy speedscope
    file."""
    with open(path) as f:
        doc = json.load(f)
    frames = doc["shared"]["frames"]
    own: dict[str, float] = {}
    total: dict[str, float] = {}
    all_weight = 0.0
    for prof in doc["profiles"]:
        for stack, w in zip(prof.get("samples", []), prof.get("weights", []), strict=False):
            if not stack:
                continue
            all_weight += w
            names = []
            for i in stack:
                fr = frames[i]
                names.append(f"{fr.get('name')} "
                             f"({os.path.basename(fr.get('file') or '?')}:{fr.get('line', '?')})")
            own[names[-1]] = own.get(names[-1], 0.0) + w
            for name in set(names):
                total[name] = total.get(name, 0.0) + w
    if not all_weight:
        return []
    top = sorted(own.items(), key=lambda kv: -kv[1])[:n]
    return [(name, 100 * w / all_weight, 100 * total[name] / all_weight) for name, w in top]


async def profile_gateway(args: argparse.Namespace, procs: Procs, pid: int, conns: list[Conn],
                          tool: str, backend: BackendSpec) -> dict[str, Any]:
    """py-spy (GIL-holding samples, by function) on the gateway while ``conns`` make sequential
    calls: an extra load, after the measured rows, so the sampling costs them nothing."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):  # noqa: ASYNC240 - a check on a local path, before any measurement
        raise BenchError("py-spy not found (pip install py-spy into the .venv)")
    secs = max(1, round(args.profile_seconds))
    out_file = args.profile
    print(f"  profiling the gateway with py-spy for {secs} s ({len(conns)} x 1 over WebSocket)",
          file=sys.stderr, flush=True)
    proc = procs.popen("py-spy",
                       [spy, "record", "--pid", str(pid), "--duration", str(secs), "--rate", "250",
                        "--gil", "--function", "--nonblocking", "--format", "speedscope",
                        "-o", out_file])
    res = LoadResult("profile", "mcp-gateway", len(conns), 1, args.calls)
    async with trio.open_nursery() as nursery:
        async def load() -> None:
            await run_load(conns, inflight=1, calls=10**9, cap=secs + 1.0, tool=tool,
                           backend=backend, result=res)

        nursery.start_soon(load)
    with trio.fail_after(secs + 30):
        while proc.poll() is None:  # noqa: ASYNC110 - a Popen child's exit: polled, it has no trio event
            await trio.sleep(0.1)
    procs.running.pop(proc.pid, None)
    if proc.returncode != 0 or not os.path.exists(out_file):  # noqa: ASYNC240 - a check on a local path, before any measurement
        raise BenchError(f"py-spy failed (code {proc.returncode}), see {procs.log_dir}/py-spy.log")
    return {"file": out_file, "seconds": secs, "calls_per_s": res.calls_per_s,
            "top": speedscope_top(out_file)}


async def bench_gateway(args: argparse.Namespace, backend: BackendSpec, procs: Procs,
                        results: list[LoadResult], singles: list[SeqResult],
                        restarts: list[RestartRun],
                        notes: list[str], extra: dict[str, Any]) -> None:
    print("mcp-gateway", file=sys.stderr, flush=True)
    tmp = tempfile.mkdtemp(prefix="mcpgw-bench-")
    unix_path = os.path.join(tmp, "gw.sock")
    ws_port, admin = free_port(), free_port()
    http_port = None if args.no_http else free_port()
    cfg_path = os.path.join(procs.log_dir, "gateway-bench.toml")
    with open(cfg_path, "w") as f:  # noqa: ASYNC230 - set-up on a local file, before any measurement
        f.write(gateway_config(backend, ws_port, admin, unix_path, args.max_inflight, http_port,
                               args.telemetry))
    # The gateway under test is the one in this tree (a worktree's, too), whatever is installed:
    # its folder goes first on PYTHONPATH, and the child's import is checked before it starts.
    env = gateway_env()
    where = subprocess.run([sys.executable, "-c", "import gateway; print(gateway.__file__)"],  # noqa: ASYNC221 - set-up, before any measurement: a quick child
                           cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=30).stdout.strip()
    if not where.startswith(os.path.join(ROOT, "gateway") + os.sep):
        raise BenchError(f"python -m gateway would import {where or 'nothing'}, not {ROOT}/gateway")
    notes.append(f"mcp-gateway under test: {os.path.dirname(where)}")
    gw = procs.popen("gateway", [sys.executable, "-m", "gateway", "run", "--config", cfg_path],
                     env=env)
    try:
        await wait_ready(gw, admin, f"{procs.log_dir}/gateway.log")
        addrs = assert_loopback_only(gw.pid, "mcp-gateway")
        notes.append(f"mcp-gateway listens on {', '.join(sorted(addrs))} and unix:{unix_path}")
        procs.remember_tree(gw.pid)
        url = f"ws://127.0.0.1:{ws_port}/"
        fx_tool = f"fx__{backend.tool}"
        cpu = {"proxy": lambda: [gw.pid], "backend": lambda: descendants(gw.pid)}

        async with trio.open_nursery() as nursery:
            # ---- idle connections: first, on a fresh heap ------------------------------------
            if args.idle_connections:
                idle = await idle_connections(url, gw.pid, args.idle_connections)
                extra["idle"] = idle
                print(f"  {idle.opened} idle WebSocket connections: RSS "
                      f"{idle.rss_before / 2**20:.1f} -> "
                      f"{idle.rss_open / 2**20:.1f} MiB (+{idle.added_mib:.1f}), "
                      f"{idle.rss_closed / 2**20:.1f} MiB "
                      f"after closing them" + (f"; {idle.first_error}" if idle.first_error else ""),
                      file=sys.stderr, flush=True)

            # ---- single client, sequential: shared vs affine, ws vs unix ----------------------
            one = await WsConn.open(nursery, url, ["mcp"])
            await one.initialize()
            sock = await trio.open_unix_socket(unix_path)
            one_unix = LineConn.start(nursery, sock, sock)
            await one_unix.initialize()
            for c, t in ((one, fx_tool), (one, f"fxa__{backend.tool}"), (one_unix, fx_tool)):
                await sequential(c, t, backend, 200, args.max_seconds)  # warm-up
            rounds: dict[str, list[list[int]]] = {"ws shared": [], "ws affine": [],
                                                  "unix shared": []}
            blocks = 5  # interleaved, so drift hits all three alike
            per = max(1, args.single_calls // blocks)
            for _ in range(args.repeat):
                lat: dict[str, list[int]] = {k: [] for k in rounds}
                for _ in range(blocks):
                    lat["ws shared"] += await sequential(one, fx_tool, backend, per,
                                                         args.max_seconds / blocks)
                    lat["ws affine"] += await sequential(one, f"fxa__{backend.tool}", backend, per,
                                                         args.max_seconds / blocks)
                    lat["unix shared"] += await sequential(one_unix, fx_tool, backend, per,
                                                           args.max_seconds / blocks)
                for k in rounds:
                    rounds[k].append(lat[k])
            for key, label in (("ws shared", "mcp-gateway WS, shared backend"),
                               ("ws affine", "mcp-gateway WS, affine backend"),
                               ("unix shared", "mcp-gateway unix, shared backend")):
                singles.append(seq_result(label, rounds[key]))
                print(f"  single client {label:<36} p50 {singles[-1].p50_us:6.0f} us",
                      file=sys.stderr, flush=True)

            # ---- N connections --------------------------------------------------------------
            ws_conns = [await WsConn.open(nursery, url, ["mcp"]) for _ in range(args.clients)]
            for c in ws_conns:
                await c.initialize()
            for inflight in (1, args.inflight):
                results.append(await measure("mcp-gateway, WebSocket", "mcp-gateway", ws_conns,
                                             args, inflight=inflight, tool=fx_tool,
                                             backend=backend, cpu_pids=cpu))
            if args.profile:
                extra["profile"] = await profile_gateway(args, procs, gw.pid, ws_conns, fx_tool,
                                                         backend)
            for c in ws_conns:
                await c.aclose()
            unix_conns: list[Conn] = []
            for _ in range(args.clients):
                s = await trio.open_unix_socket(unix_path)
                unix_conns.append(LineConn.start(nursery, s, s))
            for c in unix_conns:
                await c.initialize()
            for inflight in (1, args.inflight):
                results.append(await measure("mcp-gateway, unix socket", "mcp-gateway", unix_conns,
                                             args, inflight=inflight, tool=fx_tool,
                                             backend=backend, cpu_pids=cpu))
            for c in unix_conns:
                await c.aclose()

            # ---- Streamable HTTP /mcp: legacy sessions, then the stateless 2026-07-28 shape ----
            if http_port is not None:
                fx_before = fx_instances(await gateway_status(admin))
                for label, modern in ((GW_HTTP_LEGACY_ROW, False), (GW_HTTP_MODERN_ROW, True)):
                    http_conns: list[Conn] = [HttpConn(http_port, modern=modern,
                                                       max_links=args.inflight)
                                              for _ in range(args.clients)]
                    try:
                        for c in http_conns:
                            with trio.fail_after(10):
                                await c.initialize()
                        for inflight in (1, args.inflight):
                            results.append(await measure(label, "mcp-gateway", http_conns, args,
                                                         inflight=inflight,
                                                         tool=fx_tool, backend=backend,
                                                         cpu_pids=cpu))
                    finally:
                        notes.append(HttpConn.summary(label, http_conns))
                        for c in http_conns:
                            await c.aclose()
                fx_after = fx_instances(await gateway_status(admin))
                extra["shared_child"] = {"before": fx_before, "after": fx_after}
                print(f"  backend fx instances (pid, state): before the HTTP rows {fx_before}, "
                      f"after {fx_after}",
                      file=sys.stderr, flush=True)

            # ---- fairness: a flood on one connection, sequential calls on another --------------
            if backend.name == "fixture":
                flood_tool, flood_args = "fx__sleep", {"seconds": 0.002, "message": "flood"}
            else:
                flood_tool, flood_args = fx_tool, {"message": "flood"}
            extra["fairness"] = await fairness(nursery, url, fx_tool, flood_tool, flood_args,
                                               backend, args, FLOOD_INFLIGHT)
            extra["fairness_tool"] = f"{flood_tool} {json.dumps(flood_args)}"

            # ---- restart-to-ready -----------------------------------------------------------
            rs_tool = f"rs__{backend.tool}"
            await sequential(one, rs_tool, backend, 20, 10)
            for i in range(args.restarts):
                procs.remember_tree(gw.pid)
                run = await restart_run(admin, one, rs_tool, backend)
                restarts.append(run)
                print(f"  restart {i + 1}: RUNNING after {run.running_ms:.1f} ms, first call after "
                      f"{run.first_call_ms:.1f} ms ({run.failed_calls} failed attempts: "
                      f"{', '.join(run.errors_seen) or '-'})", file=sys.stderr, flush=True)
                await sequential(one, rs_tool, backend, 20, 10)
                await trio.sleep(0.2)
            await one.aclose()
            await one_unix.aclose()
            nursery.cancel_scope.cancel()
        status = await gateway_status(admin)
        restarts_seen = instance_of(status, "rs")["restarts"]
        notes.append(f"restart backend 'rs': /status counts {restarts_seen} restarts after "
                     f"{args.restarts} kills")
    finally:
        procs.remember_tree(gw.pid)
        procs.stop(gw.pid, grace=10.0)
        shutil.rmtree(tmp, ignore_errors=True)
        if gw.returncode not in (0, None, -signal.SIGTERM):
            notes.append(f"mcp-gateway exited with code {gw.returncode} on SIGTERM")


async def bench_floor(args: argparse.Namespace, backend: BackendSpec, procs: Procs,
                      results: list[LoadResult], notes: list[str]) -> None:
    """The floor: bench/floor.py, a forwarder without logic (frames in, the same bytes to a `cat`
    child, back out), on the gateway's two transports. The echoed request is the answer."""
    print("floor (no-logic trio forwarder -> cat)", file=sys.stderr, flush=True)
    tmp = tempfile.mkdtemp(prefix="mcpgw-bench-")
    unix_path = os.path.join(tmp, "floor.sock")
    port = free_port()
    fl = procs.popen("floor",
                     [sys.executable, FLOOR, "--ws", f"127.0.0.1:{port}", "--unix", unix_path])
    try:
        await wait_port(port, fl, "floor")
        addrs = assert_loopback_only(fl.pid, "floor")
        notes.append(f"floor listens on {', '.join(sorted(addrs))} and unix:{unix_path}")
        procs.remember_tree(fl.pid)
        cpu = {"proxy": lambda: [fl.pid], "backend": lambda: descendants(fl.pid)}
        async with trio.open_nursery() as nursery:
            ws_conns: list[Conn] = [await WsConn.open(nursery, f"ws://127.0.0.1:{port}/", ["mcp"])
                                    for _ in range(args.clients)]
            unix_conns: list[Conn] = []
            for _ in range(args.clients):
                sock = await trio.open_unix_socket(unix_path)
                unix_conns.append(LineConn.start(nursery, sock, sock))
            for c in (*ws_conns, *unix_conns):
                assert isinstance(c, StreamConn)
                c.echo_mode = True
            for label, conns in (("floor (no logic, cat), WebSocket", ws_conns),
                                 ("floor (no logic, cat), unix socket", unix_conns)):
                for inflight in (1, args.inflight):
                    results.append(await measure(label, "floor", conns, args, inflight=inflight,
                                                 tool=backend.tool, backend=backend, cpu_pids=cpu))
                for c in conns:
                    await c.aclose()
            nursery.cancel_scope.cancel()
    finally:
        procs.remember_tree(fl.pid)
        procs.stop(fl.pid)
        shutil.rmtree(tmp, ignore_errors=True)


async def bench_supergateway(args: argparse.Namespace, backend: BackendSpec, procs: Procs,
                             results: list[LoadResult], notes: list[str]) -> None:
    print("supergateway 4.0.0 (stdio -> WebSocket)", file=sys.stderr, flush=True)
    if not os.path.isfile(SUPERGATEWAY):  # noqa: ASYNC240 - a check on a local path, before any measurement
        raise BenchError("not installed (run scripts/setup-bench)")
    node = shutil.which("node")
    if node is None:
        raise BenchError("node not found")
    port = free_port()
    stdio_cmd = shlex.join(backend.argv)
    argv = [node, "--require", PRELOAD, SUPERGATEWAY, "--stdio", stdio_cmd,
            "--outputTransport", "ws", "--port", str(port), "--logLevel", "none"]
    sg = procs.popen("supergateway", argv)
    try:
        await wait_port(port, sg, "supergateway")
        addrs = assert_loopback_only(sg.pid, "supergateway")
        notes.append(f"supergateway listens on {', '.join(sorted(addrs))} (forced by "
                     "bench/loopback-preload.cjs)")
        procs.remember_tree(sg.pid)
        url = f"ws://127.0.0.1:{port}/message"
        cpu = {"proxy": lambda: [sg.pid], "backend": lambda: descendants(sg.pid)}
        async with trio.open_nursery() as nursery:
            conns = [await WsConn.open(nursery, url, None) for _ in range(args.clients)]
            for c in conns:
                with trio.fail_after(10):
                    await c.initialize()
            for inflight in (1, args.inflight):
                results.append(await measure("supergateway 4.0.0, WebSocket", "peer", conns, args,
                                             inflight=inflight, tool=backend.tool, backend=backend,
                                             cpu_pids=cpu))
            for c in conns:
                await c.aclose()
            nursery.cancel_scope.cancel()
    finally:
        procs.remember_tree(sg.pid)
        procs.stop(sg.pid)


async def bench_supergateway_http(args: argparse.Namespace, backend: BackendSpec, procs: Procs,
                                  results: list[LoadResult], notes: list[str]) -> None:
    """supergateway's Streamable HTTP output, stateful: one session per client, and supergateway
    spawns one backend child per session (their CPU and memory are the backend columns)."""
    print("supergateway 4.0.0 (stdio -> Streamable HTTP, stateful)", file=sys.stderr, flush=True)
    if not os.path.isfile(SUPERGATEWAY):  # noqa: ASYNC240 - a check on a local path, before any measurement
        raise BenchError("not installed (run scripts/setup-bench)")
    node = shutil.which("node")
    if node is None:
        raise BenchError("node not found")
    port = free_port()
    argv = [node, "--require", PRELOAD, SUPERGATEWAY, "--stdio", shlex.join(backend.argv),
            "--outputTransport", "streamableHttp", "--stateful", "--streamableHttpPath", "/mcp",
            "--port", str(port), "--logLevel", "none"]
    sg = procs.popen("supergateway-http", argv)
    try:
        await wait_port(port, sg, "supergateway")
        assert_loopback_only(sg.pid, "supergateway")
        cpu = {"proxy": lambda: [sg.pid], "backend": lambda: descendants(sg.pid)}
        conns: list[Conn] = [HttpConn(port, max_links=args.inflight) for _ in range(args.clients)]
        try:
            for c in conns:
                with trio.fail_after(START_TIMEOUT):  # each session spawns its own backend child
                    await c.initialize()
                procs.remember_tree(sg.pid)
            addrs = assert_loopback_only(sg.pid, "supergateway")
            notes.append(f"supergateway (Streamable HTTP) listens on {', '.join(sorted(addrs))} "
                         "(forced by "
                         f"bench/loopback-preload.cjs); {len(descendants(sg.pid))} processes below "
                         "it with "
                         f"{args.clients} sessions open")
            for inflight in (1, args.inflight):
                results.append(await measure(SG_HTTP_ROW, "peer", conns, args, inflight=inflight,
                                             tool=backend.tool, backend=backend, cpu_pids=cpu))
        finally:
            procs.remember_tree(sg.pid)
            notes.append(HttpConn.summary(SG_HTTP_ROW, conns))
            for c in conns:
                await c.aclose()
    finally:
        procs.remember_tree(sg.pid)
        procs.stop(sg.pid)


async def bench_mcp_proxy(args: argparse.Namespace, backend: BackendSpec, procs: Procs,
                          results: list[LoadResult], notes: list[str]) -> None:
    print("mcp-proxy 0.13.0 (stdio -> Streamable HTTP)", file=sys.stderr, flush=True)
    if not os.path.isfile(MCP_PROXY):  # noqa: ASYNC240 - a check on a local path, before any measurement
        raise BenchError("not installed (run scripts/setup-bench)")
    port = free_port()
    argv = [MCP_PROXY, "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
            *backend.argv]
    mp = procs.popen("mcp-proxy", argv)
    try:
        await wait_port(port, mp, "mcp-proxy")
        addrs = assert_loopback_only(mp.pid, "mcp-proxy")
        notes.append(f"mcp-proxy listens on {', '.join(sorted(addrs))}")
        procs.remember_tree(mp.pid)
        cpu = {"proxy": lambda: [mp.pid], "backend": lambda: descendants(mp.pid)}
        conns: list[Conn] = [HttpConn(port, max_links=args.inflight) for _ in range(args.clients)]
        try:
            for c in conns:
                with trio.fail_after(10):
                    await c.initialize()
            for inflight in (1, args.inflight):
                results.append(await measure(MP_ROW, "peer", conns, args, inflight=inflight,
                                             tool=backend.tool, backend=backend, cpu_pids=cpu))
        finally:
            notes.append(HttpConn.summary(MP_ROW, conns))
            for c in conns:
                await c.aclose()
    finally:
        procs.remember_tree(mp.pid)
        procs.stop(mp.pid)


# ==== report =====================================================================================


def cpu_calibration() -> float:
    """CPU ms of a fixed pure-Python loop (best of 3): how fast this machine's cores are right
    now."""
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        x = 0
        for i in range(1_000_000):
            x += i
        best = min(best, time.process_time() - t0)
    return best * 1000


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def attach_ratios(results: list[LoadResult]) -> None:
    direct = {(r.clients * r.inflight): r for r in results if r.group == "direct"}
    for r in results:
        base = direct.get(r.clients * r.inflight)
        if base is not None and base.calls_per_s > 0:
            r.ratio_vs_direct = r.calls_per_s / base.calls_per_s
            if not math.isnan(r.p50_us) and base.p50_us > 0:
                r.p50_vs_direct = r.p50_us / base.p50_us


WS_ROW, UNIX_ROW = "mcp-gateway, WebSocket", "mcp-gateway, unix socket"
FLOOR_WS_ROW, FLOOR_UNIX_ROW = "floor (no logic, cat), WebSocket", ("floor (no logic, cat), unix "
                                                                    "socket")
SG_ROW, DIRECT_ROW = "supergateway 4.0.0, WebSocket", "direct stdio (one pipe)"
GW_HTTP_LEGACY_ROW = "mcp-gateway, HTTP legacy session"
GW_HTTP_MODERN_ROW = "mcp-gateway, HTTP stateless 2026-07-28"
SG_HTTP_ROW = "supergateway 4.0.0, Streamable HTTP (stateful)"
MP_ROW = "mcp-proxy 0.13.0, Streamable HTTP"
FLOOR_OF = {WS_ROW: FLOOR_WS_ROW, UNIX_ROW: FLOOR_UNIX_ROW}


def find_row(results: list[LoadResult], path: str, inflight: int) -> LoadResult | None:
    return next((r for r in results if r.path == path and r.inflight == inflight and r.ok), None)


def over_floor(results: list[LoadResult], r: LoadResult) -> float | None:
    """The gateway row's proxy CPU per call minus the floor row's on the same transport and load."""
    floor = find_row(results, FLOOR_OF.get(r.path, ""), r.inflight)
    if floor is None or "proxy" not in r.cpu_us_per_call or "proxy" not in floor.cpu_us_per_call:
        return None
    return r.cpu_us_per_call["proxy"] - floor.cpu_us_per_call["proxy"]


@dataclass
class Target:
    what: str
    measured: str  # the figure, with its unit
    limit: str  # "≥ 1.2×", "≤ 90 µs", ...
    ratio: float | None  # measured ÷ limit (≥ 1 passes a lower bound, ≤ 1 an upper bound)
    passed: bool | None  # None: not measured


def evaluate_targets(results: list[LoadResult], singles: list[SeqResult], extra: dict[str, Any],
                     args: argparse.Namespace) -> list[Target]:
    """Issue 8's targets, each from this run's medians."""
    out: list[Target] = []

    def add(what: str, value: float | None, op: str, limit: float, unit: str, fmt: str = "{:.0f}",
            limit_text: str | None = None) -> None:
        shown = f"{op} {limit_text or f'{limit:g}'}{unit}"
        if value is None or (isinstance(value, float) and math.isnan(value)):
            out.append(Target(what, "not measured", shown, None, None))
            return
        ratio = value / limit if limit else None
        passed = value >= limit if op == "≥" else value < limit if op == "<" else value <= limit
        out.append(Target(what, fmt.format(value) + unit, shown, ratio, passed))

    n = args.clients
    gw_ws, gw_unix = find_row(results, WS_ROW, 1), find_row(results, UNIX_ROW, 1)
    sg, direct = find_row(results, SG_ROW, 1), find_row(results, DIRECT_ROW, 1)
    add(f"WebSocket, {n} connections: calls/s ÷ supergateway's WebSocket calls/s",
        gw_ws.calls_per_s / sg.calls_per_s if gw_ws and sg and sg.calls_per_s else None, "≥", 1.2,
        "×", "{:.2f}")
    add(f"unix socket, {n} connections: calls/s ÷ direct stdio calls/s",
        gw_unix.calls_per_s / direct.calls_per_s if gw_unix and direct and direct.calls_per_s
        else None, "≥", 0.6, "×", "{:.2f}")
    add(f"gateway CPU per call, WebSocket, {n} × 1",
        gw_ws.cpu_us_per_call.get("proxy") if gw_ws else None, "≤", 90, " µs")
    add(f"gateway CPU per call, unix socket, {n} × 1",
        gw_unix.cpu_us_per_call.get("proxy") if gw_unix else None, "≤", 70, " µs")
    add(f"gateway CPU per call minus the floor's, WebSocket, {n} × 1",
        over_floor(results, gw_ws) if gw_ws else None, "≤", 40, " µs")
    add(f"gateway CPU per call minus the floor's, unix socket, {n} × 1",
        over_floor(results, gw_unix) if gw_unix else None, "≤", 40, " µs")
    direct_seq = next((x for x in singles if x.path == "direct stdio"), None)
    for label, path, limit in (("WebSocket", "mcp-gateway WS, shared backend", 0.3),
                               ("unix socket", "mcp-gateway unix, shared backend", 0.15)):
        seq = next((x for x in singles if x.path == path), None)
        add(f"sequential added latency p50 (gateway − direct), {label}",
            (seq.p50_us - direct_seq.p50_us) / 1000 if seq and direct_seq else None, "≤", limit,
            " ms", "{:.3f}")
    fair = extra.get("fairness") or []
    ratios = [r.flood_p50_us / r.alone_p50_us for r in fair if r.alone_p50_us > 0
              and not math.isnan(r.flood_p50_us)]
    add(f"fairness: light connection's p50 under a {FLOOD_INFLIGHT}-in-flight flood "
        "÷ its p50 alone",
        statistics.median(ratios) if ratios else None, "≤", 2, "×", "{:.2f}")
    idle = extra.get("idle")
    add(f"{args.idle_connections} idle WebSocket connections: added gateway RSS",
        idle.added_mib if idle is not None and idle.opened == idle.wanted else None, "≤", 32,
        " MiB", "{:.1f}")

    # issue 9: Streamable HTTP, against supergateway's (stateful) and mcp-proxy's
    sg_http, mp = find_row(results, SG_HTTP_ROW, 1), find_row(results, MP_ROW, 1)
    shapes = (("legacy session", find_row(results, GW_HTTP_LEGACY_ROW, 1)),
              ("stateless 2026-07-28", find_row(results, GW_HTTP_MODERN_ROW, 1)))
    for shape, gw in shapes:
        for peer_name, peer in (("supergateway's (stateful)", sg_http), ("mcp-proxy's", mp)):
            add(f"HTTP {shape}, {n} clients: calls/s ÷ {peer_name} Streamable HTTP calls/s",
                gw.calls_per_s / peer.calls_per_s if gw and peer and peer.calls_per_s else None,
                "≥", 2, "×", "{:.2f}")
    mp_cpu = mp.cpu_us_per_call.get("proxy") if mp else None
    for shape, gw in shapes:
        gw_cpu = gw.cpu_us_per_call.get("proxy") if gw else None
        add(f"gateway CPU per call, HTTP {shape}, {n} × 1, ÷ mcp-proxy's "
            f"({_f(gw_cpu)} µs ÷ {_f(mp_cpu)} µs)",
            gw_cpu / mp_cpu if gw_cpu is not None and mp_cpu else None, "≤", 1 / 3, "×", "{:.2f}",
            "⅓")
    gw_rss = [r.rss_mib["proxy"] for r in results if r.group == "mcp-gateway"
              and "proxy" in r.rss_mib]
    add("gateway resident memory (the largest VmRSS seen at the end of any round of its rows)",
        max(gw_rss) * 2**20 / 1e6 if gw_rss else None, "<", 64, " MB", "{:.1f}")
    shared = extra.get("shared_child")
    if shared is None:
        out.append(Target("one shared child: backend fx instances after the HTTP rows",
                          "not measured", "= 1, same pid", None, None))
    else:
        before, after = shared["before"], shared["after"]
        same = len(before) == 1 and len(after) == 1 and before[0][0] == after[0][0]
        out.append(Target("one shared child: backend fx instances after the HTTP rows (same pid as "
                          "before them)",
                          f"{len(after)} ({'same pid' if same else f'pids {before} → {after}'})",
                          "= 1, same pid", None, same))
    return out


def markdown(args: argparse.Namespace, backend: BackendSpec, results: list[LoadResult],
             singles: list[SeqResult],
             restarts: list[RestartRun], spawns: list[float], peers: dict[str, str],
             notes: list[str], extra: dict[str, Any], targets: list[Target]) -> str:
    out = [
        f"### Targets (issues 8 and 9; medians of {args.repeat} rounds; backend: {backend.name})",
        "", "| target | measured | limit | measured ÷ limit | result |", "|---|---:|---:|---:|---|"]
    for t in targets:
        res = "n/a" if t.passed is None else ("PASS" if t.passed else "**FAIL**")
        out.append(f"| {t.what} | {t.measured} | {t.limit} | {_f(t.ratio, '{:.2f}')} | {res} |")
    out += ["", f"### Throughput: {args.clients} clients, {args.seconds:g} s per round (at most "
                f"{args.calls} calls), "
            f"median of {args.repeat} rounds (backend: {backend.name}, {os.cpu_count()} CPUs "
            "shared by client "
            "and servers)", "",
            "| path | clients × in flight | ok / err | calls/s | × direct | p50 ms | p99 ms | p50 "
            "× direct "
            "| proxy CPU µs/call (sys) | proxy CPU − floor µs/call | backend CPU µs/call "
            "| bench client CPU µs/call (sys) | other load (cores) | proxy RSS MiB | backend RSS "
            "MiB (processes) |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cpu = r.cpu_us_per_call

        def cpu_cell(label: str, cpu: dict[str, float] = cpu) -> str:
            return f"{_f(cpu.get(label))} ({_f(cpu.get(label + ' sys'))})"

        out.append(
            f"| {r.path}{' (call bound hit)' if r.call_bound_hit else ''} | {r.clients} × "
            f"{r.inflight} "
            f"| {r.ok} / {r.errors} "
            f"| {r.calls_per_s:.0f} | {_f(r.ratio_vs_direct, '{:.2f}')} | "
            f"{_f(r.p50_us / 1000, '{:.2f}')} "
            f"| {_f(r.p99_us / 1000, '{:.2f}')} | {_f(r.p50_vs_direct, '{:.2f}')} "
            f"| {cpu_cell('proxy') if r.group != 'direct' else '–'} "
            f"| {_f(over_floor(results, r), '{:+.0f}') if r.path in FLOOR_OF else '–'} "
            f"| {_f(cpu.get('backend'))} "
            f"| {cpu_cell('bench client')} | {_f(r.other_load, '{:.1f}')} "
            f"| {_f(r.rss_mib.get('proxy'), '{:.1f}') if r.group != 'direct' else '–'} "
            f"| {_f(r.rss_mib.get('backend'), '{:.1f}')} ({r.rss_mib.get('backend procs', 0):.0f}) "
            "|")
    out += ["", f"### Single client, sequential calls ({args.single_calls} per row and round; "
                "median of "
            f"{args.repeat} rounds' p50/p99)", "",
            "| path | calls | p50 µs | p99 µs | mean µs | p50 added vs direct µs | p50 added vs "
            "shared µs |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    direct = next((s for s in singles if s.path == "direct stdio"), None)
    shared = next((s for s in singles if s.path == "mcp-gateway WS, shared backend"), None)
    for s in singles:
        add_direct = s.p50_us - direct.p50_us if direct and s is not direct else None
        add_shared = s.p50_us - shared.p50_us if shared and s.path == ("mcp-gateway WS, affine "
                                                                       "backend") else None
        out.append(f"| {s.path} | {s.calls} | {_f(s.p50_us)} | {_f(s.p99_us)} | {_f(s.mean_us)} "
                   f"| {_f(add_direct, '{:+.0f}')} | {_f(add_shared, '{:+.0f}')} |")
    fair = extra.get("fairness") or []
    if fair:
        out += ["", "### Fairness (WebSocket, shared backend): a light connection's sequential "
                    "`echo` calls, "
                f"alone and while another connection keeps {FLOOD_INFLIGHT} calls in flight "
                f"(`{extra.get('fairness_tool')}`); {max(1.0, args.seconds / 2):g} s per phase", "",
                "| round | light p50 alone µs | light p99 alone µs | light p50 flooded µs | light "
                "p99 flooded µs "
                "| p50 flooded ÷ alone | light calls alone / flooded | flood calls/s | flood "
                "errors |",
                "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
        for i, r in enumerate(fair, 1):
            out.append(f"| {i} | {_f(r.alone_p50_us)} | {_f(r.alone_p99_us)} | "
                       f"{_f(r.flood_p50_us)} "
                       f"| {_f(r.flood_p99_us)} | {_f(r.flood_p50_us / r.alone_p50_us, '{:.2f}')} "
                       f"| {r.alone_calls} / {r.flood_calls} | {r.flood_calls_per_s:.0f} | "
                       f"{r.flood_errors} |")
        def med(xs: list[float]) -> float:
            return statistics.median(xs) if xs else float("nan")

        out.append(f"| **median** | {_f(med([r.alone_p50_us for r in fair]))} | "
                   f"{_f(med([r.alone_p99_us for r in fair]))} "
                   f"| {_f(med([r.flood_p50_us for r in fair]))} | "
                   f"{_f(med([r.flood_p99_us for r in fair]))} "
                   f"| **{_f(med([r.flood_p50_us / r.alone_p50_us for r in fair]), '{:.2f}')}** | "
                   "| "
                   f"{_f(med([r.flood_calls_per_s for r in fair]))} | |")
    idle = extra.get("idle")
    if idle is not None:
        out += ["", "### Idle WebSocket connections (opened first, on the gateway's fresh heap; "
                    "each initialised)",
                "", "| connections opened | gateway RSS before MiB | with them open MiB | added "
                    "MiB | added KiB per "
                "connection | 1 s after closing them MiB |", "|---:|---:|---:|---:|---:|---:|",
                f"| {idle.opened} / {idle.wanted} | {idle.rss_before / 2**20:.1f} | "
                f"{idle.rss_open / 2**20:.1f} "
                f"| {idle.added_mib:.1f} | "
                f"{_f(idle.added_mib * 1024 / idle.opened if idle.opened else None, '{:.1f}')} "
                f"| {idle.rss_closed / 2**20:.1f} |"]
        if idle.first_error:
            out.append(f"\nFirst error while opening: {idle.first_error}")
    prof = extra.get("profile")
    if prof:
        out += ["", f"### Profile: the gateway process under {args.clients} × 1 WebSocket load "
                f"(py-spy, GIL-holding samples, {prof['seconds']} s, {prof['calls_per_s']:.0f} "
                "calls/s while sampled)",
                "", "| # | function (file:first line) | own % | total % |", "|---:|---|---:|---:|"]
        for i, (name, own, total) in enumerate(prof["top"], 1):
            out.append(f"| {i} | `{name}` | {own:.1f} | {total:.1f} |")
    if restarts:
        out += ["",
                "### Restart-to-ready (kill -9 of the backend child; /status polled every 5 ms; "
                "restart backoff configured to 5 ms; times from the kill)", "",
                "| run | not RUNNING seen ms | STARTING (new pid) seen ms | RUNNING seen ms | "
                "first ok call ms "
                "| gateway's spawn→handshake ms | failed attempts | errors seen |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]
        for i, r in enumerate(restarts, 1):
            out.append(f"| {i} | {r.gone_ms:.1f} | {_f(r.starting_ms, '{:.1f}')} | "
                       f"{r.running_ms:.1f} "
                       f"| {r.first_call_ms:.1f} | {_f(r.gateway_start_ms, '{:.1f}')} | "
                       f"{r.failed_calls} "
                       f"| {', '.join(r.errors_seen) or '–'} |")
        def med(xs: list[float]) -> float:
            return statistics.median(xs) if xs else float("nan")

        starting = [r.starting_ms for r in restarts if r.starting_ms is not None]
        gw_start = [r.gateway_start_ms for r in restarts if r.gateway_start_ms is not None]
        out.append(f"| **median** | {med([r.gone_ms for r in restarts]):.1f} | "
                   f"{_f(med(starting), '{:.1f}')} "
                   f"| **{med([r.running_ms for r in restarts]):.1f}** "
                   f"| **{med([r.first_call_ms for r in restarts]):.1f}** | "
                   f"{_f(med(gw_start), '{:.1f}')} | | |")
        if spawns:
            out += ["", "Floor for comparison: spawning the backend directly and doing the same "
                        "handshake "
                    f"(initialize + the four lists) took {statistics.median(spawns):.1f} ms "
                    "(median of "
                    f"{len(spawns)}: {', '.join(f'{x:.0f}' for x in spawns)} ms)."]
    out += ["", "### Peers", ""]
    for name, state in peers.items():
        out.append(f"- {name}: {state}")
    if notes:
        out += ["", "### Notes", ""]
        out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


# ==== remote mode: server-everything's own Streamable HTTP server as the backend =================

REMOTE_DIRECT_ROW = "direct HTTP (server-everything's own server)"
REMOTE_ONE_SESSION_ROW = "direct HTTP, one session (as the gateway's upstream)"
REMOTE_WARMUP = 5.0  # seconds of load on the fresh server before its first row
REMOTE_WS_ROW = "mcp-gateway, WebSocket → remote"
REMOTE_LEGACY_ROW = "mcp-gateway, /mcp legacy → remote"
REMOTE_MODERN_ROW = "mcp-gateway, /mcp stateless 2026-07-28 → remote"


def remote_gateway_config(server_port: int, ws_port: int, http_port: int, admin_port: int, *,
                          max_connections: int | None = None,
                          max_inflight: int | None = None) -> str:
    """One backend ``ev``: server-everything's Streamable HTTP server as a ``url`` backend (its
    ``max_connections`` and ``max_inflight`` when given: ``--remote-connections``,
    ``--max-inflight``)."""
    bounds = "".join(f"{key} = {value}\n" for key, value in (
        ("max_connections", max_connections), ("max_inflight", max_inflight))
        if value is not None)
    return f"""# written by bench/run.py --backend everything-http
[gateway]
name = "mcp-gateway-bench"

[listen]
websocket = "127.0.0.1:{ws_port}"
http = "127.0.0.1:{http_port}"

[admin]
listen = "127.0.0.1:{admin_port}"

[backends.ev]
url = "http://127.0.0.1:{server_port}/mcp"
required = true
start_timeout = 10.0
{bounds}"""


def socket_inodes(pid: int) -> set[str]:
    out: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def upstream_ports(pid: int, server_port: int) -> set[int]:
    """Local ports of ``pid``'s established TCP connections to 127.0.0.1:``server_port``."""
    inodes = socket_inodes(pid)
    out: set[int] = set()
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            cols = line.split()
            remote = int(cols[2].split(":")[1], 16)
            if cols[3] == "01" and cols[9] in inodes and remote == server_port:
                out.add(int(cols[1].split(":")[1], 16))
    return out


class UpstreamWatch:
    """Samples the gateway's connections to the remote every ``every`` seconds: the most held
    at once, and how many distinct ones were seen (a connection opened and closed between two
    samples is missed)."""

    def __init__(self, pid: int, server_port: int, every: float = 0.2) -> None:
        self.pid, self.server_port, self.every = pid, server_port, every
        self.most = 0
        self.seen: set[int] = set()
        self.scope = trio.CancelScope()  # cancelled: :meth:`run` returns

    def reset(self) -> None:
        self.most, self.seen = 0, set()

    async def run(self) -> None:
        with self.scope:
            while True:
                ports = upstream_ports(self.pid, self.server_port)
                self.most = max(self.most, len(ports))
                self.seen |= ports
                await trio.sleep(self.every)


async def start_everything_http(procs: Procs, notes: list[str],
                                name: str = "everything-http") -> tuple[subprocess.Popen[bytes],
                                                                        int]:
    """server-everything's own Streamable HTTP server on 127.0.0.1 (the listen() preload), its
    output in ``name``.log.  A port another process took between :func:`free_port` and the
    server's bind (the server then exits, and the port answers) is found by the server's own
    listening sockets, and a new port tried (3 times at most)."""
    if not os.path.isfile(EVERYTHING):  # noqa: ASYNC240 - a check on a local path, before any measurement
        raise BenchError(f"{EVERYTHING} is missing: run scripts/setup first")
    node = shutil.which("node") or "node"
    for _ in range(3):
        port = free_port()
        srv = procs.popen(name, [node, "--require", PRELOAD, EVERYTHING, "streamableHttp"],
                          env=dict(os.environ, PORT=str(port)))
        try:
            await wait_port(port, srv, "server-everything (streamableHttp)")
        except BenchError:
            procs.stop(srv.pid)
            continue
        addrs = assert_loopback_only(srv.pid, "server-everything")
        if any(a.endswith(f":{port}") for a in addrs):
            notes.append(f"server-everything streamableHttp (pid {srv.pid}) listens on "
                         f"{', '.join(sorted(addrs))}")
            return srv, port
        procs.stop(srv.pid)
    raise BenchError("server-everything (streamableHttp) did not listen on a port of its own "
                     "in 3 tries")


async def http_clients(port: int, n: int, links: int, *, modern: bool = False,
                       protocol: str = PROTOCOL) -> list[Conn]:
    conns: list[Conn] = [HttpConn(port, modern=modern, max_links=links, protocol=protocol)
                         for _ in range(n)]
    for c in conns:
        with trio.fail_after(10):
            await c.initialize()
    return conns


async def wait_ready(gw: subprocess.Popen[bytes], admin: int, log: str) -> None:
    """Until the gateway answers ``/readyz`` 200 (:data:`START_TIMEOUT` at most)."""
    deadline = trio.current_time() + START_TIMEOUT
    while True:
        if gw.poll() is not None:
            raise BenchError(f"gateway exited during start-up (code {gw.returncode}); see {log}")
        try:
            if (await http_get(admin, "/readyz"))[0] == 200:
                return
        except (OSError, trio.TooSlowError):
            pass
        if trio.current_time() > deadline:
            raise BenchError("gateway not ready within start timeout")
        await trio.sleep(0.05)


def fixed_pids(*pids: int) -> Callable[[], list[int]]:
    return lambda: list(pids)


async def start_remote_gateway(procs: Procs, sport: int, name: str, notes: list[str],
                               args: argparse.Namespace
                               ) -> tuple[subprocess.Popen[bytes], int, int, int]:
    """A gateway with server-everything on ``sport`` as its ``url`` backend ``ev``, ready and its
    remote's tools listed: (process, WebSocket port, HTTP port, admin port)."""
    ws_port, http_port, admin = free_port(), free_port(), free_port()
    cfg_path = os.path.join(procs.log_dir, f"{name}.toml")
    with open(cfg_path, "w") as f:  # noqa: ASYNC230 - set-up on a local file
        f.write(remote_gateway_config(sport, ws_port, http_port, admin,
                                      max_connections=args.remote_connections,
                                      max_inflight=args.max_inflight))
    env = gateway_env()
    gw = procs.popen(name, [sys.executable, "-m", "gateway", "run", "--config", cfg_path], env=env)
    await wait_ready(gw, admin, f"{procs.log_dir}/{name}.log")
    assert_loopback_only(gw.pid, "mcp-gateway")
    return gw, ws_port, http_port, admin


async def wait_remote_tool(nursery: trio.Nursery, ws_port: int, tool: str) -> WsConn:
    """A WebSocket client of the gateway, once ``tool`` is in its catalog (the remote's tools
    arrive after its list_changed)."""
    ws = await WsConn.open(nursery, f"ws://127.0.0.1:{ws_port}/", ["mcp"])
    await ws.initialize()
    with trio.fail_after(20):
        while tool not in {t["name"] for t in  # noqa: ASYNC110 - another process's catalog: polled
                           (await ws.request("tools/list"))["result"]["tools"]}:
            await trio.sleep(0.1)
    return ws


async def bench_remote(args: argparse.Namespace, backend: BackendSpec, procs: Procs,
                       results: list[LoadResult], singles: list[SeqResult], notes: list[str],
                       extra: dict[str, Any]) -> None:
    """The remote rows.  server-everything's HTTP server keeps every event of a session (its
    heap, and its CPU per call with it, grow with the calls it has served), so each throughput
    row gets a server of its own, started fresh and warmed by :data:`REMOTE_WARMUP` seconds of
    the same load through the same path: the same clients straight to it (the limit), the same
    on one session (as the gateway's upstream), then through a fresh gateway (WebSocket, /mcp
    legacy, /mcp stateless) with it as its ``url`` backend.  The sequential rows share one
    server, interleaved in blocks.  The direct clients speak the version the gateway's upstream
    session negotiated (read in /status)."""
    tool = f"ev__{backend.tool}"
    async with trio.open_nursery() as nursery:
        # ---- single client, sequential: interleaved blocks, so drift hits all alike ----------
        print("remote: server-everything streamableHttp (sequential rows)", file=sys.stderr,
              flush=True)
        srv, sport = await start_everything_http(procs, notes)
        seq_gw, ws_port, http_port, admin = await start_remote_gateway(procs, sport,
                                                                       "gateway-seq", notes, args)
        notes.append(f"mcp-gateway under test: {ROOT}/gateway; backends.ev max_connections "
                     f"{args.remote_connections or 'default'}, max_inflight "
                     f"{args.max_inflight or 'default'}")
        version = instance_of(await gateway_status(admin), "ev")["protocol_version"]
        notes.append(f"the gateway's session with the remote speaks {version}; the direct "
                     f"clients too (the bench's clients of the gateway speak {PROTOCOL})")
        ws_one = await wait_remote_tool(nursery, ws_port, tool)
        paths: list[tuple[str, Conn, str]] = [
            ("direct HTTP", (await http_clients(sport, 1, 1, protocol=version))[0],
             backend.tool),
            (f"direct HTTP, {PROTOCOL} (for comparison)",
             (await http_clients(sport, 1, 1))[0], backend.tool),
            ("mcp-gateway WS → remote", ws_one, tool),
            ("mcp-gateway /mcp legacy → remote", (await http_clients(http_port, 1, 1))[0], tool),
            ("mcp-gateway /mcp stateless → remote",
             (await http_clients(http_port, 1, 1, modern=True))[0], tool)]
        for _, c, t in paths:
            await sequential(c, t, backend, 200, args.max_seconds)  # warm-up
        rounds: dict[str, list[list[int]]] = {p[0]: [] for p in paths}
        blocks = 5
        per = max(1, args.single_calls // blocks)
        for _ in range(args.repeat):
            lat: dict[str, list[int]] = {p[0]: [] for p in paths}
            for _ in range(blocks):
                for label, c, t in paths:
                    lat[label] += await sequential(c, t, backend, per, args.max_seconds / blocks)
            for k in rounds:
                rounds[k].append(lat[k])
        for label, c, _ in paths:
            singles.append(seq_result(label, rounds[label]))
            print(f"  single client {label:<40} p50 {singles[-1].p50_us:6.0f} us",
                  file=sys.stderr, flush=True)
            await c.aclose()
        procs.stop(seq_gw.pid, grace=10.0)
        procs.stop(srv.pid)
        # ---- N clients: each row on a fresh server (and gateway), warmed alike ---------------
        rows: list[tuple[str, str, str]] = [
            (REMOTE_DIRECT_ROW, "direct", "direct"),
            (REMOTE_ONE_SESSION_ROW, "direct, one session", "one-session"),
            (REMOTE_WS_ROW, "mcp-gateway", "gateway-ws"),
            (REMOTE_LEGACY_ROW, "mcp-gateway", "gateway-legacy"),
            (REMOTE_MODERN_ROW, "mcp-gateway", "gateway-stateless")]
        upstream: dict[str, dict[str, int]] = {}
        for label, group, name in rows:
            print(f"remote: a fresh server-everything for {label}", file=sys.stderr, flush=True)
            srv, sport = await start_everything_http(procs, [], f"everything-http-{name}")
            gw: subprocess.Popen[bytes] | None = None
            try:
                spid = srv.pid
                cpu: dict[str, Callable[[], list[int]]] = {"backend": fixed_pids(spid)}
                row_tool = backend.tool
                conns: list[Conn]
                if group == "direct":
                    conns = await http_clients(sport, args.clients, args.inflight,
                                               protocol=version)
                elif group == "direct, one session":
                    one = (await http_clients(sport, 1, args.clients * args.inflight,
                                              protocol=version))[0]
                    conns = [one] * args.clients
                else:
                    gw, ws_port, http_port, _ = await start_remote_gateway(procs, sport, name,
                                                                           notes, args)
                    cpu = {"proxy": fixed_pids(gw.pid), "backend": fixed_pids(spid)}
                    row_tool = tool
                    await (await wait_remote_tool(nursery, ws_port, tool)).aclose()
                    if label == REMOTE_WS_ROW:
                        conns = await ws_clients(nursery, f"ws://127.0.0.1:{ws_port}/",
                                                 args.clients)
                    else:
                        conns = await http_clients(http_port, args.clients, args.inflight,
                                                   modern=label == REMOTE_MODERN_ROW)
                # node's JIT: a cold server is several times slower per call than a warm one
                await run_load(conns, inflight=args.inflight, calls=args.calls,
                               cap=REMOTE_WARMUP, tool=row_tool, backend=backend)
                watch = UpstreamWatch(gw.pid, sport) if gw else None
                if watch:
                    nursery.start_soon(watch.run)
                for inflight in (1, args.inflight):
                    if watch:
                        watch.reset()
                    results.append(await measure(
                        label, group, conns, args, inflight=inflight,
                        tool=row_tool, backend=backend, cpu_pids=cpu))
                    if watch:
                        upstream[f"{label} {args.clients}x{inflight}"] = {
                            "most_at_once": watch.most, "distinct_seen": len(watch.seen)}
                if watch:
                    watch.scope.cancel()
                if label != REMOTE_WS_ROW:
                    notes.append(HttpConn.summary(label, conns[:1] if group ==
                                                  "direct, one session" else conns))
                for c in set(conns):
                    await c.aclose()
            finally:
                if gw is not None:
                    procs.stop(gw.pid, grace=10.0)
                procs.stop(srv.pid)
        extra["upstream"] = upstream
        nursery.cancel_scope.cancel()


async def ws_clients(nursery: trio.Nursery, url: str, n: int) -> list[Conn]:
    conns: list[Conn] = [await WsConn.open(nursery, url, ["mcp"]) for _ in range(n)]
    for c in conns:
        await c.initialize()
    return conns


def markdown_remote(args: argparse.Namespace, results: list[LoadResult], singles: list[SeqResult],
                    notes: list[str], extra: dict[str, Any]) -> str:
    """The remote run's tables: throughput with the CPU split per process, then latency."""
    out = [f"### Through a remote backend: {args.clients} clients, {args.seconds:g} s per round, "
           f"median of {args.repeat} rounds ({os.cpu_count()} CPUs shared by client, gateway and "
           "server)", "",
           "| path | clients × in flight | ok / err | calls/s | × direct | p50 ms | p99 ms "
           "| client CPU µs/call | gateway CPU µs/call (sys) | server CPU µs/call | other load "
           "(cores) | gateway RSS MiB | server RSS MiB "
           "| upstream connections (most at once / seen) |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    upstream = extra.get("upstream", {})
    for r in results:
        cpu = r.cpu_us_per_call
        up = upstream.get(f"{r.path} {r.clients}x{r.inflight}")
        gw_cell = (f"{_f(cpu.get('proxy'))} ({_f(cpu.get('proxy sys'))})" if "proxy" in cpu
                   else "–")
        up_cell = "–" if up is None else f"{up['most_at_once']} / {up['distinct_seen']}"
        out.append(
            f"| {r.path} | {r.clients} × {r.inflight} | {r.ok} / {r.errors} | "
            f"{r.calls_per_s:.0f} | {_f(r.ratio_vs_direct, '{:.2f}')} | "
            f"{_f(r.p50_us / 1000, '{:.2f}')} | {_f(r.p99_us / 1000, '{:.2f}')} | "
            f"{_f(cpu.get('bench client'))} | "
            f"{gw_cell} | {_f(cpu.get('backend'))} | {_f(r.other_load, '{:.1f}')} | "
            f"{_f(r.rss_mib.get('proxy'), '{:.1f}') if 'proxy' in r.rss_mib else '–'} | "
            f"{_f(r.rss_mib.get('backend'), '{:.0f}')} | {up_cell} |")
    out += ["", f"### Single client, sequential calls ({args.single_calls} per row and round, "
                f"interleaved in 5 blocks; median of {args.repeat} rounds' p50/p99)", "",
            "| path | calls | p50 µs | p99 µs | mean µs | p50 added over direct µs |",
            "|---|---:|---:|---:|---:|---:|"]
    direct = next((s for s in singles if s.path == "direct HTTP"), None)
    for s in singles:
        add = s.p50_us - direct.p50_us if direct and s is not direct else None
        out.append(f"| {s.path} | {s.calls} | {_f(s.p50_us)} | {_f(s.p99_us)} | {_f(s.mean_us)} "
                   f"| {_f(add, '{:+.0f}')} |")
    if notes:
        out += ["", "### Notes", ""]
        out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


async def amain_remote(args: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    """``--backend everything-http``: only the remote rows."""
    backend = BackendSpec("everything", [], "echo")  # its answers: "Echo: <message>"
    results: list[LoadResult] = []
    singles: list[SeqResult] = []
    notes: list[str] = []
    extra: dict[str, Any] = {}
    failure: str | None = None
    calibration = cpu_calibration()
    started = time.perf_counter()
    load_before = os.getloadavg()
    with trio.move_on_after(args.total_timeout) as total:
        try:
            await bench_remote(args, backend, procs, results, singles, notes, extra)
        except (BenchError, OSError, trio.TooSlowError, trio_websocket.HandshakeError) as exc:
            failure = f"remote rows: **not measured**: {type(exc).__name__}: {exc}"
            print(f"  {failure}", file=sys.stderr, flush=True)
    if total.cancelled_caught:
        failure = f"--total-timeout {args.total_timeout:g}s reached: the results are partial"
    if failure:
        notes.insert(0, failure)
    attach_ratios(results)
    notes.append(f"bench WebSocket client: {WsConn.client} (--ws-client)")
    notes.append(f"whole run took {time.perf_counter() - started:.1f} s; load average "
                 f"(1/5/15 min) {' '.join(f'{x:.2f}' for x in load_before)} before, "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after, on {os.cpu_count()} "
                 f"CPUs; CPU calibration: a 1M-iteration Python loop took {calibration:.0f} ms")
    report = markdown_remote(args, results, singles, notes, extra)
    return {
        "meta": {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "args": vars(args), "backend": args.backend, "cpu_calibration_ms": calibration,
                 "complete": failure is None},
        "throughput": [asdict(r) for r in results],
        "single_client": [asdict(s) for s in singles],
        "upstream": extra.get("upstream"), "notes": notes, "markdown": report,
    }


# ==== main =======================================================================================


async def amain(args: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    if args.backend == "everything-http":
        return await amain_remote(args, procs)
    backend = backend_spec(args.backend)
    results: list[LoadResult] = []
    singles: list[SeqResult] = []
    restarts: list[RestartRun] = []
    notes: list[str] = []
    peers: dict[str, str] = {}
    spawns: list[float] = []
    extra: dict[str, Any] = {}

    failures: list[str] = []  # sections of the run that could not be measured
    interrupted: list[str] = []

    async def on_signal(cancel: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
            async for sig in signals:
                print(f"bench: signal {sig}, stopping", file=sys.stderr)
                interrupted.append(f"signal {sig}")
                cancel.cancel()
                return

    async def section(name: str, fn: Callable[[], Any]) -> bool:
        """Run one part; a failure is reported in the output and the run goes on."""
        try:
            await fn()
        except (BenchError, OSError, trio.TooSlowError, trio_websocket.HandshakeError) as exc:
            msg = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            failures.append(f"{name}: **not measured**: {msg} (logs: "
                            f"{os.path.relpath(procs.log_dir, ROOT)})")  # noqa: ASYNC240 - absolute paths: no disk I/O
            print(f"  {name}: FAILED: {msg}", file=sys.stderr, flush=True)
            return False
        return True

    calibration = cpu_calibration()
    started = time.perf_counter()
    load_before = os.getloadavg()
    async with trio.open_nursery() as outer:
        outer.start_soon(on_signal, outer.cancel_scope)
        with trio.move_on_after(args.total_timeout) as total:
            await section("direct stdio",
                          lambda: bench_direct(args, backend, procs, results, singles, spawns))
            await section("mcp-gateway",
                          lambda: bench_gateway(args, backend, procs, results, singles, restarts,
                                                notes, extra))
            if not args.no_floor:
                await section("floor", lambda: bench_floor(args, backend, procs, results, notes))
            for name, fn, wanted, http in (
                    ("supergateway 4.0.0 (stdio → WebSocket)", bench_supergateway,
                     "supergateway", False),
                    ("supergateway 4.0.0 (stdio → Streamable HTTP, stateful)",
                     bench_supergateway_http, "supergateway", True),
                    ("mcp-proxy 0.13.0 (stdio → Streamable HTTP)", bench_mcp_proxy,
                     "mcp-proxy", True)):
                if wanted not in args.peers or (http and args.no_http):
                    peers[name] = ("skipped (--peers)" if wanted not in args.peers
                                   else "skipped (--no-http)")
                    continue
                before = len(results)
                if not await section(name, lambda fn=fn: fn(args, backend, procs, results, notes)):
                    peers[name] = failures.pop()[len(name) + 2:]
                    del results[before:]
                else:
                    bad = [r for r in results[before:] if r.errors]
                    peers[name] = ("measured" if not bad else
                                   f"measured, with errors: {bad[0].errors} ({bad[0].first_error})")
        if total.cancelled_caught:
            interrupted.append(f"--total-timeout {args.total_timeout:g}s reached")
        outer.cancel_scope.cancel()
    if interrupted:
        failures.append(f"run interrupted ({', '.join(interrupted)}): the results are partial")
    notes[:0] = failures
    attach_ratios(results)
    notes.append(f"bench WebSocket client: {WsConn.client} (--ws-client)")
    notes.append(f"whole run took {time.perf_counter() - started:.1f} s; load average (1 min) "
                 f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, on "
                 f"{os.cpu_count()} CPUs; "
                 f"CPU calibration: a 1M-iteration Python loop took {calibration:.0f} ms of CPU")
    targets = evaluate_targets(results, singles, extra, args)
    report = markdown(args, backend, results, singles, restarts, spawns, peers, notes, extra,
                      targets)
    return {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                     "platform": platform.platform()},
            "args": vars(args), "backend": backend.name, "backend_argv": backend.argv,
            "cpu_calibration_ms": calibration, "complete": not failures,
        },
        "throughput": [asdict(r) for r in results],
        "single_client": [asdict(s) for s in singles],
        "restart": {"runs": [asdict(r) for r in restarts],
                    "direct_spawn_to_ready_ms": spawns,
                    "median_running_ms": statistics.median([r.running_ms for r in restarts])
                    if restarts else None,
                    "median_first_call_ms": statistics.median([r.first_call_ms for r in restarts])
                    if restarts else None},
        "fairness": {"tool": extra.get("fairness_tool"),
                     "rounds": [asdict(r) for r in extra.get("fairness", [])]},
        "idle_connections": ({**asdict(extra["idle"]), "added_mib": extra["idle"].added_mib}
                             if "idle" in extra else None),
        "profile": extra.get("profile"),
        # /status fx instances [pid, state] around the HTTP rows
        "shared_child": extra.get("shared_child"),
        "targets": [asdict(t) for t in targets],
        "peers": peers,
        "notes": notes,
        "markdown": report,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0,
                   help="measured time of each throughput row, per round (default 5)")
    p.add_argument("--calls", type=int, default=200_000,
                   help="bound on the calls of one throughput round (and of each sequential phase "
                        "of the "
                        "fairness scenario) (default 200000)")
    p.add_argument("--clients", type=int, default=16,
                   help="concurrent clients / connections (default 16)")
    p.add_argument("--inflight", type=int, default=4,
                   help="calls in flight per connection in the pipelined rows (default 4)")
    p.add_argument("--single-calls", type=int, default=1000,
                   help="calls per single-client latency row (default 1000)")
    p.add_argument("--restarts", type=int, default=5, help="kill -9 / restart runs (default 5)")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of each throughput, latency and fairness figure; the median is "
                        "reported (default 3)")
    p.add_argument("--max-seconds", type=float, default=20.0,
                   help="wall-clock cap of each single-client latency row (default 20)")
    p.add_argument("--idle-connections", type=int, default=1000,
                   help="idle WebSocket connections for the gateway's added-RSS figure (0: skip; "
                        "default 1000)")
    p.add_argument("--profile", metavar="FILE",
                   help="after the gateway's WebSocket rows, profile it with py-spy (speedscope "
                        "FILE)")
    p.add_argument("--profile-seconds", type=float, default=10.0,
                   help="py-spy sampling time (default 10)")
    p.add_argument("--total-timeout", type=float, default=600.0,
                   help="hard cap on the whole run (default 600 s)")
    p.add_argument("--backend", choices=("fixture", "everything", "everything-http"),
                   default="fixture",
                   help="stdio backend: tests/fixtures/fixture_server.py (default) or "
                        "server-everything; everything-http: only the remote rows, "
                        "server-everything's own Streamable HTTP server directly and as the "
                        "gateway's url backend")
    p.add_argument("--peers", default="supergateway,mcp-proxy",
                   help="comma list of peers to run ('' for none)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor rows (bench/floor.py)")
    p.add_argument("--no-http", action="store_true",
                   help="skip every Streamable HTTP row (the gateway's /mcp, supergateway's and "
                        "mcp-proxy's)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="backends.NAME.max_inflight for the gateway's backends (default: the "
                        "gateway's)")
    p.add_argument("--remote-connections", type=int, default=None, metavar="N",
                   help="--backend everything-http: backends.ev.max_connections, the gateway's "
                        "upstream connections per instance (default: the gateway's)")
    p.add_argument("--telemetry", metavar="URL",
                   help="trace every gateway call ([telemetry], ratio 1.0), exported to this "
                        "OTLP/HTTP traces URL (the otel extra)")
    p.add_argument("--ws-client", choices=("lean", "trio-websocket"), default="lean",
                   help="the bench's WebSocket client: lean (bench/wsclient.py, default) or "
                        "trio-websocket")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    WsConn.client = args.ws_client
    args.peers = [x for x in args.peers.split(",") if x]
    if min(args.calls, args.clients, args.inflight, args.repeat,
           args.single_calls) < 1 or args.restarts < 0:
        p.error("--calls, --clients, --inflight, --repeat and --single-calls must be positive")
    if args.seconds <= 0 or args.idle_connections < 0:
        p.error("--seconds must be positive, --idle-connections not negative")

    os.makedirs(OUT_DIR, exist_ok=True)
    log_dir = os.path.join(OUT_DIR, "logs-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(log_dir, exist_ok=True)
    with Procs(log_dir) as procs:
        try:
            doc = trio.run(amain, args, procs)
        except KeyboardInterrupt:
            print("bench: interrupted", file=sys.stderr)
            return 130
    print(doc["markdown"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
        print(f"bench: JSON written to {args.json}", file=sys.stderr)
    return 0 if doc["meta"]["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
