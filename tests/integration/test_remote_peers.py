"""Peers as remote backends: another mcp-gateway (a chain: the outer gateway reaches the inner
one's ``/mcp`` with a token read from a file, never with its own caller's token; a call, its
progress and the inner child's elicitation cross both gateways to the one caller that owns
the call) and a FastMCP Streamable HTTP server."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import trio
from helpers import (
    DEPS,
    ROOT,
    bearer_auth,
    connect,
    fixture_backend,
    free_port,
    listening_process,
    make_config,
    need_deps,
    run_gateway,
    text_of,
)

from gateway import events

pytestmark = pytest.mark.system

INNER_TOKEN = "inner-token-for-the-outer-gateway"
OUTER_TOKENS = {"alice": "alice-token-outer", "bob": "bob-token-outer"}
ELICIT = {"elicitation": {"form": {}}}
FASTMCP = os.path.join(DEPS, "venv-fastmcp", "bin", "python")
FASTMCP_SERVER = os.path.join(ROOT, "tests", "fixtures", "fastmcp_http.py")


async def test_a_gateway_behind_a_gateway_serves_calls_progress_and_owned_elicitation(
        tmp_path: Path) -> None:
    token_file = tmp_path / "inner.token"
    token_file.write_text(INNER_TOKEN + "\n")
    inner_cfg = make_config(fixture_backend("fx"), extra=bearer_auth({"outer": INNER_TOKEN}))
    with trio.fail_after(30):
        async with run_gateway(inner_cfg) as inner:
            outer_cfg = make_config(
                f'[backends.in]\nurl = "{inner.http_url}"\nstart_timeout = 10.0\n'
                'headers = { Authorization = { file = "%s", prefix = "Bearer " } }\n' % token_file,
                extra=bearer_auth(OUTER_TOKENS))
            async with run_gateway(outer_cfg) as outer, \
                    connect(outer.url, token=OUTER_TOKENS["alice"], capabilities=ELICIT) as alice, \
                    connect(outer.url, token=OUTER_TOKENS["bob"], capabilities=ELICIT) as bob:
                tools = {t["name"] for t in (await alice.request("tools/list"))["result"]["tools"]}
                assert {"in__fx__echo", "in__fx__progress", "in__fx__elicit"} <= tools, tools
                assert text_of(await alice.call("in__fx__echo", {"message": "hop"})) == "hop"

                r = await alice.request("tools/call", {
                    "name": "in__fx__progress", "arguments": {"steps": 3},
                    "_meta": {"progressToken": "p"}})
                assert "result" in r, r
                progress = [n["params"] for n in alice.notifications
                            if n["method"] == "notifications/progress"]
                assert [(p["progressToken"], p["progress"]) for p in progress] == [
                    ("p", 1), ("p", 2), ("p", 3)]

                await alice.send({"jsonrpc": "2.0", "id": "e", "method": "tools/call", "params": {
                    "name": "in__fx__elicit", "arguments": {"message": "go?", "nonce": "n1"}}})
                (asked,) = await alice.wait_for(lambda: alice.requests)
                assert asked["method"] == "elicitation/create"
                assert asked["params"]["message"] == "go?"
                assert asked["params"]["_meta"]["fixture/nonce"] == "n1", asked
                await alice.send({"jsonrpc": "2.0", "id": asked["id"],
                                  "result": {"action": "accept", "content": {"answer": "yes"}}})
                got = json.loads(text_of(await alice.response("e")))
                assert (got["action"], got["content"], got["nonce"]) == (
                    "accept", {"answer": "yes"}, "n1")

                # the inner gateway saw the outer one's principal, never a caller's token
                served = [e for e in inner.events.of(events.RequestFinished)
                          if e.tool == "fx__elicit"]
                assert served and {e.principal for e in served} == {"outer"}, served
                assert bob.requests == [] and bob.notifications == []


async def test_a_fastmcp_http_server_behind_the_gateway() -> None:
    need_deps(FASTMCP)
    port = free_port()
    cfg = make_config(f'[backends.fm]\nurl = "http://127.0.0.1:{port}/mcp"\nstart_timeout = 10.0\n')
    with trio.fail_after(60):
        async with listening_process([FASTMCP, FASTMCP_SERVER, str(port)], port), \
                run_gateway(cfg) as gw, connect(gw.url) as c:
            tools = {t["name"] for t in (await c.request("tools/list"))["result"]["tools"]}
            assert {"fm__echo", "fm__count"} <= tools, tools
            assert text_of(await c.call("fm__echo", {"message": "via fastmcp"})) == "via fastmcp"
            r = await c.request("tools/call", {"name": "fm__count", "arguments": {"steps": 3},
                                               "_meta": {"progressToken": 7}})
            assert text_of(r) == "counted 3", r
            progress = [n["params"] for n in c.notifications
                        if n["method"] == "notifications/progress"]
            assert [(p["progressToken"], p["progress"]) for p in progress] == [
                (7, 1), (7, 2), (7, 3)], progress


async def test_a_remote_that_never_answers_delays_neither_the_start_nor_other_backends() -> None:
    """A remote that accepts connections and reads requests but never answers: the gateway is
    ready and serves the stdio backend at once, the remote is still starting, and the stop does
    not wait on it (it has no session yet: nothing to DELETE)."""
    held: list[trio.SocketStream] = []

    async def swallow(stream: trio.SocketStream) -> None:
        held.append(stream)
        while await stream.receive_some(65536):
            pass  # read everything, answer nothing

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, swallow, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        cfg = make_config(fixture_backend("fx") + f'[backends.mute]\nurl = "http://127.0.0.1:'
                          f'{port}/mcp"\nstart_timeout = 10.0\n')
        with trio.fail_after(5):  # ready long before the mute remote's start_timeout is out
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                assert text_of(await c.call("fx__echo", {"message": "not held up"})) == \
                    "not held up"
                status = await gw.status_until(lambda st: any(
                    b["name"] == "mute" and b["instances"][0]["state"] == "STARTING"
                    for b in st["backends"]))
                assert held  # the mute remote did get the initialize
            stopped = trio.current_time()
        assert trio.current_time() - stopped < 1.5, "the stop waited on the mute remote"
        assert [b["instances"][0]["origin"] for b in status["backends"]
                if b["name"] == "mute"] == [f"http://127.0.0.1:{port}"]
        nursery.cancel_scope.cancel()
