"""Last hostile pass against the real daemon: inputs that must never end it."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import trio
from invariants import Daemon, DaemonSlot, baseline, chaos_backend, check

pytestmark = pytest.mark.system

BACKENDS = chaos_backend("fx")


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("final"), BACKENDS)
    yield s
    s.close()


async def test_sigusr1_and_sigusr2_do_not_end_the_daemon(daemon: Daemon) -> None:
    base = await baseline(daemon)
    since = len(daemon.lines)
    for _ in range(10):
        daemon.proc.send_signal(signal.SIGUSR1)
        daemon.proc.send_signal(signal.SIGUSR2)
    await trio.sleep(0.5)
    await check(daemon, base)
    assert not daemon.failures(since)
    assert any("ignoring SIGUSR1" in line for line in daemon.lines[since:]), daemon.tail()
