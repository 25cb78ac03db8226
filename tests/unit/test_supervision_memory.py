"""Supervision over the memory connector, on trio's MockClock: no process, no pipe, no sleep on
the real clock.  A Hub runs one backend whose instances reach a scripted fake upstream
(gateway.backend.memory); calls go through the pool as the core sends them."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
from memharness import Owner

from gateway import config, errors
from gateway.backend.memory import MemoryConnector, MemoryLink, Script
from gateway.backend.pool import Backend
from gateway.events import (
    BackendExited,
    BackendProtocolError,
    BackendStateChanged,
    EventBus,
    ExitKind,
    ServerRequestRefused,
)
from gateway.hub import Hub
from gateway.protocol import jsonrpc

CAP = 1000.0  # every test's hard cap, in trio time


def make_config(**backend: str) -> config.GatewayConfig:
    lines = "\n".join(f"{key} = {value}" for key, value in backend.items())
    return config.load(f"""
[listen]
websocket = "127.0.0.1:0"
http = ""
[backends.fake]
command = "never-spawned"
{lines}
""")


@dataclass
class Fake:
    hub: Hub
    connector: MemoryConnector
    nursery: trio.Nursery
    events: list[Any] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # the trio time of each event
    _changed: trio.Event = field(default_factory=trio.Event)

    @property
    def backend(self) -> Backend:
        return self.hub.backends["fake"]

    @property
    def link(self) -> MemoryLink:
        return self.connector.links[-1]

    def states(self) -> list[str]:
        return [e.new for e in self.events if isinstance(e, BackendStateChanged)]

    def on_event(self, event: Any) -> None:
        self.events.append(event)
        self.times.append(trio.current_time())
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, state: str, count: int = 1) -> float:
        """Wait for the ``count``-th transition to ``state``; the trio time then."""
        while self.states().count(state) < count:
            await self._changed.wait()
        return trio.current_time()

    async def call(self, tool: str, owner: Owner | None = None, **arguments: Any) -> Any:
        """A tools/call through the pool, as the core sends one."""
        owner = owner if owner is not None else Owner()
        inst, child = await self.backend.acquire(owner)
        try:
            raw = await child.request(
                "tools/call", jsonrpc.encode_dict({"name": tool, "arguments": arguments}),
                timeout=60.0, owner=owner)
        finally:
            self.backend.release(inst, owner)
        return json.loads(bytes(raw))


@asynccontextmanager
async def running(script: Script, **backend: str) -> AsyncIterator[Fake]:
    connector = MemoryConnector(script)
    bus = EventBus()
    hub = Hub(make_config(**backend), bus, connectors=lambda name, cfg: connector)
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            fake = Fake(hub, connector, nursery)
            bus.subscribe(fake.on_event)
            await nursery.start(hub.run)
            await fake.until("RUNNING")
            yield fake
            nursery.cancel_scope.cancel()


async def hang(link: MemoryLink, args: dict[str, Any]) -> Any:
    await trio.sleep_forever()


async def slow(link: MemoryLink, args: dict[str, Any]) -> Any:
    await trio.sleep(args["seconds"])  # virtual-time: a tool of the scripted upstream
    return {"slept": args["seconds"]}


async def garbage(link: MemoryLink, args: dict[str, Any]) -> Any:
    link.send_raw(b"this is not json {")
    return {"ok": True}


async def ask(link: MemoryLink, args: dict[str, Any]) -> Any:
    roots = await link.request("roots/list")
    elicit = await link.request("elicitation/create", {"message": "name?",
                                                       "requestedSchema": {"type": "object"}})
    return {"roots": roots, "elicit": elicit}


NO_HEALTH = {"health": "{ interval = 0.0 }"}


async def test_starts_without_a_process_and_status_names_the_connector(
        autojump_clock: trio.testing.MockClock) -> None:
    async with running(Script(), **NO_HEALTH) as fake:
        assert fake.states() == ["STARTING", "RUNNING"]
        assert [t["name"] for t in fake.backend.lists.tools] == ["echo"]
        assert await fake.call("echo", x=1) == {
            "content": [{"type": "text", "text": '{"x": 1}'}]}
        (backend,) = fake.hub.status().backends
        assert backend.connector == "memory"
        (inst,) = backend.instances
        assert (inst.state, inst.pid, inst.origin) == ("RUNNING", None, "memory:fake")
        assert [m.get("method") for m in fake.link.received[:2]] == [
            "initialize", "notifications/initialized"]


def test_a_backend_configured_with_a_command_uses_the_stdio_connector() -> None:
    cfg = make_config()
    backend = Backend("fake", cfg.backends["fake"], "fake", Hub(cfg, EventBus()))
    assert backend.connector.kind == "stdio"
    assert backend.snapshot(0.0).connector == "stdio"  # what /status shows; nothing spawned


async def test_a_crash_fails_the_call_at_once_backs_off_and_restarts(
        autojump_clock: trio.testing.MockClock) -> None:
    script = Script(tools={"hang": hang})
    async with running(script, **NO_HEALTH,
                       restart="{ backoff_initial = 1.0, backoff_max = 1.0 }") as fake:
        failed: list[tuple[float, BaseException]] = []

        async def caller() -> None:
            try:
                await fake.call("hang")
            except errors.GatewayError as exc:
                failed.append((trio.current_time(), exc))

        fake.nursery.start_soon(caller)
        await trio.testing.wait_all_tasks_blocked()
        crashed_at = trio.current_time()
        fake.link.crash(3)
        restarted_at = await fake.until("RUNNING", 2)
        assert [(at, type(exc)) for at, exc in failed] == [(crashed_at, errors.BackendExited)]
        assert fake.states() == ["STARTING", "RUNNING", "BACKOFF", "STARTING", "RUNNING"]
        assert 0.5 <= restarted_at - crashed_at <= 1.0  # the backoff, with jitter
        (exited,) = [e for e in fake.events if isinstance(e, BackendExited)]
        assert (exited.reason, exited.returncode, exited.pid) == (ExitKind.CRASHED, 3, None)
        assert fake.backend.instances[0].last_exit == "exited (exit code 3)"
        assert len(fake.connector.links) == 2


async def test_a_crash_loop_backs_off_exponentially_then_goes_fatal(
        autojump_clock: trio.testing.MockClock) -> None:
    script = Script(lifetime=0.5)
    restart = "{ backoff_initial = 1.0, backoff_max = 4.0, max_restarts = 4, window = 100.0 }"
    async with running(script, **NO_HEALTH, restart=restart) as fake:
        await fake.until("FATAL")
        opened = len(fake.connector.links)
        await trio.sleep(50)  # FATAL stays FATAL: nothing more is opened
        assert opened == len(fake.connector.links) == 5  # the first start + max_restarts
        starts = [at for at, e in zip(fake.times, fake.events, strict=True)
                  if isinstance(e, BackendStateChanged) and e.new == "STARTING"]
        # each upstream lives 0.5 s; the gaps after that are the backoff: 1, 2, 4, 4 with
        # jitter in [base/2, base]
        waits = [b - a - 0.5 for a, b in itertools.pairwise(starts)]
        for wait, base in zip(waits, [1.0, 2.0, 4.0, 4.0], strict=True):
            assert base / 2 - 1e-9 <= wait <= base + 1e-9, waits
        with pytest.raises(errors.BackendUnavailable):
            await fake.call("echo")


async def test_a_garbage_line_is_counted_and_the_upstream_keeps_serving(
        autojump_clock: trio.testing.MockClock) -> None:
    async with running(Script(tools={"garbage": garbage}), **NO_HEALTH) as fake:
        assert await fake.call("garbage") == {"ok": True}
        kinds = [e.kind for e in fake.events if isinstance(e, BackendProtocolError)]
        assert kinds == ["not_json"]
        assert fake.states() == ["STARTING", "RUNNING"] and len(fake.connector.links) == 1


async def test_server_to_client_requests_are_decided_and_answered(
        autojump_clock: trio.testing.MockClock) -> None:
    async with running(Script(tools={"ask": ask}), **NO_HEALTH,
                       roots='["file:///srv/data"]') as fake:
        inst = fake.backend.instances[0]
        child = inst.serving()
        assert child is not None
        # A gateway-internal call: no client is in flight, so nobody may be asked.
        raw = await child.request("tools/call", jsonrpc.encode_dict({"name": "ask"}),
                                  timeout=60.0, internal=True)
        result = json.loads(bytes(raw))
        assert result["roots"]["result"] == {"roots": [{"uri": "file:///srv/data"}]}
        assert result["elicit"]["result"]["action"] == "decline"  # refused, as the spec allows
        refused = [e for e in fake.events if isinstance(e, ServerRequestRefused)]
        assert [(e.method, e.reason) for e in refused] == [
            ("elicitation/create", "no_call_in_flight")]


async def test_missed_health_pings_mark_it_unhealthy_then_restart_it(
        autojump_clock: trio.testing.MockClock) -> None:
    health = "{ interval = 1.0, timeout = 0.5, failures = 2 }"
    async with running(Script(answer_pings=False), health=health) as fake:
        await fake.until("BACKOFF")
        assert fake.states() == ["STARTING", "RUNNING", "UNHEALTHY", "UNHEALTHY", "BACKOFF"]
        assert trio.current_time() == pytest.approx(3.0)  # two rounds of interval + timeout
        assert fake.backend.instances[0].last_exit == "unhealthy (exit code 0)"
        await fake.until("RUNNING", 2)
        assert len(fake.connector.links) == 2


async def test_status_shows_the_last_health_probe_round_trip_as_latency(
        autojump_clock: trio.testing.MockClock) -> None:
    async def slow_ping(link: Any, params: dict[str, Any]) -> Any:
        await trio.sleep(0.25)
        return {}

    health = "{ interval = 1.0, timeout = 0.5, failures = 2 }"
    async with running(Script(methods={"ping": slow_ping}), health=health) as fake:
        inst = fake.backend.instances[0]
        assert inst.snapshot(trio.current_time()).latency is None  # no probe yet
        await trio.sleep(1.3)  # one probe sent at 1.0, answered at 1.25
        assert inst.snapshot(trio.current_time()).latency == pytest.approx(0.25)


async def test_a_cancelled_call_never_answered_is_recycled_without_a_failure(
        autojump_clock: trio.testing.MockClock) -> None:
    async with running(Script(tools={"hang": hang}), **NO_HEALTH, cancel_grace="2.0") as fake:
        with trio.move_on_after(1.0):
            await fake.call("hang")  # given up by its caller; the upstream never answers
        assert fake.link.received[-1]["method"] == "notifications/cancelled"
        first = fake.link
        await fake.until("RUNNING", 2)
        assert trio.current_time() == pytest.approx(3.0)  # cancelled at 1 + cancel_grace
        assert "BACKOFF" not in fake.states()
        inst = fake.backend.instances[0]
        assert inst.sup.recycles == 1
        assert [e.reason for e in fake.events if isinstance(e, BackendExited)] == [
            ExitKind.RECYCLED]
        assert first.returncode == 0 and fake.link is not first


async def test_drain_waits_for_the_calls_in_flight_within_its_grace(
        autojump_clock: trio.testing.MockClock) -> None:
    async with running(Script(tools={"slow": slow}), **NO_HEALTH) as fake:
        results: list[tuple[float, Any]] = []

        async def caller(seconds: float) -> None:
            result = await fake.call("slow", seconds=seconds)
            results.append((trio.current_time(), result))

        fake.nursery.start_soon(caller, 3.0)
        fake.nursery.start_soon(caller, 30.0)
        await trio.testing.wait_all_tasks_blocked()
        assert fake.backend.inflight() == 2
        await fake.backend.drain(10.0)  # the 3 s call ends; the 30 s one outlasts the grace
        assert trio.current_time() == pytest.approx(10.0)
        assert results == [(3.0, {"slept": 3.0})]
        with pytest.raises(errors.BackendUnavailable):  # draining: no new calls
            await fake.call("slow", seconds=1.0)
        assert fake.backend.inflight() == 1


async def test_a_handshake_slower_than_start_timeout_fails_the_start_and_backs_off(
        autojump_clock: trio.testing.MockClock) -> None:
    connector = MemoryConnector(Script(start_delay=5.0))
    bus = EventBus()
    hub = Hub(make_config(start_timeout="2.0", **NO_HEALTH,
                          restart="{ backoff_initial = 1.0, backoff_max = 1.0 }"),
              bus, connectors=lambda name, cfg: connector)
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            fake = Fake(hub, connector, nursery)
            bus.subscribe(fake.on_event)
            await nursery.start(hub.run)
            await fake.until("BACKOFF")
            assert trio.current_time() == pytest.approx(2.0)
            assert fake.states() == ["STARTING", "BACKOFF"]
            assert fake.backend.instances[0].last_exit == "start failed (exit code 0)"
            connector.script.start_delay = 0.0  # the next generation answers at once
            await fake.until("RUNNING")
            assert len(connector.links) == 2
            nursery.cancel_scope.cancel()
