"""The live catalog: namespacing, boot-time conflicts, list_changed (only on real change),
prompts / completion / resources routed to their backend, subscription refcounting and
per-connection log levels.

The gateway runs in-process on virtual time (tests/memharness.py: memory backends that do what
the fixture server does, clients on memory streams).  Only two tests use real processes: two
real fixture children namespaced and routed, and the CLI refusing a name conflict (exit 1).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import ROOT, Client, connect, fixture_backend, make_config, run_gateway, text_of
from memharness import backend, memory_config, notes, running, sent, settle

from gateway import service

Clock = trio.testing.MockClock


def nonce() -> str:
    return secrets.token_hex(6)


def leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


async def tool_names(c: Client) -> set[str]:
    r = await c.request("tools/list")
    return {t["name"] for t in r["result"]["tools"]}


async def complete(c: Any, ref: dict[str, str], argument: str, value: str) -> dict[str, Any]:
    return await c.request("completion/complete",
                           {"ref": ref, "argument": {"name": argument, "value": value}})


async def client_info(c: Client, tool: str = "fx__client_info") -> dict[str, Any]:
    info: dict[str, Any] = json.loads(text_of(await c.call(tool)))
    return info


RESTART = "{ backoff_initial = 0.01, backoff_max = 0.02 }"


# ---- real children ------------------------------------------------------------------------


@pytest.mark.system
async def test_two_backends_are_namespaced_and_routed() -> None:
    cfg = make_config(fixture_backend("a") + fixture_backend("b"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            names = await tool_names(c)
            assert {"a__echo", "b__echo", "a__client_info", "b__client_info"} <= names
            assert not [n for n in names if not n.startswith(("a__", "b__"))]
            pid_a = json.loads(text_of(await c.call("a__client_info")))["pid"]
            pid_b = json.loads(text_of(await c.call("b__client_info")))["pid"]
            assert pid_a != pid_b
            tag = nonce()
            assert text_of(await c.call("a__echo", {"message": f"a-{tag}"})) == f"a-{tag}"
            assert text_of(await c.call("b__echo", {"message": f"b-{tag}"})) == f"b-{tag}"
            prompts = {p["name"] for p in (await c.request("prompts/list"))["result"]["prompts"]}
            assert prompts == {"a__greet", "a__plain", "b__greet", "b__plain"}



@pytest.mark.system
async def test_empty_prefix_conflict_cli_exits_1_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n[admin]\nlisten = "127.0.0.1:0"\n'
        + fixture_backend("alpha", prefix="")
        + fixture_backend("beta", prefix="")
    )
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, "-m", "gateway", "run", "--config", str(path)],
            cwd=ROOT,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "cannot start" in err and "'alpha'" in err and "'beta'" in err, err



# ---- namespacing and conflicts ------------------------------------------------------------


async def test_empty_prefix_on_both_backends_refuses_to_start(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("a", prefix="") + backend("b", prefix=""))
    errors: list[str] = []
    try:
        async with running(cfg):
            pytest.fail("the gateway started despite a name conflict")
    except* service.StartupError as group:
        errors = [str(e) for e in leaves(group)]
    assert len(errors) == 1
    assert "'a'" in errors[0] and "'b'" in errors[0], errors[0]
    assert "prefix" in errors[0]


async def test_one_empty_prefix_is_fine(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("a", prefix="") + backend("b"))
    async with running(cfg) as gw, gw.connect() as c:
        names = await tool_names(c)
        assert {"echo", "b__echo"} <= names
        tag = nonce()
        assert text_of(await c.call("echo", {"message": tag})) == tag
        assert text_of(await c.call("b__echo", {"message": tag})) == tag
        assert len(sent(gw.link("a"), "tools/call")) == 1  # each reached its own backend
        assert len(sent(gw.link("b"), "tools/call")) == 1


# ---- list_changed ---------------------------------------------------------------------------


async def test_list_changed_reaches_every_initialized_client_once(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    async with running(cfg) as gw, AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(gw.connect()) for _ in range(3)]
        uninit = await stack.enter_async_context(gw.connect(initialize=False))
        a = clients[0]
        assert "fx__extra_tool" not in await tool_names(a)
        assert text_of(await a.call("fx__notify_list_changed", {"kind": "tools"})) == "ok"
        for c in clients:
            await c.wait_for(lambda c=c: notes(c, "notifications/tools/list_changed"))
        await settle()
        for c in clients:
            assert len(notes(c, "notifications/tools/list_changed")) == 1
            assert notes(c, "notifications/prompts/list_changed") == []
            assert notes(c, "notifications/resources/list_changed") == []
            assert "fx__extra_tool" in await tool_names(c)
        assert uninit.received == []
        assert text_of(await clients[1].call("fx__extra_tool")) == "extra"

        # prompts and resources too, each exactly once
        assert text_of(await a.call("fx__notify_list_changed", {"kind": "prompts"})) == "ok"
        assert text_of(await a.call("fx__notify_list_changed", {"kind": "resources"})) == "ok"
        for c in clients:
            await c.wait_for(lambda c=c: (notes(c, "notifications/prompts/list_changed")
                                          and notes(c, "notifications/resources/list_changed")))
        await settle()
        for c in clients:
            assert len(notes(c, "notifications/tools/list_changed")) == 1
            assert len(notes(c, "notifications/prompts/list_changed")) == 1
            assert len(notes(c, "notifications/resources/list_changed")) == 1
        prompts = {p["name"] for p in (await a.request("prompts/list"))["result"]["prompts"]}
        assert "fx__extra_prompt" in prompts
        uris = {r["uri"] for r in (await a.request("resources/list"))["result"]["resources"]}
        assert "fixture://extra" in uris
        assert uninit.received == []

        # toggled back off: the tool is gone, one more list_changed
        assert text_of(await a.call("fx__notify_list_changed", {"kind": "tools"})) == "ok"
        for c in clients:
            await c.wait_for(lambda c=c: len(notes(c, "notifications/tools/list_changed")) == 2)
        assert "fx__extra_tool" not in await tool_names(a)
        r = await a.call("fx__extra_tool")
        assert r["error"]["code"] == -32602


async def test_restart_with_unchanged_lists_sends_no_list_changed(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", restart=RESTART))
    async with running(cfg) as gw, gw.connect() as a, gw.connect() as b:
        before = await tool_names(a)
        pid = (await client_info(a))["pid"]
        r = await a.call("fx__crash", {})
        assert r["error"]["code"] == -32004
        tag = nonce()
        r = await b.call("fx__echo", {"message": tag})  # waits out the backoff (restart_wait)
        assert text_of(r) == tag
        assert (await client_info(a))["pid"] != pid
        assert gw.instance("fx")["restarts"] == 1
        await settle()
        for c in (a, b):
            assert [m for m in c.notifications if m["method"].endswith("/list_changed")] == []
        assert await tool_names(b) == before


async def test_restart_with_changed_lists_sends_list_changed(autojump_clock: Clock) -> None:
    """The counterpart: the extra tool was on, the restarted child lists without it."""
    cfg = memory_config(backend("fx", restart=RESTART))
    async with running(cfg) as gw, gw.connect() as a:
        await a.call("fx__notify_list_changed", {"kind": "tools"})
        await a.wait_for(lambda: notes(a, "notifications/tools/list_changed"))
        assert "fx__extra_tool" in await tool_names(a)
        assert (await a.call("fx__crash", {}))["error"]["code"] == -32004
        await a.wait_for(lambda: len(notes(a, "notifications/tools/list_changed")) == 2)
        assert "fx__extra_tool" not in await tool_names(a)
        await settle()
        assert len(notes(a, "notifications/tools/list_changed")) == 2
        assert notes(a, "notifications/prompts/list_changed") == []


async def test_boot_merges_every_backends_first_lists_once(autojump_clock: Clock) -> None:
    # one merge at boot, not one per backend (that would cost backends x tools to start)
    cfg = memory_config(backend("a") + backend("b") + backend("c"))
    async with running(cfg) as gw, gw.connect() as c:
        assert {"a__echo", "b__echo", "c__echo"} <= await tool_names(c)
        for kind in ("tools", "prompts", "resources"):
            assert gw.metric("mcp_gateway_catalog_changes_total", kind=kind) == 1, kind
        await c.call("b__notify_list_changed", {"kind": "tools"})  # after boot: rebuilt
        await c.wait_for(lambda: notes(c, "notifications/tools/list_changed"))
        assert "b__extra_tool" in await tool_names(c)
        assert gw.metric("mcp_gateway_catalog_changes_total", kind="tools") == 2


# ---- prompts, completion, resources -------------------------------------------------------


async def test_prompts_completion_and_resources_are_routed(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    async with running(cfg) as gw, gw.connect() as c:
        tag = nonce()
        r = await c.request("prompts/get", {"name": "fx__greet", "arguments": {"name": tag}})
        assert r["result"]["messages"][0]["content"]["text"] == f"Hello, {tag}!"
        r = await c.request("prompts/get", {"name": "fx__plain"})
        assert r["result"]["messages"][0]["content"]["text"] == "This is a plain prompt."
        r = await c.request("prompts/get", {"name": "fx__nope"})
        assert r["error"]["code"] == -32602
        r = await c.request("prompts/get", {"name": "fx__greet", "arguments": {}})
        assert r["error"]["code"] == -32602  # the backend's own error, passed through
        assert [m["params"]["name"] for m in sent(gw.link("fx"), "prompts/get")] == [
            "greet", "plain", "greet"]  # fx__nope never reached it

        r = await complete(c, {"type": "ref/prompt", "name": "fx__greet"}, "name", "A")
        assert r["result"]["completion"]["values"] == ["Alice"]
        r = await complete(c, {"type": "ref/prompt", "name": "fx__greet"}, "name", "")
        assert r["result"]["completion"]["values"] == ["Alice", "Bob"]
        r = await complete(c, {"type": "ref/resource", "uri": "fixture://item/{id}"}, "id", "")
        assert r["result"]["completion"]["values"] == ["1", "2", "3"]
        r = await complete(c, {"type": "ref/resource", "uri": "fixture://item/{id}"}, "id", "2")
        assert r["result"]["completion"]["values"] == ["2"]
        r = await complete(c, {"type": "ref/prompt", "name": "greet"}, "name", "")
        assert r["error"]["code"] == -32602  # the unprefixed name is not a gateway name

        templates = (await c.request("resources/templates/list"))["result"]["resourceTemplates"]
        assert [t["uriTemplate"] for t in templates] == ["fixture://item/{id}"]
        uris = {res["uri"] for res in (await c.request("resources/list"))["result"]["resources"]}
        assert uris == {"fixture://static/a", "fixture://static/b"}
        r = await c.request("resources/read", {"uri": "fixture://static/a"})
        assert r["result"]["contents"] == [{"uri": "fixture://static/a", "mimeType": "text/plain",
                                            "text": "content of fixture://static/a"}]
        r = await c.request("resources/read", {"uri": "fixture://item/7"})
        assert r["result"]["contents"][0]["text"] == "item 7"
        r = await c.request("resources/read", {"uri": f"fixture://item/{tag}"})
        assert r["result"]["contents"][0]["text"] == f"item {tag}"
        for uri in ("fixture://nope", "other://thing"):
            r = await c.request("resources/read", {"uri": uri})
            assert r["error"]["code"] == -32002, (uri, r)


async def test_unknown_resource_with_two_resource_backends(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("a") + backend("b"))
    async with running(cfg) as gw, gw.connect() as c:
        r = await c.request("resources/read", {"uri": "nowhere://x"})
        assert r["error"]["code"] == -32002
        r = await c.request("resources/read", {"uri": "fixture://static/b"})
        assert r["result"]["contents"][0]["text"] == "content of fixture://static/b"


# ---- subscriptions --------------------------------------------------------------------------


async def test_resource_subscriptions_are_refcounted(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    uri = "fixture://static/a"
    updated = "notifications/resources/updated"
    async with running(cfg) as gw, gw.connect() as a, gw.connect() as b, gw.connect() as c:
        link = gw.link("fx")

        def upstream(method: str) -> list[str]:
            return [m["params"]["uri"] for m in sent(link, method)]

        async def child_subscriptions() -> list[str]:
            subscriptions: list[str] = (await client_info(c))["subscriptions"]
            return subscriptions

        assert await child_subscriptions() == []
        for s in (a, b):
            r = await s.request("resources/subscribe", {"uri": uri})
            assert r["result"] == {}, r
        assert await child_subscriptions() == [uri]
        assert upstream("resources/subscribe") == [uri]  # one upstream subscription

        assert text_of(await c.call("fx__update_resource", {"uri": uri})) == "ok"
        for s in (a, b):
            got = await s.wait_for(lambda s=s: notes(s, updated))
            assert got == [{"jsonrpc": "2.0", "method": updated, "params": {"uri": uri}}]
        # an update of another resource reaches nobody
        assert text_of(await c.call("fx__update_resource", {"uri": "fixture://static/b"})) == "ok"
        await settle()
        assert notes(c, updated) == []
        assert len(notes(a, updated)) == 1 and len(notes(b, updated)) == 1

        r = await a.request("resources/unsubscribe", {"uri": uri})
        assert r["result"] == {}
        assert await child_subscriptions() == [uri]  # b still holds it
        assert upstream("resources/unsubscribe") == []
        assert text_of(await c.call("fx__update_resource", {"uri": uri})) == "ok"
        await b.wait_for(lambda: len(notes(b, updated)) == 2)
        await settle()
        assert len(notes(a, updated)) == 1
        assert notes(c, updated) == []

        r = await b.request("resources/unsubscribe", {"uri": uri})
        assert r["result"] == {}
        assert await child_subscriptions() == []
        assert upstream("resources/subscribe") == [uri]
        assert upstream("resources/unsubscribe") == [uri]
        assert text_of(await c.call("fx__update_resource", {"uri": uri})) == "ok"
        await settle()
        assert len(notes(a, updated)) == 1 and len(notes(b, updated)) == 2
        assert notes(c, updated) == []


async def test_subscription_dropped_when_its_connection_closes(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    uri = "fixture://static/b"
    async with running(cfg) as gw, gw.connect() as c:
        async with gw.connect() as a:
            assert (await a.request("resources/subscribe", {"uri": uri}))["result"] == {}
            assert (await client_info(c))["subscriptions"] == [uri]
        await settle()  # the close, and all it causes, is done
        assert (await client_info(c))["subscriptions"] == []


async def test_subscriptions_are_restored_after_a_restart(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", restart=RESTART))
    uri = "fixture://static/a"
    async with running(cfg) as gw, gw.connect() as a:
        assert (await a.request("resources/subscribe", {"uri": uri}))["result"] == {}
        first = gw.link("fx")
        assert (await a.call("fx__crash", {}))["error"]["code"] == -32004
        await gw.until(lambda: gw.instance("fx")["state"] == "RUNNING"
                       and gw.instance("fx")["restarts"] == 1)
        assert gw.link("fx") is not first
        info = await client_info(a)
        assert info["subscriptions"] == [uri]
        await a.call("fx__update_resource", {"uri": uri})
        await a.wait_for(lambda: notes(a, "notifications/resources/updated"))


# ---- logging --------------------------------------------------------------------------------


async def test_log_level_is_per_connection(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    async with running(cfg) as gw, gw.connect() as a, gw.connect() as b, gw.connect() as c:
        assert (await a.request("logging/setLevel", {"level": "debug"}))["result"] == {}
        assert (await b.request("logging/setLevel", {"level": "error"}))["result"] == {}
        r = await c.request("logging/setLevel", {"level": "loud"})
        assert r["error"]["code"] == -32602
        # the child is asked for the most verbose level any connection wants
        await settle()
        assert (await client_info(c))["logLevel"] == "debug"

        # lines written with no call in flight go to every connection that asked for
        # their level (one written during a call goes to its caller only: test_log_routing)
        tag = nonce()
        assert text_of(await c.call("fx__log", {"level": "info", "data": {"n": tag},
                                                "after": 0.05})) == "ok"
        msg = await a.wait_for(lambda: notes(a, "notifications/message"))
        assert msg == [{"jsonrpc": "2.0", "method": "notifications/message",
                        "params": {"level": "info", "logger": "fixture", "data": {"n": tag}}}]
        await settle()
        assert notes(b, "notifications/message") == []
        assert notes(c, "notifications/message") == []  # never asked for logs

        assert text_of(await c.call("fx__log", {"level": "critical", "data": f"crit-{tag}",
                                                "after": 0.05})) == "ok"
        await b.wait_for(lambda: notes(b, "notifications/message"))
        await a.wait_for(lambda: len(notes(a, "notifications/message")) == 2)
        assert [m["params"]["data"] for m in notes(b, "notifications/message")] == [f"crit-{tag}"]
        assert [m["params"]["data"] for m in notes(a, "notifications/message")] == [
            {"n": tag}, f"crit-{tag}"]
        await settle()
        assert notes(c, "notifications/message") == []
