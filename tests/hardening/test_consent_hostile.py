"""Hostile modern (2026-07-28) callers of the gateway's own consent prompt (policy ``ask`` answered
as an ``InputRequiredResult``, gateway.core.bridge / gateway.core.policy) on an in-process gateway
with real sockets and a real fixture child: each hostile retry gets a specific answer, nothing runs
without its consent, no traceback is logged, and the gateway goes on serving."""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import connect, fixture_backend, make_config, run_gateway, wait_status

from gateway import events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

V = "2026-07-28"
FORM = {"elicitation": {"form": {}}}
ASK = """
[policy]
elicitation_timeout = 10.0
rules = [{ match = "fx__echo", action = "ask" }]
"""
ACCEPT = {"action": "accept", "content": {"approve": True}}
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json",
           "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "fx__echo"}


def meta(caps: dict[str, Any] = FORM) -> dict[str, Any]:
    return {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": caps}


def echo(message: str, **extra: Any) -> dict[str, Any]:
    return {"name": "fx__echo", "arguments": {"message": message}, **extra, "_meta": meta()}


async def post(c: httpx.AsyncClient, url: str, id: int, params: dict[str, Any],
               headers: dict[str, str] | None = None) -> httpx.Response:
    with trio.fail_after(10):
        return await c.post(url, headers=headers or HEADERS,
                            json={"jsonrpc": "2.0", "id": id, "method": "tools/call",
                                  "params": params})


def echoed(transcript: Path) -> list[str]:
    """The messages the child was asked to echo (every tools/call it read)."""
    if not transcript.exists():
        return []
    calls = [json.loads(line) for line in transcript.read_text().splitlines()[1:]]
    return [m["params"]["arguments"]["message"] for m in calls if m.get("method") == "tools/call"]


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


async def test_a_websocket_calls_state_retried_on_mcp_is_invalid_state_and_runs_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A WebSocket call's consent state presented on stateless /mcp (same principal) was resumed
    there: the consent counted, the tool ran on the WebSocket connection (its result sent there
    under the HTTP retry's id), and the HTTP handler failed an assertion (traceback, connection
    dropped unanswered).  Now: 400 invalid_state, the call goes on waiting for its own retry."""
    caplog.set_level(logging.ERROR)
    transcript = tmp_path / "fx.jsonl"
    cfg = make_config(fixture_backend("fx", env={"FIXTURE_TRANSCRIPT": str(transcript)}), extra=ASK)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c, \
                connect(gw.url, initialize=False) as ws:
            first = (await ws.request("tools/call", echo("ws")))["result"]
            assert first["resultType"] == "input_required"
            retry = echo("ws", inputResponses={"consent": ACCEPT},
                         requestState=first["requestState"])
            r = await post(c, gw.http_url, 99, retry)
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == -32602, r.text
            assert error["data"]["reason"] == "invalid_state"
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)  # whatever follows is done
            assert not gw.events.of(events.RequestStarted)  # nothing went to the child
            assert echoed(transcript) == [] and [m.get("id") for m in ws.received] == [1]
            done = await ws.request("tools/call", retry)  # its own connection's retry still works
            assert done["result"]["content"][0]["text"] == "ws"
    assert echoed(transcript) == ["ws"]
    no_traceback(caplog)


async def test_parked_calls_are_bounded_by_max_parked_flows(
    caplog: pytest.LogCaptureFixture) -> None:
    """Each modern POST under ``ask`` parked a call (its flow session, request and task, about
    20 KB) until elicitation_timeout, with no bound but buffered_bytes_total (~300 bytes of
    request each): anyone could hold gigabytes.  Now past gateway.max_parked_flows a call under
    ask gets -32006 overloaded (nothing parked, nothing run) and a legacy child's elicitation is
    declined; a parked call that ends makes room."""
    caplog.set_level(logging.ERROR)
    extra = ASK.replace('action = "ask" }]',
                        'action = "ask" }, { match = "fx__elicit", action = "allow" }]')
    cfg = make_config(fixture_backend("fx"), extra=extra,
                      gateway="max_parked_flows = 3\ndrain_grace = 0.5")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            states = []
            for i in range(3):
                r = await post(c, gw.http_url, i, echo(f"p{i}"))
                states.append(r.json()["result"]["requestState"])
            r = await post(c, gw.http_url, 9, echo("over"))
            error = r.json()["error"]
            assert error["code"] == -32006 and error["data"]["reason"] == "overloaded", r.text
            headers = dict(HEADERS, **{"mcp-name": "fx__elicit"})
            r = await post(c, gw.http_url, 10, {**echo("name?"), "name": "fx__elicit"}, headers)
            assert r.json()["result"]["resultType"] == "complete", r.text  # not parked: declined
            assert json.loads(r.json()["result"]["content"][0]["text"])["action"] == "decline"
            st = await wait_status(gw.bound.admin_port,
                                   lambda s: s["client_requests_in_flight"] == 3)
            r = await post(c, gw.http_url, 11,
                           echo("p0", inputResponses={"consent": {"action": "decline"}},
                                requestState=states[0]))
            assert r.json()["error"]["data"]["reason"] == "declined"
            r = await post(c, gw.http_url, 12, echo("room"))  # room again
            assert r.json()["result"]["resultType"] == "input_required", r.text
            assert st["client_requests_in_flight"] == 3
    no_traceback(caplog)


async def test_a_response_to_the_unsent_consent_request_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A modern WebSocket client is never sent the consent request, but it was recorded as a
    server request under a ``gw-<salt>-<n>`` id: a JSON-RPC response guessing that id (24 bits
    of salt) was accepted as the answer, so the tool ran without the retry and its state, its
    result dropped (the call's id was already answered input_required), and the real retry
    then got invalid_state.  Now that response is refused; the retry decides."""
    import gateway.core.session

    monkeypatch.setattr(gateway.core.session, "_entropy",
                        types.SimpleNamespace(hex=lambda n: "000000"))  # a salt it guesses
    caplog.set_level(logging.ERROR)
    transcript = tmp_path / "fx.jsonl"
    cfg = make_config(fixture_backend("fx", env={"FIXTURE_TRANSCRIPT": str(transcript)}), extra=ASK)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, initialize=False) as ws:
            first = (await ws.request("tools/call", echo("direct")))["result"]
            await ws.send({"jsonrpc": "2.0", "id": "gw-000000-1", "result": ACCEPT})
            await ws.request("ping")  # answered (an error in this era): read after the guess
            await trio.testing.wait_all_tasks_blocked()
            assert not gw.events.of(events.RequestStarted)  # nothing went to the child
            assert echoed(transcript) == []
            retry = echo("direct", inputResponses={"consent": {"action": "decline"}},
                         requestState=first["requestState"])
            no = await ws.request("tools/call", retry)
            assert no["error"]["code"] == -32005 and no["error"]["data"]["reason"] == "declined", no
    assert echoed(transcript) == []
    no_traceback(caplog)


