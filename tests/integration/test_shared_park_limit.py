"""An abandoned bridged flow on a ``shared`` backend does not hold the child's attribution for
``state_ttl``: another caller's call that asks for input waits for it, and once it has been parked
``gateway.shared_park_limit`` seconds it is preempted (its child request answered cancel, its call
given up, its retry refused ``invalid_state`` / ``preempted``) and the other caller gets its
prompt.  A flow whose caller retries within the limit is never preempted."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from helpers import fixture_backend, make_config, metric, run_gateway, wait_status

from gateway import events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

V = "2026-07-28"
CAPS = {"elicitation": {}}
LIMIT = 1.0


async def call(c: httpx.AsyncClient, url: str, message: str, *, id: int = 1,
               **extra: Any) -> httpx.Response:
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "fx__elicit"}
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": CAPS}
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "fx__elicit", "arguments": {"message": message}, **extra,
                       "_meta": meta}}
    with trio.fail_after(10):
        return await c.post(url, headers=headers, json=body)


def config() -> Any:
    return make_config(fixture_backend("fx", sharing="shared", instances=1),
                       gateway=f"shared_park_limit = {LIMIT}")


def asked(r: httpx.Response, message: str) -> tuple[str, str]:
    """The (key, state) of an InputRequiredResult that asks ``message``."""
    result = r.json()["result"]
    assert result["resultType"] == "input_required", r.text
    (key, ask), = result["inputRequests"].items()
    assert ask["params"]["message"] == message
    return key, result["requestState"]


def answered(r: httpx.Response) -> Any:
    result = r.json()["result"]
    assert result["resultType"] == "complete", r.text
    return json.loads(result["content"][0]["text"])


async def test_an_abandoned_flow_is_preempted_for_another_callers_prompt() -> None:
    async with run_gateway(config()) as gw, httpx.AsyncClient() as c:
        port = gw.bound.admin_port
        _key, alice_state = asked(await call(c, gw.http_url, "alice?"), "alice?")
        parked = trio.current_time()  # alice never retries (in time)
        r = await call(c, gw.http_url, "bob?", id=2)
        waited = trio.current_time() - parked
        bob_key, bob_state = asked(r, "bob?")  # bob's prompt: not declined as unattributable
        print(f"bob's prompt {waited:.2f}s after alice's flow parked (limit {LIMIT}s)")
        assert LIMIT <= waited < LIMIT + 1
        r = await call(c, gw.http_url, "bob?", id=3, requestState=bob_state,
                       inputResponses={bob_key: {"action": "accept", "content": {"answer": "B"}}})
        assert answered(r)["content"] == {"answer": "B"}
        r = await call(c, gw.http_url, "alice?", id=4, requestState=alice_state,
                       inputResponses={"srv-1": {"action": "accept", "content": {"answer": "A"}}})
        error = r.json()["error"]
        assert r.status_code == 400 and error["data"]["reason"] == "invalid_state", r.text
        assert "shared_park_limit" in error["message"]
        assert await metric(port, "mcp_gateway_request_states_refused_total",
                            reason="preempted") == 1
        assert await metric(port, "mcp_gateway_unroutable_server_requests_total", backend="fx",
                            method="elicitation/create", reason="unattributable") == 0
        with trio.fail_after(5):
            await wait_status(port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)


async def test_a_flow_whose_caller_retries_within_the_limit_is_not_preempted() -> None:
    async with run_gateway(config()) as gw, httpx.AsyncClient() as c:
        port = gw.bound.admin_port
        alice_key, alice_state = asked(await call(c, gw.http_url, "alice?"), "alice?")
        async with trio.open_nursery() as nursery:
            bob: list[httpx.Response] = []

            async def bob_calls() -> None:
                bob.append(await call(c, gw.http_url, "bob?", id=2))

            mark = gw.events.count
            nursery.start_soon(bob_calls)
            # bob's call is in, waiting for alice's parked flow
            await gw.events.wait(events.RequestStarted, backend="fx", since=mark)
            r = await call(c, gw.http_url, "alice?", id=3, requestState=alice_state,
                           inputResponses={alice_key: {"action": "accept",
                                                       "content": {"answer": "A"}}})
            assert answered(r)["content"] == {"answer": "A"}
        bob_key, bob_state = asked(bob[0], "bob?")
        r = await call(c, gw.http_url, "bob?", id=4, requestState=bob_state,
                       inputResponses={bob_key: {"action": "accept", "content": {"answer": "B"}}})
        assert answered(r)["content"] == {"answer": "B"}
        assert await metric(port, "mcp_gateway_request_states_refused_total",
                            reason="preempted") == 0


async def test_a_websocket_connections_parked_flow_is_preempted_and_the_connection_goes_on(
) -> None:
    from helpers import connect

    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": CAPS}
    with trio.fail_after(20):
        async with run_gateway(config()) as gw, connect(gw.url, initialize=False) as ws, \
                httpx.AsyncClient() as c:
            args = {"name": "fx__elicit", "arguments": {"message": "alice?"}, "_meta": meta}
            first = (await ws.request("tools/call", args))["result"]
            assert first["resultType"] == "input_required"
            bob_key, bob_state = asked(await call(c, gw.http_url, "bob?", id=2), "bob?")
            late = await ws.request("tools/call", {**args, "requestState": first["requestState"],
                                                   "inputResponses": {
                                                       "srv-1": {"action": "decline"}}})
            assert late["error"]["data"]["reason"] == "invalid_state"
            echo = await ws.request("tools/call",
                                    {"name": "fx__echo", "arguments": {"message": "on"},
                                                   "_meta": meta})
            assert echo["result"]["content"][0]["text"] == "on"  # the connection goes on
            r = await call(c, gw.http_url, "bob?", id=3, requestState=bob_state,
                           inputResponses={bob_key: {"action": "accept",
                                                     "content": {"answer": "B"}}})
            assert answered(r)["content"] == {"answer": "B"}
