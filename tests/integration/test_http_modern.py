"""Streamable HTTP at /mcp, modern shape (2026-07-28): stateless POSTs checked at the
edge, served by a flow of their own, cancelled by closing the response stream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import (
    TIME_SERVER,
    fixture_backend,
    http_json,
    make_config,
    run_gateway,
    wait_status,
)

from gateway import events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

V = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": V,
        "io.modelcontextprotocol/clientCapabilities": {}}


def post(method: str, params: dict[str, Any], *, id: int | str = 1,
         **headers: str) -> dict[str, Any]:
    h = {"accept": "application/json, text/event-stream", "content-type": "application/json",
         "mcp-protocol-version": V, "mcp-method": method}
    if method == "tools/call":
        h["mcp-name"] = params["name"]
    h.update(headers)
    return {"headers": h, "json": {"jsonrpc": "2.0", "id": id, "method": method,
                                   "params": {**params, "_meta": META}}}


async def test_a_stateless_call_with_its_headers_checked_and_no_session() -> None:
    async with run_gateway(make_config(fixture_backend("fx"))) as gw, httpx.AsyncClient() as c:
        r = await c.post(gw.http_url,
                         **post("tools/call", {"name": "fx__echo", "arguments": {"message": "m"}}))
        assert r.status_code == 200 and "mcp-session-id" not in r.headers
        body = r.json()
        assert body["result"]["resultType"] == "complete"
        assert body["result"]["content"][0]["text"] == "m"
        args = post("tools/call", {"name": "fx__progress", "arguments": {"steps": 2}})
        args["json"]["params"]["_meta"] = {**META, "progressToken": "t"}
        r = await c.post(gw.http_url, **args)  # streamed: progress, then the result; no event ids
        assert r.headers["content-type"] == "text/event-stream" and "id:" not in r.text, r.text
        assert [json.loads(line[6:]).get("method") for line in r.text.splitlines()
                if line.startswith("data: ")] == ["notifications/progress"] * 2 + [None], r.text
        r = await c.post(gw.http_url,
                         **post("tools/call", {"name": "fx__echo", "arguments": {"message": "m"}},
                                **{"mcp-name": "fx__other"}))
        assert r.status_code == 400 and r.json()["error"]["code"] == -32020
        r = await c.post(gw.http_url, **post("tools/list", {}, **{"mcp-method": "prompts/list"}))
        assert r.status_code == 400 and r.json()["error"]["code"] == -32020
        r = await c.post(gw.http_url, **post("ping", {}))  # removed in 2026-07-28
        assert r.status_code == 404 and r.json()["error"]["code"] == -32601
        args = post("tools/list", {})
        args["json"]["params"]["_meta"] = {**META,
                                           "io.modelcontextprotocol/protocolVersion": "2099-01-01"}
        r = await c.post(gw.http_url,
                         headers=dict(args["headers"], **{"mcp-protocol-version": "2099-01-01"}),
                         json=args["json"])
        assert r.status_code == 400 and r.json()["error"]["code"] == -32022
        r = await c.get(gw.http_url,
                        headers={"accept": "text/event-stream", "mcp-protocol-version": V})
        assert r.status_code == 405
        st = await http_json(gw.bound.admin_port, "/status")
        assert st["connections"].get("http", 0) == 0  # every flow ended with its request


async def test_a_stateless_flow_ends_with_its_answer_on_an_idle_kept_alive_connection() -> None:
    """Its POST's task waits for the client's next request, not for the answer: the flow ends
    in the task that answered it, not when the client next speaks (or the keep-alive time)."""
    async with run_gateway(make_config(fixture_backend("fx"))) as gw, httpx.AsyncClient() as c:
        for n in range(3):
            r = await c.post(gw.http_url, **post("tools/call", {
                "name": "fx__echo", "arguments": {"message": f"m{n}"}}, id=n))
            assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == f"m{n}"
            with trio.fail_after(5):  # far less than the 15 s keep-alive time
                await wait_status(gw.bound.admin_port,
                                  lambda st: st["connections"].get("http", 0) == 0
                                  and st["client_requests_in_flight"] == 0)


async def test_closing_the_response_stream_cancels_the_call() -> None:
    async with run_gateway(make_config(fixture_backend("fx"))) as gw:
        port = gw.bound.admin_port
        async with httpx.AsyncClient() as c:
            with trio.move_on_after(1.0):  # the client gives up: its connection closes
                await c.post(gw.http_url, **post("tools/call", {"name": "fx__sleep",
                                                                "arguments": {"seconds": 30}}))
        # the call was cancelled (no answer, the child told), not left to run its 30 s
        await gw.events.wait(events.RequestFinished, backend="fx", method="tools/call",
                             outcome=events.RequestOutcome.CANCELLED, principal="_none")
        with trio.fail_after(10):
            await wait_status(port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)


async def test_a_dual_era_child_gets_no_modern_envelope_from_a_modern_client() -> None:
    """mcp-server-time (Python SDK 2.x) speaks both eras and refuses a 2026-07-28 envelope on
    the legacy session the gateway opened with it: the client's envelope must not reach it."""
    backend = f"[backends.time]\ncommand = {json.dumps(TIME_SERVER)}\n"
    async with run_gateway(make_config(backend)) as gw, httpx.AsyncClient() as c:
        args = post("tools/call",
                    {"name": "time__get_current_time", "arguments": {"timezone": "UTC"},
                                   "_meta": {"progressToken": "p1"}})
        args["json"]["params"]["_meta"] = {**META, "progressToken": "p1"}  # other keys pass on
        with trio.fail_after(20):
            r = await c.post(gw.http_url, **args)
        assert r.status_code == 200, r.text
        body = r.json() if r.headers["content-type"].startswith("application/json") else [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")][-1]
        assert "error" not in body, body
        assert (body["result"]["resultType"] == "complete"
                and "UTC" in body["result"]["content"][0]["text"])


async def _events(response: httpx.Response) -> Any:
    """The JSON messages of an SSE response, as they arrive."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


async def test_subscriptions_listen_streams_tagged_notifications_until_the_client_closes() -> None:
    """subscriptions/listen: acknowledged first, then only the kinds asked for, each tagged with
    the listen's id; closing the stream ends it and releases its upstream subscription."""
    uri = "fixture://static/a"
    tag = "io.modelcontextprotocol/subscriptionId"
    async with (run_gateway(make_config(fixture_backend("fx"))) as gw,
                httpx.AsyncClient(timeout=30) as c):

        async def upstream_subscriptions() -> list[str]:
            r = await c.post(gw.http_url,
                             **post("tools/call", {"name": "fx__client_info", "arguments": {}}))
            return json.loads(r.json()["result"]["content"][0]["text"])["subscriptions"]

        async def call(tool: str, **arguments: Any) -> None:
            r = await c.post(gw.http_url,
                             **post("tools/call", {"name": tool, "arguments": arguments}))
            assert r.json()["result"]["resultType"] == "complete", r.text

        tools = post("subscriptions/listen", {"notifications": {
            "toolsListChanged": True, "resourceSubscriptions": [uri]}}, id="L1")
        prompts = post("subscriptions/listen", {"notifications": {"promptsListChanged": True}},
                       id=7)
        with trio.fail_after(20):
            async with c.stream("POST", gw.http_url, **tools) as r1, \
                    c.stream("POST", gw.http_url, **prompts) as r2:
                assert r1.status_code == 200 and r1.headers["content-type"] == "text/event-stream"
                e1, e2 = _events(r1), _events(r2)
                ack = await anext(e1)
                assert ack["method"] == "notifications/subscriptions/acknowledged"
                assert ack["params"]["notifications"] == {"toolsListChanged": True,
                                                          "resourceSubscriptions": [uri]}
                assert ack["params"]["_meta"] == {tag: "L1"}
                ack = await anext(e2)
                assert ack["params"] == {"notifications": {"promptsListChanged": True},
                                         "_meta": {tag: 7}}
                assert await upstream_subscriptions() == [uri]

                await call("fx__notify_list_changed", kind="tools")
                got = await anext(e1)
                assert got == {"jsonrpc": "2.0", "method": "notifications/tools/list_changed",
                               "params": {"_meta": {tag: "L1"}}}
                # every listen was handed that change at once: the prompts-only one got none
                await call("fx__notify_list_changed", kind="prompts")
                got = await anext(e2)
                assert got["method"] == "notifications/prompts/list_changed"
                assert got["params"]["_meta"] == {tag: 7}
                await call("fx__update_resource", uri=uri + "/part")  # a sub-resource
                got = await anext(e1)
                assert got["method"] == "notifications/resources/updated"
                assert got["params"] == {"uri": uri + "/part", "_meta": {tag: "L1"}}
            # both streams closed by the client: the listens end, the subscription is released
            await wait_status(gw.bound.admin_port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
            # idle again: the unsubscribe went to the child, which reads it before the next call
            await trio.testing.wait_all_tasks_blocked()
            assert await upstream_subscriptions() == []


async def test_a_modern_request_gets_log_messages_only_at_the_level_it_asked_for() -> None:
    """2026-07-28: ``_meta`` logLevel per request; none asked, none sent; only on that request's
    stream (the other flow calling the same child gets nothing)."""
    async with run_gateway(make_config(fixture_backend("fx"))) as gw, httpx.AsyncClient() as c:
        async def messages(level: str | None, log: str) -> list[dict[str, Any]]:
            args = post("tools/call",
                        {"name": "fx__log", "arguments": {"level": log, "data": "hi"}})
            if level is not None:
                args["json"]["params"]["_meta"] = {**META,
                                                   "io.modelcontextprotocol/logLevel": level}
            with trio.fail_after(10):
                r = await c.post(gw.http_url, **args)
            assert r.status_code == 200, r.text
            if r.headers["content-type"].startswith("application/json"):
                return [r.json()]
            return [json.loads(line[6:]) for line in r.text.splitlines()
                    if line.startswith("data: ")]

        got = await messages("info", "warning")
        assert [m.get("method") for m in got] == ["notifications/message", None]
        assert got[0]["params"]["data"] == "hi" and got[-1]["result"]["resultType"] == "complete"
        assert [m.get("method") for m in await messages("error", "warning")] == [None]  # below it
        assert [m.get("method") for m in await messages(None, "emergency")] == [None]  # none asked
        args = post("tools/call", {"name": "fx__echo", "arguments": {"message": "m"}})
        for bad in ("loud", ["info"], {"a": 1}):
            args["json"]["params"]["_meta"] = {**META, "io.modelcontextprotocol/logLevel": bad}
            r = await c.post(gw.http_url, **args)
            assert r.status_code == 400 and r.json()["error"]["code"] == -32602
