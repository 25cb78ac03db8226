#!/usr/bin/env python3
"""Growth curves: how mcp-gateway's cost grows with its work, measured on real daemons.

    .venv/bin/python bench/growth.py [--quick] [--only catalog,ws,http,view,restart]
                                     [--out bench/results]

Five curves, each at least six points spread (log-spaced) over its range:

* ``catalog``: ``tools/list`` latency (first page, p50/p99 of 1,000 calls; the fastest of five
  walks over every page), the gateway's VmRSS and its start time against the merged catalog:
  100 → 20,000 tools over 1 → 100 backends, each a ``bench/lean_server.py`` child (stdio);
* ``ws``: the gateway's VmRSS and one client's call latency (p50/p99) against open WebSocket
  connections, 10 → 4,000 (each initialised, then idle), one lean backend;
* ``http``: the same against legacy Streamable HTTP sessions, 10 → 1,024 (the default
  ``listen.http_max_sessions``; one more is checked to get 503);
* ``view``: a pure in-process micro-benchmark of ``gateway.core.policy.Policy.view`` (a caller's
  ``tools`` view) against policy rules (1 → 1,000) and catalog tools (100 → 20,000);
* ``restart``: gateway start to ``/readyz`` 200 and every backend RUNNING, against backends
  starting at once (1 → 50).

The run writes ``growth.json`` and ``growth.md`` (the table, with the machine's load average)
into ``--out``, then draws the plots with ``bench/growth_plot.py`` under the matplotlib venv of
``scripts/setup-bench`` (``.deps/bench/venv-plot``); without it, it says which command to run.
``--quick`` (development, under a minute) runs three small points per curve; ``--redraw JSON``
measures nothing and writes the table and plots of an earlier run.  The clients are
bench/run.py's (``WsConn``, ``HttpConn``); every server binds 127.0.0.1, every loop is bounded,
every process started is stopped (process group, then recorded descendants) on any exit, also
on SIGTERM or SIGHUP, and the whole run is bounded (20 min).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
for _p in (ROOT, BENCH_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# after sys.path holds this tree (gateway) and bench/ (run.py: processes, the lean clients)
import run as br  # noqa: E402
import trio  # noqa: E402

LEAN = os.path.join(BENCH_DIR, "lean_server.py")
RESULTS = os.path.join(BENCH_DIR, "results")
PLOT = os.path.join(BENCH_DIR, "growth_plot.py")
PLOT_PYTHON = os.path.join(ROOT, ".deps", "bench", "venv-plot", "bin", "python")
CURVES = ("catalog", "ws", "http", "view", "restart")
READY_TIMEOUT = 60.0  # a gateway start with up to 100 backends, on a loaded 2-core machine
POLL = 0.01  # seconds between two /readyz or /status polls while a gateway starts
OPEN_AT_ONCE = 64  # client connections or sessions being opened at the same time
OPEN_TIMEOUT = 300.0  # opening all of a point's connections or sessions
TOTAL_TIMEOUT = 1200.0  # the whole run (a full one takes about a minute and a half)
BACKEND_NOTE = ("backends: bench/lean_server.py (stdio, python3 -S, one process each, "
                "generated tools, every tool echoes)")


@dataclass(frozen=True)
class Plan:
    """The points of each curve, and how many calls each latency figure is taken over."""

    catalog: tuple[tuple[int, int], ...]  # (tools, backends)
    ws: tuple[int, ...]  # WebSocket connections
    http: tuple[int, ...]  # legacy HTTP sessions
    view_rules: tuple[int, ...]  # policy rules (at view_tools tools)
    view_tools: tuple[int, ...]  # catalog tools (at view_rules_fixed rules)
    restart: tuple[int, ...]  # backends starting at once
    calls: int  # latency samples per point
    view_tools_fixed: int = 2000
    view_rules_fixed: int = 100
    view_repeat: int = 15
    restart_repeat: int = 2


FULL = Plan(
    catalog=((100, 1), (300, 2), (1000, 5), (2500, 15), (7000, 40), (20000, 100)),
    ws=(10, 30, 100, 300, 1000, 4000),
    http=(10, 30, 100, 300, 600, 1024),
    view_rules=(1, 3, 10, 30, 100, 300, 1000),
    view_tools=(100, 300, 1000, 3000, 10000, 20000),
    restart=(1, 2, 5, 10, 20, 50),
    calls=1000,
)
QUICK = Plan(
    catalog=((100, 1), (1000, 4), (3000, 10)),
    ws=(10, 50, 200),
    http=(10, 50, 200),
    view_rules=(1, 10, 100),
    view_tools=(100, 1000, 5000),
    restart=(1, 3, 6),
    calls=100,
    view_tools_fixed=1000,
    view_rules_fixed=30,
    view_repeat=3,
    restart_repeat=1,
)
SMOKE = Plan(  # the smallest point of each curve: what the test runs
    catalog=((100, 1),), ws=(10,), http=(10,), view_rules=(1,), view_tools=(100,), restart=(1,),
    calls=20, view_tools_fixed=100, view_rules_fixed=1, view_repeat=1, restart_repeat=1)


# ==== shapes =====================================================================================


def exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of log y against log x (1: linear, 0: flat)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return float("nan")
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else float("nan")


def shape(xs: Sequence[float], ys: Sequence[float]) -> str:
    """``flat`` (the last point under 1.5× the first), else by ``k top``, the log-log slope over
    the last three points (growth at scale; the small points carry fixed costs and fit in the
    CPU caches): ``linear or less`` up to 1.25 (a shared machine's noise moves a slope by about
    0.15), else ``worse than linear``.  ``k`` is the slope over every point."""
    if len(xs) < 2 or not ys or ys[0] <= 0:
        return "n/a"
    k, top = exponent(xs, ys), exponent(xs[-3:], ys[-3:])
    if ys[-1] < 1.5 * ys[0]:
        return f"flat (×{ys[-1] / ys[0]:.2f} over ×{xs[-1] / xs[0]:.0f}; k={k:.2f})"
    verdict = "linear or less" if top <= 1.25 else "worse than linear"
    return f"{verdict} (k top={top:.2f}, k={k:.2f})"


# ==== a gateway daemon ===========================================================================


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def gateway_toml(backends: dict[str, int], ws: int, http: int, admin: int) -> str:
    """A config: the given lean backends (name -> tools), WebSocket, HTTP and admin on loopback."""
    out = ['[gateway]', 'name = "growth-bench"', "drain_delay = 0.0", "drain_grace = 2.0", "",
           "[listen]", f'websocket = "127.0.0.1:{ws}"', f'http = "127.0.0.1:{http}"', "",
           "[admin]", f'listen = "127.0.0.1:{admin}"', ""]
    for name, tools in backends.items():
        out += [f"[backends.{name}]", f"command = {json.dumps(sys.executable)}",
                f"args = {json.dumps(['-S', LEAN, '--tools', str(tools)])}",
                "start_timeout = 30.0", ""]
    return "\n".join(out)


def lean_backends(tools: int, backends: int) -> dict[str, int]:
    """``tools`` tools spread over ``backends`` backends (the first ones get the remainder)."""
    base, extra = divmod(tools, backends)
    return {f"b{i}": base + (1 if i < extra else 0) for i in range(backends)}


class Gateway:
    """One ``python -m gateway run`` of this tree, its start timed to ready."""

    def __init__(self, procs: br.Procs, backends: dict[str, int], label: str) -> None:
        self.procs = procs
        self.backends = backends
        self.ws, self.http, self.admin = br.free_port(), br.free_port(), br.free_port()
        self.cfg = os.path.join(procs.log_dir, f"{label}.toml")
        self.label = label
        self.pid = 0
        self.ready_s = self.running_s = float("nan")

    async def start(self) -> None:
        """Start it; return once ``/readyz`` is 200 and every backend's instance is RUNNING
        (``ready_s``, ``running_s``: seconds from the spawn)."""
        with open(self.cfg, "w") as f:  # noqa: ASYNC230 - set-up on a local file, before timing
            f.write(gateway_toml(self.backends, self.ws, self.http, self.admin))
        env = dict(os.environ, PYTHONPATH=ROOT)
        t0 = time.perf_counter()
        proc = self.procs.popen(self.label, [sys.executable, "-m", "gateway", "run", "--config",
                                             self.cfg], env=env)
        self.pid = proc.pid
        deadline = trio.current_time() + READY_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise br.BenchError(f"gateway exited during start-up (code {proc.returncode}); "
                                    f"see {self.procs.log_dir}/{self.label}.log")
            if trio.current_time() > deadline:
                raise br.BenchError(f"gateway not ready within {READY_TIMEOUT:g} s")
            try:
                if math.isnan(self.ready_s):
                    code, _ = await br.http_get(self.admin, "/readyz")
                    if code == 200:
                        self.ready_s = time.perf_counter() - t0
                if not math.isnan(self.ready_s):
                    st = await br.gateway_status(self.admin)
                    states = [i["state"] for b in st["backends"] for i in b["instances"]]
                    if len(states) >= len(self.backends) and all(s == "RUNNING" for s in states):
                        self.running_s = time.perf_counter() - t0
                        break
            except (OSError, trio.TooSlowError, br.BenchError, ValueError):
                pass
            await trio.sleep(POLL)
        br.assert_loopback_only(self.pid, "mcp-gateway")
        self.procs.remember_tree(self.pid)

    def rss_mib(self) -> float:
        return br.rss_bytes(self.pid) / 2**20

    def stop(self) -> None:
        if self.pid:
            self.procs.stop(self.pid)
            self.pid = 0


async def call_latencies(conn: br.Conn, method: str, params: dict[str, Any] | None, calls: int,
                         check: Callable[[dict[str, Any]], bool]) -> list[int]:
    """``calls`` sequential requests (after a tenth as many for warm-up): their latencies (ns)."""
    out: list[int] = []
    for i in range(calls // 10 + calls):
        t0 = time.perf_counter_ns()
        resp = await conn.request(method, params)
        t1 = time.perf_counter_ns()
        if not check(resp):
            raise br.BenchError(f"{method}: unexpected answer {json.dumps(resp)[:200]}")
        if i >= calls // 10:
            out.append(t1 - t0)
    return sorted(out)


def lat_ms(sorted_ns: list[int]) -> dict[str, float]:
    return {"p50_ms": round(br.pct(sorted_ns, 0.5) / 1000, 3),
            "p99_ms": round(br.pct(sorted_ns, 0.99) / 1000, 3)}


ECHO = {"name": "b0__t0", "arguments": {"message": "growth"}}


def echo_ok(resp: dict[str, Any]) -> bool:
    try:
        return bool(resp["result"]["content"][0]["text"] == "growth")
    except (KeyError, IndexError, TypeError):
        return False


# ==== the curves =================================================================================


async def curve_catalog(plan: Plan, procs: br.Procs) -> list[dict[str, Any]]:
    rows = []
    for tools, backends in plan.catalog:
        gw = Gateway(procs, lean_backends(tools, backends), f"catalog-{tools}")
        await gw.start()
        try:
            async with trio.open_nursery() as nursery:
                conn = await br.WsConn.open(nursery, f"ws://127.0.0.1:{gw.ws}/", ["mcp"])
                await conn.initialize()
                first = await call_latencies(conn, "tools/list", None, plan.calls,
                                             lambda r: "tools" in r.get("result", {}))
                walks = []
                for _ in range(5):
                    t0, seen, cursor, pages = time.perf_counter(), 0, None, 0
                    while pages < 10_000:  # bounded: 20,000 tools are 200 pages of 100
                        resp = await conn.request("tools/list",
                                                  None if cursor is None else {"cursor": cursor})
                        seen += len(resp["result"]["tools"])
                        pages += 1
                        cursor = resp["result"].get("nextCursor")
                        if cursor is None:
                            break
                    walks.append(time.perf_counter() - t0)
                if seen != tools:
                    raise br.BenchError(f"catalog: {seen} tools listed, {tools} expected")
                await conn.aclose()
                nursery.cancel_scope.cancel()
            rows.append({"tools": tools, "backends": backends, **lat_ms(first),
                         "walk_ms": round(min(walks) * 1000, 2), "pages": pages,
                         "rss_mib": round(gw.rss_mib(), 1),
                         "start_s": round(gw.running_s, 3), "load": loadavg()})
        finally:
            gw.stop()
        print(f"  catalog {rows[-1]}", file=sys.stderr, flush=True)
    return rows


async def _open_many(n: int, open_one: Callable[[], Any]) -> None:
    """Run ``open_one`` ``n`` times, :data:`OPEN_AT_ONCE` at a time (bounded by OPEN_TIMEOUT)."""
    limit = trio.Semaphore(OPEN_AT_ONCE)

    async def one() -> None:
        async with limit:
            await open_one()

    with trio.fail_after(OPEN_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)


async def curve_ws(plan: Plan, procs: br.Procs) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    gw = Gateway(procs, {"b0": 1}, "ws")
    await gw.start()
    rows = []
    url = f"ws://127.0.0.1:{gw.ws}/"
    try:
        async with trio.open_nursery() as nursery:
            probe = await br.WsConn.open(nursery, url, ["mcp"])
            await probe.initialize()
            conns: list[br.WsConn] = [probe]
            rss0 = gw.rss_mib()

            async def open_one() -> None:
                c = await br.WsConn.open(nursery, url, ["mcp"])
                conns.append(c)
                await c.initialize()

            for n in plan.ws:
                await _open_many(n - len(conns), open_one)
                await trio.sleep(0.3)  # settle: the last handshakes' garbage is collected
                rss = gw.rss_mib()
                lat = await call_latencies(probe, "tools/call", ECHO, plan.calls, echo_ok)
                st = await br.gateway_status(gw.admin)
                alive = sum(1 for c in conns if c.closed is None)
                rows.append({"connections": n, "alive": alive, **lat_ms(lat),
                             "rss_mib": round(rss, 1),
                             "rss_per_conn_kib": round((rss - rss0) * 1024 / max(1, n - 1), 1),
                             "gateway_counts": st.get("connections", {}), "load": loadavg()})
                print(f"  ws {rows[-1]}", file=sys.stderr, flush=True)
            limits = _proc_limit(gw.pid)
            with trio.move_on_after(30):
                async with trio.open_nursery() as closing:
                    for c in conns:
                        closing.start_soon(c.aclose)
            nursery.cancel_scope.cancel()
    finally:
        gw.stop()
    return rows, {"gateway_open_files_limit": limits}


def _proc_limit(pid: int) -> str:
    """The 'Max open files' soft and hard limit of ``pid``."""
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return f"soft {soft}, hard {hard}"


async def curve_http(plan: Plan, procs: br.Procs) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    gw = Gateway(procs, {"b0": 1}, "http")
    await gw.start()
    rows = []
    extra: dict[str, Any] = {}
    try:
        probe = br.HttpConn(gw.http)
        await probe.initialize()
        sessions: list[br.HttpConn] = [probe]
        rss0 = gw.rss_mib()

        async def open_one() -> None:
            c = br.HttpConn(gw.http)
            await c.initialize()
            c.drop_links()  # the session stays; its TCP connection does not count here
            sessions.append(c)

        for n in plan.http:
            await _open_many(n - len(sessions), open_one)
            await trio.sleep(0.3)
            rss = gw.rss_mib()
            lat = await call_latencies(probe, "tools/call", ECHO, plan.calls, echo_ok)
            st = await br.gateway_status(gw.admin)
            rows.append({"sessions": n, **lat_ms(lat), "rss_mib": round(rss, 1),
                         "rss_per_session_kib": round((rss - rss0) * 1024 / max(1, n - 1), 1),
                         "gateway_counts": st.get("connections", {}), "load": loadavg()})
            print(f"  http {rows[-1]}", file=sys.stderr, flush=True)
        if plan.http[-1] == 1024:  # the default listen.http_max_sessions: one more is refused
            try:
                await br.HttpConn(gw.http).initialize()
                extra["session_1025"] = "accepted"
            except br.BenchError as exc:
                extra["session_1025"] = str(exc)[:200]
        with trio.move_on_after(60):
            for c in sessions:
                await c.aclose()
    finally:
        gw.stop()
    return rows, extra


def view_setup(tools: int, rules: int) -> tuple[Any, Any]:
    """A ``tools``-tool catalog (over up to 10 backends) and a :class:`Policy` of ``rules``
    per-caller rules (each names a principal glob, half deny), told of that catalog."""
    from gateway.config import PolicyRule, PolicySection
    from gateway.core.policy import Policy
    from gateway.events import EventBus
    from gateway.protocol.catalog import BackendLists, build_catalog

    per = lean_backends(tools, min(10, tools))
    lists = [(name, name, BackendLists(tools=[{"name": f"t{i}", "inputSchema": {}}
                                              for i in range(n)])) for name, n in per.items()]
    catalog, _ = build_catalog(lists, "__")
    names = sorted(per)
    section = PolicySection(rules=[
        PolicyRule(match=f"{names[i % len(names)]}__t{i}*", action="deny" if i % 2 else "allow",
                   principal=f"user-{i % 7}*") for i in range(rules)])
    policy = Policy(section, EventBus())
    policy.catalog_changed(catalog)
    return catalog, policy


def view_point(tools: int, rules: int, repeat: int) -> dict[str, Any]:
    """Build one caller's ``tools`` view (:func:`view_setup`): the first caller after a catalog
    change (cold: every rule's glob tried on every name) and a second caller (the per-name rule
    lists cached); the fastest of ``repeat``, in ms (noise only adds)."""
    from gateway.protocol.policy import Caller

    catalog, policy = view_setup(tools, rules)
    cold, warm = [], []
    first, second = Caller("ws", "user-0"), Caller("ws", "user-1")
    for _ in range(repeat):
        policy.catalog_changed(catalog)
        t0 = time.perf_counter()
        seen = policy.view(catalog, "tools", first)
        t1 = time.perf_counter()
        policy.view(catalog, "tools", second)
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    return {"tools": tools, "rules": rules, "visible": len(seen),
            "cold_ms": round(min(cold) * 1000, 3), "warm_ms": round(min(warm) * 1000, 3),
            "load": loadavg()}


def curve_view(plan: Plan) -> dict[str, list[dict[str, Any]]]:
    by_rules = [view_point(plan.view_tools_fixed, n, plan.view_repeat) for n in plan.view_rules]
    by_tools = [view_point(n, plan.view_rules_fixed, plan.view_repeat) for n in plan.view_tools]
    for row in by_rules + by_tools:
        print(f"  view {row}", file=sys.stderr, flush=True)
    return {"by_rules": by_rules, "by_tools": by_tools}


async def curve_restart(plan: Plan, procs: br.Procs) -> list[dict[str, Any]]:
    rows = []
    for n in plan.restart:
        ready, running = [], []
        for r in range(plan.restart_repeat):
            gw = Gateway(procs, lean_backends(10 * n, n), f"restart-{n}-{r}")
            try:
                await gw.start()
                ready.append(gw.ready_s)
                running.append(gw.running_s)
            finally:
                gw.stop()
        rows.append({"backends": n, "ready_s": round(statistics.median(ready), 3),
                     "running_s": round(statistics.median(running), 3), "load": loadavg()})
        print(f"  restart {rows[-1]}", file=sys.stderr, flush=True)
    return rows


# ==== the report =================================================================================


def _fmt_load(row: dict[str, Any]) -> str:
    return " / ".join(f"{x:.1f}" for x in row.get("load", []))


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    out = [f"# mcp-gateway growth curves ({meta['mode']} run)", "",
           f"{meta['date']}, commit {meta['commit']}, {meta['machine']}; Python "
           f"{meta['python']}; {meta['cpus']} CPUs; load average (1/5/15 min) at the start "
           f"{' / '.join(str(x) for x in meta['load_start'])}, at the end "
           f"{' / '.join(str(x) for x in meta['load_end'])}. The machine is shared: absolute "
           "numbers are noisy, the shapes are what matter. Each row's `load` is the 1/5/15-minute "
           "load average when the point was taken. Command: `" + meta["command"] + "`.", "",
           f"{BACKEND_NOTE}. {meta['fd_note']}", ""]
    shapes = doc.get("shapes", {})
    if "catalog" in doc:
        out += ["## tools/list and memory against catalog size", "",
                "| tools | backends | first page p50 ms | p99 ms | all pages ms (pages) | "
                "ms per page | gateway VmRSS MiB | start to all RUNNING s | load |",
                "|---" * 9 + "|"]
        out += [f"| {r['tools']} | {r['backends']} | {r['p50_ms']} | {r['p99_ms']} | "
                f"{r['walk_ms']} ({r['pages']}) | {r['walk_ms'] / r['pages']:.3f} | "
                f"{r['rss_mib']} | {r['start_s']} | {_fmt_load(r)} |" for r in doc["catalog"]]
        out += [""]
    if "ws" in doc:
        out += ["## WebSocket connections", "",
                "| connections | alive | probe call p50 ms | p99 ms | gateway VmRSS MiB | "
                "KiB per connection | load |", "|---" * 7 + "|"]
        out += [f"| {r['connections']} | {r['alive']} | {r['p50_ms']} | {r['p99_ms']} | "
                f"{r['rss_mib']} | {r['rss_per_conn_kib']} | {_fmt_load(r)} |" for r in doc["ws"]]
        if "gateway_open_files_limit" in doc.get("extra", {}):
            out += ["", "The gateway's open-files limit (`/proc/<pid>/limits`, after it raised its "
                    f"soft limit at start): {doc['extra']['gateway_open_files_limit']}."]
        out += [""]
    if "http" in doc:
        out += ["## Legacy HTTP sessions", "",
                "| sessions | probe call p50 ms | p99 ms | gateway VmRSS MiB | KiB per session | "
                "load |", "|---" * 6 + "|"]
        out += [f"| {r['sessions']} | {r['p50_ms']} | {r['p99_ms']} | {r['rss_mib']} | "
                f"{r['rss_per_session_kib']} | {_fmt_load(r)} |" for r in doc["http"]]
        if "session_1025" in doc.get("extra", {}):
            out += ["", f"Session 1,025 (over `listen.http_max_sessions`): "
                    f"{doc['extra']['session_1025']}."]
        out += [""]
    if "view" in doc:
        out += ["## Per-caller view build (in-process, `Policy.view`)", "",
                "| tools | rules | visible | first caller ms | next caller ms | load |",
                "|---" * 6 + "|"]
        out += [f"| {r['tools']} | {r['rules']} | {r['visible']} | {r['cold_ms']} | "
                f"{r['warm_ms']} | {_fmt_load(r)} |"
                for r in doc["view"]["by_rules"] + doc["view"]["by_tools"]]
        out += [""]
    if "restart" in doc:
        out += ["## Start to ready against backends starting at once", "",
                "| backends | /readyz 200 s | all RUNNING s | load |", "|---" * 4 + "|"]
        out += [f"| {r['backends']} | {r['ready_s']} | {r['running_s']} | {_fmt_load(r)} |"
                for r in doc["restart"]]
        out += [""]
    if shapes:
        out += ["## Shapes", "", "| curve | shape |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in shapes.items()]
        out += [""]
    return "\n".join(out)


def shapes_of(doc: dict[str, Any]) -> dict[str, str]:
    s: dict[str, str] = {}
    if rows := doc.get("catalog"):
        x = [r["tools"] for r in rows]
        s["tools/list first page p99 vs tools"] = shape(x, [r["p99_ms"] for r in rows])
        s["tools/list all pages vs tools"] = shape(x, [r["walk_ms"] for r in rows])
        s["gateway VmRSS vs tools"] = shape(x, [r["rss_mib"] for r in rows])
        s["start to all RUNNING vs tools (and backends)"] = shape(x, [r["start_s"] for r in rows])
    for key, what in (("ws", "connections"), ("http", "sessions")):
        if rows := doc.get(key):
            x = [r[what] for r in rows]
            s[f"probe call p99 vs {what}"] = shape(x, [r["p99_ms"] for r in rows])
            s[f"gateway VmRSS vs {what}"] = shape(x, [r["rss_mib"] for r in rows])
    if view := doc.get("view"):
        for key, what in (("by_rules", "rules"), ("by_tools", "tools")):
            x = [r[what] for r in view[key]]
            s[f"view, first caller vs {what}"] = shape(x, [r["cold_ms"] for r in view[key]])
            s[f"view, next caller vs {what}"] = shape(x, [r["warm_ms"] for r in view[key]])
    if rows := doc.get("restart"):
        s["start to all RUNNING vs backends"] = shape([r["backends"] for r in rows],
                                                      [r["running_s"] for r in rows])
    return s


def raise_fd_limit() -> str:
    """Raise this process's soft open-files limit to its hard limit; say what was done."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return (f"The bench raised its own open-files soft limit from {soft} to its hard limit "
                f"{hard}.")
    return f"The bench's open-files limit: soft {soft}, hard {hard} (not raised)."


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


