"""The daemon and its open-files limit (RLIMIT_NOFILE), run as ``mcp-gateway run`` with lowered
limits: the soft limit is raised to the hard one at start; ``max_connections`` is fitted beside
the daemon's reserve (the default lowered with a warning, an explicit value refused); and when
the fds do run out (the test lowers the running daemon's limit with prlimit), a respawn that
fails with EMFILE never makes the backend FATAL, accepting backs off with one log line and no
traceback, ``/healthz`` answers on an open admin connection throughout, and the backend comes
back RUNNING once fds are free again."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, daemon_toml, free_port

pytestmark = pytest.mark.system

NOFILE = resource.RLIMIT_NOFILE


def write_config(path: Path, ws: int, admin: int, gateway: str = "", backend: str = "") -> None:
    path.write_text(daemon_toml(ws, admin, gateway=f"drain_delay = 0.0\n{gateway}",
                                backend=f"health = {{ interval = 0.0 }}\n{backend}"))


@contextmanager
def daemon(cfg: Path, soft: int, hard: int) -> Iterator[subprocess.Popen[bytes]]:
    """``mcp-gateway run`` started with RLIMIT_NOFILE (soft, hard); killed at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "run", "--config", str(cfg)],
        env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(NOFILE, (soft, hard)))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def output(proc: subprocess.Popen[bytes]) -> str:
    """Everything the daemon wrote (call once it exited or was killed)."""
    if proc.poll() is None:
        proc.kill()
    assert proc.stdout is not None
    return proc.stdout.read().decode()


