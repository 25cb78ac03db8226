"""Backend faults: crashes mid-call, restart, backoff, crash loops (FATAL), call timeouts,
failed and answered health checks, an unanswered cancel past cancel_grace.

Most run the gateway in-process on virtual time (tests/memharness.py: memory backends, clients
on memory streams), so every timing is exact.  What needs a real child process stays real
(``system``): kill -9 mid-call, restart-to-ready of a real spawn, a crash during the real
handshake with its stderr in /status, a child ignoring SIGTERM, a reply over the line limit
(stdio framing), and no orphans (grandchildren included) with the gateway run as the daemon.

Measured numbers are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ROOT,
    Client,
    connect,
    fixture_backend,
    http_json,
    make_config,
    run_gateway,
    text_of,
)
from memharness import (
    Harness,
    backend,
    elapse,
    fixture_script,
    memory_config,
    running,
    sent,
    settle,
)

Clock = trio.testing.MockClock
FAST_RESTART = "{ backoff_initial = 0.05, backoff_max = 0.1, max_restarts = 20, window = 60.0 }"


def nonce() -> str:
    return secrets.token_hex(6)


def proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (``Z`` = zombie), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rfind(")") + 2 :].split()[0]


def alive(pid: int) -> bool:
    state = proc_state(pid)
    return state is not None and state != "Z"


def children_of(ppid: int) -> list[int]:
    from gateway.procfs import stats as proc_stats

    return [pid for pid, state, parent, _pgrp in proc_stats() if parent == ppid and state != "Z"]


async def instance_status(port: int | None, backend: str) -> dict[str, Any]:
    doc = await http_json(port, "/status")
    (b,) = [b for b in doc["backends"] if b["name"] == backend]
    return b["instances"][0]


async def child_pid(c: Client, tool: str = "fx__client_info") -> int:
    """The child's pid (a memory backend: its generation's number)."""
    r = await c.call(tool, {})
    assert "result" in r, r
    return int(json.loads(text_of(r))["pid"])


def assert_exited_error(r: dict[str, Any], backend: str) -> None:
    assert "result" not in r, r
    err = r["error"]
    assert err["code"] == -32004, err
    assert err["data"]["reason"] == "backend_exited"
    assert err["data"]["backend"] == backend


async def first_success(c: Client, tool: str, args: dict[str, Any], bound: float) -> dict[str, Any]:
    """Call until the call succeeds (bounded): the backend is back."""
    with trio.fail_after(bound):
        while True:
            r = await c.call(tool, args, timeout=bound)
            if "result" in r and not r["result"].get("isError"):
                return r
            # real-clock: a real child's restart, seen from outside only by calling
            await trio.sleep(0.02)


async def restarted(gw: Harness, name: str, restarts: int = 1) -> dict[str, Any]:
    """Wait (on the bus) until ``name``'s instance runs again after ``restarts`` restarts."""
    def back() -> dict[str, Any] | None:
        inst = gw.instance(name)
        return inst if inst["state"] == "RUNNING" and inst["restarts"] >= restarts else None
    found: dict[str, Any] = await gw.until(back)
    return found


# ---- crash mid-call ---------------------------------------------------------------------------


