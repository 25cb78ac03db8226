"""The hardening suite: a test that fails leaves its daemon to be replaced (see DaemonSlot)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from invariants import FAILED


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[FAILED] = True
    return report
