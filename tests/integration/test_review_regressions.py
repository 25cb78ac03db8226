"""Regressions found in the second review (one test per bug)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from helpers import connect, fixture_backend, make_config, run_gateway, text_of

pytestmark = pytest.mark.system


def call_msg(id: Any, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments or {}}}


async def test_per_session_first_call_cancelled_at_once_does_not_wedge_the_session() -> None:
    # The first call of a connection starts its per-session child; when that call is cancelled
    # while the child is being started, the instance must still be supervised and reaped (it
    # used to stay in the backend's table, stopped, so every later call waited restart_wait
    # and failed with backend_unavailable, and the slot counted against max_sessions forever).
    cfg = make_config(fixture_backend("fx", sharing="per-session", max_sessions=1),
                      gateway="restart_wait = 3.0")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url, version="2025-03-26") as c:
                await c.send([call_msg(1, "fx__echo", {"message": "x"}),
                              {"jsonrpc": "2.0", "method": "notifications/cancelled",
                               "params": {"requestId": 1}}])
                await trio.sleep(0.3)
                r = await c.call("fx__echo", {"message": "after"}, timeout=10)
                assert text_of(r) == "after", r
            # the connection closed: its child is reaped and the slot is free for another one
            async with connect(gw.url) as d:
                with trio.fail_after(10):
                    while True:
                        r = await d.call("fx__echo", {"message": "next"}, timeout=10)
                        if "result" in r:
                            break
                        assert r["error"]["code"] == -32006, r  # the old child is still stopping
                        await trio.sleep(0.1)
                assert text_of(r) == "next"
