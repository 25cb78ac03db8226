"""Era bridging.  A legacy child's elicitation / sampling / roots request during a
modern (2026-07-28) client's call becomes an InputRequiredResult with a signed requestState;
the client's retry carries the answers back to the waiting child (gateway.core.bridge)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from helpers import fixture_backend, make_config, metric, run_gateway, wait_status

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

V = "2026-07-28"
ALL_CAPS = {"elicitation": {}, "sampling": {}, "roots": {}}


async def call(c: httpx.AsyncClient, url: str, name: str, args: dict[str, Any], *, id: int = 1,
               caps: dict[str, Any] | None = None, **extra: Any) -> httpx.Response:
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": ALL_CAPS if caps is None else caps}
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": name}
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": name, "arguments": args, **extra, "_meta": meta}}
    with trio.fail_after(10):
        return await c.post(url, headers=headers, json=body)


def invalid_state(r: httpx.Response) -> bool:
    error = r.json().get("error") or {}
    return r.status_code == 400 and error.get("code") == -32602 and error["data"][
        "reason"] == "invalid_state"


async def test_an_elicitation_round_trip_and_a_replayed_state() -> None:
    async with run_gateway(make_config(fixture_backend("fx"), gateway='replica_id = "r7"')) as gw, \
            httpx.AsyncClient() as c:
        args = {"message": "your name?"}
        r = await call(c, gw.http_url, "fx__elicit", args)
        assert r.status_code == 200, r.text
        first = r.json()["result"]
        assert first["resultType"] == "input_required"
        (key, ask), = first["inputRequests"].items()
        assert key == "srv-1"  # the child's own request id
        assert ask["method"] == "elicitation/create" and ask["params"]["message"] == "your name?"
        state = first["requestState"]
        assert state.startswith("r7.")
        answer = {key: {"action": "accept", "content": {"answer": "Ada"}}}
        r = await call(c, gw.http_url, "fx__elicit", args, id=2, inputResponses=answer,
                       requestState=state)
        assert r.status_code == 200, r.text
        done = r.json()
        assert done["id"] == 2 and done["result"]["resultType"] == "complete"
        assert json.loads(done["result"]["content"][0]["text"])["content"] == {"answer": "Ada"}
        r = await call(c, gw.http_url, "fx__elicit", args, id=3, inputResponses=answer,
                       requestState=state)
        assert invalid_state(r), r.text  # one retry per state
        with trio.fail_after(5):
            await wait_status(gw.bound.admin_port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)


async def test_tampered_other_params_and_missing_capability() -> None:
    backends = fixture_backend("fx") + fixture_backend("fy")
    async with run_gateway(make_config(backends)) as gw, httpx.AsyncClient() as c:
        port = gw.bound.admin_port
        r = await call(c, gw.http_url, "fx__elicit", {"message": "m"})
        state = r.json()["result"]["requestState"]
        r = await call(c, gw.http_url, "fx__elicit", {"message": "m"}, id=2,
                       inputResponses={"srv-1": {"action": "accept", "content": {"answer": "x"}}},
                       requestState=state + "-TAMPERED")
        assert invalid_state(r), r.text
        assert await metric(port, "mcp_gateway_request_states_refused_total",
                            reason="tampered") == 1
        assert await metric(port, "mcp_gateway_input_required_results_total", backend="fx") == 1
        # an unauthenticated caller's tampered state ends nothing (anyone can name a flow): the
        # genuine retry completes the call, and nothing is left in flight
        r = await call(c, gw.http_url, "fx__elicit", {"message": "m"}, id=3,
                       inputResponses={"srv-1": {"action": "accept", "content": {"answer": "x"}}},
                       requestState=state)
        assert r.json()["result"]["resultType"] == "complete", r.text
        with trio.fail_after(5):
            await wait_status(port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
        # a caller without the capability: the child is answered -32021, no input is asked
        r = await call(c, gw.http_url, "fy__sample", {"prompt": "p"}, caps={"elicitation": {}})
        result = r.json()["result"]
        assert result["resultType"] == "complete" and result["isError"]
        assert "-32021" in result["content"][0]["text"]
        # (fy: a child's request is bridged only while one caller's calls are in flight there)
        r = await call(c, gw.http_url, "fy__elicit", {"message": "m"})
        assert "requestState" in r.json()["result"], r.text
        state = r.json()["result"]["requestState"]
        r = await call(c, gw.http_url, "fy__elicit", {"message": "other"}, id=2,
                       inputResponses={}, requestState=state)
        assert invalid_state(r) and "params differ" in r.json()["error"]["message"]


async def test_a_parked_flow_expires_after_state_ttl() -> None:
    """roots/list reaches a caller only from a per-session child (a shared one is answered the
    configured roots: it could keep one client's roots for the next)."""
    cfg = make_config(fixture_backend("fx", sharing="per-session"), gateway="state_ttl = 0.5")
    async with run_gateway(cfg) as gw, httpx.AsyncClient() as c:
        r = await call(c, gw.http_url, "fx__roots", {})
        first = r.json()["result"]
        assert [a["method"] for a in first["inputRequests"].values()] == ["roots/list"]
        with trio.fail_after(5):  # the child's roots/list is refused, its call ends
            await wait_status(gw.bound.admin_port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
        r = await call(c, gw.http_url, "fx__roots", {}, id=2,
                       inputResponses={"srv-1": {"roots": []}}, requestState=first["requestState"])
        assert invalid_state(r), r.text


async def test_a_modern_websocket_connection_is_bridged_too_and_goes_on_after_a_flow_ends() -> None:
    """On a byte stream the retry comes on the same connection; a flow that ends (here: a
    tampered state) ends its call only, not the connection."""
    from helpers import connect

    cfg = make_config(fixture_backend("fx"))
    caps = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": ALL_CAPS}
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url, initialize=False) as c:
            args = {"name": "fx__elicit", "arguments": {"message": "name?"}, "_meta": caps}
            first = (await c.request("tools/call", args))["result"]
            assert (first["resultType"] == "input_required"
                    and list(first["inputRequests"]) == ["srv-1"])
            answer = {"srv-1": {"action": "accept", "content": {"answer": "Ada"}}}
            done = await c.request("tools/call", {**args, "inputResponses": answer,
                                                  "requestState": first["requestState"]})
            assert json.loads(done["result"]["content"][0]["text"])["content"] == {"answer": "Ada"}
            second = (await c.request("tools/call", args))["result"]  # a new flow on the connection
            assert list(second["inputRequests"]) == ["srv-2"]
            bad = await c.request("tools/call", {**args, "inputResponses": {},
                                                 "requestState": second["requestState"] + "x"})
            assert bad["error"]["data"]["reason"] == "invalid_state"
            r = await c.request("tools/call", {"name": "fx__echo", "arguments": {"message": "on"},
                                               "_meta": caps})
            assert r["result"]["content"][0]["text"] == "on"  # the connection goes on
