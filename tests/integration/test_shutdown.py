"""Shutdown paths in-process: readiness while a failing daemon goes down."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import ROOT, Events, fixture_backend, make_config, wait_status

from gateway import config, events, service
from gateway.backend import process
from gateway.events import EventBus
from gateway.hub import Hub
from gateway.status import GatewayStatus

pytestmark = pytest.mark.system


async def test_not_ready_while_a_failing_daemon_stops_its_backends(
    monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 7: when run() failed after boot, the client listener closed but /readyz kept
    # answering 200 while the backends were being stopped.
    # the snapshot /readyz serves, taken as the backends' children are being stopped
    seen: list[GatewayStatus] = []
    hubs: list[Hub] = []
    real_run, real_stop_process = Hub.run, process.stop_process

    async def run(self: Hub, **kw: Any) -> None:
        hubs.append(self)
        await real_run(self, **kw)

    async def stop_process(proc: Any) -> str:
        seen.append(hubs[0].status())
        return await real_stop_process(proc)

    async def failing_control_loop(*args: Any) -> None:
        raise RuntimeError("boom")  # any failure once serving

    monkeypatch.setattr(Hub, "run", run)
    monkeypatch.setattr(process, "stop_process", stop_process)
    monkeypatch.setattr(service, "_control_loop", failing_control_loop)
    cfg = make_config(fixture_backend("a"))
    failed = False
    with trio.fail_after(30):
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(service.run, cfg))
        except* RuntimeError:
            failed = True
    assert failed
    assert seen, "backends were not stopped"
    snap = seen[0]
    assert snap.backends[0].instances[0].state == "RUNNING"  # the backend itself was fine
    assert not snap.listeners_bound
    assert not snap.ready


def slow_pid(status: dict[str, Any]) -> int | None:
    backends = {b["name"]: b for b in status["backends"]}
    return backends["slow"]["instances"][0]["pid"] if "slow" in backends else None


async def test_stop_during_a_reload_that_starts_a_backend_stops_it_at_once(tmp_path: Path) -> None:
    # Issue 7: a stop waited for the running reload (here: for a slow backend it started to
    # become ready).  Now the reload is abandoned and the backend it started is stopped and reaped.
    path = tmp_path / "gw.toml"
    head = ('[gateway]\ndrain_grace = 5.0\n[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n'
            '[admin]\nlisten = "127.0.0.1:0"\n')
    path.write_text(head + fixture_backend("a"))
    cfg = config.load(path.read_bytes(), base_dir=ROOT)
    control = service.Control()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            bus = EventBus()
            seen = Events(bus)
            bound = await nursery.start(partial(service.run, cfg, config_path=str(path),
                                                control=control, bus=bus))
            path.write_text(head + fixture_backend("a") + fixture_backend(
                "slow", env={"FIXTURE_START_DELAY": "20"}, start_timeout=25.0))
            control.reload()
            # the reload starts the slow backend; its child's pid shows once spawned (a thread)
            await seen.wait(events.BackendStateChanged, backend="slow", new="STARTING")
            st = await wait_status(bound.admin_port, lambda st: slow_pid(st) is not None)
            pid = slow_pid(st)
            stopped_at = trio.current_time()
            control.stop()
        assert trio.current_time() - stopped_at < 5  # not the 20 s start delay
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_drain_cancels_a_pending_elicitation_at_its_owner() -> None:
    # Issue 7 (hostile tester): on SIGTERM a backend's pending elicitation/create ended
    # without the owner being told; it must get notifications/cancelled for it.  Issue 11: not
    # at the drain's start (the call may still finish) but when drain_grace ends.
    from helpers import connect, run_gateway

    cfg = make_config(fixture_backend("fx"), gateway="drain_grace = 1.0")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities={"elicitation": {}}) as c:
            await c.send({"jsonrpc": "2.0", "id": "e", "method": "tools/call",
                          "params": {"name": "fx__elicit", "arguments": {"message": "sure?"}}})
            (req,) = await c.wait_for(lambda: c.requests)
            gw.control.stop()
            cancelled = await c.wait_for(lambda: [n for n in c.notifications
                                                  if n["method"] == "notifications/cancelled"])
            assert cancelled[0]["params"]["requestId"] == req["id"]
            r = await c.response("e")  # the call itself still gets its one answer
            assert ("result" in r) != ("error" in r)
