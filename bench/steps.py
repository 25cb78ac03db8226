#!/usr/bin/env python3
"""Count the trio task steps and task spawns the gateway spends per forwarded call.

    .venv/bin/python bench/steps.py [--calls 2000] [--clients 1]
                                    [--transport unix|websocket|http|http-legacy]
                                    [--count-calls [--top N]] [--telemetry URL]

Runs the gateway of this tree in-process (one echo backend, ``tests/fixtures/fixture_server.py``)
under a trio Instrument, and drives it from a separate client process (plain sockets, no trio)
that makes ``--calls`` sequential ``tools/call echo`` per client (``--remote URL``: the backend
is that Streamable HTTP server instead, e.g. server-everything's).  A *task step* is one run of a
task between two checkpoints: every wake-up of a task (a reader woken by its socket, a writer
woken by its queue, a task woken by an event) is one; trio's fixed cost per step is what issue 8
asks to count.  Reported per call, over the measured calls only (the warm-up is excluded).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import textwrap
import time

import trio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gateway import config as gwconfig  # noqa: E402 - once sys.path holds the repo
from gateway import service  # noqa: E402 - imported once sys.path holds the repo

CLIENT = r'''
import base64, json, os, socket, sys, time
transport, addr, calls, clients = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def ws_frame(data):
    mask = os.urandom(4)
    n = len(data)
    head = bytes([0x81])
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))

class Conn:
    def __init__(self):
        if transport == "unix":
            self.s = socket.socket(socket.AF_UNIX); self.s.connect(addr)
        else:
            host, port = addr.rsplit(":", 1)
            self.s = socket.create_connection((host, int(port)))
        if transport in ("http", "http-legacy"):  # POSTs on one keep-alive connection
            self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif transport == "websocket":
            key = base64.b64encode(os.urandom(16)).decode()
            self.s.sendall((f"GET / HTTP/1.1\r\nHost: {addr}\r\n"
                            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                            "Sec-WebSocket-Protocol: mcp\r\n\r\n").encode())
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += self.s.recv(4096)
            self.buf = buf.split(b"\r\n\r\n", 1)[1]
        self.buf = getattr(self, "buf", b"")
    def send(self, msg):
        data = json.dumps(msg).encode()
        self.s.sendall(data + b"\n" if transport == "unix" else ws_frame(data))
    def recv(self):
        while True:
            if transport == "unix":
                if b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1); return json.loads(line)
            elif len(self.buf) >= 2:
                n = self.buf[1] & 0x7F; off = 2
                if n == 126: n = int.from_bytes(self.buf[2:4], "big"); off = 4
                elif n == 127: n = int.from_bytes(self.buf[2:10], "big"); off = 10
                if len(self.buf) >= off + n:
                    data = self.buf[off:off + n]; self.buf = self.buf[off + n:]
                    return json.loads(data)
            self.buf += self.s.recv(65536)
    def post(self, i, method, params):
        if transport == "http":
            params = dict(params, _meta={"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                                         "io.modelcontextprotocol/clientCapabilities": {}})
            extra = ("mcp-protocol-version: 2026-07-28\r\n"
                     f"mcp-method: {method}\r\nmcp-name: {params['name']}\r\n")
        else:
            extra = getattr(self, "session", "")
        msg = {"jsonrpc": "2.0", "method": method, "params": params}
        if i is not None:
            msg["id"] = i
        body = json.dumps(msg).encode()
        self.s.sendall((f"POST /mcp HTTP/1.1\r\nhost: {addr}\r\n"
                        "accept: application/json, text/event-stream\r\n"
                        f"content-type: application/json\r\n{extra}"
                        f"content-length: {len(body)}\r\n\r\n").encode() + body)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.s.recv(65536)
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        raw, head = head.decode(), head.decode().lower()
        if "mcp-session-id:" in head and not hasattr(self, "session"):
            at = head.index("mcp-session-id:") + len("mcp-session-id:")
            sid = raw[at:].split("\r\n", 1)[0].strip()
            self.session = f"mcp-session-id: {sid}\r\nmcp-protocol-version: 2025-06-18\r\n"
        if head.startswith("http/1.1 202"):
            return None
        assert head.startswith("http/1.1 200"), head
        if "content-length:" in head:
            n = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
            while len(self.buf) < n:
                self.buf += self.s.recv(65536)
            data, self.buf = self.buf[:n], self.buf[n:]
            return json.loads(data)
        assert "chunked" in head, head  # an SSE stream: to its last chunk
        while b"\r\n0\r\n\r\n" not in self.buf and not self.buf.startswith(b"0\r\n\r\n"):
            self.buf += self.s.recv(65536)
        data, self.buf = self.buf.split(b"0\r\n\r\n", 1)
        for line in data.split(b"\n"):
            if line.startswith(b"data:") and b'"id"' in line:
                return json.loads(line[5:])
        raise AssertionError(data)
    def call(self, i, method, params):
        if transport.startswith("http"):
            return self.post(i, method, params)
        self.send({"jsonrpc": "2.0", "id": i, "method": method, "params": params})
        while True:
            m = self.recv()
            if m.get("id") == i: return m

conns = [Conn() for _ in range(clients)]
for c in conns if transport != "http" else ():
    c.call(0, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                             "clientInfo": {"name": "steps", "version": "0"}})
    if transport == "http-legacy":
        c.post(None, "notifications/initialized", {})
    else:
        c.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
for i in range(1, 51):
    for c in conns: c.call(i, "tools/call", {"name": "fx__echo", "arguments": {"message": "warm"}})
print("GO", flush=True); sys.stdin.readline()
for i in range(51, 51 + calls):
    for c in conns:
        r = c.call(i, "tools/call", {"name": "fx__echo", "arguments": {"message": "x"}})
        assert "result" in r, r
print("DONE", flush=True); sys.stdin.readline()
'''


class Counter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.on = False
        self.steps: collections.Counter[str] = collections.Counter()
        self.spawned = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on:
            self.steps[task.name.rsplit(".", 1)[-1]] += 1

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        if self.on:
            self.spawned += 1


async def main(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="steps-")
    sock = os.path.join(tmp, "gw.sock")
    toml = textwrap.dedent(f"""
        [gateway]
        name = "steps"
        [listen]
        websocket = "127.0.0.1:0"
        http = "{'127.0.0.1:0' if args.transport.startswith('http') else ''}"
        unix = "{sock}"
        [admin]
        listen = ""
        [backends.fx]
        health = {{ interval = 0 }}
    """)
    if args.remote:  # a remote Streamable HTTP server (its tool echo) as the url backend
        toml += f'url = "{args.remote}"\n'
    else:
        toml += (f'command = "{sys.executable}"\n'
                 f'args = ["{ROOT}/tests/fixtures/fixture_server.py"]\n')
    if args.telemetry:  # every call traced (ratio 1), exported to this OTLP/HTTP endpoint
        toml += f'[telemetry]\nenabled = true\nendpoint = "{args.telemetry}"\nsample_ratio = 1.0\n'

    cfg = gwconfig.load(toml)
    counter = Counter()
    trio.lowlevel.add_instrument(counter)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(lambda task_status: service.run(cfg, task_status=task_status))
        addr = (sock if args.transport == "unix" else
                f"127.0.0.1:{bound.http_port}" if args.transport.startswith("http") else
                f"127.0.0.1:{bound.websocket_port}")
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", CLIENT, args.transport, addr, str(args.calls),
             str(args.clients)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        buf = b""

        async def expect(word: bytes) -> None:
            nonlocal buf
            while word not in buf:
                data = await proc.stdout.receive_some(4096)
                assert data, f"client ended before {word!r}"
                buf += data
            buf = b""

        await expect(b"GO")
        profile = cProfile.Profile() if args.count_calls else None
        counter.on = True
        t0, cpu0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        await proc.stdin.send_all(b"\n")
        await expect(b"DONE")
        if profile is not None:
            profile.disable()
        counter.on = False
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await proc.stdin.send_all(b"\n")
        await proc.wait()
        n = args.calls * args.clients
        total = sum(counter.steps.values())
        print(f"{args.transport}, {args.clients} client(s), {n} calls in {elapsed:.2f}s: "
              f"{total / n:.2f} task steps per call, {counter.spawned / n:.3f} tasks spawned per "
              f"call, gateway CPU {cpu / n * 1e6:.0f} µs per call")
        for name, count in counter.steps.most_common(12):
            print(f"  {count / n:6.2f}  {name}")
        if profile is not None:
            calls = pstats.Stats(profile).total_calls
            print(f"{calls / n:.1f} Python function calls per call in the gateway's thread")
            if args.profile_out:
                profile.dump_stats(args.profile_out)
            if args.top:
                stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
                rows = sorted(((nc, f"{os.path.basename(fn)}:{line}({name})")
                               for (fn, line, name), (_cc, nc, *_rest) in stats.items()),
                              reverse=True)
                for nc, where in rows[:args.top]:
                    print(f"  {nc / n:6.2f}  {where}")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--transport", choices=("unix", "websocket", "http", "http-legacy"),
                   default="unix", help="http: stateless 2026-07-28 POSTs to /mcp; http-legacy: "
                   "one 2025-06-18 session on /mcp")
    p.add_argument("--remote", metavar="URL",
                   help="the backend: this Streamable HTTP server (e.g. server-everything's "
                        "streamableHttp at http://127.0.0.1:PORT/mcp), not the fixture")
    p.add_argument("--telemetry", metavar="URL",
                   help="trace every call, exported to this OTLP/HTTP traces URL")
    p.add_argument("--count-calls", action="store_true",
                   help="also count the Python function calls per call (cProfile)")
    p.add_argument("--profile-out", metavar="FILE",
                   help="with --count-calls: also write the cProfile stats there (pstats format)")
    p.add_argument("--top", type=int, default=0, metavar="N",
                   help="with --count-calls: the N functions called most, calls per call")
    trio.run(main, p.parse_args())
