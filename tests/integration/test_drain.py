"""The drain contract, so a client always knows what to retry.

While the gateway drains, a connection keeps reading (the answers to its calls' prompts still
arrive), a request that would start something is refused at once as retryable (-32005
``shutdown``; over HTTP a 503 with ``Retry-After`` that a load balancer retries elsewhere), every
call already read gets its answer, a bridged call's retry is taken, and only then does the
connection close (WebSocket 1012, service restart).  The lame duck before it (SIGTERM,
``drain_delay``) is tested on a real daemon in tests/system/test_daemon.py.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
import trio
from helpers import (
    connect,
    fixture_backend,
    http_request,
    make_config,
    run_gateway,
    text_of,
    wait_status,
)

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore::ResourceWarning",
                                         "ignore::pytest.PytestUnraisableExceptionWarning")]

V = "2026-07-28"
MODERN = {"io.modelcontextprotocol/protocolVersion": V,
          "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}
H = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
RETRYABLE = {"reason": "shutdown", "retryable": True}
BACKENDS = fixture_backend("fx", sharing="per-session") + fixture_backend("fy")  # prompts: fx
GATEWAY = "drain_delay = 0.0\ndrain_grace = 10.0"


def _modern_headers(name: str) -> dict[str, str]:
    return dict(H, **{"mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": name})


def _modern_call(name: str, args: dict[str, Any], id: int, **extra: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": name, "arguments": args, **extra, "_meta": MODERN}}


async def test_websocket_drain_answers_every_call_read_refuses_new_ones_and_closes_1012() -> None:
    cfg = make_config(BACKENDS, gateway=GATEWAY)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities={"elicitation": {}}) as a, \
                connect(gw.url) as b, connect(gw.url, initialize=False) as m:
            admin = gw.bound.admin_port
            # m: a modern connection whose bridged call is parked, waiting for its retry
            margs = {"name": "fx__elicit", "arguments": {"message": "name?"}, "_meta": MODERN}
            first = (await m.request("tools/call", margs))["result"]
            assert first["resultType"] == "input_required"
            # a: a legacy call waiting on its elicitation; b: a slow call
            await a.send({"jsonrpc": "2.0", "id": "e", "method": "tools/call",
                          "params": {"name": "fx__elicit", "arguments": {"message": "sure?"}}})
            (prompt,) = await a.wait_for(lambda: a.requests)
            await b.send({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
                          "params": {"name": "fy__sleep",
                                     "arguments": {"seconds": 2, "message": "slept"}}})
            await wait_status(admin, lambda st: st["client_requests_in_flight"] == 3)
            gw.control.stop()
            await wait_status(admin, lambda st: st["draining"])
            assert (await http_request(admin, "/readyz"))[0] == 503
            with pytest.raises(ConnectionRefusedError):  # no new WebSocket connection
                socket.create_connection(("127.0.0.1", gw.bound.websocket_port), timeout=2).close()
            # a new request: refused at once, safe to send elsewhere
            refused = await b.call("fy__echo", {"message": "late"})
            assert refused["error"]["code"] == -32005 and refused["error"]["data"] == RETRYABLE
            # the prompt of a call in flight still gets its answer through, and so the call ends
            assert not [n for n in a.notifications if n["method"] == "notifications/cancelled"]
            await a.send({"jsonrpc": "2.0", "id": prompt["id"],
                          "result": {"action": "accept", "content": {"answer": "yes"}}})
            done = await a.response("e")
            assert json.loads(text_of(done))["content"] == {"answer": "yes"}
            # the bridged call's retry is no new request: taken, and its call completes
            answer = {"srv-1": {"action": "accept", "content": {"answer": "Ada"}}}
            retried = await m.request("tools/call", {**margs, "inputResponses": answer,
                                                     "requestState": first["requestState"]})
            assert json.loads(text_of(retried))["content"] == {"answer": "Ada"}
            assert text_of(await b.response("slow")) == "slept"
            for c in (a, b, m):  # then each connection closes: 1012, service restart
                await c.wait_for(lambda c=c: c.closed or None)
                assert c.ws.closed is not None and c.ws.closed.code == 1012


async def test_http_drain_503_with_retry_after_for_what_did_not_start() -> None:
    cfg = make_config(BACKENDS, gateway=GATEWAY)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            url, admin = gw.http_url, gw.bound.admin_port
            init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"}}}
            r = await c.post(url, headers=H, json=init)
            session = dict(H, **{"mcp-session-id": r.headers["mcp-session-id"],
                                 "mcp-protocol-version": "2025-11-25"})
            await c.post(url, headers=session,
                         json={"jsonrpc": "2.0", "method": "notifications/initialized"})
            # a modern bridged call, parked
            margs = {"message": "name?"}
            r = await c.post(url, headers=_modern_headers("fx__elicit"),
                             json=_modern_call("fx__elicit", margs, 1))
            first = r.json()["result"]
            assert first["resultType"] == "input_required"
            slow: dict[str, httpx.Response] = {}

            async def slow_call() -> None:  # a legacy session's call in flight across the drain
                slow["r"] = await c.post(url, headers=session, json={
                    "jsonrpc": "2.0", "id": 7, "method": "tools/call",
                    "params": {"name": "fy__sleep",
                               "arguments": {"seconds": 2, "message": "slept"}}})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow_call)
                await wait_status(admin, lambda st: st["client_requests_in_flight"] == 2)
                gw.control.stop()
                await wait_status(admin, lambda st: st["draining"])
                probe = await c.get(url.replace("/mcp", "/readyz"))  # the same listener's probe
                assert probe.status_code == 503
                refusals = [
                    await c.post(url, headers=session, json={  # a legacy session's new request
                        "jsonrpc": "2.0", "id": 8, "method": "tools/call",
                        "params": {"name": "fy__echo", "arguments": {"message": "late"}}}),
                    await c.post(url, headers=H, json=init),  # a new session
                    await c.post(url, headers=_modern_headers("fy__echo"),  # a stateless request
                                 json=_modern_call("fy__echo", {"message": "late"}, 9)),
                ]
                for r in refusals:
                    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                    error = r.json()["error"]
                    assert error["code"] == -32005 and error["data"] == RETRYABLE
                # the bridged call's retry, on a new connection: taken, and its call completes
                answer = {"srv-1": {"action": "accept", "content": {"answer": "Ada"}}}
                async with httpx.AsyncClient(timeout=10) as other:
                    r = await other.post(url, headers=_modern_headers("fx__elicit"),
                                         json=_modern_call(
                        "fx__elicit", margs, 2, inputResponses=answer,
                        requestState=first["requestState"]))
                assert r.status_code == 200, r.text
                text = r.json()["result"]["content"][0]["text"]
                assert json.loads(text)["content"] == {"answer": "Ada"}
            r = slow["r"]  # the call read before the drain: answered
            assert r.status_code == 200
            (msg,) = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ")] \
                if r.headers["content-type"].startswith("text/event-stream") else [r.json()]
            assert msg["id"] == 7 and text_of(msg) == "slept"
