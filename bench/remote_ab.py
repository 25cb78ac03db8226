#!/usr/bin/env python3
"""A/B of two trees' gateways (or two upstream pool sizes) through one remote backend.

    .venv/bin/python bench/remote_ab.py --base /path/to/other/worktree [--seconds 4] [--repeat 3]
    .venv/bin/python bench/remote_ab.py --connections 16,64 --inflight 4 --max-inflight 64

Starts server-everything's own Streamable HTTP server once (bench/run.py's remote mode), then
``--repeat`` times, alternately for the other tree (``--base``) and this one: a gateway with
that server as its ``url`` backend, 16 WebSocket clients, 16 legacy ``/mcp`` sessions and 16
stateless 2026-07-28 ``/mcp`` clients, each row calling ``ev__echo`` for ``--seconds`` (after a
1 s warm-up), then 400 sequential calls on one WebSocket interleaved with 400 straight to the
server (100 at a time, the same protocol version as the gateway's session).  Prints per tree
the medians of calls/s, the gateway's and the server's CPU µs per call, and each round's
sequential p50 added over direct, with the load.  ``--connections A,B``: this tree twice, its
backend's ``max_connections`` A, then B; ``--inflight``: calls in flight per client.
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


async def one_round(name: str, tree: str, sport: int, srv: int, procs: B.Procs,
                    args: argparse.Namespace, connections: int | None) -> dict[str, Any]:
    ws, http, admin = B.free_port(), B.free_port(), B.free_port()
    seconds, inflight = args.seconds, args.inflight
    cfg = os.path.join(procs.log_dir, f"gateway-{name}.toml")
    with open(cfg, "w") as f:  # noqa: ASYNC230 - set-up on a local file
        f.write(B.remote_gateway_config(sport, ws, http, admin, max_connections=connections,
                                        max_inflight=args.max_inflight))
    gw = procs.popen(f"gateway-{name}",
                     [sys.executable, "-m", "gateway", "run", "--config", cfg],
                     env=dict(os.environ, PYTHONPATH=tree), cwd=tree)  # -m: cwd first
    out: dict[str, Any] = {}
    try:
        await B.wait_port(ws, gw, "gateway")
        version = B.instance_of(await B.gateway_status(admin), "ev")["protocol_version"]
        async with trio.open_nursery() as nursery:
            rows = {"ws": await B.ws_clients(nursery, f"ws://127.0.0.1:{ws}/", 16),
                    "legacy": await B.http_clients(http, 16, inflight),
                    "stateless": await B.http_clients(http, 16, inflight, modern=True)}
            for row, conns in rows.items():
                await B.run_load(conns, inflight=inflight, calls=10**6, cap=1.0,
                                 tool="ev__echo", backend=ECHO)
                g0, s0, load = cpu(gw.pid), cpu(srv), os.getloadavg()[0]
                r = await B.run_load(conns, inflight=inflight, calls=10**6, cap=seconds,
                                     tool="ev__echo", backend=ECHO)
                out[row] = {"calls_per_s": r.calls_per_s, "errors": r.errors, "load": load,
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
    trees: dict[str, tuple[str, int | None]] = (
        {f"N={n}": (B.ROOT, n) for n in args.connections} if args.connections
        else {"base": (args.base, None), "this": (B.ROOT, None)})  # base: absolute (main)
    srv, sport = await B.start_everything_http(procs, [])
    res: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    try:
        for i in range(args.repeat):
            for name, (tree, connections) in trees.items():
                res[name].append(await one_round(name, tree, sport, srv.pid, procs, args,
                                                 connections))
                print(f"round {i + 1} {name}: {res[name][-1]}", file=sys.stderr, flush=True)
    finally:
        procs.stop(srv.pid)
    print(f"trees: {trees}")
    for name in trees:
        for row in ("ws", "legacy", "stateless"):
            rs = [r[row] for r in res[name]]
            med = {k: statistics.median(r[k] for r in rs)
                   for k in ("calls_per_s", "gateway_us", "server_us")}
            print(f"{name:5} {row:9} 16x{args.inflight}: calls/s {med['calls_per_s']:5.0f}"
                  f"  gateway CPU µs/call {med['gateway_us']:4.0f}"
                  f"  server CPU µs/call {med['server_us']:4.0f}"
                  f"  errors {sum(r['errors'] for r in rs)}"
                  f"  load {[round(r['load'], 1) for r in rs]}")
        print(f"{name:5} sequential p50 added over direct µs: "
              f"{[round(r['seq']['added_us']) for r in res[name]]} (direct p50 "
              f"{[round(r['seq']['direct_p50_us']) for r in res[name]]})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the other tree (a worktree of another commit)")
    p.add_argument("--connections", metavar="A,B", type=lambda v: [int(x) for x in v.split(",")],
                   help="instead of --base: this tree with backends.ev max_connections A, then B")
    p.add_argument("--inflight", type=int, default=1, help="calls in flight per client")
    p.add_argument("--max-inflight", type=int, default=None, help="backends.ev max_inflight")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if (args.base is None) == (args.connections is None):
        p.error("give --base or --connections")
    if args.base is not None:
        args.base = os.path.abspath(args.base)
    log_dir = tempfile.mkdtemp(prefix="remote-ab-")
    with B.Procs(log_dir) as procs:
        trio.run(amain, args, procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
