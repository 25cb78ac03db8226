"""Shutdown paths in-process: readiness while a failing daemon goes down."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio
from helpers import fixture_backend, make_config

from gateway import service
from gateway.backend import process
from gateway.hub import Hub
from gateway.status import GatewayStatus

pytestmark = pytest.mark.system


async def test_not_ready_while_a_failing_daemon_stops_its_backends(monkeypatch: pytest.MonkeyPatch) -> None:
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
