"""service.Control: reload requests coalesce, stop is a level; nothing queues, nothing overflows."""

from __future__ import annotations

import trio
import trio.testing

from gateway.service import Command, Control


async def test_a_burst_of_reloads_is_one_reload_and_nothing_overflows() -> None:
    control = Control()
    for _ in range(1000):  # the old control channel held 16
        control.reload()
    assert await control.next() is Command.RELOAD
    got: list[Command] = []

    async def take() -> None:
        got.append(await control.next())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # the burst was one reload
        control.reload()
        control.reload()
    assert got == [Command.RELOAD]


async def test_stop_is_a_level_and_wins_over_a_pending_reload() -> None:
    control = Control()
    control.reload()
    control.stop()
    control.stop()
    assert await control.next() is Command.STOP
    assert await control.next() is Command.STOP  # stays requested
    assert control.stopping.is_set()
