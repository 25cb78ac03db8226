"""Consent timeout on the mock clock: the parked call ends at exactly elicitation_timeout."""

from __future__ import annotations

import json

import trio
from helpers import memory_stream_pair

from gateway import config
from gateway.core import connection
from gateway.events import EventBus, ServerRequestFinished
from gateway.hub import Hub
from gateway.protocol.catalog import BackendLists, build_catalog

CFG = """
[listen]
websocket = "127.0.0.1:0"
http = ""
[policy]
elicitation_timeout = 60.0
rules = [{ match = "x__t", action = "ask" }]
"""


async def test_consent_prompt_times_out_exactly_once(
    autojump_clock: trio.testing.MockClock) -> None:
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(seen.append)
    hub = Hub(config.load(CFG), bus)
    hub.catalog, _ = build_catalog(
        [("x", "x", BackendLists(tools=[{"name": "t", "inputSchema": {}}]))], "__")
    client, server = memory_stream_pair()

    async def recv() -> dict:
        return json.loads(await client.receive())

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(connection.serve, hub, server, "memory")
            await client.send(
                json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {"elicitation": {}}}}).encode())
            assert (await recv())["id"] == 1
            t0 = trio.current_time()
            await client.send(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                          "params": {"name": "x__t",
                                                     "arguments": {"k": "v"}}}).encode())
            prompt = await recv()
            assert prompt["method"] == "elicitation/create"
            withdrawn = await recv()
            assert withdrawn == {"jsonrpc": "2.0", "method": "notifications/cancelled",
                                 "params": {"requestId": prompt["id"],
                                            "reason": "the consent prompt was withdrawn"}}
            reply = await recv()
            assert trio.current_time() - t0 == 60.0
            assert reply["id"] == 2 and reply["error"]["code"] == -32005
            assert reply["error"]["data"]["reason"] == "timeout"
            # a late answer is dropped quietly (not refused as spoofing)
            await client.send(json.dumps({"jsonrpc": "2.0", "id": prompt["id"],
                                          "result": {"action": "accept"}}).encode())
            await client.send(json.dumps({"jsonrpc": "2.0", "id": 3, "method": "ping"}).encode())
            assert (await recv())["id"] == 3
            await client.aclose()
    finished = [e for e in seen if isinstance(e, ServerRequestFinished)]
    assert [e.outcome for e in finished] == ["timeout"]
    assert not [e for e in seen if type(e).__name__ == "AnswerRefused"]
