"""Drain of one replica under load (issue 11): N WebSocket clients loop calls, the daemon gets
SIGTERM, and every call is accounted for.

Each client makes one call at a time (3 in 4 an echo, 1 in 4 a 0.3 s sleep, so calls are in
flight when the drain begins) until its connection closes.  A call ends as one of: answered (a
result), refused retryable (-32005 ``retryable: true``: the client stops calling and would go
to another replica), cut off (-32005 ``retryable: false``), another error, or unanswered (the
connection closed first).  Reports the counts, the close codes, the time from SIGTERM to the
drain's start (``drain_delay``), to the last connection closed, and to the daemon's exit.

    .venv/bin/python bench/drain_one.py [--clients 16] [--load 3] [--drain-delay 2] [--drain-grace
    10]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
import trio_websocket

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import daemon_toml, free_port  # noqa: E402 - imported once sys.path holds tests/


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.close_codes: collections.Counter[str] = collections.Counter()
        self.made = 0
        self.first_refusal: float | None = None
        self.last_close = 0.0


async def client(url: str, n: int, tally: Tally) -> None:
    async with trio_websocket.open_websocket_url(url, subprotocols=["mcp"]) as ws:
        await ws.send_message(
            json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "b", "version": "0"}}}))
        await ws.get_message()
        await ws.send_message(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        i = 0
        try:
            while True:
                i += 1
                if (i + n) % 4 == 0:
                    name, args = "fx__sleep", {"seconds": 0.3, "message": "s"}
                else:
                    name, args = "fx__echo", {"message": "e"}
                tally.made += 1
                try:
                    await ws.send_message(
                        json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                                                      "params": {"name": name, "arguments": args}}))
                    msg = json.loads(await ws.get_message())
                except trio_websocket.ConnectionClosed:
                    tally.outcomes["unanswered"] += 1
                    raise
                if "result" in msg:
                    tally.outcomes["answered"] += 1
                    continue
                data = msg["error"].get("data") or {}
                if data.get("reason") == "shutdown" and data.get("retryable") is True:
                    tally.outcomes["refused_retryable"] += 1
                    tally.first_refusal = tally.first_refusal or time.monotonic()
                    break  # a fleet client would now send it to another replica
                if data.get("reason") == "shutdown":
                    tally.outcomes["cut_off_not_retryable"] += 1
                else:
                    tally.outcomes[f"error {msg['error']['code']}"] += 1
            await ws.get_message()  # nothing more comes: wait for the close
        except trio_websocket.ConnectionClosed as exc:
            tally.close_codes[str(exc.reason.code)] += 1
            tally.last_close = max(tally.last_close, time.monotonic())


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--load", type=float, default=3.0, help="seconds of calls before SIGTERM")
    ap.add_argument("--drain-delay", type=float, default=2.0)
    ap.add_argument("--drain-grace", type=float, default=10.0)
    opts = ap.parse_args()
    ws, admin = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "gw.toml"
        cfg.write_text(daemon_toml(ws, admin, gateway=f"drain_delay = {opts.drain_delay}\n"
                                   f"drain_grace = {opts.drain_grace}\nlog_level = \"warning\"",
                                   backend="max_inflight = 64"))
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "run", "--config", str(cfg)],  # noqa: ASYNC220 - a long-lived daemon: signalled and reaped by hand
                                cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        try:
            while True:
                with trio.move_on_after(0.05):
                    try:
                        await trio.open_tcp_stream("127.0.0.1", ws)
                        break
                    except OSError:
                        pass
                if proc.poll() is not None:
                    raise SystemExit("the daemon did not start")
                await trio.sleep(0.05)
            tally = Tally()
            async with trio.open_nursery() as nursery:
                for n in range(opts.clients):
                    nursery.start_soon(client, f"ws://127.0.0.1:{ws}/", n, tally)
                await trio.sleep(opts.load)
                term = time.monotonic()
                proc.send_signal(signal.SIGTERM)
            exited = await trio.to_thread.run_sync(proc.wait)
            end = time.monotonic()
        finally:
            if proc.poll() is None:
                proc.kill()
            err = proc.stderr.read().decode(errors="replace")
    accounted = sum(tally.outcomes.values())
    print(f"clients {opts.clients}, drain_delay {opts.drain_delay}s, drain_grace "
          f"{opts.drain_grace}s")
    print(f"calls made {tally.made}, accounted {accounted}: " + ", ".join(
        f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    print("close codes: " + ", ".join(f"{k} x{v}" for k, v in sorted(tally.close_codes.items())))
    if tally.first_refusal is not None:
        print("SIGTERM -> first retryable refusal (drain begins): "
              f"{tally.first_refusal - term:.2f}s")
    print(f"SIGTERM -> last connection closed: {tally.last_close - term:.2f}s; "
          f"-> daemon exit {exited}: {end - term:.2f}s")
    if err.strip():
        print("daemon stderr (tail):\n" + err[-1500:])


if __name__ == "__main__":
    trio.run(main)
