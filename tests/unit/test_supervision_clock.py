"""Supervision on the mock clock: a crash-looping child is restarted with exponential backoff
(with jitter) and then marked FATAL.  The child is a fake process on memory streams (the spawn
and stop seams of gateway.backend.process are replaced), so autojump never touches real I/O."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import trio
import trio.testing

from gateway import config
from gateway.backend import process
from gateway.events import BackendStateChanged, EventBus
from gateway.hub import Hub

CFG = """
[listen]
websocket = "127.0.0.1:0"
http = ""
[backends.fake]
command = "fake-server"
health = { interval = 0.0 }
restart = { backoff_initial = 1.0, backoff_max = 4.0, max_restarts = 4, window = 100.0 }
"""


class FakeProcess:
    """Looks like trio.Process to the instance; its 'child' is a task that serves the MCP
    handshake and then exits after ``lifetime`` seconds of trio time."""

    def __init__(self, pid: int, lifetime: float) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin, self._child_in = trio.testing.memory_stream_one_way_pair()
        self._child_out, self.stdout = trio.testing.memory_stream_one_way_pair()
        self._err_out, self.stderr = trio.testing.memory_stream_one_way_pair()
        self._exited = trio.Event()
        self.lifetime = lifetime

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def child(self) -> None:
        buf = b""
        with trio.move_on_after(self.lifetime):
            while True:
                data = await self._child_in.receive_some(65536)
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    if "id" not in msg or "method" not in msg:
                        continue
                    result: Any = {}
                    if msg["method"] == "initialize":
                        result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                                  "serverInfo": {"name": "fake", "version": "1"}}
                    elif msg["method"] == "tools/list":
                        result = {"tools": [{"name": "t", "inputSchema": {"type": "object"}}]}
                    reply = {"jsonrpc": "2.0", "id": msg["id"], "result": result}
                    await self._child_out.send_all(json.dumps(reply).encode() + b"\n")
        self.returncode = 1
        await self._child_out.aclose()
        await self._err_out.aclose()
        self._exited.set()


async def test_crash_loop_backs_off_then_goes_fatal(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[float] = []

    async def fake_spawn(cfg: config.BackendConfig, env: dict[str, str] | None = None
                         ) -> FakeProcess:
        spawned.append(trio.current_time())
        proc = FakeProcess(1_000_000 + len(spawned), lifetime=0.5)
        nursery.start_soon(proc.child)
        return proc

    async def fake_stop(proc: FakeProcess, **kw: Any) -> str:
        await proc.wait()
        return "exited"

    monkeypatch.setattr(process, "spawn", fake_spawn)
    monkeypatch.setattr(process, "stop_process", fake_stop)
    monkeypatch.setattr(process, "kill_group", lambda pgid: None)
    bus = EventBus()
    states: list[tuple[float, str]] = []
    fatal = trio.Event()

    def on_event(e: object) -> None:
        if isinstance(e, BackendStateChanged):
            states.append((trio.current_time(), e.new))
            if e.new == "FATAL":
                fatal.set()

    bus.subscribe(on_event)
    hub = Hub(config.load(CFG), bus)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            await fatal.wait()
            fatal_at = trio.current_time()
            await trio.sleep(50)  # FATAL stays FATAL: no further spawn
            assert len(spawned) == 5  # the first start + max_restarts restarts
            assert states[-1][1] == "FATAL"
            nursery.cancel_scope.cancel()
    # each child lives 0.5 s; the gaps after that are the backoff: base 1, 2, 4, 4 with jitter
    # in [base/2, base]
    waits = [b - a - 0.5 for a, b in itertools.pairwise(spawned)]
    for wait, base in zip(waits, [1.0, 2.0, 4.0, 4.0], strict=True):
        assert base / 2 - 1e-9 <= wait <= base + 1e-9, (waits, base)
    assert fatal_at == pytest.approx(spawned[-1] + 0.5, abs=0.2)
    seen = [s for _, s in states]
    assert seen[:3] == ["STARTING", "RUNNING", "BACKOFF"]
    assert seen.count("RUNNING") == 5 and seen.count("BACKOFF") == 4
