"""Modern (2026-07-28) backends.  ``protocol_mode`` decides how a child is opened
(``server/discover`` or ``initialize``), the era found is pinned and never silently downgraded
after a restart, every request to a modern child carries the modern ``_meta``, and a modern
child's ``InputRequiredResult`` reaches a legacy client as pushed requests (gateway.core.inputs)
and a modern client unchanged.  The child is tests/fixtures/modern_server.py."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import pytest
import trio
from helpers import (
    FIXTURE,
    ROOT,
    connect,
    http_json,
    make_config,
    metric,
    run_gateway,
    text_of,
    wait_status,
)

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

MODERN_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "modern_server.py")
V = "2026-07-28"


def backend(name: str, mode: str, *args: str, script: str = MODERN_FIXTURE, **extra: Any) -> str:
    lines = [f"[backends.{name}]", f"command = {json.dumps(sys.executable)}",
             f"args = {json.dumps([script, *args])}", f'protocol_mode = "{mode}"']
    lines += [f"{k} = {v if isinstance(v, str) and v.startswith('{') else json.dumps(v)}"
              for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def eras(status: dict[str, Any]) -> dict[str, list[tuple[str, str | None]]]:
    return {b["name"]: [(i["state"], i["era"]) for i in b["instances"]] for b in status["backends"]}


async def test_each_protocol_mode_opens_its_child_in_the_era_it_speaks() -> None:
    cfg = make_config(backend("mo", "modern_only") + backend("pl", "prefer_legacy")
                      + backend("dual", "prefer_modern", "--dual")
                      + backend("leg", "prefer_modern", script=FIXTURE)
                      + backend("lo", "legacy_only", restart="{ max_restarts = 0 }"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            port = gw.bound.admin_port
            st = await wait_status(port, lambda st: eras(st)["lo"][0][0] == "FATAL")
            assert eras(st) == {"mo": [("RUNNING", "modern")], "pl": [("RUNNING", "modern")],
                                "dual": [("RUNNING", "modern")], "leg": [("RUNNING", "legacy")],
                                "lo": [("FATAL", None)]}  # legacy_only: initialize is -32601
            assert {b["name"]: b["protocol_mode"] for b in st["backends"]}["pl"] == "prefer_legacy"
            assert await metric(port, "mcp_gateway_backend_era_instances", backend="mo",
                                era="modern") == 1
            assert await metric(port, "mcp_gateway_backend_era_instances", backend="leg",
                                era="legacy") == 1
            async with connect(gw.url, capabilities={"elicitation": {}}) as c:
                tools = [t["name"] for t in (await c.request("tools/list"))["result"]["tools"]]
                assert {"mo__echo", "pl__ask_name", "dual__echo", "leg__echo"} <= set(tools)
                assert not any(t.startswith("lo__") for t in tools)
                # the catalog item carries no page-level caching hints of the modern child
                listed = (await c.request("tools/list"))["result"]
                assert "ttlMs" not in listed and "resultType" not in listed
                assert ("leg__echo" in tools
                        and text_of(await c.call("leg__echo", {"message": "old"})) == "old")
                # every request to a modern child carries the modern envelope: the gateway's
                # capabilities the caller also has, its log level; its progress token still works
                await c.request("logging/setLevel", {"level": "debug"})
                r = await c.request("tools/call", {"name": "mo__show_meta", "arguments": {},
                                                   "_meta": {"progressToken": "p"}})
                meta = json.loads(text_of(r))
                assert meta["io.modelcontextprotocol/protocolVersion"] == V
                caps = meta["io.modelcontextprotocol/clientCapabilities"]
                assert caps["elicitation"] == {"form": {}}
                assert "sampling" not in caps
                assert meta["io.modelcontextprotocol/logLevel"] == "debug"
                assert meta["progressToken"] != "p"  # rewritten to the gateway's own token
                r = await c.request("tools/call", {"name": "mo__progress", "arguments": {},
                                                   "_meta": {"progressToken": "p"}})
                assert "error" not in r
                progress = [n["params"] for n in c.notifications
                            if n["method"] == "notifications/progress"]
                assert [(p["progressToken"], p["progress"])
                        for p in progress] == [("p", 1), ("p", 2)]
                # a modern child's complete result passes to a legacy client with resultType kept
                r = await c.call("mo__echo", {"message": "hi"})
                assert text_of(r) == "hi" and r["result"]["resultType"] == "complete"
                # list changes come through the gateway's subscriptions/listen on the child
                await c.call("mo__add_tool")
                await c.wait_for(lambda: [n for n in c.notifications
                                          if n["method"] == "notifications/tools/list_changed"])
                tools = [t["name"] for t in (await c.request("tools/list"))["result"]["tools"]]
                assert "mo__added" in tools


async def test_a_modern_child_that_comes_back_legacy_after_a_restart_is_a_failed_start(
    tmp_path: Any) -> None:
    marker = str(tmp_path / "legacy-now")
    cfg = make_config(backend("m", "prefer_modern", "--legacy-if-exists", marker,
                              restart="{ max_restarts = 1, backoff_initial = 0.05 }"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            port = gw.bound.admin_port
            assert eras(await http_json(port, "/status"))["m"] == [("RUNNING", "modern")]
            open(marker, "w").close()  # the next child answers initialize, not server/discover  # noqa: ASYNC230 - a local marker file, instant
            async with connect(gw.url) as c:
                r = await c.call("m__exit")  # the child crashes: the gateway restarts it
                assert r["error"]["data"]["reason"] == "backend_exited"
                st = await wait_status(port, lambda st: eras(st)["m"][0][0] == "FATAL")
                inst = st["backends"][0]["instances"][0]
                assert inst["era"] is None and st["backends"][0]["modern_seen"] is True
                assert inst["last_exit"].startswith("start failed")  # not a silent legacy child
                r = await c.call("m__echo", {"message": "x"})
                assert r["error"]["data"]["reason"] == "backend_unavailable"


async def test_a_legacy_client_is_asked_the_modern_childs_input_requests_the_legacy_way() -> None:
    cfg = make_config(backend("m", "modern_only"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            async with (connect(gw.url, capabilities={"elicitation": {}}) as c,
                        trio.open_nursery() as n):
                answered: list[str] = []

                async def answer() -> None:
                    while True:
                        asked = await c.wait_for(lambda: [q for q in c.requests
                                                          if q["id"] not in answered])
                        for q in asked:
                            assert q["method"] == "elicitation/create"
                            answered.append(q["id"])
                            word = q["params"]["message"].split()[-1].rstrip("?")
                            name = "Ada" if word == "user_name" else word
                            await c.send({"jsonrpc": "2.0", "id": q["id"],
                                          "result": {"action": "accept",
                                                     "content": {"name": name}}})

                n.start_soon(answer)
                r = await c.call("m__ask_name")
                assert text_of(r) == "Hello, Ada" and len(answered) == 1
                r = await c.call("m__ask_two")  # two rounds, the first answer in the child's state
                assert text_of(r) == "first+second"
                assert len(answered) == 3
                n.cancel_scope.cancel()
            # a client that cannot answer an elicitation is not asked: the child says -32021
            async with connect(gw.url) as c:
                r = await c.call("m__ask_name")
                assert r["error"]["code"] == -32021 and not c.requests
            # cancelling the call withdraws the pushed request
            async with connect(gw.url, capabilities={"elicitation": {}}) as c:
                await c.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                              "params": {"name": "m__ask_name", "arguments": {}}})
                (q,) = await c.wait_for(lambda: c.requests)
                await c.notify("notifications/cancelled", {"requestId": 9})
                cancelled = await c.wait_for(lambda: [x for x in c.notifications
                                                      if x["method"] == "notifications/cancelled"])
                assert cancelled[0]["params"]["requestId"] == q["id"] and 9 not in c.responses
                st = await wait_status(gw.bound.admin_port,
                                       lambda st: st["pending_server_requests"] == 0)
                assert st["client_requests_in_flight"] == 0


async def test_a_modern_http_client_gets_the_input_required_result_and_completes_on_retry() -> None:
    cfg = make_config(backend("m", "modern_only"))
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "m__ask_name"}
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, httpx.AsyncClient() as http:
            r = await http.post(gw.http_url, headers=headers, json={
                "jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "m__ask_name", "arguments": {}, "_meta": meta}})
            first = r.json()["result"]
            assert first["resultType"] == "input_required"
            assert first["inputRequests"]["user_name"]["method"] == "elicitation/create"
            # the retry: a new request with inputResponses and the child's requestState as sent
            # (the fixture's HMAC fails on any other bytes)
            r = await http.post(gw.http_url, headers=headers, json={
                "jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "m__ask_name", "arguments": {}, "_meta": meta,
                           "requestState": first["requestState"],
                           "inputResponses": {"user_name": {"action": "accept",
                                                            "content": {"name": "Grace"}}}}})
            done = r.json()["result"]
            assert done["resultType"] == "complete" and done["content"][0]["text"] == "Hello, Grace"
            r = await http.post(gw.http_url, headers=headers, json={
                "jsonrpc": "2.0", "id": 3, "method": "tools/call",
                "params": {"name": "m__ask_name", "arguments": {}, "_meta": meta,
                           "requestState": first["requestState"][:-2] + "00",
                           "inputResponses": {"user_name": {"action": "accept",
                                                            "content": {"name": "G"}}}}})
            assert r.json()["error"]["code"] == -32602  # the child's own check of its state
