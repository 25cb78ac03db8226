"""Rolling restarts of a fleet behind HAProxy, tried as a client fleet would (issue 11).

Three replicas (``python -m gateway run``, fixture backend) behind a real HAProxy running
``packaging/haproxy/mcp-gateway.cfg`` (tests/fleetutil.py: the shipped file with its ports and
certificate swapped), TLS at HAProxy, bearer tokens at the replicas.  Clients loop calling
``fx__echo`` (one call in flight each) while each replica in turn is restarted: SIGTERM, wait
for it to exit, start it again, wait until it is ready and HAProxy has it back in rotation.

Two runs, one after the other:

* ``websocket``: ``--clients`` WebSocket connections through HAProxy.  A call refused as
  retryable (-32005 with ``data.retryable = true``: it never started) is retried on a new
  connection; a call whose connection closes before its answer is *lost* (the client cannot
  know whether it ran); a connection that closes between calls is reopened.
* ``http``: ``--clients`` stateless (2026-07-28) HTTP clients through HAProxy, each on its own
  keep-alive connection.  A 503 (HAProxy found no replica to take it, or passed on a replica's
  503) or a -32005 retryable error is retried after ``Retry-After`` (at most 1 s); a request
  whose connection breaks or that HAProxy answers 502/504 is *lost*.

Reported per run: calls made, answered, refused as retryable and then retried successfully,
lost, cut off by ``drain_grace`` (-32005 ``retryable: false``), other errors; the WebSocket
close codes seen (1001 going away, 1012 service restart); HAProxy's own retries and
redispatches; and per replica: SIGTERM to out of rotation (HAProxy marks it DOWN), SIGTERM to
exit (the drain), start to ready, start to back in rotation.  When the gateway has
``gateway.drain_delay`` (the lame duck), ``--drain-delay`` sets it.

    .venv/bin/python bench/fleet.py                 # both runs, defaults: about 1-2 minutes
    .venv/bin/python bench/fleet.py --runs websocket --clients 16 --settle 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fleetutil import TOKEN, Fleet  # noqa: E402 - imported once sys.path holds tests/

from gateway.config import GatewaySection  # noqa: E402 - once sys.path holds tests/

MODERN = "2026-07-28"
AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]
#: A call without an answer for this long is counted lost (and its connection dropped).
CALL_TIMEOUT = 30.0
INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "bench", "version": "0"}}}


@dataclass
class Counts:
    made: int = 0  # calls sent (a retry is a call too)
    answered: int = 0  # a result
    refused_retryable: int = 0  # -32005 retryable: true (or HTTP 503): never started
    retried_ok: int = 0  # ... of which the retry (on another connection) was answered
    lost: int = 0  # no answer: the connection closed (or the call timed out) with it unanswered
    cut_off: int = 0  # -32005 retryable: false (drain_grace ended with it running)
    other_errors: int = 0
    connects: int = 0
    connect_failures: int = 0
    close_codes: Counter[str] = field(default_factory=Counter)  # WebSocket close codes seen
    lost_detail: Counter[str] = field(default_factory=Counter)
    other_detail: Counter[str] = field(default_factory=Counter)


@dataclass
class Restart:
    replica: str
    out_of_rotation: float | None = None  # SIGTERM -> HAProxy marks it DOWN
    drained: float | None = None  # SIGTERM -> process exit
    exit_code: int | None = None
    ready: float | None = None  # start -> ready line
    in_rotation: float | None = None  # start -> HAProxy marks it UP


def classify_error(error: dict[str, Any]) -> str:
    data = error.get("data") or {}
    if error.get("code") == -32005 and data.get("reason") == "shutdown":
        return "retryable" if data.get("retryable") else "cut_off"
    return f"{error.get('code')} {data.get('reason', error.get('message', ''))}"[:80]


# ---- WebSocket clients ---------------------------------------------------------------------


async def ws_client(fleet: Fleet, c: Counts, stop: trio.Event) -> None:
    ctx = fleet.certs.client_context()
    retry = False  # the next call is the retry of a refused one
    next_id = 1
    while not stop.is_set():
        try:
            ws = await trio_websocket.connect_websocket_url(
                _nursery, fleet.ws_url, ssl_context=ctx, subprotocols=["mcp"], extra_headers=AUTH)
        except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionRejected) as exc:
            c.connect_failures += 1
            c.other_detail[f"connect: {type(exc).__name__}"] += 1
            await trio.sleep(0.05)
            continue
        c.connects += 1
        try:
            await ws.send_message(json.dumps(INIT))
            if "result" not in json.loads(await ws.get_message()):
                c.connect_failures += 1
                continue
            await ws.send_message('{"jsonrpc":"2.0","method":"notifications/initialized"}')
            while not stop.is_set():
                next_id += 1
                call = json.dumps({"jsonrpc": "2.0", "id": next_id, "method": "tools/call",
                                   "params": {"name": "fx__echo", "arguments": {"message": "m"}}})
                try:
                    await ws.send_message(call)
                except trio_websocket.ConnectionClosed as exc:  # never sent: not a call
                    c.close_codes[str(exc.reason.code if exc.reason else None)] += 1
                    break
                c.made += 1
                try:
                    with trio.fail_after(CALL_TIMEOUT):
                        while True:
                            msg = json.loads(await ws.get_message())
                            if msg.get("id") == next_id:
                                break
                except trio_websocket.ConnectionClosed as exc:
                    code = str(exc.reason.code if exc.reason else None)
                    c.close_codes[code] += 1
                    c.lost += 1
                    c.lost_detail[f"closed {code}"] += 1
                    break
                except trio.TooSlowError:
                    c.lost += 1
                    c.lost_detail["timeout"] += 1
                    break
                if "result" in msg:
                    c.answered += 1
                    if retry:
                        c.retried_ok += 1
                        retry = False
                    continue
                kind = classify_error(msg.get("error") or {})
                if kind == "retryable":
                    c.refused_retryable += 1
                    retry = True
                    break  # this connection is going away: retry on a new one
                if kind == "cut_off":
                    c.cut_off += 1
                else:
                    c.other_errors += 1
                    c.other_detail[kind] += 1
        except trio_websocket.ConnectionClosed as exc:  # between calls (or in the handshake)
            c.close_codes[str(exc.reason.code if exc.reason else None)] += 1
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(2):
                    await ws.aclose()
                await ws._stream.aclose()  # trio-websocket leaves it open after a server close


# ---- stateless HTTP clients ----------------------------------------------------------------


async def http_client(fleet: Fleet, c: Counts, stop: trio.Event) -> None:
    headers = {"authorization": f"Bearer {TOKEN}", "accept": "application/json, text/event-stream",
               "content-type": "application/json", "mcp-protocol-version": MODERN,
               "mcp-method": "tools/call", "mcp-name": "fx__echo"}
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {}}
    retry = False
    n = 0
    async with httpx.AsyncClient(verify=fleet.certs.client_context(), timeout=CALL_TIMEOUT) as http:
        while not stop.is_set():
            n += 1
            body = {"jsonrpc": "2.0", "id": n, "method": "tools/call",
                    "params": {"name": "fx__echo", "arguments": {"message": "m"}, "_meta": meta}}
            c.made += 1
            try:
                r = await http.post(fleet.http_url, headers=headers, json=body)
            except httpx.TimeoutException:
                c.lost += 1
                c.lost_detail["timeout"] += 1
                continue
            except httpx.TransportError as exc:
                c.lost += 1
                c.lost_detail[type(exc).__name__] += 1
                continue
            try:
                msg = r.json()
            except ValueError:
                msg = {}
            if r.status_code == 200 and "result" in msg:
                c.answered += 1
                if retry:
                    c.retried_ok += 1
                    retry = False
                continue
            kind = classify_error(msg.get("error")
                                  or {}) if "error" in msg else f"HTTP {r.status_code}"
            if r.status_code == 503 or kind == "retryable":
                c.refused_retryable += 1
                c.other_detail[f"refused: HTTP {r.status_code} retry-after "
                               f"{r.headers.get('retry-after')}"] += 1
                retry = True
                try:
                    wait = float(r.headers.get("retry-after") or 0)
                except ValueError:
                    wait = 0.0
                await trio.sleep(min(wait, 1.0))
            elif r.status_code in (502, 504):
                c.lost += 1
                c.lost_detail[f"HTTP {r.status_code}"] += 1
            elif kind == "cut_off":
                c.cut_off += 1
            else:
                c.other_errors += 1
                c.other_detail[kind] += 1


# ---- the restarts --------------------------------------------------------------------------


async def roll(fleet: Fleet, settle: float) -> list[Restart]:
    out = []
    await trio.sleep(settle)
    for name, replica in fleet.replicas.items():
        rec = Restart(name)
        t0 = time.monotonic()
        replica.signal(signal.SIGTERM)

        async def watch_down(rec: Restart = rec, t0: float = t0, name: str = name) -> None:
            await trio.to_thread.run_sync(lambda: fleet.replica_up(name, up=False, timeout=120))
            rec.out_of_rotation = time.monotonic() - t0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_down)
            rec.exit_code = await trio.to_thread.run_sync(replica.wait_exit)
            rec.drained = time.monotonic() - t0
        t1 = time.monotonic()
        replica.start()
        await trio.to_thread.run_sync(replica.wait_ready)
        rec.ready = time.monotonic() - t1
        await trio.to_thread.run_sync(lambda name=name: fleet.replica_up(name))
        rec.in_rotation = time.monotonic() - t1
        out.append(rec)
        print(f"  {name}: {rec}", file=sys.stderr)
        await trio.sleep(settle)
    return out


def haproxy_retries(fleet: Fleet) -> dict[str, dict[str, int]]:
    """HAProxy's counters per backend: retries (wretr), redispatches (wredis), 5xx answered."""
    out = fleet.haproxy_command("show stat")
    header = out.splitlines()[0].lstrip("# ").split(",")
    got = {}
    for line in out.splitlines()[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("svname") == "BACKEND":
            got[row["pxname"]] = {k: int(row[k] or 0)
                                  for k in ("wretr", "wredis", "hrsp_5xx", "eresp", "econ")}
    return got


_nursery: trio.Nursery


async def one_run(kind: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    global _nursery
    extra = f"drain_grace = {args.drain_grace}\n"
    if "drain_delay" in GatewaySection.__struct_fields__:
        extra += f"drain_delay = {args.drain_delay}\n"
    fleet = Fleet(folder, extra=extra)
    await trio.to_thread.run_sync(fleet.start)
    try:
        counts, stop = Counts(), trio.Event()
        client = ws_client if kind == "websocket" else http_client
        t0 = time.monotonic()
        async with trio.open_nursery() as nursery:
            _nursery = nursery
            for _ in range(args.clients):
                nursery.start_soon(client, fleet, counts, stop)
            restarts = await roll(fleet, args.settle)
            stop.set()
        seconds = time.monotonic() - t0
        lb = haproxy_retries(fleet)
    finally:
        await trio.to_thread.run_sync(fleet.stop)
    tallies = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(counts).items()}
    return {"kind": kind, "seconds": seconds, "counts": tallies,
            "restarts": [asdict(r) for r in restarts], "haproxy": lb}


def report(run: dict[str, Any], args: argparse.Namespace) -> str:
    c = run["counts"]
    lines = [f"### {run['kind']}: {args.clients} clients, {run['seconds']:.0f} s, each of 3 "
             "replicas "
             "restarted in turn", "",
             "| calls made | answered | refused retryable | retried ok | lost | cut off | other "
             "errors |",
             "|---|---|---|---|---|---|---|",
             f"| {c['made']} | {c['answered']} | {c['refused_retryable']} | {c['retried_ok']} | "
             f"{c['lost']} | {c['cut_off']} | {c['other_errors']} |", ""]
    if c["close_codes"]:
        lines.append("WebSocket close codes: " + ", ".join(f"{k} x {v}" for k,
                                                           v in sorted(c["close_codes"].items())))
    for key in ("lost_detail", "other_detail"):
        if c[key]:
            lines.append(
                f"{key.replace('_', ' ')}: " + "; ".join(f"{k} x {v}" for k, v in c[key].items()))
    lines.append(f"connections opened {c['connects']}, connect failures {c['connect_failures']}")
    lines.append("HAProxy: " + "; ".join(f"{b} retries {v['wretr']} redispatches {v['wredis']} "
                                          f"5xx {v['hrsp_5xx']}" for b, v in run[
                                              "haproxy"].items()))
    lines += ["", "| replica | SIGTERM → out of rotation | SIGTERM → exit (drain) | exit code | "
                  "start → ready "
              "| start → in rotation |", "|---|---|---|---|---|---|"]
    for r in run["restarts"]:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f} s"
        lines.append(f"| {r['replica']} | {s(r['out_of_rotation'])} | {s(r['drained'])} | "
                     f"{r['exit_code']} "
                     f"| {s(r['ready'])} | {s(r['in_rotation'])} |")
    return "\n".join(lines) + "\n"


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    for kind in args.runs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{kind} run...", file=sys.stderr)
            runs.append(await one_run(kind, args, Path(tmp)))
    return runs


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="websocket,http", help="websocket, http, or both")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds of load before the first restart and after each")
    parser.add_argument("--drain-grace", type=float, default=20.0)
    parser.add_argument("--drain-delay", type=float, default=3.0,
                        help="gateway.drain_delay, when the gateway has it")
    parser.add_argument("--json", help="also write the figures as JSON to this file")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    runs = trio.run(main, args)
    has_delay = "drain_delay" in GatewaySection.__struct_fields__
    print(f"mcp-gateway at {ROOT}; drain_grace {args.drain_grace} s; drain_delay "
          f"{f'{args.drain_delay} s' if has_delay else 'not in this gateway'}\n")
    for run in runs:
        print(report(run, args))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    cli()
