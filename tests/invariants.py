"""The hardening suite's invariants, read from outside the daemon.

A :class:`Daemon` is ``python -m gateway run`` as a real subprocess (subreaper, signals, its own
fds and RSS).  :func:`baseline` records what an idle daemon looks like; :func:`check` asserts,
after a scenario, that it looks like that again:

* alive: the process runs and ``/healthz`` answers;
* a bystander WebSocket connection's echo call succeeds (and gets nothing that is not its own);
* the published ``/status`` snapshot settles back to the baseline: per-instance in-flight counts,
  pending server->client requests, connections by transport, client requests in flight and
  queued outbound messages (polled with an explicit deadline: an external observer can only poll);
* open fds of the daemon are back to the baseline (+- ``FD_SLACK``);
* the daemon's descendants are exactly the backend instances ``/status`` names (no orphan,
  no grandchild left behind);
* resident memory stays under ``RSS_BOUND``.

Nothing here reads the daemon's internal objects, so a rewrite of the routing core keeps these
tests as they are.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import ROOT, Client, connect, http_json, http_request, poll, text_of, unix_connect

FD_SLACK = 4  # sockets in a close handshake, the admin connection of the check itself
RSS_BOUND = 256 * 2**20  # the daemon's resident memory, bytes
SETTLE = 15.0  # seconds for /status to settle back to the baseline
POLL = 0.02  # seconds between two /status reads while settling
CHAOS = os.path.join(ROOT, "tests", "fixtures", "chaos_server.py")
READY = re.compile(r"ready: websocket port (\d+), unix (\S+), admin port (\d+)")


def chaos_backend(name: str, env: dict[str, str] | None = None, **extra: Any) -> str:
    """A TOML [backends.NAME] table running the chaos server."""
    lines = [f"[backends.{name}]", f"command = {json.dumps(sys.executable)}",
             f"args = [{json.dumps(CHAOS)}]"]
    if env:
        lines.append("env = {" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + "}")
    for key, value in extra.items():
        inline = isinstance(value, str) and value.startswith("{")  # a TOML inline table
        lines.append(f"{key} = {value if inline else json.dumps(value)}")
    return "\n".join(lines) + "\n"


# ---- /proc ----------------------------------------------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (non-zombie) process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read().decode(errors="replace")
        except OSError:
            continue
        state, ppid = data[data.rfind(")") + 2:].split()[:2]
        if state != "Z":
            out[int(name)] = int(ppid)
    return out


def descendants(pid: int) -> set[int]:
    parents = _parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return False
    return data[data.rfind(")") + 2:].split()[0] != "Z"


# ---- the daemon -----------------------------------------------------------------------------


class Daemon:
    """``python -m gateway run --config PATH`` with WebSocket, unix socket and admin listeners.

    A subclass whose config puts TLS or authentication on the WebSocket listener sets
    ``ssl_context`` (then ``url`` is ``wss://``) and ``token``: the bystander connects with them."""

    ssl_context: ssl.SSLContext | None = None
    token: str | None = None

    def __init__(self, workdir: Path, backends: str, gateway: str = "") -> None:
        self.workdir = workdir
        self.config_path = workdir / "gateway.toml"
        self.unix_path = str(workdir / "gw.sock")
        self.backends, self.gateway = backends, gateway
        self.write_config(backends)
        self.lines: list[str] = []
        self._ready = threading.Event()
        # who waits for the next line: (the waiting trio run, its event), set from the reader
        self._wake: tuple[trio.lowlevel.TrioToken, trio.Event] | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(self.config_path)],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        if not self._ready.wait(30) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("daemon did not become ready:\n" + self.tail())
        (m,) = [m for line in self.lines if (m := READY.search(line))]
        self.ws_port, self.admin_port = int(m.group(1)), int(m.group(3))

    def write_config(self, backends: str) -> None:
        self.config_path.write_text(f"""
[gateway]
drain_delay = 0.0
{self.gateway}
[listen]
websocket = "127.0.0.1:0"
http = ""
unix = "{self.unix_path}"
[admin]
listen = "127.0.0.1:0"
{backends}
""")

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            if len(self.lines) < 20000:
                self.lines.append(line)
            if READY.search(line):
                self._ready.set()
            self._woken()
        self._ready.set()
        self._woken()

    def _woken(self) -> None:
        if (wake := self._wake) is not None:
            token, event = wake
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(event.set)

    async def line_until(self, predicate: Callable[[str], bool], since: int = 0) -> str:
        """The first log line from the ``since``-th on for which ``predicate`` holds, waiting
        for the reader thread to add it (the caller bounds the wait)."""
        token = trio.lowlevel.current_trio_token()
        try:
            while True:
                event = trio.Event()
                self._wake = (token, event)  # before looking: a line added after it wakes us
                for line in self.lines[since:]:
                    if predicate(line):
                        return line
                await event.wait()
        finally:
            self._wake = None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"{'wss' if self.ssl_context else 'ws'}://127.0.0.1:{self.ws_port}/"

    def failures(self, since: int = 0) -> list[str]:
        """Log lines (from the ``since``-th on) that say the daemon itself failed: a traceback,
        an ERROR or CRITICAL."""
        return [line for line in self.lines[since:]
                if "Traceback" in line or " ERROR " in line or " CRITICAL " in line]

    @asynccontextmanager
    async def client(self, transport: str, *, initialize: bool = True) -> AsyncIterator[Client]:
        """A connection to this daemon over ``"websocket"`` or ``"unix"``."""
        opener = connect(self.url, initialize=initialize, token=self.token,
                         ssl_context=self.ssl_context) if transport == "websocket" \
            else unix_connect(self.unix_path, initialize=initialize)
        async with opener as c:
            yield c

    async def status(self) -> dict[str, Any]:
        return await http_json(self.admin_port, "/status")

    async def instance(self, backend: str, index: int = 0) -> dict[str, Any]:
        (b,) = [b for b in (await self.status())["backends"] if b["name"] == backend]
        return b["instances"][index]

    async def status_until(self, predicate: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        """``/status`` once ``predicate`` holds for it (polled: the daemon is another process;
        the caller bounds the wait)."""
        async def look() -> dict[str, Any] | None:
            st = await self.status()
            return st if predicate(st) else None

        return await poll(look)

    async def instance_until(self, backend: str, predicate: Callable[[dict[str, Any]], Any],
                             index: int = 0) -> dict[str, Any]:
        """The ``/status`` instance once ``predicate`` holds for it (polled, as above)."""
        async def look() -> dict[str, Any] | None:
            inst = await self.instance(backend, index)
            return inst if predicate(inst) else None

        return await poll(look)

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        status, body = await http_request(self.admin_port, "/metrics")
        assert status == 200
        total = 0.0
        for line in body.decode().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        """SIGTERM, bounded wait, SIGKILL as a last resort; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.proc.returncode


# ---- baseline and check ---------------------------------------------------------------------


def settled_view(status: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a /status document that must return to the baseline after a scenario."""
    return {
        "connections": {k: v for k, v in status["connections"].items() if v},
        "pending_server_requests": status["pending_server_requests"],
        "client_requests_in_flight": status["client_requests_in_flight"],
        "outbound_messages_queued": status["outbound_messages_queued"],
        "connection_slots": status["connection_slots"],
        "inflight": {i["name"]: i["inflight"] for b in status["backends"] for i in b["instances"]},
    }


def instance_pids(status: dict[str, Any]) -> set[int]:
    return {i["pid"] for b in status["backends"] for i in b["instances"] if i["pid"] is not None}


@dataclass
class Baseline:
    view: dict[str, Any]
    fds: int
    rss: int
    figures: dict[str, Any] = field(default_factory=dict)


async def baseline(daemon: Daemon) -> Baseline:
    """What the idle daemon looks like; taken once its backends settled (every instance
    RUNNING or FATAL) and what earlier scenarios left was let go (no WebSocket or unix
    connection, call, prompt or queued message: a closed client is seen a moment later)."""
    async def settled() -> dict[str, Any] | None:
        status = await daemon.status()
        states = {i["state"] for b in status["backends"] for i in b["instances"]}
        view = settled_view(status)
        idle = (not view["connection_slots"]  # legacy HTTP sessions may stay: no slot
                and not view["pending_server_requests"] and not view["client_requests_in_flight"]
                and not view["outbound_messages_queued"] and not any(view["inflight"].values()))
        return status if states <= {"RUNNING", "FATAL"} and idle else None

    with trio.fail_after(SETTLE):
        status = await poll(settled, POLL)
    return Baseline(settled_view(status), open_fds(daemon.pid), rss_bytes(daemon.pid))


async def bystander_echo(daemon: Daemon, tool: str = "fx__echo") -> None:
    """A fresh WebSocket connection's echo call succeeds, and it receives only its own answers."""
    tag = secrets.token_hex(6)
    with trio.fail_after(15):
        async with connect(daemon.url, token=daemon.token, ssl_context=daemon.ssl_context) as c:
            r = await c.call(tool, {"message": tag}, id=f"bystander-{tag}")
            assert "result" in r, r
            assert text_of(r) == tag
            ids = [m.get("id") for m in c.received if "method" not in m]
            assert ids == [1, f"bystander-{tag}"], ids  # initialize, the call: nothing foreign


async def check(daemon: Daemon, base: Baseline, *, bystander_tool: str = "fx__echo",
                settle: float = SETTLE) -> None:
    """Assert every invariant against ``base``; the snapshot gets ``settle`` seconds."""
    assert daemon.proc.poll() is None, "daemon died:\n" + daemon.tail()
    status, body = await http_request(daemon.admin_port, "/healthz")
    assert (status, body) == (200, b"ok\n")
    await bystander_echo(daemon, bystander_tool)
    # the published snapshot settles back; so do the fds and the process tree
    view: dict[str, Any] = {}
    fds = 0
    extra: set[int] = set()

    async def settled() -> bool:
        nonlocal view, fds, extra
        status_doc = await daemon.status()
        view = settled_view(status_doc)
        fds = open_fds(daemon.pid)
        extra = descendants(daemon.pid) - instance_pids(status_doc)
        return view == base.view and fds <= base.fds + FD_SLACK and not extra

    with trio.move_on_after(settle):
        await poll(settled, POLL)
    if not view == base.view or fds > base.fds + FD_SLACK or extra:  # the last look's figures
        procs = {p: _cmdline(p) for p in extra}
        raise AssertionError(
            f"did not settle within {settle}s:\n view {view}\n base {base.view}\n"
            f" fds {fds} (baseline {base.fds}, slack {FD_SLACK})\n extra processes {procs}\n"
            + daemon.tail(15))
    assert abs(fds - base.fds) <= FD_SLACK, (fds, base.fds)
    rss = rss_bytes(daemon.pid)
    assert rss <= RSS_BOUND, f"daemon RSS {rss / 2**20:.1f} MiB over {RSS_BOUND / 2**20:.0f} MiB"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


FAILED = pytest.StashKey[bool]()  # set by tests/hardening/conftest.py when a test's call failed


def failed(request: pytest.FixtureRequest) -> bool:
    return request.node.stash.get(FAILED, False)


class DaemonSlot:
    """One daemon shared by a module's tests, replaced when a test left it dead (so one crash
    fails its own test, not every test after it).  ``daemon_type``: the Daemon subclass run."""

    def __init__(self, workdir: Path, backends: str, gateway: str = "", *,
                 daemon_type: type[Daemon] | None = None) -> None:
        self.workdir, self.backends, self.gateway = workdir, backends, gateway
        self.daemon_type = daemon_type or Daemon
        self.current: Daemon | None = None
        self.spawned = 0

    def get(self) -> Daemon:
        if self.current is None or self.current.proc.poll() is not None:
            self.spawned += 1
            workdir = self.workdir / f"d{self.spawned}"
            workdir.mkdir()
            self.current = self.daemon_type(workdir, self.backends, self.gateway)
        return self.current

    def discard(self) -> None:
        """Kill the current daemon (its test failed: it may be half broken).  Sockets a client
        library leaked when the daemon died are collected now, not in the next test."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        if self.current is not None:
            if self.current.proc.poll() is None:
                self.current.proc.kill()
            self.current.stop()
            self.current = None

    def close(self) -> None:
        """Stop the live daemon; it must exit 0."""
        if self.current is not None and self.current.proc.poll() is None:
            code = self.current.stop()
            assert code == 0, self.current.tail()
