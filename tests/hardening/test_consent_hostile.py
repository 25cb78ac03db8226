"""Hostile modern (2026-07-28) callers of the gateway's own consent prompt (policy ``ask`` answered
as an ``InputRequiredResult``, gateway.bridge / gateway.policy) on an in-process gateway with real
sockets and a real fixture child: each hostile retry gets a specific answer, nothing runs without
its consent, no traceback is logged, and the gateway goes on serving."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from helpers import connect, fixture_backend, make_config, run_gateway, wait_status

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
    return {"io.modelcontextprotocol/protocolVersion": V, "io.modelcontextprotocol/clientCapabilities": caps}


def echo(message: str, **extra: Any) -> dict[str, Any]:
    return {"name": "fx__echo", "arguments": {"message": message}, **extra, "_meta": meta()}


async def post(c: httpx.AsyncClient, url: str, id: int, params: dict[str, Any],
               headers: dict[str, str] | None = None) -> httpx.Response:
    with trio.fail_after(10):
        return await c.post(url, headers=headers or HEADERS,
                            json={"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})


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
            retry = echo("ws", inputResponses={"consent": ACCEPT}, requestState=first["requestState"])
            r = await post(c, gw.http_url, 99, retry)
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == -32602, r.text
            assert error["data"]["reason"] == "invalid_state"
            await trio.sleep(0.2)
            assert echoed(transcript) == [] and [m.get("id") for m in ws.received] == [1]
            done = await ws.request("tools/call", retry)  # its own connection's retry still works
            assert done["result"]["content"][0]["text"] == "ws"
    assert echoed(transcript) == ["ws"]
    no_traceback(caplog)
