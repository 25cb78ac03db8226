#!/usr/bin/env python3
"""A/B of two trees' gateways through one remote backend, back to back.

    .venv/bin/python bench/remote_ab.py --base /path/to/other/worktree [--seconds 4] [--repeat 3]

Starts server-everything's own Streamable HTTP server once (bench/run.py's remote mode), then
``--repeat`` times, alternately for the other tree (``--base``) and this one: a gateway with
that server as its ``url`` backend, 16 WebSocket clients, 16 legacy ``/mcp`` sessions and 16
stateless 2026-07-28 ``/mcp`` clients, each row calling ``ev__echo`` for ``--seconds`` (after a
1 s warm-up), then 400 sequential calls on one WebSocket interleaved with 400 straight to the
server (100 at a time, the same protocol version as the gateway's session).  Prints per tree
the medians of calls/s, the gateway's and the server's CPU µs per call, and each round's
sequential p50 added over direct, with the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as B  # the bench's clients and helpers, from this folder

ECHO = B.BackendSpec("everything", [], "echo")


def cpu(pid: int) -> float:
    user, system = B.cpu_seconds(pid)
    return user + system


async def one_round(tree: str, sport: int, srv: int, procs: B.Procs,
                    seconds: float) -> dict[str, Any]:
    ws, http, admin = B.free_port(), B.free_port(), B.free_port()
    cfg = os.path.join(procs.log_dir, f"gateway-{os.path.basename(tree)}.toml")
    with open(cfg, "w") as f:  # noqa: ASYNC230 - set-up on a local file
        f.write(B.remote_gateway_config(sport, ws, http, admin))
    gw = procs.popen(f"gateway-{os.path.basename(tree)}",
                     [sys.executable, "-m", "gateway", "run", "--config", cfg],
                     env=dict(os.environ, PYTHONPATH=tree), cwd=tree)  # -m: cwd first
    out: dict[str, Any] = {}
    try:
        await B.wait_port(ws, gw, "gateway")
        version = B.instance_of(await B.gateway_status(admin), "ev")["protocol_version"]
        async with trio.open_nursery() as nursery:
            rows = {"ws": await B.ws_clients(nursery, f"ws://127.0.0.1:{ws}/", 16),
                    "legacy": await B.http_clients(http, 16, 1),
                    "stateless": await B.http_clients(http, 16, 1, modern=True)}
            for name, conns in rows.items():
                await B.run_load(conns, inflight=1, calls=10**6, cap=1.0, tool="ev__echo",
                                 backend=ECHO)
                g0, s0, load = cpu(gw.pid), cpu(srv), os.getloadavg()[0]
                r = await B.run_load(conns, inflight=1, calls=10**6, cap=seconds,
                                     tool="ev__echo", backend=ECHO)
                out[name] = {"calls_per_s": r.calls_per_s, "errors": r.errors, "load": load,
                             "gateway_us": (cpu(gw.pid) - g0) / max(1, r.ok) * 1e6,
                             "server_us": (cpu(srv) - s0) / max(1, r.ok) * 1e6}
            direct = (await B.http_clients(sport, 1, 1, protocol=version))[0]
            seq: dict[str, list[int]] = {"direct": [], "ws": []}
            for _ in range(4):
                seq["direct"] += await B.sequential(direct, "echo", ECHO, 100, 20)
                seq["ws"] += await B.sequential(rows["ws"][0], "ev__echo", ECHO, 100, 20)
            p50 = {k: B.pct(sorted(v), 0.5) for k, v in seq.items()}
            out["seq"] = {"direct_p50_us": p50["direct"], "added_us": p50["ws"] - p50["direct"]}
            await direct.aclose()
            for c in rows["legacy"] + rows["stateless"]:
                await c.aclose()
            nursery.cancel_scope.cancel()
    finally:
        procs.stop(gw.pid)
    return out


async def amain(args: argparse.Namespace, procs: B.Procs) -> None:
    trees = {"base": args.base, "this": B.ROOT}  # base: made absolute by main
    srv, sport = await B.start_everything_http(procs, [])
    res: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    try:
        for i in range(args.repeat):
            for name, tree in trees.items():
                res[name].append(await one_round(tree, sport, srv.pid, procs, args.seconds))
                print(f"round {i + 1} {name}: {res[name][-1]}", file=sys.stderr, flush=True)
    finally:
        procs.stop(srv.pid)
    print(f"trees: {trees}")
    for name in trees:
        for row in ("ws", "legacy", "stateless"):
            rs = [r[row] for r in res[name]]
            med = {k: statistics.median(r[k] for r in rs)
                   for k in ("calls_per_s", "gateway_us", "server_us")}
            print(f"{name:5} {row:9} 16x1: calls/s {med['calls_per_s']:5.0f}"
                  f"  gateway CPU µs/call {med['gateway_us']:4.0f}"
                  f"  server CPU µs/call {med['server_us']:4.0f}"
                  f"  errors {sum(r['errors'] for r in rs)}"
                  f"  load {[round(r['load'], 1) for r in rs]}")
        print(f"{name:5} sequential p50 added over direct µs: "
              f"{[round(r['seq']['added_us']) for r in res[name]]} (direct p50 "
              f"{[round(r['seq']['direct_p50_us']) for r in res[name]]})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other tree (a worktree of another commit)")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    args.base = os.path.abspath(args.base)
    log_dir = tempfile.mkdtemp(prefix="remote-ab-")
    with B.Procs(log_dir) as procs:
        trio.run(amain, args, procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
