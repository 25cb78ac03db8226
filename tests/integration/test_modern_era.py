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


async def test_a_modern_connection_discovers_lists_and_calls_a_legacy_child_without_a_handshake() -> None:
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
            r = await c.request("tools/call", {"name": "fx__echo", "arguments": {"message": "hi"}, **meta()})
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
