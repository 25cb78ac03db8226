"""StreamIO (gateway.transports.rawio): writes through a trio stream (TLS), held until flushed."""

from __future__ import annotations

import trio
import trio.testing

from gateway.transports.rawio import StreamIO


async def test_a_flush_cancelled_before_its_send_leaves_the_bytes_held() -> None:
    """A flush that gets the lock and is cancelled before it sends (a request's writer whose
    request just ended) keeps the bytes held: the next flush sends them.  It had taken them
    and raised at send_all's first cancel point: lost, the client never answered."""
    sent = trio.testing.MemorySendStream()
    io = StreamIO(sent)
    io.write([b"the answer"])
    scope = trio.CancelScope()

    async def flusher() -> None:
        with scope:
            await io.flush()

    async with trio.open_nursery() as nursery:
        async with io._lock:  # the flusher queues behind a flush under way
            nursery.start_soon(flusher)
            await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # it was handed the lock and has not run yet
    assert scope.cancelled_caught
    assert io.held == len(b"the answer")
    await io.flush()
    assert sent.get_data_nowait() == b"the answer"
