"""Remote backends in the 2026-07-28 shape, with real parts: a server on the official Python SDK
(mcp 2.3, its stateless modern HTTP entry) behind the gateway (catalog, calls, the headers it
got, x-mcp-header arguments mirrored and an invalid mark dropped, an input request answered by
the gateway's client, a list change through subscriptions/listen, a cancelled call's stream
closed), and ``prefer_modern`` probing a modern and a legacy remote."""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from fixtures.remote_server import RemoteServer
from helpers import (
    DEPS,
    ROOT,
    connect,
    free_port,
    http_json,
    listening_process,
    make_config,
    poll,
    run_gateway,
    text_of,
    wait_instance,
)

pytestmark = pytest.mark.system

PY2 = os.path.join(DEPS, "venv-mcp2", "bin", "python")
SERVER = os.path.join(ROOT, "tests", "fixtures", "modern_remote_server.py")
V = "2026-07-28"


@asynccontextmanager
async def sdk_server(port: int, record: str) -> AsyncIterator[trio.Process]:
    """The SDK 2.3 fixture on 127.0.0.1:``port``, recording each request into ``record``."""
    assert os.path.exists(PY2), "missing .deps/venv-mcp2: run scripts/setup --test"  # noqa: ASYNC240 - a local path
    async with listening_process([PY2, SERVER, str(port), record], port) as proc:
        yield proc


def remote(name: str, port: int, mode: str, **extra: str) -> str:
    lines = [f"[backends.{name}]", f'url = "http://127.0.0.1:{port}/mcp"',
             f'protocol_mode = "{mode}"', 'start_timeout = 10.0',
             *(f"{k} = {v}" for k, v in extra.items())]
    return "\n".join(lines) + "\n"


