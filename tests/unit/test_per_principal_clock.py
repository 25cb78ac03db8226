"""A per-principal backend's instances on trio's MockClock, over the memory connector: one per
principal (not per connection), a caller without a principal refused -32005, the
``max_sessions`` cap, and an instance stopped (its cached upstream tokens forgotten) when it
idles, when the latest credential it was called with expires, or when a reload removes its
principal."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing
from memharness import Owner
from test_supervision_memory import running

from gateway import errors
from gateway.auth.principal import Principal
from gateway.backend.memory import Script


class Forgets:
    """A credential source that records what it is told to forget."""

    kind = "token_files"

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    async def headers(self, principal: Principal) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer for-{principal.name}")]

    def forget(self, principal_key: str) -> None:
        self.forgotten.append(principal_key)


async def test_instances_per_principal_capped_and_stopped(
        autojump_clock: trio.testing.MockClock) -> None:
    async with running(Script(), sharing='"per-principal"', max_sessions="2",
                       idle_timeout="50.0") as fake:
        backend = fake.backend
        source = backend.credentials = Forgets()
        with pytest.raises(errors.Denied, match="not authenticated") as refused:
            await backend.acquire(Owner())
        assert refused.value.code == -32005
        alice = Principal("alice", via="bearer", expires=time.time() + 20)
        bob = Principal("bob", via="bearer")
        one, two, three = Owner(), Owner(), Owner()
        a1, _ = await backend.acquire(one, principal=alice)
        a2, _ = await backend.acquire(two, principal=alice)
        b, _ = await backend.acquire(three, principal=bob)
        assert a1 is a2 and a1 is not b and (a1.name, b.name) == ("fake/p1", "fake/p2")
        assert backend.pick_now(Owner(), principal=alice) is not None  # (no wait once running)
        with pytest.raises(errors.Overloaded, match="max_sessions"):
            await backend.acquire(Owner(), principal=Principal("carol", via="bearer"))
        with pytest.raises(errors.Overloaded):  # the same name vouched for otherwise: another
            await backend.acquire(Owner(), principal=Principal("alice", via="oauth"))
        for inst, owner in ((a1, one), (a1, two), (b, three)):
            backend.release(inst, owner)
        started = trio.current_time()
        await a1.stopped.wait()  # alice's credential expired (20 s), bob's is used on
        assert 19 <= trio.current_time() - started <= 22 and not b.stopped.is_set()
        await trio.sleep(1)
        assert source.forgotten == ["bearer:alice"] and a1 not in backend.instances
        await b.stopped.wait()  # idle 50 s
        assert 49 <= trio.current_time() - started <= 52 and source.forgotten[-1] == "bearer:bob"
        renewed = Principal("alice", via="bearer", expires=time.time() + 3600)
        a3, _ = await backend.acquire(one, principal=renewed)
        assert a3 is not a1 and a3.name == "fake/p3"
        await trio.sleep(10)
        assert backend.drop_principals(lambda p: p.name != "alice") == 1  # a reload removed her
        await a3.stopped.wait()
        await trio.sleep(1)
        assert source.forgotten[-1] == "bearer:alice" and len(backend.instances) == 1
        assert backend.instances[0].name == "fake/0"  # the probe (the lists) stays
