"""A shared backend's call that may ask for input, behind another caller's parked flow, on the
mock clock (gateway.backend.pool.Backend._acquire_unparked): it waits; the flow is preempted at
exactly ``shared_park_limit`` after it parked, never earlier; the call goes once the child has
answered the given-up call; a flow resumed within the limit is never preempted."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from gateway.backend import pool
from gateway.config import BackendConfig
from gateway.events import EventBus

LIMIT = 30.0


class Child:
    """The attribution set of one child (owners with calls there) and who has a SENT call."""

    def __init__(self) -> None:
        self.owners: set[str] = set()
        self.sent: set[str] = set()
        self.router = self  # (pick_now weighs router.load)
        self.load = 0

    def attribution(self) -> set[str]:
        return set(self.owners)

    def calls_of(self, owner: str) -> list[str]:
        return [owner] if owner in self.sent else []


class Inst:
    def __init__(self, child: Child) -> None:
        self.child = child

    def serving(self) -> Child:
        return self.child

    def calls_changed(self) -> None:
        pass


class Parking:
    park_limit = LIMIT

    def __init__(self) -> None:
        self.parked: dict[str, float] = {}
        self.preempted: list[tuple[str, float]] = []
        self.first_preempted = trio.Event()

    def parked_since(self, owner: str) -> float | None:
        return self.parked.get(owner)

    def was_preempted(self, owner: str) -> bool:
        return any(o == owner for o, _ in self.preempted)

    def preempt(self, owner: str, child: Child) -> None:
        del self.parked[owner]
        child.sent.discard(owner)  # given up: its call stays at the child until it answers
        self.preempted.append((owner, trio.current_time()))
        self.first_preempted.set()


class Host:
    bus = EventBus()
    restart_wait = 10.0


def backend(child: Child, parking: Parking) -> pool.Backend:
    cfg = BackendConfig(command="true", sharing="shared")
    b = pool.Backend("fx", cfg, "fx", Host())  # type: ignore[arg-type]  # a fake host
    b.instances = [Inst(child)]  # type: ignore[list-item]  # a fake instance
    b.parking = parking  # type: ignore[assignment]  # a fake parking
    return b


@pytest.fixture
def setup() -> tuple[Child, Parking, pool.Backend]:
    child, parking = Child(), Parking()
    child.owners = {"alice"}
    child.sent = {"alice"}
    parking.parked["alice"] = 0.0  # (the clock starts at 0)
    return child, parking, backend(child, parking)


async def test_the_parked_flow_is_preempted_at_the_limit_and_the_call_goes_on_the_childs_reply(
        autojump_clock: trio.testing.MockClock, setup: Any) -> None:
    child, parking, b = setup
    await trio.sleep(5)  # bob calls 5 s after alice's flow parked
    assert b.pick_now("bob", asks=True) is None
    assert b.pick_now("bob") is not None  # a call that never asked goes

    async def child_answers_the_given_up_call() -> None:
        await parking.first_preempted.wait()
        await trio.sleep(0.05)
        child.owners.discard("alice")
        b.on_settled(b.instances[0])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(child_answers_the_given_up_call)
        _inst, got = await b.acquire("bob", asks=True)
    assert got is child and parking.preempted == [("alice", LIMIT)]
    assert trio.current_time() == pytest.approx(LIMIT + 0.05, abs=0.02)


async def test_a_flow_resumed_within_the_limit_is_never_preempted(
        autojump_clock: trio.testing.MockClock, setup: Any) -> None:
    child, parking, b = setup

    async def alice_retries_and_finishes() -> None:
        await trio.sleep(LIMIT - 1)
        del parking.parked["alice"]  # resumed: active again
        await trio.sleep(0.5)
        child.owners.discard("alice")  # her call is over
        child.sent.discard("alice")
        b.release(b.instances[0], "alice")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(alice_retries_and_finishes)
        await b.acquire("bob", asks=True)
    assert parking.preempted == []
    assert trio.current_time() == pytest.approx(LIMIT - 0.5)  # woken by her call's end


async def test_a_child_that_never_answers_the_given_up_call_holds_the_call_a_bounded_time(
        autojump_clock: trio.testing.MockClock, setup: Any) -> None:
    _child, parking, b = setup
    await b.acquire("bob", asks=True)
    assert parking.preempted == [("alice", LIMIT)]
    assert trio.current_time() == pytest.approx(LIMIT + b.cfg.cancel_grace)


async def test_callers_waiting_behind_one_flow_go_one_at_a_time(
        autojump_clock: trio.testing.MockClock, setup: Any) -> None:
    child, parking, b = setup
    went: dict[str, float] = {}

    async def waiter(name: str) -> None:
        await b.acquire(name, asks=True)
        went[name] = trio.current_time()
        child.owners.add(name)  # its call reaches the child
        child.sent.add(name)
        if len(went) == 1:  # the first one's call ends 3 s later
            await trio.sleep(3)
            child.owners.discard(name)
            child.sent.discard(name)
            b.release(b.instances[0], name)

    async def child_answers_the_given_up_call() -> None:
        await parking.first_preempted.wait()
        child.owners.discard("alice")
        b.on_settled(b.instances[0])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(child_answers_the_given_up_call)
        nursery.start_soon(waiter, "bob")
        nursery.start_soon(waiter, "carol")
    first, second = sorted(went.values())
    assert parking.preempted == [("alice", LIMIT)]
    assert first == pytest.approx(LIMIT, abs=0.02)
    assert second == pytest.approx(first + 3)  # not with the first: its request is its own
