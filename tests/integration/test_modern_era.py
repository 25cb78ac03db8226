"""The 2026-07-28 era on a WebSocket connection: no handshake, every request carries its version
and capabilities in ``_meta``, every result says ``resultType`` (gateway.protocol.era)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import connect, fixture_backend, make_config, run_gateway, text_of

pytestmark = pytest.mark.system

V = "io.modelcontextprotocol/protocolVersion"
CAPS = "io.modelcontextprotocol/clientCapabilities"


def meta(version: str = "2026-07-28", **extra: Any) -> dict[str, Any]:
    return {"_meta": {V: version, CAPS: {}, **extra}}


async def test_a_modern_connection_discovers_lists_and_calls_a_legacy_child_without_a_handshake(
) -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url, initialize=False) as c:
            d = await c.request("server/discover", meta())
            r = d["result"]
            assert "2026-07-28" in r["supportedVersions"] and "2025-11-25" in r["supportedVersions"]
            assert r["resultType"] == "complete" and r["cacheScope"] == "public" and r["ttlMs"] == 0
            assert r["_meta"]["io.modelcontextprotocol/serverInfo"]["name"]
            assert "tools" in r["capabilities"]
            tools = (await c.request("tools/list", meta()))["result"]
            assert tools["resultType"] == "complete" and tools["cacheScope"] == "public"
            assert "fx__echo" in [t["name"] for t in tools["tools"]]
            # the legacy child's result gets resultType added, its content passes unchanged
            r = await c.request("tools/call",
                                {"name": "fx__echo", "arguments": {"message": "hi"}, **meta()})
            assert r["result"]["resultType"] == "complete" and text_of(r) == "hi"
            # a resource the gateway cannot find is -32602 in this revision (was -32002)
            r = await c.request("resources/read", {"uri": "nowhere://x", **meta()})
            assert r["error"]["code"] == -32602


async def test_modern_requests_are_checked_and_the_era_is_pinned_per_connection() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url, initialize=False) as c:
                r = await c.request("tools/list", meta("2099-01-01"))
                assert r["error"]["code"] == -32022
                assert "2026-07-28" in r["error"]["data"]["supported"]
                assert r["error"]["data"]["requested"] == "2099-01-01"
                r = await c.request("tools/list", {"_meta": {V: "2026-07-28"}})  # no capabilities
                assert r["error"]["code"] == -32602 and CAPS in r["error"]["message"]
                r = await c.request("tools/list", {})  # no _meta at all on a modern connection
                assert r["error"]["code"] == -32602
                for method in ("initialize", "ping", "logging/setLevel"):  # removed in 2026-07-28
                    r = await c.request(method, meta())
                    assert r["error"]["code"] == -32601, (method, r)
                assert "result" in await c.request("tools/list", meta())  # the connection goes on
            async with connect(gw.url) as legacy:  # initialized: legacy, and stays so
                r = await legacy.request("server/discover", meta())
                assert r["error"]["code"] == -32601
                r = await legacy.request("tools/list")
                assert "resultType" not in r["result"]  # legacy results are unchanged


async def test_subscriptions_listen_on_a_websocket_ends_with_its_result_on_cancel_and_on_drain(
) -> None:
    """On a byte stream the client ends a listen with notifications/cancelled, and the gateway
    ends every listen when it drains: both answered with the closing result."""
    tag = "io.modelcontextprotocol/subscriptionId"
    closing = {"resultType": "complete", "_meta": {tag: 5}}
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url) as legacy:  # a legacy connection has resources/subscribe
                r = await legacy.request("subscriptions/listen",
                                         {"notifications": {"toolsListChanged": True}})
                assert r["error"]["code"] == -32601
            async with connect(gw.url, initialize=False) as c:
                for id, flag in ((5, "resourcesListChanged"), (6, "toolsListChanged")):
                    await c.send({"jsonrpc": "2.0", "id": id, "method": "subscriptions/listen",
                                  "params": {"notifications": {flag: True}, **meta()}})
                    await c.wait_for(lambda id=id: [n for n in c.notifications
                                                    if n["params"]["_meta"] == {tag: id}])
                r = await c.request("tools/call", {"name": "fx__notify_list_changed",
                                                   "arguments": {"kind": "resources"}, **meta()})
                assert r["result"]["resultType"] == "complete"
                changed = await c.wait_for(lambda: [n for n in c.notifications
                                                    if n["method"].endswith("/list_changed")])
                assert changed == [{"jsonrpc": "2.0",
                                    "method": "notifications/resources/list_changed",
                                    "params": {"_meta": {tag: 5}}}]
                await c.notify("notifications/cancelled", {"requestId": 5})
                assert (await c.response(5))["result"] == closing
                gw.control.stop()  # drain: the other listen ends with its result too
                assert (await c.response(6))["result"] == {**closing, "_meta": {tag: 6}}
                # by now everything sent before has arrived: the tools listen got no change
                assert [n for n in c.notifications
                        if n["method"].endswith("/list_changed")] == changed
