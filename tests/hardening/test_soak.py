"""Soak: many connections for minutes against the real daemon, mixing calls, cancels,
disconnects, kill -9 of backends and reloads.  No answer is lost or misrouted (every call
carries a per-connection nonce that the backend echoes back), and resident memory after the
run stays within 16 MiB of what it was after warm-up.

SOAK_SECONDS (default 120) and SOAK_CONNECTIONS (default 200) size the run; the figures are
printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import gc
import json
import os
import random
import secrets
import signal
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket
from helpers import Client, connect, fixture_backend, unix_connect
from invariants import Daemon, baseline, check, rss_bytes

pytestmark = [pytest.mark.system, pytest.mark.soak]

SECONDS = float(os.environ.get("SOAK_SECONDS") or 120)
CONNECTIONS = int(os.environ.get("SOAK_CONNECTIONS") or 200)
WARMUP = max(3.0, SECONDS * 0.2)
RSS_GROWTH = 16 * 2**20
ANSWER_BOUND = 30.0  # seconds a call may take before it counts as lost
ALLOWED_ERRORS = {-32001, -32004}  # backend restarting / killed under the call
FAST_RESTART = "{ backoff_initial = 0.05, backoff_max = 0.2, max_restarts = 1000, window = 60.0 }"
BACKENDS = (fixture_backend("a", restart=FAST_RESTART, instances=2)
            + fixture_backend("b", restart=FAST_RESTART))
EXTRA = fixture_backend("c", restart=FAST_RESTART)


@dataclass
class Figures:
    calls: int = 0
    answers: int = 0
    results: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    cancels: int = 0
    disconnects: int = 0
    connections: int = 0
    lost: list[str] = field(default_factory=list)
    misrouted: list[str] = field(default_factory=list)
    timed_out: int = 0  # upgrades answered 408: this process sent no head within 10 s
    kills: int = 0
    reloads: int = 0
    rss_warm: int = 0  # the daemon's RSS once warmed up


def audit(c: Client, sent: dict[Any, str], fig: Figures) -> None:
    """Every answer on ``c`` is to an id it sent, at most once, carrying that call's nonce
    (a cancelled call may or may not be answered)."""
    seen: Counter[Any] = Counter()
    for m in c.received:
        if "method" in m or m.get("id") == 1:  # requests, notifications, initialize
            continue
        rid = m.get("id")
        seen[rid] += 1
        if rid not in sent or seen[rid] > 1:
            fig.misrouted.append(f"unexpected answer {str(m)[:200]}")
        elif "result" in m:
            text = m["result"]["content"][0]["text"]
            if text != sent[rid]:
                fig.misrouted.append(f"id {rid!r}: sent {sent[rid]!r}, got {text!r}")


async def session(daemon: Daemon, n: int, deadline: float, fig: Figures) -> None:
    """One connection after another until ``deadline``: calls, cancels and abrupt closes."""
    rng = random.Random(n)
    while trio.current_time() < deadline:
        nonce = secrets.token_hex(6)
        opener = (connect(daemon.url, initialize=False) if n % 2
                  else unix_connect(daemon.unix_path, initialize=False))
        fig.connections += 1
        try:
            async with opener as c:
                try:  # the calls' bound: under this load a handshake may wait as long
                    await c.initialize(timeout=ANSWER_BOUND)
                except trio.TooSlowError:
                    fig.lost.append(f"connection {nonce}: no initialize answer within "
                                    f"{ANSWER_BOUND}s")
                    continue
                await _session_calls(c, rng, nonce, deadline, fig)
        except trio_websocket.ConnectionRejected as exc:
            # the gateway's slow-loris bound, when this loaded client was starved past it
            if exc.status_code != 408:
                raise
            fig.timed_out += 1


async def _session_calls(c: Client, rng: random.Random, nonce: str, deadline: float,
                         fig: Figures) -> None:
    """One connection's calls, cancels and abrupt close; its answers audited."""
    sent: dict[Any, str] = {}
    for seq in range(2, 2 + rng.randint(5, 40)):
        if trio.current_time() >= deadline:
            break
        rid = f"{nonce}-{seq}"
        message = f"{nonce}:{seq}"
        sent[rid] = message
        roll = rng.random()
        backend = rng.choice("ab")
        if roll < 0.8:  # a call, answered
            fig.calls += 1
            try:
                r = await c.call(f"{backend}__echo", {"message": message}, id=rid,
                                 timeout=ANSWER_BOUND)
            except trio.TooSlowError:
                fig.lost.append(f"{rid}: no answer within {ANSWER_BOUND}s")
                continue
            except ConnectionError:
                fig.lost.append(f"{rid}: connection closed by the gateway")
                break
            fig.answers += 1
            if "result" in r:
                fig.results += 1
            else:
                fig.errors[r["error"]["code"]] += 1
        elif roll < 0.93:  # a call cancelled while it runs
            fig.cancels += 1
            await c.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                          "params": {"name": f"{backend}__sleep",
                                     "arguments": {"seconds": 2, "message": message}}})
            # real-clock: the cancel lands at a random point of the call's life (the load)
            await trio.sleep(rng.random() * 0.1)
            await c.notify("notifications/cancelled", {"requestId": rid})
        else:  # a call in flight, then the connection goes away
            fig.disconnects += 1
            await c.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                          "params": {"name": f"{backend}__sleep",
                                     "arguments": {"seconds": 1, "message": message}}})
            break
    if c.closed:
        fig.lost.append(f"connection {nonce} closed by the gateway")
    audit(c, sent, fig)


