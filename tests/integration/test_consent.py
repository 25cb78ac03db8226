"""Issue 3: the gateway's own consent prompts (policy "ask") and sensitive tools."""

from __future__ import annotations

import json
import tomllib
from typing import Any

import pytest
import trio
from helpers import (
    ROOT,
    Client,
    connect,
    fixture_backend,
    make_config,
    run_gateway,
    text_of,
)

from gateway import config, events
from gateway.service import StartupError

pytestmark = pytest.mark.system

ELICIT = {"elicitation": {"form": {}}}
ASK_ECHO = """
[policy]
default = "allow"
elicitation_timeout = 0.5
rules = [{ match = "fx__echo", action = "ask" }, { match = "fx__big", action = "deny" }]
"""


async def call_with_answer(c: Client, answer: dict[str, Any] | None,
                           args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def call() -> None:
        out.update(await c.call("fx__echo", args))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        prompt = await c.wait_for(lambda: c.requests and c.requests[-1])
        assert prompt["method"] == "elicitation/create"
        assert ("fx__echo" in prompt["params"]["message"]
                and args["message"] in prompt["params"]["message"])
        assert prompt["params"]["requestedSchema"]["properties"]["approve"]["type"] == "boolean"
        if answer is not None:
            await c.send({"jsonrpc": "2.0", "id": prompt["id"], **answer})
    return out


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ({"result": {"action": "accept", "content": {"approve": True}}}, None),
        ({"result": {"action": "accept", "content": {"approve": False}}}, "declined"),
        ({"result": {"action": "accept", "content": {}}}, "declined"),
        ({"result": {"action": "decline"}}, "declined"),
        ({"result": {"action": "cancel"}}, "declined"),
        ({"error": {"code": -32603, "message": "ui crashed"}}, "declined"),
        (None, "timeout"),  # silence is not consent
    ],
)
async def test_consent_paths(answer: dict[str, Any] | None, reason: str | None) -> None:
    cfg = make_config(fixture_backend("fx"), extra=ASK_ECHO)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities=ELICIT) as c:
            r = await call_with_answer(c, answer, {"message": "nonce-123"})
            if reason is None:
                assert text_of(r) == "nonce-123"
            else:
                assert r["error"]["code"] == -32005
                assert r["error"]["data"]["reason"] == reason
            if reason == "timeout":
                cancels = [n for n in c.notifications if n["method"] == "notifications/cancelled"]
                assert [n["params"]["requestId"] for n in cancels] == [c.requests[-1]["id"]]
            # allowed tools are untouched; denied ones are denied without a prompt
            assert text_of(await c.call("fx__progress", {"steps": 1})) == "done"
            denied = await c.call("fx__big", {"size": 1})
            assert denied["error"]["data"]["reason"] == "denied"
            assert len(c.requests) == 1


async def test_no_elicitation_capability_is_authorization_required() -> None:
    cfg = make_config(fixture_backend("fx"), extra=ASK_ECHO)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            r = await c.call("fx__echo", {"message": "x"})
            assert r["error"]["code"] == -32005
            assert r["error"]["data"]["reason"] == "authorization_required"
            assert c.requests == []


async def test_cancelling_parked_call_withdraws_prompt_without_response() -> None:
    cfg = make_config(fixture_backend("fx"), extra=ASK_ECHO.replace("0.5", "30"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities=ELICIT) as c:
            await c.send({"jsonrpc": "2.0", "id": 77, "method": "tools/call",
                          "params": {"name": "fx__echo", "arguments": {"message": "m"}}})
            prompt = await c.wait_for(lambda: c.requests and c.requests[0])
            await c.notify("notifications/cancelled", {"requestId": 77})
            note = await c.wait_for(lambda: [n for n in c.notifications
                                             if n["method"] == "notifications/cancelled"])
            assert note[0]["params"]["requestId"] == prompt["id"]
            # a late answer to the withdrawn prompt is dropped quietly, the call never runs
            await c.send({"jsonrpc": "2.0", "id": prompt["id"],
                          "result": {"action": "accept", "content": {"approve": True}}})
            assert (await c.request("ping"))["result"] == {}  # read after the late answer
            assert 77 not in c.responses
            assert not gw.events.of(events.RequestStarted)  # nothing was forwarded


async def test_owner_disconnect_while_parked() -> None:
    cfg = make_config(fixture_backend("fx"), extra=ASK_ECHO.replace("0.5", "30"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url, capabilities=ELICIT) as c:
                await c.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                              "params": {"name": "fx__echo", "arguments": {"message": "m"}}})
                await c.wait_for(lambda: c.requests)
            async with connect(gw.url, capabilities=ELICIT) as d:
                assert (await d.request("ping"))["result"] == {}


async def test_sensitive_tool_refuses_boot_without_rule() -> None:
    cfg = make_config(fixture_backend("fx", sensitive=["echo"]))
    with trio.fail_after(30), pytest.RaisesGroup(pytest.RaisesExc(StartupError, match="fx__echo"),
                                                  flatten_subgroups=True):
        async with run_gateway(cfg):
            pass


async def test_the_rule_snippet_printed_at_a_sensitive_tools_refusal_makes_the_gateway_start(
) -> None:
    text = f"""
[listen]
websocket = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
{fixture_backend("fx", sensitive=["echo", "big"])}"""
    with (trio.fail_after(30),
          pytest.RaisesGroup(pytest.RaisesExc(StartupError), flatten_subgroups=True) as got):
        async with run_gateway(config.load(text, base_dir=ROOT)):
            pass
    leaf: BaseException = got.value
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    message = str(leaf)
    snippet = message.split("\n\n", 1)[1]
    rules = tomllib.loads(snippet)["policy"]["rules"]
    assert rules == [{"match": "fx__big", "action": "ask"}, {"match": "fx__echo", "action": "ask"}]
    with trio.fail_after(30):
        async with (run_gateway(config.load(text + "\n" + snippet, base_dir=ROOT)) as gw,
                    connect(gw.url) as c):
            r = await c.call("fx__echo", {"message": "m"})  # asks; this client cannot be asked
            assert r["error"]["data"]["reason"] == "authorization_required"


async def test_sensitive_tool_with_rule_boots() -> None:
    extra = '[policy]\nrules = [{ match = "fx__ec*", action = "allow" }]\n'
    cfg = make_config(fixture_backend("fx", sensitive=["echo"]), extra=extra)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            assert text_of(await c.call("fx__echo", {"message": "ok"})) == "ok"


async def test_late_destructive_tool_is_denied() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            mark = gw.events.count
            await c.call("fx__add_destructive")
            # the caller's view did not change (wipe is hidden from it): no list_changed
            await gw.events.wait(events.CatalogChanged, lambda e: "tools" in e.kinds, since=mark)
            await c.request("ping")  # sent after any list_changed to it would have been
            assert not [n for n in c.notifications
                        if n["method"] == "notifications/tools/list_changed"]
            tools = (await c.request("tools/list"))["result"]["tools"]
            assert "fx__wipe" not in [t["name"] for t in tools]  # nobody may call it: not listed
            r = await c.call("fx__wipe")
            assert r["error"]["code"] == -32005 and r["error"]["data"]["tool"] == "fx__wipe"
            assert json.loads(text_of(await c.call("fx__client_info")))["pid"] > 0
