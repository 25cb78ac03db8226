"""A spawn that fails for lack of resources (EMFILE: the gateway is out of file descriptors)
is not the backend's fault: it backs off and retries, and never counts toward FATAL.  The pure
table, then a Hub on trio's MockClock whose spawn fails with EMFILE a number of times."""

from __future__ import annotations

import errno
import itertools
import random
from typing import Any

import pytest
import trio
import trio.testing
from test_supervision_clock import FakeProcess

from gateway import config
from gateway.backend import process
from gateway.events import BackendStateChanged, EventBus
from gateway.hub import Hub
from gateway.protocol.supervision import STARVED_BACKOFF_MAX, RestartPolicy, State, Supervision


class NoJitter(random.Random):
    def random(self) -> float:
        return 1.0  # no jitter: the delay is the base


def test_starved_spawns_back_off_and_never_count_toward_fatal() -> None:
    sup = Supervision(RestartPolicy(backoff_initial=0.1, backoff_max=30.0, max_restarts=1,
                                    window=60.0), NoJitter())
    sup.start()
    delays = []
    for _ in range(12):
        t = sup.starved("spawn failed for lack of resources: EMFILE")
        assert t.new is State.BACKOFF
        delays.append(t.delay)
        sup.start("restart")
    assert delays[:6] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2])
    assert delays[6:] == [STARVED_BACKOFF_MAX] * 6  # capped: the fds may come back any moment
    assert sup.starts == 1  # the attempts that spawned nothing are not restarts
    sup.ready(0.0)  # it spawned at last
    assert sup.exited(1.0, "crashed").new is State.BACKOFF  # the first counted failure
    sup.start("restart")
    assert sup.exited(2.0, "crashed").new is State.FATAL  # max_restarts = 1: the second one
    sup.start()
    sup.ready(3.0)
    sup.exited(4.0, "crashed")
    sup.start("restart")
    assert sup.starved("EMFILE").delay == 0.1  # a run in between started the starved delay over


async def test_a_backend_whose_spawns_hit_emfile_comes_back_running_never_fatal(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    starved_for = 25  # spawns that fail with EMFILE
    attempts: list[float] = []

    async def fake_spawn(cfg: config.BackendConfig, env: dict[str, str] | None = None
                         ) -> FakeProcess:
        attempts.append(trio.current_time())
        if len(attempts) <= starved_for:
            raise OSError(errno.EMFILE, "Too many open files")
        proc = FakeProcess(2_000_000 + len(attempts), lifetime=1e9)
        nursery.start_soon(proc.child)
        return proc

    async def fake_stop(proc: FakeProcess, **kw: Any) -> str:
        return "exited"

    monkeypatch.setattr(process, "spawn", fake_spawn)
    monkeypatch.setattr(process, "stop_process", fake_stop)
    monkeypatch.setattr(process, "kill_group", lambda pgid: None)
    bus = EventBus()
    states: list[str] = []
    running = trio.Event()

    def on_event(e: object) -> None:
        if isinstance(e, BackendStateChanged):
            states.append(e.new)
            if e.new == "RUNNING":
                running.set()

    bus.subscribe(on_event)
    cfg = config.load("""
[listen]
websocket = "127.0.0.1:0"
http = ""
[backends.fake]
command = "fake-server"
health = { interval = 0.0 }
restart = { backoff_initial = 0.1, backoff_max = 30.0, max_restarts = 0, window = 600.0 }
""")
    hub = Hub(cfg, bus)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            await running.wait()
            inst = hub.backends["fake"].instances[0]
            assert inst.state is State.RUNNING
            nursery.cancel_scope.cancel()
    assert "FATAL" not in states  # max_restarts = 0: one counted failure would have been FATAL
    assert len(attempts) == starved_for + 1
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert max(gaps) <= STARVED_BACKOFF_MAX + 1e-9  # retried at least every 5 s
    assert sum(gaps) > 60  # backed off, not a busy loop
