"""The official MCP conformance suite (npm ``@modelcontextprotocol/conformance``) against the
gateway's ``/mcp``, with ``tests/fixtures/conformance_server.py`` (a legacy stdio server) as its
one backend, unprefixed (see tests/conformance/run.py).

Every scored scenario of both requirement sets passes.  In 2026-07-28 the fixture is a legacy
child reached by modern clients: the input-required-result scenarios go through era bridging
(gateway.core.bridge), ``server-stateless`` through the fixture's diagnostic tools and
``subscriptions/listen``.  The not-scored ones (the tasks extension, pending scenarios) are
reported, not asserted.
"""

from __future__ import annotations

import pytest
import trio
from conformance.run import gateway_toml, run_suite
from helpers import ROOT, run_gateway

from gateway import config

pytestmark = [pytest.mark.conformance, pytest.mark.system]



@pytest.mark.parametrize("requirements", ["2025-11-25", "2026-07-28"])
async def test_the_suite_through_the_gateway(requirements: str) -> None:
    cfg = config.load(gateway_toml("127.0.0.1:0"), base_dir=ROOT)
    async with run_gateway(cfg) as gw:
        url = f"http://127.0.0.1:{gw.bound.http_port}/mcp"
        report = await trio.to_thread.run_sync(run_suite, url, requirements)
    print(report.summary_line())
    assert not report.scored_failures, report.explain()
    assert sum(s.scored for s in report.scenarios.values()) == {"2025-11-25": 30,
                                                                "2026-07-28": 37}[requirements]
