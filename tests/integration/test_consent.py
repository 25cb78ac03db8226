"""The gateway's own consent prompts (policy "ask") and sensitive tools.

The gateway runs in-process on virtual time (tests/memharness.py: a memory backend doing what
the fixture server does, clients on memory streams), so the consent timeout is exact.  One test
stays on a real child over a real WebSocket (``system``): an approved call reaches the child.
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

import pytest
import trio
import trio.testing
from helpers import Client, connect, fixture_backend, make_config, run_gateway, text_of
from memharness import (
    backend,
    fixture_script,
    m_tools_call,
    m_tools_list,
    memory_config,
    running,
    sent,
    settle,
    text,
)

from gateway import events
from gateway.backend.memory import MemoryLink, Script
from gateway.service import StartupError

Clock = trio.testing.MockClock

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


def destructive_script() -> Script:
    """The fixture with ``add_destructive``: lists ``wipe`` (destructiveHint) from then on."""
    async def tools_list(link: MemoryLink, params: dict[str, Any]) -> Any:
        listed = await m_tools_list(link, params)
        listed["tools"].append({"name": "add_destructive", "inputSchema": {"type": "object"}})
        if link.state.get("destructive"):
            listed["tools"].append({"name": "wipe", "inputSchema": {"type": "object"},
                                    "annotations": {"destructiveHint": True}})
        return listed

    async def tools_call(link: MemoryLink, params: dict[str, Any]) -> Any:
        if params.get("name") == "add_destructive":
            link.state["destructive"] = True
            link.notify("notifications/tools/list_changed")
            return text("ok")
        if params.get("name") == "wipe" and link.state.get("destructive"):
            return text("wiped")
        return await m_tools_call(link, params)

    script = fixture_script()
    script.methods.update({"tools/list": tools_list, "tools/call": tools_call})
    return script


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
async def test_consent_paths(answer: dict[str, Any] | None, reason: str | None,
                             autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"), extra=ASK_ECHO)
    async with running(cfg) as gw, gw.connect(capabilities=ELICIT) as c:
        start = trio.current_time()
        r = await call_with_answer(c, answer, {"message": "nonce-123"})
        if reason is None:
            assert text_of(r) == "nonce-123"
        else:
            assert r["error"]["code"] == -32005
            assert r["error"]["data"]["reason"] == reason
        if reason == "timeout":
            assert trio.current_time() - start == pytest.approx(0.5)  # elicitation_timeout
            cancels = [n for n in c.notifications if n["method"] == "notifications/cancelled"]
            assert [n["params"]["requestId"] for n in cancels] == [c.requests[-1]["id"]]
        else:
            assert trio.current_time() == start  # an answer decides at once
        # allowed tools are untouched; denied ones are denied without a prompt
        assert text_of(await c.call("fx__progress", {"steps": 1})) == "done"
        denied = await c.call("fx__big", {"size": 1})
        assert denied["error"]["data"]["reason"] == "denied"
        assert len(c.requests) == 1


@pytest.mark.system
async def test_an_approved_call_reaches_a_real_child() -> None:
    cfg = make_config(fixture_backend("fx"), extra=ASK_ECHO.replace("0.5", "30"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities=ELICIT) as c:
            answer = {"result": {"action": "accept", "content": {"approve": True}}}
            r = await call_with_answer(c, answer, {"message": "nonce-real"})
            assert text_of(r) == "nonce-real"
            assert json.loads(text_of(await c.call("fx__client_info")))["pid"] > 0


async def test_no_elicitation_capability_is_authorization_required(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"), extra=ASK_ECHO)
    async with running(cfg) as gw, gw.connect() as c:
        r = await c.call("fx__echo", {"message": "x"})
        assert r["error"]["code"] == -32005
        assert r["error"]["data"]["reason"] == "authorization_required"
        assert c.requests == []


async def test_cancelling_parked_call_withdraws_prompt_without_response(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"), extra=ASK_ECHO.replace("0.5", "30"))
    async with running(cfg) as gw, gw.connect(capabilities=ELICIT) as c:
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
        await settle()
        assert 77 not in c.responses
        assert not [e for e in gw.events if isinstance(e, events.RequestStarted)
                    and e.backend == "fx"]  # nothing was forwarded
        assert sent(gw.link("fx"), "tools/call") == []


async def test_owner_disconnect_while_parked(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"), extra=ASK_ECHO.replace("0.5", "30"))
    async with running(cfg) as gw:
        async with gw.connect(capabilities=ELICIT) as c:
            await c.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                          "params": {"name": "fx__echo", "arguments": {"message": "m"}}})
            await c.wait_for(lambda: c.requests)
        await gw.until(lambda: gw.status()["client_requests_in_flight"] == 0)
        async with gw.connect(capabilities=ELICIT) as d:
            assert (await d.request("ping"))["result"] == {}
        assert sent(gw.link("fx"), "tools/call") == []  # the parked call never ran


async def test_sensitive_tool_refuses_boot_without_rule(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", sensitive=["echo"]))
    with pytest.RaisesGroup(pytest.RaisesExc(StartupError, match="fx__echo"),
                            flatten_subgroups=True):
        async with running(cfg):
            pass


async def test_the_rule_snippet_printed_at_a_sensitive_tools_refusal_makes_the_gateway_start(
        autojump_clock: Clock) -> None:
    fx = backend("fx", sensitive=["echo", "big"])
    with pytest.RaisesGroup(pytest.RaisesExc(StartupError), flatten_subgroups=True) as got:
        async with running(memory_config(fx)):
            pass
    leaf: BaseException = got.value
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    message = str(leaf)
    snippet = message.split("\n\n", 1)[1]
    rules = tomllib.loads(snippet)["policy"]["rules"]
    assert rules == [{"match": "fx__big", "action": "ask"}, {"match": "fx__echo", "action": "ask"}]
    async with running(memory_config(fx, extra=snippet)) as gw, gw.connect() as c:
        r = await c.call("fx__echo", {"message": "m"})  # asks; this client cannot be asked
        assert r["error"]["data"]["reason"] == "authorization_required"


async def test_sensitive_tool_with_rule_boots(autojump_clock: Clock) -> None:
    extra = '[policy]\nrules = [{ match = "fx__ec*", action = "allow" }]\n'
    cfg = memory_config(backend("fx", sensitive=["echo"]), extra=extra)
    async with running(cfg) as gw, gw.connect() as c:
        assert text_of(await c.call("fx__echo", {"message": "ok"})) == "ok"


async def test_late_destructive_tool_is_denied(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    async with running(cfg, {"fx": destructive_script()}) as gw, gw.connect() as c:
        mark = len(gw.events)
        await c.call("fx__add_destructive")
        # the caller's view did not change (wipe is hidden from it): no list_changed
        await gw.until(lambda: [e for e in gw.events[mark:]
                                if isinstance(e, events.CatalogChanged) and "tools" in e.kinds])
        await settle()
        assert not [n for n in c.notifications
                    if n["method"] == "notifications/tools/list_changed"]
        tools = (await c.request("tools/list"))["result"]["tools"]
        assert "fx__wipe" not in [t["name"] for t in tools]  # nobody may call it: not listed
        r = await c.call("fx__wipe")
        assert r["error"]["code"] == -32005 and r["error"]["data"]["tool"] == "fx__wipe"
        assert sent(gw.link("fx"), "tools/call")[-1]["params"]["name"] == "add_destructive"
        assert json.loads(text_of(await c.call("fx__client_info")))["pid"] > 0
