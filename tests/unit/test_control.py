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


async def test_lame_duck_waits_drain_delay_from_the_first_stop_unless_asked_again(
        autojump_clock: trio.testing.MockClock) -> None:
    """SIGTERM (``lame_duck``) waits ``drain_delay`` counted from the first stop; a second stop
    ends the wait; a stop without it (SIGINT, tests) never waits."""
    control = Control()
    control.stop(lame_duck=True)
    start = trio.current_time()
    await trio.sleep(2)  # e.g. a reload finishing: the delay runs meanwhile
    await control.until_drain(5)
    assert trio.current_time() - start == 5
    assert await control.next() is Command.STOP

    control = Control()
    control.stop(lame_duck=True)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(control.until_drain, 5)
        await trio.sleep(1)
        control.stop(lame_duck=True)  # asked again
    assert trio.current_time() - start == 1

    control = Control()
    control.stop()
    start = trio.current_time()
    await control.until_drain(5)
    assert trio.current_time() == start
