"""Edges of the routing core (gateway.protocol.routing) seen from outside: real children, real
sockets, calls queued behind ``max_inflight`` at the moments the core changes its mind."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import connect, fixture_backend, http_json, make_config, run_gateway, text_of, wait_status

pytestmark = pytest.mark.system


def call_msg(id: Any, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}


def load(st: dict[str, Any]) -> int:
    return st["backends"][0]["instances"][0]["inflight"]


async def test_call_queued_behind_an_abandoned_call_moves_to_the_recycled_child() -> None:
    """max_inflight = 1, the slot held by a cancelled call the child never answers (per the spec
    it should not): where attribution matters the child is recycled after cancel_grace.  A call
    of another client queued behind it never reached the child: it must go to the next child,
    not wait out request_timeout on a child that drains for ever."""
    cfg = make_config(fixture_backend("fx", max_inflight=1, cancel_grace=0.5, request_timeout=30.0))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as a, connect(gw.url) as b:
            port = gw.bound.admin_port
            await a.send(call_msg("hog", "fx__sleep", {"seconds": 60}))
            await wait_status(port, lambda st: load(st) == 1)
            await b.send(call_msg("queued", "fx__echo", {"message": "through"}))
            await wait_status(port, lambda st: load(st) == 2)  # queued behind the sleep
            await a.notify("notifications/cancelled", {"requestId": "hog"})
            with trio.fail_after(10):  # well under request_timeout
                r = await b.response("queued", timeout=10)
            assert text_of(r) == "through", r
            st = await http_json(port, "/status")
            assert st["backends"][0]["instances"][0]["recycles"] == 1
            assert "hog" not in a.responses  # cancelled: no answer
