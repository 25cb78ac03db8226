"""A modern caller's consent prompt on the mock clock: silence ends the call at the consent
timeout (the earlier of policy.elicitation_timeout and gateway.state_ttl), exactly once, with
no second answer to the call's id and nothing sent but the InputRequiredResult."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import trio
from helpers import memory_stream_pair

from gateway import config
from gateway.core import connection
from gateway.events import EventBus, RequestFinished, ServerRequestFinished
from gateway.hub import Hub
from gateway.protocol.catalog import BackendLists, build_catalog

CFG = """
[gateway]
state_ttl = {ttl}
[listen]
websocket = "127.0.0.1:0"
http = ""
[policy]
elicitation_timeout = 60.0
rules = [{{ match = "x__t", action = "ask" }}]
"""
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}}


def expiry(state: str) -> float:
    """Seconds from now until the state's signed expiry."""
    payload = state.split(".")[1]
    return json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["x"] - time.time()


@pytest.mark.parametrize(("ttl", "ends_after"), [(300.0, 60.0), (10.0, 10.0)])
async def test_silence_ends_the_consent_round_once(autojump_clock: trio.testing.MockClock,
                                                   ttl: float,
                                                    ends_after: float) -> None:
    bus = EventBus()
    seen: list[tuple[float, object]] = []
    bus.subscribe(lambda e: seen.append((trio.current_time(), e)))
    hub = Hub(config.load(CFG.format(ttl=ttl)), bus)
    hub.catalog, _ = build_catalog(
        [("x", "x", BackendLists(tools=[{"name": "t", "inputSchema": {}}]))], "__")
    client, server = memory_stream_pair()
    received: list[dict[str, Any]] = []

    async def recv() -> dict[str, Any]:
        received.append(json.loads(await client.receive()))
        return received[-1]

    params = {"name": "x__t", "arguments": {"k": "v"}, "_meta": META}
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.serve, hub, server, "memory")
            t0 = trio.current_time()
            await client.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                          "params": params}).encode())
            first = (await recv())["result"]
            assert (first["resultType"] == "input_required"
                    and list(first["inputRequests"]) == ["consent"])
            assert abs(expiry(first["requestState"]) - ends_after) <= 2
            with trio.move_on_after(ends_after + 100):  # silence: nothing more comes for id 1
                await recv()
            assert received == [received[0]]
            # the retry after the timeout finds nothing to continue: the call is over
            await client.send(
                json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                **params,
                "inputResponses": {"consent": {"action": "accept", "content": {"approve": True}}},
                "requestState": first["requestState"]}}).encode())
            late = await recv()
            assert late["id"] == 2 and late["error"]["data"]["reason"] == "invalid_state"
            await client.aclose()
    prompts = [(t, e) for t, e in seen if isinstance(e, ServerRequestFinished)]
    assert [(t - t0, e.outcome) for t, e in prompts] == [(ends_after, "timeout")]
    calls = [(t, e) for t, e in seen if isinstance(e, RequestFinished) and e.method == "tools/call"]
    assert [e.error_code for _, e in calls] == [-32005, -32602]
    assert calls[0][0] - t0 == ends_after
