"""Accepting when the daemon is out of file descriptors: the listener pauses 0.1 s, doubling to
1 s while ``accept`` fails with EMFILE, logs one line per 10 s (no traceback), and accepts again
at full speed once it succeeds.  A fake listener on trio's MockClock."""

from __future__ import annotations

import errno
import logging

import pytest
import trio
import trio.testing

from gateway.transports import listeners


class Starved(trio.abc.Listener[trio.abc.AsyncResource]):
    """``accept`` fails with EMFILE ``failures`` times, then hands out streams."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []

    async def accept(self) -> trio.abc.AsyncResource:
        await trio.lowlevel.checkpoint()
        self.calls.append(trio.current_time())
        if len(self.calls) <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        await trio.sleep(1.0)  # virtual-time: the next connection comes a second later
        return trio.testing.MemorySendStream()

    async def aclose(self) -> None:
        pass


async def test_accept_backs_off_on_emfile_with_one_log_line(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    listener = Starved(failures=30)
    handled: list[float] = []
    two_handled = trio.Event()

    async def handler(stream: trio.abc.AsyncResource) -> None:
        handled.append(trio.current_time())
        if len(handled) == 2:
            two_handled.set()

    monkeypatch.setattr(listeners, "_accept_log", listeners._AcceptLog())  # nothing logged before
    with caplog.at_level(logging.WARNING, logger=listeners.__name__):
        async with trio.open_nursery() as nursery:
            await nursery.start(listeners.serve_listeners, handler, [listener])
            await two_handled.wait()
            nursery.cancel_scope.cancel()
    gaps = [round(b - a, 6) for a, b in zip(listener.calls, listener.calls[1:], strict=False)]
    assert gaps[:6] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert all(gap <= 1.0 for gap in gaps)
    # no pause once it works
    assert len(handled) == 2 and handled[1] - handled[0] == pytest.approx(1.0)
    lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
    # 30 failures over ~26 s: a line at the first and one per 10 s after, none with a traceback
    assert 2 <= len(lines) <= 3 and all(r.exc_info is None for r in lines)
    assert "EMFILE" in lines[0].getMessage()
    assert "more since the last such line" in lines[1].getMessage()