def recorded(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        out = []
        for line in f:
            seen = json.loads(line)
            seen["headers"] = {k: v for k, v in seen["headers"]}
            out.append(seen)
        return out


async def test_a_modern_remote_behind_the_gateway(tmp_path: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    port, record = free_port(), str(tmp_path / "seen.jsonl")
    caplog.set_level(logging.INFO)
    with trio.fail_after(60):
        async with sdk_server(port, record), run_gateway(
                make_config(remote("rm", port, "modern_only", cancel_grace="0.5"))) as gw:
            st = await http_json(gw.bound.admin_port, "/status")
            inst = st["backends"][0]["instances"][0]
            assert (inst["state"], inst["era"]) == ("RUNNING", "modern")
            async with connect(gw.url, capabilities={"elicitation": {}}) as c:
                tools = {t["name"] for t in (await c.request("tools/list"))["result"]["tools"]}
                assert {"rm__echo", "rm__where", "rm__ask_name", "rm__add_tool"} <= tools
                assert "rm__bad_mark" not in tools  # x-mcp-header on a number: dropped
                assert any("dropping tool 'bad_mark'" in r.getMessage() and "number" in
                           r.getMessage() for r in caplog.records)
                assert text_of(await c.call("rm__echo", {"message": "hi"})) == "hi"
                # the server checks Mcp-Param-* against the body (-32020 when one is missing or
                # wrong) and answers what it got: plain ASCII as is, the rest base64
                got = json.loads(text_of(await c.call("rm__where", {
                    "region": "Zürich ", "priority": 7, "note": "not mirrored"})))
                assert got == {"mcp-param-region": "=?base64?"
                               + base64.b64encode("Zürich ".encode()).decode() + "?=",
                               "mcp-param-priority": "7"}
                got = json.loads(text_of(await c.call("rm__where", {"region": "eu-west 1"})))
                assert got == {"mcp-param-region": "eu-west 1"}

                # the remote's InputRequiredResult: its elicitation asked of this client (the
                # legacy way), the answer sent back in the retry
                async with trio.open_nursery() as n:
                    async def answer() -> None:
                        q = await c.wait_for(lambda: c.requests and c.requests[0], 20)
                        assert q["method"] == "elicitation/create"
                        assert q["params"]["message"] == "Your name?"
                        await c.send({"jsonrpc": "2.0", "id": q["id"], "result": {
                            "action": "accept", "content": {"name": "Ada"}}})
                    n.start_soon(answer)
                    assert text_of(await c.call("rm__ask_name", timeout=20)) == "Hello, Ada"

                # a list change reaches the client through the gateway's subscriptions/listen
                await c.call("rm__add_tool")
                await c.wait_for(lambda: any(
                    x["method"] == "notifications/tools/list_changed" for x in c.notifications),
                    20)
                tools = {t["name"] for t in (await c.request("tools/list"))["result"]["tools"]}
                assert "rm__added" in tools

                # a resource update: the listen opened again with the URI in its filter
                assert (await c.request("resources/subscribe", {"uri": "memo://a"}))["result"] == {}
                updated = "notifications/resources/updated"

                async def touched() -> bool:  # the new listen may not be open yet: touch again
                    await c.call("rm__touch", {"uri": "memo://a"})
                    with trio.move_on_after(0.5):
                        await c.wait_for(lambda: any(x["method"] == updated
                                                     for x in c.notifications), 1)
                        return True
                    return False

                await poll(touched)
                note = next(x for x in c.notifications if x["method"] == updated)
                assert note["params"]["uri"] == "memo://a"
                text = (await c.request("resources/read", {"uri": "memo://a"}))["result"]
                assert text["contents"][0]["text"] == "memo"

                # a cancelled call: its stream is closed (no notifications/cancelled is POSTed),
                # the call leaves the attribution set at once (so no recycle after cancel_grace:
                # only an abandoned call still in the set causes one)
                await c.send({"jsonrpc": "2.0", "id": "gone", "method": "tools/call",
                              "params": {"name": "rm__slow", "arguments": {}}})
                await poll(lambda: trio.to_thread.run_sync(lambda: any(
                    s["headers"].get("mcp-name") == "slow" for s in recorded(record))))
                await c.notify("notifications/cancelled", {"requestId": "gone"})
                # in flight: only the gateway's own subscriptions/listen
                await wait_instance(gw.bound.admin_port, lambda i: i["inflight"] == 1, 5)
                inst = await wait_instance(gw.bound.admin_port, lambda i: True)
                assert (inst["state"], inst["restarts"], inst["recycles"]) == ("RUNNING", 0, 0)
    seen = recorded(record)
    assert {s["method"] for s in seen} == {"POST"}  # no GET stream, no DELETE
    assert not [s for s in seen if "mcp-method" not in s["headers"]]  # no notification POSTed
    posts = [s["headers"] for s in seen]
    assert all("mcp-session-id" not in h for h in posts)
    assert all(h["mcp-protocol-version"] == V for h in posts)
    methods = [h["mcp-method"] for h in posts]
    assert methods[0] == "server/discover" and "initialize" not in methods
    assert methods.count("subscriptions/listen") >= 2  # opened again with the resource filter
    calls = [h for h in posts if h["mcp-method"] == "tools/call"]
    assert [h["mcp-name"] for h in calls][:2] == ["echo", "where"]
    assert [h["mcp-name"] for h in calls].count("ask_name") == 2  # the call and its retry


async def test_the_listen_has_its_own_slot_and_is_opened_again_when_the_remote_ends_it(
        tmp_path: Any) -> None:
    port, record = free_port(), str(tmp_path / "seen.jsonl")

    def count(name: str) -> int:
        return sum(1 for s in recorded(record) if name in (s["headers"].get("mcp-name"),
                                                           s["headers"].get("mcp-method")))

    async def counted(name: str, want: int) -> bool:
        return await trio.to_thread.run_sync(count, name) >= want

    with trio.fail_after(60):
        async with sdk_server(port, record), run_gateway(make_config(remote(
                "rm", port, "modern_only", cancel_grace="0.5"))) as gw, connect(gw.url) as c:
            # all 12 calls' streams at once reach the remote beside the open listen
            for i in range(12):
                await c.send({"jsonrpc": "2.0", "id": f"s{i}", "method": "tools/call",
                              "params": {"name": "rm__slow", "arguments": {}}})
            await poll(lambda: counted("slow", 12))
            for i in range(12):
                await c.notify("notifications/cancelled", {"requestId": f"s{i}"})
            await wait_instance(gw.bound.admin_port, lambda i: i["inflight"] == 1, 10)
            assert count("subscriptions/listen") == 1
            # the remote ends the listen: the gateway opens it again and fetches the lists again
            lists = count("tools/list")
            assert text_of(await c.call("rm__end_listens")) == "ended"
            await poll(lambda: counted("subscriptions/listen", 2))
            await poll(lambda: counted("tools/list", lists + 1))
            await c.call("rm__add_tool")
            await c.wait_for(lambda: any(
                x["method"] == "notifications/tools/list_changed" for x in c.notifications), 20)


async def test_prefer_modern_probes_a_remote_and_falls_back_to_initialize(tmp_path: Any) -> None:
    port, record = free_port(), str(tmp_path / "seen.jsonl")
    legacy = RemoteServer()
    with trio.fail_after(60):
        async with sdk_server(port, record), trio.open_nursery() as nursery:
            await nursery.start(legacy.serve)
            cfg = make_config(remote("new", port, "prefer_modern")
                              + remote("old", legacy.port, "prefer_modern"))
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                st = await http_json(gw.bound.admin_port, "/status")
                eras = {b["name"]: b["instances"][0]["era"] for b in st["backends"]}
                assert eras == {"new": "modern", "old": "legacy"}
                assert text_of(await c.call("new__echo", {"message": "m"})) == "m"
                assert text_of(await c.call("old__echo", {"n": 1})) == '{"n": 1}'
            nursery.cancel_scope.cancel()
    # the legacy remote refused the probe (404, no JSON-RPC body) and was then initialized
    methods = [s.body.get("method") if s.body else s.method for s in legacy.seen]
    assert methods[:2] == ["server/discover", "initialize"] and "GET" in methods
    assert legacy.seen[0].headers["mcp-method"] == "server/discover"
    assert "mcp-method" not in legacy.seen[1].headers
    assert recorded(record)[0]["headers"]["mcp-method"] == "server/discover"
