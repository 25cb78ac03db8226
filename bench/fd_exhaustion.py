"""Idle connections against a low open-files limit (issue 16, fault 4): the daemon runs with
RLIMIT_NOFILE (soft, hard) and the default ``max_connections``; N idle TCP connections are
opened to its WebSocket port and held, its backend's child is killed, then the connections are
released.  Reports the limit in force, the daemon's open fds, ``/healthz`` with the connections
held, the backend's state 3 s after the kill and 4 s after the release, and the log's EMFILE,
Traceback and FATAL counts.

    .venv/bin/python bench/fd_exhaustion.py [--soft 1024] [--hard 1024] [--connections 1100]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import daemon_toml, free_port  # noqa: E402 - imported once sys.path holds tests/


def get(port: int, path: str, timeout: float = 3.0) -> tuple[int | None, bytes, float]:
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      "Connection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return int(data.split()[1]), data.partition(b"\r\n\r\n")[2], time.monotonic() - start
    except OSError:
        return None, b"", time.monotonic() - start


def instance(admin: int) -> tuple[str, int | None, int] | None:
    status, body, _ = get(admin, "/status")
    if status != 200:
        return None
    doc = json.loads(body)
    inst = doc["backends"][0]["instances"][0]
    return inst["state"], inst["pid"], doc["connection_slots"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--soft", type=int, default=1024)
    ap.add_argument("--hard", type=int, default=1024)
    ap.add_argument("--connections", type=int, default=1100)
    args = ap.parse_args()
    ws, admin = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg, log = Path(tmp) / "gw.toml", Path(tmp) / "out.log"
        cfg.write_text(daemon_toml(ws, admin, gateway="drain_delay = 0.0",
                                   backend="health = { interval = 0.0 }"))
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "run", "--config", str(cfg)],
                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                      (args.soft, args.hard)))
        try:
            for _ in range(200):
                if get(admin, "/readyz", 0.5)[0] == 200:
                    break
                time.sleep(0.1)  # poll interval of the bounded /readyz poll above (200 tries)
            limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
            limit = next(line for line in limits if "open files" in line).split()[3:5]
            first = instance(admin)
            assert first is not None and first[1] is not None
            print(
                f"open-files limit in force: soft {limit[0]}, hard {limit[1]}; backend {first[0]}")
            conns = []
            for _ in range(args.connections):
                try:
                    conns.append(socket.create_connection(("127.0.0.1", ws), timeout=2))
                except OSError as exc:
                    print(f"connect failed after {len(conns)}: {exc}")
                    break
            time.sleep(1.0)  # fixed settle point: some may be refused, no count to await
            status, _, took = get(admin, "/healthz")
            fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
            print(f"{len(conns)} idle connections held: daemon fds {fds}, "
                  f"/healthz {status} in {took * 1000:.1f} ms, /status {instance(admin)}")
            os.kill(first[1], signal.SIGKILL)
            time.sleep(3.0)  # the report's fixed observation point (3 s after the kill)
            print(f"3 s after killing the backend's child: {instance(admin)}")
            for conn in conns:
                conn.close()
            time.sleep(4.0)  # the report's fixed observation point (4 s after release)
            status, _, took = get(admin, "/healthz")
            print(f"4 s after releasing them: {instance(admin)}, /healthz {status} in "
                  f"{took * 1000:.1f} ms")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        text = log.read_text()
        lowered = [line[line.find("max_connections"):][:60]
                   for line in text.splitlines() if "lowered" in line]
        print(f"log: {text.count('EMFILE')} EMFILE, {text.count('Traceback')} Traceback, "
              f"{text.count('FATAL')} FATAL lines; {lowered or 'max_connections not lowered'}")


if __name__ == "__main__":
    main()