async def amain(plan: Plan, only: Sequence[str], procs: br.Procs, doc: dict[str, Any]) -> None:
    """The curves in ``only``, into ``doc``; SIGTERM or SIGHUP stops the run (an error)."""
    stopped: list[str] = []

    async def on_signal(cancel: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
            async for sig in signals:
                stopped.append(f"signal {sig}")
                cancel.cancel()
                return

    async with trio.open_nursery() as outer:
        outer.start_soon(on_signal, outer.cancel_scope)
        with trio.fail_after(TOTAL_TIMEOUT):
            await curves(plan, only, procs, doc)
        outer.cancel_scope.cancel()
    if stopped:
        raise br.BenchError(f"stopped by {stopped[0]}")


async def curves(plan: Plan, only: Sequence[str], procs: br.Procs, doc: dict[str, Any]) -> None:
    extra = doc.setdefault("extra", {})
    if "catalog" in only:
        print("catalog", file=sys.stderr, flush=True)
        doc["catalog"] = await curve_catalog(plan, procs)
    if "ws" in only:
        print("ws", file=sys.stderr, flush=True)
        doc["ws"], more = await curve_ws(plan, procs)
        extra.update(more)
    if "http" in only:
        print("http", file=sys.stderr, flush=True)
        doc["http"], more = await curve_http(plan, procs)
        extra.update(more)
    if "view" in only:
        print("view", file=sys.stderr, flush=True)
        doc["view"] = curve_view(plan)
    if "restart" in only:
        print("restart", file=sys.stderr, flush=True)
        doc["restart"] = await curve_restart(plan, procs)


def plot(json_path: str, out_dir: str) -> str:
    """Draw the plots with the matplotlib venv; a sentence saying what happened."""
    if not os.path.exists(PLOT_PYTHON):
        return (f"plots not drawn: {PLOT_PYTHON} is missing; run scripts/setup-bench, then "
                f"{os.path.relpath(PLOT_PYTHON, ROOT)} bench/growth_plot.py {json_path} {out_dir}")
    done = subprocess.run([PLOT_PYTHON, PLOT, json_path, out_dir], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        return f"plots failed: {done.stderr.strip()[-500:]}"
    return done.stdout.strip()


def redraw(json_path: str, out_dir: str, *, plot_too: bool) -> int:
    """The table (and the plots) of the run recorded in ``json_path``, into ``out_dir``."""
    with open(json_path) as f:
        doc = json.load(f)
    doc["shapes"] = shapes_of(doc)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "growth.md"), "w") as f:
        f.write(markdown(doc))
    if plot_too:
        print(f"growth: {plot(json_path, out_dir)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="three small points per curve (< 1 min)")
    ap.add_argument("--smoke", action="store_true", help="the smallest point of each curve only")
    ap.add_argument("--only", default=",".join(CURVES), help=f"curves, of {','.join(CURVES)}")
    ap.add_argument("--out", default=RESULTS, help="where growth.json, growth.md, plots go")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--redraw", metavar="JSON",
                    help="measure nothing: write the table and plots of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.redraw:
        return redraw(args.redraw, args.out, plot_too=not args.no_plot)
    only = [c for c in args.only.split(",") if c]
    if unknown := set(only) - set(CURVES):
        ap.error(f"unknown curves: {', '.join(sorted(unknown))}")
    plan, mode = (SMOKE, "smoke") if args.smoke else (QUICK, "quick") if args.quick else (FULL,
                                                                                          "full")
    os.makedirs(args.out, exist_ok=True)
    doc: dict[str, Any] = {"meta": {
        "mode": mode, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(), "machine": platform.platform(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "load_start": loadavg(), "fd_note": raise_fd_limit(),
        "command": "bench/growth.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "backend": BACKEND_NOTE}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mcpgw-growth-") as logs:
        with br.Procs(logs) as procs:
            try:
                trio.run(amain, plan, only, procs, doc)
            except br.BenchError as exc:
                print(f"growth: failed: {exc} (logs: {logs}, removed now)", file=sys.stderr)
                return 1
    doc["meta"]["load_end"] = loadavg()
    doc["meta"]["seconds"] = round(time.monotonic() - started, 1)
    doc["shapes"] = shapes_of(doc)
    json_path = os.path.join(args.out, "growth.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "growth.md"), "w") as f:
        f.write(markdown(doc))
    print(f"growth: {doc['meta']['seconds']} s; wrote {json_path} and growth.md", file=sys.stderr)
    if not args.no_plot:
        print(f"growth: {plot(json_path, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
