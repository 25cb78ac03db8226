"""A fleet on one machine: mcp-gateway replicas (``python -m gateway run``, real processes) behind
a real HAProxy running ``packaging/haproxy/mcp-gateway.cfg`` as shipped, its ports and
certificate path swapped by text substitution (README "Replicas behind HAProxy").

Used by tests/integration/test_fleet_haproxy.py and bench/fleet.py.  Synchronous on purpose (plain
``subprocess``, threads reading the logs): a module-scoped pytest fixture and a benchmark both
start it outside any trio run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tlsutil import Certs, make_certs

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "packaging" / "haproxy" / "mcp-gateway.cfg"
FIXTURE = ROOT / "tests" / "fixtures" / "fixture_server.py"
#: The shipped config's replicas: (WebSocket port, HTTP port) by server name = replica id.
SHIPPED_PORTS = {"r1": (8765, 8766), "r2": (8775, 8776), "r3": (8785, 8786)}
SHIPPED_BIND = "bind :443 "
SHIPPED_CERT = "/etc/haproxy/certs/mcp-gateway.pem"
TOKEN = "fleet-test-token-0123456789abcdef"
READY = re.compile(r"ready: websocket port (\d+), unix \S+, admin port (\d+), http port (\d+)")
#: Bounds on waiting for a process to come up or go away (2 shared cores, CI).
START_TIMEOUT = 30.0
STOP_TIMEOUT = 60.0


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nobody listens on right now (bound at once, then freed)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def backend_toml(name: str) -> str:
    return (f"[backends.{name}]\ncommand = {json.dumps(sys.executable)}\n"
            f"args = [{json.dumps(str(FIXTURE))}]\n")


@dataclass
class Replica:
    """One ``python -m gateway run`` process with fixed client ports (HAProxy names them)."""

    name: str  # its gateway.replica_id and its HAProxy server name
    ws: int
    http: int
    folder: Path
    extra: str = ""  # more [gateway] keys (e.g. drain_grace)
    backends: tuple[str, ...] = ("fx",)
    proc: subprocess.Popen[bytes] | None = None
    admin: int | None = None
    log: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def config_path(self) -> Path:
        return self.folder / f"{self.name}.toml"

    def write_config(self) -> None:
        sha = hashlib.sha256(TOKEN.encode()).hexdigest()
        text = (f'[gateway]\nreplica_id = "{self.name}"\n{self.extra}\n'
                f'[listen]\nwebsocket = "127.0.0.1:{self.ws}"\nhttp = "127.0.0.1:{self.http}"\n'
                f'[admin]\nlisten = "127.0.0.1:0"\n'
                f'[[auth.bearer]]\nprincipal = "fleet"\ntoken_sha256 = "{sha}"\n'
                + "".join(backend_toml(b) for b in self.backends))
        self.config_path.write_text(text)

    def start(self) -> None:
        """Spawn it (returns at once; :meth:`wait_ready` waits for its ready line)."""
        self.write_config()
        self._ready.clear()
        self.admin = None
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(self.config_path)],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        threading.Thread(target=self._read_log, args=(self.proc,), daemon=True).start()

    def _read_log(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            self.log.append(line)
            m = READY.search(line)
            if m and proc is self.proc:
                self.admin = int(m.group(2))
                self._ready.set()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        if not self._ready.wait(timeout):
            raise RuntimeError(f"replica {self.name} did not start:\n" + "\n".join(self.log[-20:]))

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = STOP_TIMEOUT) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Fleet:
    """Replicas r1..rN and HAProxy on 127.0.0.1 (``lb``: its TLS port), all started here."""

    def __init__(self, folder: Path, *, replicas: int = 3, extra: str = "",
                 backends: tuple[str, ...] = ("fx",)) -> None:
        assert 1 <= replicas <= len(SHIPPED_PORTS)
        self.folder = folder
        ports = free_ports(2 * replicas + 1)
        self.lb = ports.pop()
        self.replicas = {name: Replica(name, ports[2 * i], ports[2 * i + 1], folder, extra,
                                       backends)
                         for i, name in enumerate(list(SHIPPED_PORTS)[:replicas])}
        self.certs: Certs = make_certs(folder, ("localhost",))
        self.stats_socket = folder / "haproxy.sock"
        self.haproxy: subprocess.Popen[bytes] | None = None
        self.haproxy_log: list[str] = []

    @property
    def ws_url(self) -> str:
        return f"wss://127.0.0.1:{self.lb}/"

    @property
    def http_url(self) -> str:
        return f"https://127.0.0.1:{self.lb}/mcp"

    def haproxy_config(self) -> str:
        """The shipped file with this fleet's ports and certificate (and nothing else) swapped;
        replicas it does not run are left out."""
        text = SHIPPED.read_text()
        assert SHIPPED_BIND in text and SHIPPED_CERT in text, "the shipped config changed shape"
        pem = self.folder / "haproxy.pem"
        pem.write_bytes(self.certs.cert.read_bytes() + self.certs.key.read_bytes())
        text = text.replace(SHIPPED_BIND,
                            f"bind 127.0.0.1:{self.lb} ").replace(SHIPPED_CERT, str(pem))
        for name, (ws, http) in SHIPPED_PORTS.items():
            r = self.replicas.get(name)
            if r is None:  # not run here: its server lines go
                text = "\n".join(line for line in text.splitlines()
                                 if not line.strip().startswith(f"server {name} "))
                continue
            for old, new in ((ws, r.ws), (http, r.http)):
                assert f"127.0.0.1:{old}" in text or f"port {old}" in text
                text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}").replace(
                    f"port {old}", f"port {new}")
        return text

    def start(self) -> None:
        try:
            for r in self.replicas.values():
                r.start()
            cfg = self.folder / "haproxy.cfg"
            cfg.write_text(self.haproxy_config())
            # The test's own additions in a second file (HAProxy merges global sections): a stats
            # socket to see what HAProxy thinks of each server.
            extra = self.folder / "test-stats.cfg"
            extra.write_text(f"global\n    stats socket {self.stats_socket} mode 600 level admin\n")
            check = subprocess.run(["haproxy", "-c", "-q", "-f", str(cfg), "-f", str(extra)],
                                   capture_output=True, text=True)
            if check.returncode != 0:
                raise RuntimeError(f"haproxy -c: {check.stdout}{check.stderr}")
            for r in self.replicas.values():
                r.wait_ready()
            self.haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(cfg), "-f", str(extra)],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE)
            threading.Thread(target=self._read_haproxy_log, daemon=True).start()
            self.wait_servers(lambda st: all(v == "UP" for v in st.values()))
        except BaseException:
            self.stop()
            raise

    def _read_haproxy_log(self) -> None:
        assert self.haproxy is not None and self.haproxy.stderr is not None
        for raw in self.haproxy.stderr:
            self.haproxy_log.append(raw.decode("utf-8", "replace").rstrip())

    def stop(self) -> None:
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            try:
                self.haproxy.wait(10)
            except subprocess.TimeoutExpired:
                self.haproxy.kill()
                self.haproxy.wait()
        for r in self.replicas.values():
            r.stop()

    def haproxy_command(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(self.stats_socket))
            s.sendall(command.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def server_states(self) -> dict[tuple[str, str], str]:
        """(backend, server) -> "UP" / "DOWN" / "MAINT" / ... as HAProxy sees it now."""
        out = self.haproxy_command("show stat")
        header = out.splitlines()[0].lstrip("# ").split(",")
        states = {}
        for line in out.splitlines()[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("svname") not in ("FRONTEND", "BACKEND", None):
                states[(row["pxname"], row["svname"])] = row["status"].split(" ")[0]
        return states

    def wait_servers(self, predicate, timeout: float = START_TIMEOUT) -> dict[tuple[str, str], str]:
        """Poll HAProxy's view of the servers until ``predicate`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                st = self.server_states()
            except OSError:
                st = {}
            if st and predicate(st):
                return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy servers: {st}\n" + "\n".join(self.haproxy_log[-20:]))
            time.sleep(0.05)

    def replica_up(self, name: str, up: bool = True, timeout: float = START_TIMEOUT) -> None:
        want = "UP" if up else "DOWN"
        self.wait_servers(lambda st: all(v == want for (_, sv), v in st.items() if sv == name),
                          timeout)
