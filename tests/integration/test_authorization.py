"""Authorization end to end: each caller sees and may call its own catalog.

The unix socket's caller is the peer's user (``SO_PEERCRED``; the tests run as root, so the
principal is ``root``), the WebSocket's has no principal (authentication not configured).
"""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import (
    Client,
    connect,
    fixture_backend,
    make_config,
    metric,
    run_gateway,
    text_of,
    unix_connect,
)

from gateway import events

pytestmark = pytest.mark.system

V = "io.modelcontextprotocol/protocolVersion"
CAPS = "io.modelcontextprotocol/clientCapabilities"
MODERN = {"_meta": {V: "2026-07-28", CAPS: {}}}
ME = pwd.getpwuid(os.getuid()).pw_name  # root under CI
MY_GROUP = grp.getgrgid(pwd.getpwuid(os.getuid()).pw_gid).gr_name

POLICY = f"""
[policy]
rules = [
  {{ match = "fx__sleep", action = "allow", transport = "unix", principal = "{ME}" }},
  {{ match = "fx__sleep", action = "deny" }},
  {{ match = "fx__big", action = "deny", principal = "{ME}" }},
  {{ match = "fx__echo", action = "allow", principal = "{ME}", scopes = ["echo:run"] }},
  {{ match = "fx__echo", action = "deny", transport = "unix" }},
  {{ match = "fx__extra_tool", action = "deny", transport = "unix" }},
  {{ kind = "prompt", match = "fx__plain", action = "deny", group = "{MY_GROUP}" }},
  {{ kind = "resource", match = "fixture://static/b", action = "deny", transport = "ws" }},
]
[[auth.limits]]
principal = "{ME}"
max_inflight = 1
"""


async def listed(c: Client, method: str, field: str,
                 extra: dict[str, Any] | None = None) -> list[str]:
    """Every name (URI) of a list, page by page (page_size = 4)."""
    names: list[str] = []
    params: dict[str, Any] = dict(extra or {})
    while True:
        r = (await c.request(method, params))["result"]
        names += [i.get("name") if field != "resources" else i["uri"] for i in r[field]]
        if "nextCursor" not in r:
            return names
        params = {**(extra or {}), "cursor": r["nextCursor"]}


