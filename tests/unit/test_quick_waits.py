"""The POSTs' quick-answer timer (gateway.transports.endpoint._QuickWaits) on trio's MockClock:
a POST not answered in time is woken at QUICK_ANSWER, and the timer task sleeps past POSTs
already answered instead of waking every QUICK_TICK while POSTs keep coming."""

from __future__ import annotations

import trio
import trio.testing

from gateway.transports import endpoint


class _Sink:
    answered: trio.Event | None = None


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.tick = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("_tick"):
            self.tick += 1


async def test_unanswered_post_woken_at_quick_answer(autojump_clock: trio.testing.MockClock
                                                     ) -> None:
    async with trio.open_nursery() as nursery:
        quick = endpoint._QuickWaits(nursery)
        t0 = trio.current_time()
        await quick.wait(_Sink())  # type: ignore[arg-type]
        waited = trio.current_time() - t0
    assert endpoint.QUICK_ANSWER <= waited < endpoint.QUICK_ANSWER + 2 * endpoint.QUICK_TICK


async def test_timer_sleeps_past_answered_posts(autojump_clock: trio.testing.MockClock) -> None:
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        async with trio.open_nursery() as nursery:
            quick = endpoint._QuickWaits(nursery)

            async def answer(sink: _Sink) -> None:
                await trio.sleep(0.001)
                assert sink.answered is not None
                sink.answered.set()

            t0 = trio.current_time()
            for _ in range(100):  # 100 POSTs back to back, each answered in 1 ms: 0.1 s
                sink = _Sink()
                nursery.start_soon(answer, sink)
                await quick.wait(sink)  # type: ignore[arg-type]
            assert trio.current_time() - t0 < 0.2
    finally:
        trio.lowlevel.remove_instrument(steps)
    # woken about once per QUICK_ANSWER (5 times here), not every QUICK_TICK (12 times)
    assert steps.tick <= 6, steps.tick