async def test_crash_mid_call_gives_backend_exited_then_the_backend_restarts(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", restart=FAST_RESTART))
    async with running(cfg) as gw, gw.connect() as c, gw.connect() as other:
        old_pid = await child_pid(c)
        old_link = gw.link("fx")
        tag = nonce()
        # another connection's call is in flight too: it fails the same way, at once
        await other.send({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
                          "params": {"name": "fx__sleep",
                                     "arguments": {"seconds": 30, "message": tag}}})
        await settle()
        assert len(sent(old_link, "tools/call")) == 2  # client_info and the sleep
        start = trio.current_time()
        r = await c.call("fx__crash", {"code": 7}, timeout=5)
        assert trio.current_time() == start  # no time passes between crash and error
        assert_exited_error(r, "fx")
        assert_exited_error(await other.response("slow", timeout=1), "fx")
        assert trio.current_time() == start

        await restarted(gw, "fx")
        assert trio.current_time() - start <= 0.1  # the backoff (jitter within 0.05-0.1)
        r = await c.call("fx__echo", {"message": tag})
        assert text_of(r) == tag
        new_pid = await child_pid(c)
        assert new_pid != old_pid and old_link.returncode == 7
        inst = gw.instance("fx")
        assert inst["state"] == "RUNNING" and inst["restarts"] == 1
        assert "exit code 7" in inst["last_exit"]


# ---- backoff and crash loops ----------------------------------------------------------------


async def test_call_during_backoff_waits_then_succeeds_or_fails_retryable(
        autojump_clock: Clock) -> None:
    quick = "{ backoff_initial = 0.3, backoff_max = 0.3, max_restarts = 10 }"
    slow = "{ backoff_initial = 5.0, backoff_max = 5.0, max_restarts = 10 }"
    cfg = memory_config(backend("quick", restart=quick) + backend("slow", restart=slow),
                        gateway="restart_wait = 1.5")
    async with running(cfg) as gw, gw.connect() as c:
        tag = nonce()
        # slow: BACKOFF of 2.5-5 s > restart_wait: the call fails after 1.5 s, retryable
        assert_exited_error(await c.call("slow__crash", {}), "slow")
        start = trio.current_time()
        r = await c.call("slow__echo", {"message": tag}, timeout=5)
        waited = trio.current_time() - start
        err = r["error"]
        assert err["code"] == -32001, err
        assert err["data"] == {"backend": "slow", "retryable": True,
                               "reason": "backend_unavailable"}
        assert waited == pytest.approx(1.5), waited
        assert gw.instance("slow")["state"] == "BACKOFF"
        # quick: BACKOFF of 0.15-0.3 s < restart_wait: the call waits, then succeeds
        assert_exited_error(await c.call("quick__crash", {}), "quick")
        start = trio.current_time()
        r = await c.call("quick__echo", {"message": tag}, timeout=5)
        waited = trio.current_time() - start
        assert "result" in r and text_of(r) == tag, r
        assert 0.15 <= waited <= 0.3, waited
        inst = gw.instance("quick")
        assert inst["state"] == "RUNNING" and inst["restarts"] == 1


CRASH_LOOP = "{ backoff_initial = 0.01, backoff_max = 0.02, max_restarts = 2, window = 60.0 }"


async def test_crash_loop_goes_fatal_and_calls_fail_fast_not_retryable(
        autojump_clock: Clock) -> None:
    script = fixture_script(exit_code=3)
    cfg = memory_config(backend("cl", restart=CRASH_LOOP) + backend("fx"))
    async with running(cfg, {"cl": script}) as gw, gw.connect() as c:
        tag = nonce()
        assert text_of(await c.call("cl__echo", {"message": tag})) == tag
        script.lifetime = 0.0  # from now on every start crashes (exit 3) at once
        assert_exited_error(await c.call("cl__crash", {}), "cl")
        inst = await gw.until(lambda: (i := gw.instance("cl"))["state"] == "FATAL" and i)
        assert inst["restarts"] == 2 and "exit code 3" in inst["last_exit"]
        assert len(gw.links("cl")) == 3  # the first start + max_restarts
        for i in range(3):
            start = trio.current_time()
            r = await c.call("cl__echo", {"message": f"{tag}{i}"}, timeout=5)
            assert trio.current_time() == start  # refused at once
            err = r["error"]
            assert err["code"] == -32001, err
            assert err["data"]["reason"] == "backend_unavailable"
            assert err["data"]["retryable"] is False
            assert err["data"]["backend"] == "cl"
        # the tools stay listed while FATAL (the lists survive), the other backend is fine
        names = {t["name"] for t in (await c.request("tools/list"))["result"]["tools"]}
        assert {"cl__echo", "fx__echo"} <= names
        assert text_of(await c.call("fx__echo", {"message": tag})) == tag


# ---- timeouts, health, cancel ---------------------------------------------------------------


async def test_call_timeout_gives_32003(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", request_timeout=0.5))
    async with running(cfg) as gw, gw.connect() as c:
        link = gw.link("fx")
        tag = nonce()
        start = trio.current_time()
        r = await c.call("fx__sleep", {"seconds": 5, "message": tag}, timeout=5)
        took = trio.current_time() - start
        err = r["error"]
        assert err["code"] == -32003, err
        assert err["data"]["reason"] == "timeout" and err["data"]["backend"] == "fx"
        assert took == pytest.approx(0.5), took
        # the child is fine; a quick call inside the timeout works
        r = await c.call("fx__sleep", {"seconds": 0.05, "message": tag})
        assert text_of(r) == tag
        await elapse(5)  # past the moment the timed-out call would have ended
        assert len([m for m in c.received if "method" not in m]) == 3  # no late reply leaked
        # the child was told: notifications/cancelled for the timed-out call's gateway id
        (gid,) = [m["id"] for m in sent(link, "tools/call")
                  if m["params"]["arguments"] == {"seconds": 5, "message": tag}]
        assert [m["params"]["requestId"] for m in sent(link, "notifications/cancelled")] == [gid]


async def test_unanswered_pings_restart_the_instance(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", health="{ interval = 0.2, timeout = 0.2, failures = 2 }"))
    async with running(cfg, {"fx": fixture_script(answer_pings=False)}) as gw, gw.connect() as c:
        first = gw.link("fx")
        inst = await gw.until(lambda: (i := gw.instance("fx"))["restarts"] >= 1 and i)
        assert "unhealthy" in inst["last_exit"]
        assert first.returncode is not None and gw.link("fx") is not first
        await restarted(gw, "fx")
        tag = nonce()
        assert text_of(await c.call("fx__echo", {"message": tag})) == tag


async def test_answered_pings_do_not_restart(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", health="{ interval = 0.1, timeout = 0.5, failures = 1 }"))
    async with running(cfg) as gw, gw.connect() as c:
        pid = await child_pid(c)
        await elapse(1.0)
        assert len(sent(gw.link("fx"), "ping")) >= 9  # pinged all along, and answered
        inst = gw.instance("fx")
        assert inst["restarts"] == 0 and inst["state"] == "RUNNING"
        assert await child_pid(c) == pid


async def test_unanswered_cancel_restarts_a_shared_child_that_may_elicit(
        autojump_clock: Clock) -> None:
    """A cancelled call the child never answers keeps attribution closed; past cancel_grace the
    child is restarted rather than guessed done.  With nothing to attribute, it is just
    forgotten."""
    backends = backend("el", cancel_grace=0.5) + backend("plain", cancel_grace=0.5, declare=[])
    async with running(memory_config(backends)) as gw, gw.connect() as c:
        pids = {}
        for name in ("el", "plain"):
            pids[name] = await child_pid(c, f"{name}__client_info")
            await c.send({"jsonrpc": "2.0", "id": f"s-{name}", "method": "tools/call",
                          "params": {"name": f"{name}__sleep", "arguments": {"seconds": 30}}})
        await settle()
        for name in ("el", "plain"):
            await c.notify("notifications/cancelled", {"requestId": f"s-{name}"})
        cancelled = trio.current_time()
        await gw.until(lambda: gw.instance("el")["recycles"] == 1)
        assert trio.current_time() - cancelled == pytest.approx(0.5)  # at cancel_grace
        after = {name: await child_pid(c, f"{name}__client_info") for name in ("el", "plain")}
        assert after["el"] != pids["el"]  # restarted: it may still have asked someone something
        assert after["plain"] == pids["plain"]  # nothing to misattribute: kept running
        assert gw.instance("el")["recycles"] == 1 and gw.instance("plain")["restarts"] == 0
        assert "s-el" not in c.responses and "s-plain" not in c.responses


# ---- real child processes ---------------------------------------------------------------------


@pytest.mark.system
async def test_kill_9_mid_call_gives_backend_exited_within_1s() -> None:
    cfg = make_config(fixture_backend("fx", restart=FAST_RESTART))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            pid = await child_pid(c)
            tag = nonce()
            for i in range(3):
                await c.send(
                    {
                        "jsonrpc": "2.0",
                        "id": f"s{i}",
                        "method": "tools/call",
                        "params": {
                            "name": "fx__sleep",
                            "arguments": {"seconds": 30, "message": f"{tag}{i}"},
                        },
                    }
                )
            # real-clock: the calls reach the real child's stdin; no event says so
            await trio.sleep(0.2)
            killed = trio.current_time()
            os.kill(pid, signal.SIGKILL)
            r = await c.response("s0", timeout=2)
            to_error = trio.current_time() - killed
            assert_exited_error(r, "fx")
            for i in (1, 2):
                assert_exited_error(await c.response(f"s{i}", timeout=1), "fx")
            assert to_error < 1.0
            r = await first_success(c, "fx__echo", {"message": tag}, bound=10)
            restarted = trio.current_time() - killed
            assert text_of(r) == tag
            assert await child_pid(c) != pid
            print(
                f"\n[measure] kill -9 -> caller's -32004: {to_error * 1000:.0f} ms; "
                f"kill -9 -> first successful call: {restarted * 1000:.0f} ms"
            )
            inst = await instance_status(gw.bound.admin_port, "fx")
            assert inst["restarts"] == 1 and "signal 9" in inst["last_exit"]


@pytest.mark.system
async def test_restart_to_ready_time() -> None:
    """Restart-to-ready, measured by polling /status after a crash (spawn + handshake + lists)."""
    cfg = make_config(
        fixture_backend("fx", restart="{ backoff_initial = 0.001, backoff_max = 0.001 }")
    )
    samples = []
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            for _ in range(3):
                pid = await child_pid(c)
                assert_exited_error(await c.call("fx__crash", {}), "fx")
                start = trio.current_time()
                with trio.fail_after(10):
                    while True:
                        inst = await instance_status(gw.bound.admin_port, "fx")
                        if inst["state"] == "RUNNING" and inst["pid"] not in (None, pid):
                            break
                        # real-clock: measures a real spawn through /status; no event
                        await trio.sleep(0.005)
                samples.append(trio.current_time() - start)
                tag = nonce()
                assert text_of(await c.call("fx__echo", {"message": tag}, timeout=2)) == tag
    print(
        "\n[measure] crash -> RUNNING again (fixture backend, backoff 1 ms): "
        + ", ".join(f"{s * 1000:.0f} ms" for s in samples)
    )
    assert max(samples) < 5.0


@pytest.mark.system
async def test_crash_on_start_goes_fatal_other_backend_keeps_working() -> None:
    cfg = make_config(
        fixture_backend("bad", env={"FIXTURE_CRASH_ON_START": "1"}, restart=CRASH_LOOP)
        + fixture_backend("fx")
    )
    with trio.fail_after(20):
        start = trio.current_time()
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            booted = trio.current_time() - start
            with trio.fail_after(5):
                while (inst := await instance_status(gw.bound.admin_port, "bad"))[  # noqa: ASYNC110 - the gateway seen through /status over HTTP: no event to wait on
                    "state"
                ] != "FATAL":
                    await trio.sleep(0.02)  # real-clock: the gateway seen through /status; no event
            assert inst["restarts"] == 2 and inst["pid"] is None
            assert "exit code 3" in inst["last_exit"]
            assert any("FIXTURE_CRASH_ON_START" in line for line in inst["stderr_tail"])
            # it never listed anything: no bad__ tool, a call is refused at once
            tools = (await c.request("tools/list"))["result"]["tools"]
            assert not [t for t in tools if t["name"].startswith("bad__")]
            start = trio.current_time()
            r = await c.call("bad__echo", {"message": "x"})
            assert "error" in r and trio.current_time() - start < 0.5
            tag = nonce()
            assert text_of(await c.call("fx__echo", {"message": tag})) == tag
            status = await http_json(gw.bound.admin_port, "/status")
            assert status["ready"] is True  # not required
        # a crash during the handshake is noticed at once, not after start_timeout (10 s)
        assert booted < 5.0, booted


@pytest.mark.system
async def test_child_ignoring_sigterm_and_eof_is_killed_on_stop_in_bounded_time() -> None:
    cfg = make_config(fixture_backend("fx", env={"FIXTURE_IGNORE_SIGTERM": "1"}))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url) as c:
                pid = await child_pid(c)
            assert alive(pid)
            stopping = trio.current_time()
        took = trio.current_time() - stopping
    print(f"\n[measure] stop of a child ignoring stdin EOF and SIGTERM: {took:.2f} s")
    assert took < 8.0
    assert not alive(pid)


# ---- the real daemon: no orphans ------------------------------------------------------------


class Daemon:
    """``python -m gateway run`` as a subprocess, its stderr collected line by line."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = trio.Event()

    async def read_stderr(self) -> None:
        assert self.proc.stderr is not None
        buf = b""
        async for chunk in self.proc.stderr:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in lines]
            self._changed.set()
            self._changed = trio.Event()
        self._changed.set()

    async def wait_line(
        self, pattern: str, count: int = 1, bound: float = 10.0
    ) -> list[re.Match[str]]:
        with trio.fail_after(bound):
            while True:
                found = [m for line in self.lines if (m := re.search(pattern, line))]
                if len(found) >= count:
                    return found
                if self.proc.returncode is not None:
                    raise AssertionError("gateway exited:\n" + "\n".join(self.lines[-30:]))
                await self._changed.wait()


def daemon_config(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(f"""
[gateway]
drain_delay = 0.0
[listen]
websocket = "127.0.0.1:0"
http = ""
[admin]
listen = "127.0.0.1:0"
{fixture_backend("fx", env={"FIXTURE_SPAWN_GRANDCHILD": "1"}, restart=FAST_RESTART)}
""")
    return path


async def run_daemon(tmp_path: Path, nursery: trio.Nursery) -> Daemon:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "gateway", "run", "--config", str(daemon_config(tmp_path))],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    daemon = Daemon(proc)
    nursery.start_soon(daemon.read_stderr)
    await daemon.wait_line(r"ready: websocket port \d+")
    return daemon


GRANDCHILD = r"\[fx/0\] grandchild-pid (\d+)"


async def stop_daemon(daemon: Daemon) -> float:
    start = trio.current_time()
    daemon.proc.send_signal(signal.SIGTERM)
    with trio.fail_after(10):
        await daemon.proc.wait()
    took = trio.current_time() - start
    assert daemon.proc.returncode == 0, "\n".join(daemon.lines[-30:])
    return took


@pytest.mark.system
async def test_sigterm_leaves_no_orphans(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            daemon = await run_daemon(tmp_path, nursery)
            try:
                (m,) = await daemon.wait_line(GRANDCHILD)
                grandchild = int(m.group(1))
                kids = children_of(daemon.proc.pid)
                assert len(kids) == 1, kids
                (child,) = kids
                assert alive(child) and alive(grandchild)
                assert grandchild not in kids  # setsid'd away under the child
                took = await stop_daemon(daemon)
            finally:
                if daemon.proc.returncode is None:
                    daemon.proc.kill()
        print(f"\n[measure] SIGTERM -> daemon exit 0: {took:.2f} s")
        assert took < 8.0
        assert not alive(child)
        assert not alive(grandchild)
        assert any("mcp-gateway stopped" in line for line in daemon.lines)


@pytest.mark.system
async def test_kill_9_child_its_grandchild_is_reaped_after_restart(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            daemon = await run_daemon(tmp_path, nursery)
            try:
                (m,) = await daemon.wait_line(GRANDCHILD)
                old_grandchild = int(m.group(1))
                (child,) = children_of(daemon.proc.pid)
                os.kill(child, signal.SIGKILL)
                found = await daemon.wait_line(GRANDCHILD, count=2)
                new_grandchild = int(found[1].group(1))
                assert new_grandchild != old_grandchild
                # the leaked grandchild was killed and reaped: gone, not even a zombie
                with trio.fail_after(5):
                    while proc_state(old_grandchild) is not None:  # noqa: ASYNC110 - /proc has no event to wait on
                        await trio.sleep(0.02)  # real-clock: /proc has no event
                assert not alive(child)
                (new_child,) = children_of(daemon.proc.pid)
                assert new_child != child and alive(new_grandchild)
                await stop_daemon(daemon)
            finally:
                if daemon.proc.returncode is None:
                    daemon.proc.kill()
        assert not alive(new_child)
        assert not alive(new_grandchild)


@pytest.mark.system
async def test_reply_over_the_limit_fails_the_call_at_once() -> None:
    """A child's reply over max_message_bytes is dropped and its caller told now, not at timeout."""
    from helpers import connect, fixture_backend, make_config, run_gateway

    cfg = make_config(fixture_backend("fx", request_timeout=30.0),
                      gateway="max_message_bytes = 65536")
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            started = trio.current_time()
            r = await c.call("fx__big", {"size": 100_000})
            assert trio.current_time() - started < 2.0
            assert r["error"]["code"] == -32008
            assert r["error"]["data"] == {"reason": "response_too_large", "backend": "fx",
                                          "limit": 65536}
            assert (await c.call("fx__echo",
                                 {"message": "next"}))["result"]["content"][0]["text"] == "next"
