"""A call cancelled at a legacy shared child that never answers it: fail-closed for cancel_grace,
then recycled (README "Attribution", ``cancel_grace``).

The fixture, as the spec allows, never answers a cancelled call.  However the caller gives up —
a 2026-07-28 caller closing its stateless POST's response stream, or a legacy WebSocket client
sending ``notifications/cancelled`` — the call is abandoned at the router: the child is told
``notifications/cancelled``, the instance still shows it (``inflight: 1``) and refuses the
child's elicitations for anybody (its asker cannot be proven); past ``cancel_grace`` the instance
is recycled, and the next caller's elicitation is delivered.  Nothing stays stuck.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import (
    Client,
    connect,
    fixture_backend,
    http_json,
    make_config,
    metric,
    run_gateway,
    text_of,
    wait_instance,
)

from gateway import events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

GRACE = 1.0
V = "2026-07-28"
ELICIT_CAPS = {"elicitation": {"form": {}}}
SLEEP = {"name": "fx__sleep", "arguments": {"seconds": 30}}


async def instance(port: int | None) -> dict[str, Any]:
    return (await http_json(port, "/status"))["backends"][0]["instances"][0]


async def cancel_modern(gw: Any, port: int | None) -> None:
    """A stateless 2026-07-28 fx__sleep whose response stream the client closes once the call
    is at the child."""
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "fx__sleep"}
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": {}}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {**SLEEP, "_meta": meta}}
    async with httpx.AsyncClient() as c, trio.open_nursery() as nursery:
        nursery.start_soon(lambda: c.post(gw.http_url, headers=headers, json=body))
        await wait_instance(port, lambda s: s["inflight"] == 1)
        nursery.cancel_scope.cancel()  # the client gives up: its stream (and connection) closes


async def cancel_websocket(gw: Any, port: int | None) -> None:
    """A legacy WebSocket client's fx__sleep, cancelled with notifications/cancelled."""
    async with connect(gw.url) as a:
        await a.send({"jsonrpc": "2.0", "id": "s", "method": "tools/call", "params": SLEEP})
        await wait_instance(port, lambda s: s["inflight"] == 1)
        await a.notify("notifications/cancelled", {"requestId": "s"})
        # (the notification is read in order)
        await wait_instance(port, lambda s: s["inflight"] == 1)
        await a.call("fx__echo", {"message": "after the cancel"})  # the cancel has been read


async def elicit(b: Client, id: str) -> dict[str, Any]:
    """``fx__elicit`` from ``b``, accepting whatever it is asked; the tool's JSON result."""
    await b.send({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                  "params": {"name": "fx__elicit", "arguments": {"message": id}}})
    asked = len(b.requests)
    got = await b.wait_for(lambda: b.responses.get(id) or b.requests[asked:])
    if isinstance(got, list):
        answer = {"action": "accept", "content": {"ok": 1}}
        await b.send({"jsonrpc": "2.0", "id": got[0]["id"], "result": answer})
        got = await b.response(id)
    return json.loads(text_of(got))


@pytest.mark.parametrize("cancel", [cancel_modern, cancel_websocket],
                         ids=["modern_stream_closed", "websocket_cancelled"])
async def test_a_cancelled_call_the_child_never_answers_recycles_it_after_cancel_grace(
        tmp_path: Path, cancel: Any, caplog: pytest.LogCaptureFixture) -> None:
    transcript = tmp_path / "child.jsonl"
    cfg = make_config(fixture_backend("fx", cancel_grace=GRACE, request_timeout=30.0,
                                      env={"FIXTURE_TRANSCRIPT": str(transcript)}))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities=ELICIT_CAPS) as b:
            port = gw.bound.admin_port
            pid = (await wait_instance(port, lambda s: s["state"] == "RUNNING"))["pid"]
            await cancel(gw, port)
            gave_up = trio.current_time()
            # the call is abandoned at the router (and the child told, checked once it is gone)
            await gw.events.wait(events.RequestFinished, tool="fx__sleep",
                                 outcome=events.RequestOutcome.CANCELLED)

            # within cancel_grace: still at the child, so nobody's elicitation can be attributed
            inst = await instance(port)
            assert (inst["pid"], inst["inflight"], inst["recycles"]) == (pid, 1, 0), inst
            assert (await elicit(b, "early"))["action"] == "decline"
            assert not b.requests  # nobody was asked
            refused = [m for r in caplog.records if "refused" in (m := r.getMessage())]
            assert len(refused) == 1, refused  # and why: not a second live caller
            assert "1 of them only for a cancelled call" in refused[0], refused
            assert await metric(port, "mcp_gateway_unroutable_server_requests_total", backend="fx",
                                method="elicitation/create", reason="unattributable") == 1

            # past cancel_grace: recycled (a new child, nothing in flight), not a failure
            inst = await wait_instance(port,
                                       lambda s: s["recycles"] == 1 and s["state"] == "RUNNING")
            waited = trio.current_time() - gave_up
            assert GRACE * 0.9 <= waited < GRACE + 3, waited
            assert inst["pid"] != pid and inst["inflight"] == 0 and not inst["draining"], inst
            assert inst["last_exit"].startswith("recycled"), inst
            # the call was abandoned at the router: the child (its transcript complete now that
            # it is gone) was told, by the gateway's id
            lines = [json.loads(line) for line in transcript.read_text().splitlines()]
            (gid,) = [m["id"] for m in lines if m.get("method") == "tools/call"
                      and m["params"]["name"] == "sleep"]
            assert any(m.get("method") == "notifications/cancelled"
                       and m["params"]["requestId"] == gid for m in lines), lines

            # the next caller's elicitation is delivered and answered
            later = await elicit(b, "later")
            assert later == {"action": "accept", "content": {"ok": 1}, "message": "later"}
            assert len(b.requests) == 1