async def chaos(daemon: Daemon, deadline: float, fig: Figures) -> None:
    """kill -9 a backend instance (its pid read from /status) every 3 s, reload every 5 s
    (alternately adding and removing backend ``c``); the RSS after ``WARMUP`` seconds."""
    rng = random.Random(0)
    next_kill, next_reload, with_extra = 3.0, 5.0, False
    start = trio.current_time()
    end, warm_at = deadline - start, min(WARMUP, deadline - start)
    while (now := trio.current_time() - start) < end:
        due = min(next_kill, next_reload, end, warm_at if not fig.rss_warm else end)
        # real-clock: the soak runs on a schedule (its kills, reloads, warm-up are times)
        await trio.sleep(max(0.0, due - now))
        now = trio.current_time() - start
        if not fig.rss_warm and now >= warm_at:
            fig.rss_warm = rss_bytes(daemon.pid)
        if now >= next_kill:
            next_kill += 3.0
            status = await daemon.status()
            pids = [i["pid"] for b in status["backends"] if b["name"] in ("a", "b")
                    for i in b["instances"] if i["pid"] is not None]
            if pids:
                try:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                except ProcessLookupError:  # it exited (a reload's stop) after /status was read
                    pass
                else:
                    fig.kills += 1
        if now >= next_reload:
            next_reload += 5.0
            with_extra = not with_extra
            daemon.write_config(BACKENDS + (EXTRA if with_extra else ""))
            daemon.proc.send_signal(signal.SIGHUP)
            fig.reloads += 1
    if with_extra:  # back to the configuration the baseline saw
        daemon.write_config(BACKENDS)
        daemon.proc.send_signal(signal.SIGHUP)
        fig.reloads += 1


async def settled_config(daemon: Daemon) -> None:
    """Wait (bounded) until /status shows exactly the baseline's backends, all RUNNING."""
    def settled(status: dict[str, Any]) -> bool:
        names = {b["name"] for b in status["backends"]}
        states = {i["state"] for b in status["backends"] for i in b["instances"]}
        return names == {"a", "b"} and states == {"RUNNING"}

    with trio.fail_after(30):
        await daemon.status_until(settled)


async def test_soak_no_lost_or_misrouted_answers_and_bounded_memory(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, BACKENDS, gateway="max_inflight_per_connection = 8")
    fig = Figures()
    try:
        with trio.fail_after(SECONDS + 120):
            base = await baseline(daemon)
            start = trio.current_time()
            deadline = start + SECONDS
            async with trio.open_nursery() as nursery:
                nursery.start_soon(chaos, daemon, deadline, fig)
                for n in range(CONNECTIONS):
                    nursery.start_soon(session, daemon, n, deadline, fig)
            rss_warm = fig.rss_warm
            assert rss_warm, "the soak ended before its warm-up"
            await settled_config(daemon)
            await check(daemon, base, bystander_tool="a__echo")
            rss_final = rss_bytes(daemon.pid)
            reloads_ok = await daemon.metric("mcp_gateway_config_reloads_total", result="success")
    except BaseException:
        print("\n".join(line for line in daemon.lines if " WARNING " in line or " ERROR " in line))
        raise
    finally:
        daemon.stop()
        with warnings.catch_warnings():  # sockets a client library left open on a failure
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
    print(f"\n[soak] {SECONDS:g}s, {CONNECTIONS} concurrent sessions, "
          f"{fig.connections} connections ({fig.timed_out} answered 408 before the upgrade)")
    print(f"[soak] calls {fig.calls}, answers {fig.answers}, results {fig.results}, "
          f"errors {json.dumps(dict(fig.errors))}, cancels {fig.cancels}, "
          f"disconnects {fig.disconnects}")
    print(f"[soak] kill -9 {fig.kills}, reloads {fig.reloads} (succeeded {reloads_ok:g}), "
          f"lost {len(fig.lost)}, misrouted {len(fig.misrouted)}")
    print(f"[soak] RSS after warm-up {rss_warm / 2**20:.1f} MiB, final {rss_final / 2**20:.1f} MiB")
    assert not fig.lost, fig.lost[:10]
    assert not fig.misrouted, fig.misrouted[:10]
    assert fig.answers == fig.calls
    assert set(fig.errors) <= ALLOWED_ERRORS, fig.errors
    assert fig.results > fig.calls // 2
    assert fig.kills > 0 and reloads_ok >= 1
    assert rss_final <= rss_warm + RSS_GROWTH, (rss_warm, rss_final)
