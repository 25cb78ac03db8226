"""Who may end a parked bridged flow with a bad ``requestState``: only that flow's own principal.

A flow's id is readable in its state (the payload is signed, not encrypted), so anyone can build
a state naming it.  A tampered state presented by the flow's principal still ends the flow at
once (its child stops waiting); one presented by another principal, or by an unauthenticated
caller, is refused as ``invalid_state`` and ends nothing: the owner's genuine retry completes."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import httpx
import pytest
import trio
from helpers import fixture_backend, make_config, metric, run_gateway, wait_status

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

V = "2026-07-28"
CAPS = {"elicitation": {}, "sampling": {}, "roots": {}}
TOKENS = {"alice": "alice-secret-token-1", "bob": "bob-secret-token-2"}
ARGS = {"message": "your name?"}
ANSWER = {"srv-1": {"action": "accept", "content": {"answer": "Ada"}}}


def bearer_toml(*names: str) -> str:
    return "".join(f'[[auth.bearer]]\nprincipal = "{n}"\n'
                   f'token_sha256 = "{hashlib.sha256(TOKENS[n].encode()).hexdigest()}"\n'
                   for n in names)


async def call(c: httpx.AsyncClient, url: str, who: str | None, *, id: int = 1,
               **extra: Any) -> httpx.Response:
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "fx__elicit"}
    if who is not None:
        headers["authorization"] = f"Bearer {TOKENS[who]}"
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": CAPS}
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "fx__elicit", "arguments": ARGS, **extra, "_meta": meta}}
    with trio.fail_after(10):
        return await c.post(url, headers=headers, json=body)


def forgeries(state: str) -> list[str]:
    """States naming the same flow that this replica did not sign: the genuine payload with a
    wrong mac, and a payload rewritten to another principal with the genuine mac."""
    replica, payload, mac = state.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    rewritten = base64.urlsafe_b64encode(
        json.dumps({**claims, "p": "bob"}).encode()).rstrip(b"=").decode()
    wrong_mac = ("A" if mac[0] != "A" else "B") + mac[1:]
    return [f"{replica}.{payload}.{wrong_mac}", f"{replica}.{rewritten}.{mac}"]


def refused(r: httpx.Response) -> bool:
    error = r.json().get("error") or {}
    return r.status_code == 400 and error.get("code") == -32602 and error["data"][
        "reason"] == "invalid_state"


async def test_another_principals_forged_state_does_not_end_the_flow_it_names() -> None:
    cfg = make_config(fixture_backend("fx"), extra=bearer_toml("alice", "bob"))
    async with run_gateway(cfg) as gw, httpx.AsyncClient() as c:
        port = gw.bound.admin_port
        r = await call(c, gw.http_url, "alice")
        state = r.json()["result"]["requestState"]
        # (bob with alice's genuine one too)
        for n, forged in enumerate([*forgeries(state), state], 2):
            r = await call(c, gw.http_url, "bob", id=n,
                           inputResponses={"srv-1": {"action": "decline"}}, requestState=forged)
            assert refused(r), r.text
        assert await metric(port, "mcp_gateway_request_states_refused_total",
                            reason="tampered") == 2
        r = await call(c, gw.http_url, "alice", id=9, inputResponses=ANSWER, requestState=state)
        result = r.json()["result"]
        assert result["resultType"] == "complete", r.text
        assert json.loads(result["content"][0]["text"])["content"] == {"answer": "Ada"}


async def test_the_flows_own_principal_presenting_a_tampered_state_ends_it_at_once() -> None:
    cfg = make_config(fixture_backend("fx"), extra=bearer_toml("alice", "bob"))
    async with run_gateway(cfg) as gw, httpx.AsyncClient() as c:
        r = await call(c, gw.http_url, "alice")
        state = r.json()["result"]["requestState"]
        r = await call(c, gw.http_url, "alice", id=2, inputResponses=ANSWER,
                       requestState=forgeries(state)[0])
        assert refused(r), r.text
        with trio.fail_after(5):  # the child was answered and the call ended: nothing waits
            await wait_status(gw.bound.admin_port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
        r = await call(c, gw.http_url, "alice", id=3, inputResponses=ANSWER, requestState=state)
        assert refused(r) and r.json()["error"]["data"].get("reason") == "invalid_state", r.text


async def test_an_unauthenticated_callers_tampered_state_never_ends_a_flow() -> None:
    async with run_gateway(make_config(fixture_backend("fx"))) as gw, httpx.AsyncClient() as c:
        r = await call(c, gw.http_url, None)
        state = r.json()["result"]["requestState"]
        for n, forged in enumerate(forgeries(state), 2):
            r = await call(c, gw.http_url, None, id=n,
                           inputResponses={"srv-1": {"action": "decline"}}, requestState=forged)
            assert refused(r), r.text
        r = await call(c, gw.http_url, None, id=9, inputResponses=ANSWER, requestState=state)
        result = r.json()["result"]
        assert result["resultType"] == "complete", r.text
        assert json.loads(result["content"][0]["text"])["content"] == {"answer": "Ada"}