async def test_a_drain_refuses_a_new_call_dressed_as_a_retry(
    caplog: pytest.LogCaptureFixture) -> None:
    """While a WebSocket connection had a consent prompt parked, a drain let in any request of
    the same method with a ``requestState`` key as the parked call's retry: a new call to a
    modern backend (whose own states pass through) with a junk state ran during the drain.
    Now only a state that continues a parked flow passes; the junk one gets -32005 shutdown,
    and the parked call's real retry still runs."""
    import os
    import sys

    from helpers import ROOT

    caplog.set_level(logging.ERROR)
    modern = os.path.join(ROOT, "tests", "fixtures", "modern_server.py")
    backend = (f"[backends.mo]\ncommand = {json.dumps(sys.executable)}\n"
               f"args = [{json.dumps(modern)}]\nprotocol_mode = \"modern_only\"\n")
    extra = ('[policy]\nelicitation_timeout = 10.0\nrules = [{ match = "mo__show_meta", action = '
             '"ask" }]\n')
    cfg = make_config(backend, extra=extra, gateway="drain_delay = 0.0\ndrain_grace = 3.0")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url, initialize=False) as ws:
            parked = {"name": "mo__show_meta", "arguments": {}, "_meta": meta()}
            asked = (await ws.request("tools/call", parked))["result"]
            assert asked["resultType"] == "input_required"
            gw.control.stop()
            await wait_status(gw.bound.admin_port, lambda st: st["draining"])
            new = {"name": "mo__echo", "arguments": {"message": "new"}, "_meta": meta()}
            for params in (new, {**new, "requestState": "junk"}):
                r = await ws.request("tools/call", params)
                assert r["error"]["code"] == -32005 and r["error"]["data"][
                    "reason"] == "shutdown", r
            done = await ws.request("tools/call", {**parked, "inputResponses": {"consent": ACCEPT},
                                                   "requestState": asked["requestState"]})
            assert done["result"]["resultType"] == "complete", done
    no_traceback(caplog)
