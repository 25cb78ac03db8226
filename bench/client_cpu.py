#!/usr/bin/env python3
"""The bench's own clients side by side: what each costs the bench process per call.

    .venv/bin/python bench/client_cpu.py [--rounds 5] [--calls 4000] [--clients 16]

Starts one gateway of this tree (the fixture echo backend, as bench/run.py configures it) and
drives it with bench/run.py's three clients: the lean WebSocket client, trio-websocket's and the
lean HTTP client (a legacy ``/mcp`` session each).  Throughput rounds (``clients`` × 1 echo calls)
are interleaved client by client, so drift hits them alike; each reports the bench process's CPU
(``getrusage``) per call.  Then one client of each kind makes 1000 sequential calls under cProfile:
the Python function calls per call, a count that does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time

import run as br
import trio

KINDS = ("lean", "trio-websocket", "http")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def amain(args: argparse.Namespace, procs: br.Procs) -> None:
    backend = br.backend_spec("fixture")
    tool = "fx__echo"
    tmp = tempfile.mkdtemp(prefix="mcpgw-clientcpu-")
    ws, admin, http = br.free_port(), br.free_port(), br.free_port()
    cfg = os.path.join(tmp, "gateway.toml")
    with open(cfg, "w") as f:  # noqa: ASYNC230 - before anything runs
        f.write(br.gateway_config(backend, ws, admin, os.path.join(tmp, "gw.sock"), None, http))
    gw = procs.popen("gateway", [sys.executable, "-m", "gateway", "run", "--config", cfg],
                     env=br.gateway_env())
    try:
        await br.wait_port(ws, gw, "gateway")
        await br.wait_port(http, gw, "gateway")
        async with trio.open_nursery() as nursery:

            async def clients(kind: str, n: int) -> list[br.Conn]:
                conns: list[br.Conn]
                if kind == "http":
                    conns = [br.HttpConn(http) for _ in range(n)]
                else:
                    br.WsConn.client = kind
                    conns = [await br.WsConn.open(nursery, f"ws://127.0.0.1:{ws}/", ["mcp"])
                             for _ in range(n)]
                for c in conns:
                    await c.initialize()
                return conns

            pools = {k: await clients(k, args.clients) for k in KINDS}
            for k in KINDS:  # warm-up
                await br.run_load(pools[k], inflight=1, calls=500, cap=10, tool=tool,
                                  backend=backend)
            cpu: dict[str, list[float]] = {k: [] for k in KINDS}
            rate: dict[str, list[float]] = {k: [] for k in KINDS}
            for _ in range(args.rounds):
                for k in KINDS:
                    c0, t0 = cpu_seconds(), time.perf_counter()
                    r = await br.run_load(pools[k], inflight=1, calls=args.calls, cap=60,
                                          tool=tool, backend=backend)
                    c1, t1 = cpu_seconds(), time.perf_counter()
                    if r.errors or not r.ok:
                        raise br.BenchError(f"{k}: {r.errors} errors ({r.first_error})")
                    cpu[k].append((c1 - c0) / r.ok * 1e6)
                    rate[k].append(r.ok / (t1 - t0))
            print(f"{args.clients} x 1, {args.rounds} interleaved rounds of {args.calls} calls; "
                  f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            for k in KINDS:
                print(f"  {k:15s} bench client CPU us/call: median {statistics.median(cpu[k]):.0f} "
                      f"(rounds: {', '.join(f'{x:.0f}' for x in cpu[k])}); calls/s median "
                      f"{statistics.median(rate[k]):.0f}")
            print("one client, 1000 sequential calls under cProfile:")
            for k in KINDS:
                one = (await clients(k, 1))[0]
                for i in range(50):
                    await one.request("tools/call", {"name": tool,
                                                     "arguments": {"message": f"w{i}"}})
                prof = cProfile.Profile()
                prof.enable()
                for i in range(1000):
                    await one.request("tools/call", {"name": tool,
                                                     "arguments": {"message": f"m{i}"}})
                prof.disable()
                print(f"  {k:15s} Python function calls per call: "
                      f"{pstats.Stats(prof).total_calls / 1000:.1f}")
                await one.aclose()
            for conns in pools.values():
                for c in conns:
                    await c.aclose()
            nursery.cancel_scope.cancel()
    finally:
        procs.stop(gw.pid)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=4000, help="calls per client kind and round")
    p.add_argument("--clients", type=int, default=16)
    args = p.parse_args()
    if min(args.rounds, args.calls, args.clients) < 1:
        p.error("--rounds, --calls and --clients must be positive")
    with br.Procs(tempfile.mkdtemp(prefix="mcpgw-clientcpu-logs-")) as procs:
        trio.run(amain, args, procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