class KeepAlive:
    """One keep-alive HTTP/1.1 connection to the admin listener, opened while fds are free."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""

    def get(self, path: str) -> tuple[int, bytes]:
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]  # the gateway always sends it
        while len(self.buf) < length:
            self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(head.split()[1]), body

    def close(self) -> None:
        self.sock.close()

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, "the admin connection was closed"
        self.buf += chunk

    def instance(self) -> dict[str, Any]:
        status, body = self.get("/status")
        assert status == 200
        return json.loads(body)["backends"][0]["instances"][0]  # type: ignore[no-any-return]  # JSON


def wait_ready(admin: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, output(proc)
        try:
            with socket.create_connection(("127.0.0.1", admin), timeout=2) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if s.recv(100).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)  # poll interval of the bounded /readyz poll (deadline above)
    raise AssertionError("not ready: " + output(proc))


def open_fds(pid: int) -> list[int]:
    return sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))


def limit_leaving(pid: int, free: int) -> int:
    """The soft limit under which ``pid`` can open just ``free`` more fds (the lowest numbers
    not in use below it)."""
    used = set(open_fds(pid))
    limit, available = 0, 0
    while available < free or limit in used:
        if limit not in used:
            available += 1
        limit += 1
    return limit


def test_the_soft_limit_is_raised_and_the_default_max_connections_fitted(tmp_path: Path) -> None:
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    write_config(cfg, ws, admin)
    with daemon(cfg, soft=256, hard=600) as proc:
        wait_ready(admin, proc)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        assert re.search(r"Max open files\s+600\s+600", limits), limits
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        out = output(proc)
    assert "soft limit raised from 256 to 600" in out, out
    # 600 - (64 fixed + 8 for the child + 2 x 2 listeners + 32 admin + 64 refusals) = 428
    lowered = [line for line in out.splitlines() if "max_connections lowered" in line]
    assert len(lowered) == 1 and "default 4096 to 428" in lowered[0] and "600" in lowered[0], out


def test_an_explicit_max_connections_that_does_not_fit_refuses_to_start(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    write_config(cfg, free_port(), free_port(), gateway="max_connections = 1000")
    with daemon(cfg, soft=400, hard=400) as proc:
        assert proc.wait(timeout=20) == 1
        out = output(proc)
    assert "cannot start: gateway.max_connections = 1000 does not fit" in out, out
    assert ("limit (RLIMIT_NOFILE, ulimit -n, LimitNOFILE=) is 400" in out
            and "at most 228" in out), out


def test_a_reload_to_an_explicit_max_connections_that_does_not_fit_keeps_the_running_config(
        tmp_path: Path) -> None:
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    write_config(cfg, ws, admin, gateway="max_connections = 200")
    with daemon(cfg, soft=400, hard=400) as proc:
        wait_ready(admin, proc)
        write_config(cfg, ws, admin, gateway="max_connections = 1000")
        proc.send_signal(signal.SIGHUP)
        probe = KeepAlive(admin)
        try:
            deadline = time.monotonic() + 10
            failed = b'mcp_gateway_config_reloads_total{result="failure"} 1.0'
            while failed not in probe.get("/metrics")[1]:
                assert time.monotonic() < deadline
                time.sleep(0.05)  # poll interval of the bounded /metrics poll (deadline above)
        finally:
            probe.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        out = output(proc)
    assert ("reload failed, keeping the running config: "
            "gateway.max_connections = 1000 does not fit") in out, out


def test_out_of_fds_the_backend_is_never_fatal_and_healthz_answers(tmp_path: Path) -> None:
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    # one counted failure (the kill below) is allowed, a second would be FATAL
    write_config(cfg, ws, admin, gateway="max_connections = 50",
                 backend="restart = { backoff_initial = 0.2, backoff_max = 1.0, max_restarts = 1, "
                         "window = 600.0 }")
    with daemon(cfg, soft=600, hard=600) as proc:
        wait_ready(admin, proc)
        probe = KeepAlive(admin)
        try:
            out = starve_then_recover(proc, probe, ws)
        finally:
            probe.close()
    accept_lines = [line for line in out.splitlines() if "accept failed" in line]
    assert len(accept_lines) == 1 and "EMFILE" in accept_lines[0], out  # one line per 10 s
    assert "Traceback" not in out, out
    assert "FATAL" not in out, out


def starve_then_recover(proc: subprocess.Popen[bytes], probe: KeepAlive, ws: int) -> str:
    """Leave the daemon 2 free fds, kill its backend's child, hold connections to the
    WebSocket port; then free the fds: returns the daemon's output."""
    child = probe.instance()["pid"]
    resource.prlimit(proc.pid, NOFILE, (limit_leaving(proc.pid, 2), 600))
    os.kill(child, signal.SIGKILL)
    clients: list[socket.socket] = []
    seen: set[str] = set()
    exits: set[str] = set()
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:  # starved: respawns fail with EMFILE
            assert probe.get("/healthz") == (200, b"ok\n")
            inst = probe.instance()
            seen.add(inst["state"])
            exits.add(inst["last_exit"] or "")
            if len(clients) < 6:  # more than the 2 free fds: accepting fails with EMFILE
                clients.append(socket.create_connection(("127.0.0.1", ws), timeout=5))
            time.sleep(0.2)  # sampling of a fixed 4 s window: never-FATAL has no end event
    finally:
        for c in clients:
            c.close()
    assert "FATAL" not in seen and "BACKOFF" in seen, seen
    assert any("lack of resources" in e and "Too many open files" in e for e in exits), exits
    resource.prlimit(proc.pid, NOFILE, (600, 600))  # fds are free again
    deadline = time.monotonic() + 15.0
    while probe.instance()["state"] != "RUNNING":
        assert time.monotonic() < deadline, probe.instance()
        time.sleep(0.2)  # poll interval of the bounded RUNNING poll (deadline above)
    assert probe.instance()["pid"] != child
    assert probe.instance()["restarts"] == 1  # the starved attempts spawned nothing: not restarts
    with socket.create_connection(("127.0.0.1", ws), timeout=5) as s:  # accepting again
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                  b"Connection: Upgrade\r\n"
                  b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                  b"\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 101 ")
    assert probe.get("/readyz")[0] == 200
    return output(proc)
