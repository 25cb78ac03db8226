"""Many short Streamable HTTP sessions against a real gateway daemon: resident memory and
``/status`` before and after (issue 9: sessions must free everything).

Starts ``python -m gateway run`` from this tree with the fixture backend, then runs ``--sessions``
sessions (default 10,000), ``--clients`` at a time, each over a fresh keep-alive TCP connection:
initialize, notifications/initialized, one ``fx__echo`` call, DELETE.  A lean client on raw trio
sockets (no httpx).  Prints the daemon's VmRSS after a warm-up and at the end, and what
``/status`` still counts.

    .venv/bin/python bench/http_sessions.py --sessions 10000 --clients 16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import trio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "fixture_server.py")
READY = re.compile(rb"admin port (\d+), http port (\d+)")
INIT = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "bench", "version": "0"}}}).encode()
INITIALIZED = b'{"jsonrpc":"2.0","method":"notifications/initialized"}'
CALL = (b'{"jsonrpc":"2.0","id":2,"method":"tools/call",'
        b'"params":{"name":"fx__echo","arguments":{"message":"m"}}}')


class Conn:
    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self.stream = stream
        self.port = port
        self.buf = b""

    async def request(self, method: str, body: bytes = b"",
                      sid: str | None = None) -> tuple[int, dict[str, str], bytes]:
        head = [f"{method} /mcp HTTP/1.1", f"host: 127.0.0.1:{self.port}",
                "accept: application/json, text/event-stream", "content-type: application/json",
                f"content-length: {len(body)}"]
        if sid:
            head += [f"mcp-session-id: {sid}", "mcp-protocol-version: 2025-11-25"]
        await self.stream.send_all(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        while b"\r\n\r\n" not in self.buf:
            self.buf += await self.stream.receive_some(65536)
        raw_head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                self.buf += await self.stream.receive_some(65536)
            body, self.buf = self.buf[:n], self.buf[n:]
        else:  # chunked SSE: read to the terminating chunk
            while b"0\r\n\r\n" not in self.buf:
                self.buf += await self.stream.receive_some(65536)
            body, _, self.buf = self.buf.partition(b"0\r\n\r\n")
        return status, headers, body


async def one_session(port: int) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        c = Conn(stream, port)
        status, headers, _ = await c.request("POST", INIT)
        assert status == 200, status
        sid = headers["mcp-session-id"]
        assert (await c.request("POST", INITIALIZED, sid))[0] == 202
        assert (await c.request("POST", CALL, sid))[0] == 200
        assert (await c.request("DELETE", b"", sid))[0] == 200


async def run_sessions(port: int, n: int, clients: int) -> float:
    start = time.monotonic()
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one_session(port)

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(worker)
    return time.monotonic() - start


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def status(admin: int) -> dict:
    stream = await trio.open_tcp_stream("127.0.0.1", admin)
    async with stream:
        await stream.send_all(f"GET /status HTTP/1.1\r\nhost: 127.0.0.1:{admin}\r\n"
                              "connection: close\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


async def main(args: argparse.Namespace, pid: int, admin: int, port: int) -> None:
    warm = min(1000, args.sessions // 10 or 1)
    await run_sessions(port, warm, args.clients)
    before = rss(pid)
    seconds = await run_sessions(port, args.sessions, args.clients)
    await trio.sleep(0.5)
    after = rss(pid)
    st = await status(admin)
    print(f"{args.sessions} sessions ({args.clients} at a time) in {seconds:.1f} s "
          f"({args.sessions / seconds:.0f} sessions/s)")
    print(f"gateway VmRSS after {warm} warm-up sessions: {before / 2**20:.1f} MiB; after: "
          f"{after / 2**20:.1f} MiB ({(after - before) / 2**20:+.1f} MiB)")
    print(f"/status: connections {st['connections']}, requests in flight "
          f"{st['client_requests_in_flight']}, buffered bytes {st['buffered_bytes']}, "
          f"connection slots {st['connection_slots']}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gateway.toml")
        with open(path, "w") as f:
            f.write('[listen]\nwebsocket = ""\nhttp = "127.0.0.1:0"\n[admin]\n'
                    'listen = "127.0.0.1:0"\n'
                    f'[backends.fx]\ncommand = {json.dumps(sys.executable)}\n'
                    f'args = [{json.dumps(FIXTURE)}]\n')
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "run", "--config", path],
                                cwd=ROOT, env=env, stderr=subprocess.PIPE,
                                stdout=subprocess.DEVNULL)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                m = READY.search(line)
                if m:
                    admin, port = int(m.group(1)), int(m.group(2))
                    break
            else:
                raise SystemExit("the gateway did not start")
            # drain logs
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            trio.run(main, args, proc.pid, admin, port)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    cli()