async def test_each_caller_sees_and_calls_its_own_catalog_unix_peer_vs_websocket(
    tmp_path: Path) -> None:
    sock = tmp_path / "gw.sock"
    cfg = make_config(fixture_backend("fx"), gateway="page_size = 4", unix=str(sock), extra=POLICY)
    with trio.fail_after(40):
        async with run_gateway(cfg) as gw, unix_connect(str(sock)) as u, connect(gw.url) as w:
            u_tools = await listed(u, "tools/list", "tools")
            w_tools = await listed(w, "tools/list", "tools")
            assert "fx__sleep" in u_tools and "fx__sleep" not in w_tools  # transport + principal
            assert "fx__big" not in u_tools and "fx__big" in w_tools  # principal
            assert "fx__echo" not in u_tools and "fx__echo" in w_tools  # no scope on the socket
            assert len(u_tools) == len(set(u_tools)) and len(w_tools) == len(set(w_tools))  # paging
            assert set(u_tools) == ({*w_tools, "fx__sleep"} - {"fx__big", "fx__echo"})
            assert await listed(u, "prompts/list", "prompts") == ["fx__greet"]  # group
            assert await listed(w, "prompts/list", "prompts") == ["fx__greet", "fx__plain"]
            assert await listed(w, "resources/list", "resources") == ["fixture://static/a"]
            assert len(await listed(u, "resources/list", "resources")) == 2
            # calls outside the view are refused
            r = await w.call("fx__sleep", {"seconds": 0})
            assert r["error"]["code"] == -32005 and r["error"]["data"]["reason"] == "denied"
            r = await u.call("fx__echo", {"message": "x"})
            assert r["error"]["code"] == -32005
            assert r["error"]["data"] == {"reason": "insufficient_scope", "scopes": ["echo:run"],
                                          "tool": "fx__echo"}
            assert (await u.request("prompts/get",
                                    {"name": "fx__plain"}))["error"]["code"] == -32005
            r = await w.request("resources/read", {"uri": "fixture://static/b"})
            assert r["error"]["data"] == {"reason": "denied", "uri": "fixture://static/b"}
            assert text_of(await w.call("fx__echo", {"message": "hi"})) == "hi"
            # [[auth.limits]] max_inflight = 1 for the socket's principal: -32006 with retryAfter
            await u.send({"jsonrpc": "2.0", "id": "long", "method": "tools/call",
                          "params": {"name": "fx__sleep", "arguments": {"seconds": 30}}})
            await gw.events.wait(events.RequestStarted, backend="fx")
            r = await u.request("tools/list")
            assert r["error"]["code"] == -32006
            assert r["error"]["data"] == {"reason": "rate_limited", "limit": "max_inflight",
                                          "value": 1, "retryAfter": 1.0}
            assert "result" in await u.request("ping")  # not counted
            assert "result" in await w.request("tools/list")  # not this principal
            await u.notify("notifications/cancelled", {"requestId": "long"})
            await gw.events.wait(events.RequestFinished, backend="fx")
            assert "long" not in u.responses  # cancelled: never answered
            assert "result" in await u.request("tools/list")
            # list_changed only where the view changed: extra_tool is denied on the socket
            assert text_of(await w.call("fx__notify_list_changed", {"kind": "tools"})) == "ok"
            await w.wait_for(lambda: [n for n in w.notifications
                                      if n["method"] == "notifications/tools/list_changed"])
            assert "fx__extra_tool" in await listed(w, "tools/list", "tools")
            await u.request("ping")  # sent after any list_changed to it would have been
            assert not [n for n in u.notifications if n["method"].endswith("list_changed")]
            # a modern client's lists are private once they are filtered per caller
            async with connect(gw.url, initialize=False) as m:
                r = (await m.request("tools/list", MODERN))["result"]
                assert r["cacheScope"] == "private"
                r = (await m.request("server/discover", MODERN))["result"]
                assert r["cacheScope"] == "public"
            # the operator view: the principal label (configured name) and "_none"
            port = gw.bound.admin_port
            assert await metric(port, "mcp_gateway_requests_total", method="tools/list",
                                backend="_gateway", outcome="ok", principal=ME) >= 3
            assert await metric(port, "mcp_gateway_requests_total", method="tools/list",
                                backend="_gateway", outcome="error", principal=ME) == 1
            assert await metric(port, "mcp_gateway_requests_total", method="tools/list",
                                backend="_gateway", outcome="ok", principal="_none") >= 3


FILTERED = fixture_backend(
    "fx",
    tools='{ include = ["echo", "sleep", "notify_*"], exclude = ["sleep"] }',
    prompts='{ exclude = ["plain"] }',
    resources='{ include = ["fixture://static/*"] }',
)


async def test_backend_include_exclude_filters_hide_and_refuse() -> None:
    cfg = make_config(FILTERED)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            assert await listed(c, "tools/list", "tools") == ["fx__echo", "fx__notify_list_changed"]
            r = await c.call("fx__sleep", {"seconds": 0})
            assert r["error"]["code"] == -32602 and "unknown tool" in r["error"]["message"]
            assert await listed(c, "prompts/list", "prompts") == ["fx__greet"]
            r = await c.request("prompts/get", {"name": "fx__plain"})
            assert r["error"]["code"] == -32602
            assert await listed(c, "resources/list", "resources") == ["fixture://static/a",
                                                                      "fixture://static/b"]
            assert (await c.request("resources/templates/list"))["result"][
                "resourceTemplates"] == []
            r = await c.request("resources/read", {"uri": "fixture://item/1"})
            assert r["error"]["code"] == -32002  # as if absent
            r = await c.request("resources/read", {"uri": "fixture://static/a"})
            assert r["result"]["contents"][0]["uri"] == "fixture://static/a"
            r = await c.request("completion/complete",
                                {"ref": {"type": "ref/resource", "uri": "fixture://item/{id}"},
                                                        "argument": {"name": "id", "value": ""}})
            assert r["error"]["code"] == -32602
            assert text_of(await c.call("fx__echo", {"message": "ok"})) == "ok"
            # no policy rule tells callers apart: a modern client's lists are public
            async with connect(gw.url, initialize=False) as m:
                r = (await m.request("tools/list", MODERN))["result"]
                assert r["cacheScope"] == "public" and len(r["tools"]) == 2
