"""The hardening suite: a test that fails leaves its daemon to be replaced (see DaemonSlot)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from invariants import FAILED, Daemon, DaemonSlot, failed


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[FAILED] = True
    return report


@pytest.fixture
def daemon(slot: DaemonSlot, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """The module's shared daemon (its ``slot`` fixture); replaced after a test that failed."""
    yield slot.get()
    if failed(request):
        slot.discard()
