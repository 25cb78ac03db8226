"""A JSON-RPC batch (2025-03-26) with invalid entries: each invalid entry is answered in the
batch's array by its own -32600 with ``id: null``, and the valid entries are served (JSON-RPC 2.0
§6), on /mcp (HTTP 200, one array) as on WebSocket; the same rule refuses a whole batch only when
it cannot be a batch at all (empty, too large, not 2025-03-26)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from helpers import (
    HTTP_HEADERS,
    HTTP_INIT,
    connect,
    fixture_backend,
    make_config,
    run_gateway,
    text_of,
)

from gateway import events

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore::ResourceWarning",
                                         "ignore::pytest.PytestUnraisableExceptionWarning")]

V = "2025-03-26"


def call(id: Any, tool: str, **arguments: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments}}


INVALID = [1, "x", None, {"jsonrpc": "1.0", "id": 5, "method": "ping"}]


def body_of(r: httpx.Response) -> Any:
    """The one JSON value of a response: a JSON body, or the last event of an SSE stream."""
    if r.headers["content-type"].startswith("application/json"):
        return r.json()
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")][-1]


def invalid_errors(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in answers if a["id"] is None]


async def test_invalid_entries_of_a_batch_are_answered_in_its_array_on_http() -> None:
    async with (run_gateway(make_config(fixture_backend())) as gw,
                httpx.AsyncClient(timeout=10) as c):
        url = gw.http_url
        init = dict(HTTP_INIT, params=dict(HTTP_INIT["params"], protocolVersion=V))
        r = await c.post(url, headers=HTTP_HEADERS, json=init)
        assert r.status_code == 200, r.text
        h = dict(HTTP_HEADERS,
                 **{"mcp-session-id": r.headers["mcp-session-id"], "mcp-protocol-version": V})
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert (await c.post(url, headers=h, json=initialized)).status_code == 202

        # the batch: three invalid entries and one call; a fourth invalid entry carries an
        # id
        r = await c.post(url, headers=h, json=[*INVALID, call("e", "fx__echo", message="ran")])
        assert r.status_code == 200, r.text
        answers = body_of(r)
        assert isinstance(answers, list) and len(answers) == 5, answers
        errors = invalid_errors(answers)
        assert len(errors) == 4 and all(e["error"]["code"] == -32600 for e in errors), errors
        (ok,) = [a for a in answers if a["id"] == "e"]
        assert text_of(ok) == "ran"

        # no valid entry at all: 200 with the errors only; with a notification beside them too
        r = await c.post(url, headers=h, json=[1, initialized])
        assert r.status_code == 200, r.text
        (only,) = body_of(r)
        assert only["id"] is None and only["error"]["code"] == -32600
        # an invalid entry beside a call cancelled meanwhile: the array still comes, its error only
        async with trio.open_nursery() as nursery:
            got: list[httpx.Response] = []

            async def slow_batch() -> None:
                got.append(await c.post(url, headers=h,
                                        json=[call("s", "fx__sleep", seconds=30), "bad"]))

            mark = gw.events.count
            nursery.start_soon(slow_batch)
            await gw.events.wait(events.RequestStarted, backend="fx", since=mark)
            cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                      "params": {"requestId": "s"}}
            r = await c.post(url, headers=h, json=cancel)
            assert r.status_code == 202
        (r,) = got
        assert r.status_code == 200 and [a["id"] for a in body_of(r)] == [None], r.text

        # what refuses a batch as a whole is unchanged: empty, not JSON (400), nothing to answer
        # (202)
        r = await c.post(url, headers=h, content=b"[]")
        assert r.status_code == 400 and r.json()["error"]["code"] == -32600
        r = await c.post(url, headers=h, content=b"[1,")
        assert r.status_code == 400 and r.json()["error"]["code"] == -32700
        r = await c.post(url, headers=h, json=[initialized])
        assert r.status_code == 202
        # the session goes on
        r = await c.post(url, headers=h, json=call(9, "fx__echo", message="after"))
        assert r.status_code == 200 and text_of(body_of(r)) == "after"


async def test_invalid_entries_of_a_batch_are_answered_in_its_array_on_websocket() -> None:
    async with run_gateway(make_config(fixture_backend())) as gw:
        async with connect(gw.url, version=V) as ws:
            await ws.send([*INVALID, call("e", "fx__echo", message="ran")])
            answers = await ws.wait_for(
                lambda: next((m for m in [ws.responses.get("e")] if m), None))
            assert text_of(answers) == "ran"
            errors = await ws.wait_for(lambda: [m for m in ws.received if m.get("id", 0) is None]
                                       or None)
            assert len(errors) == 4 and all(e["error"]["code"] == -32600 for e in errors), errors
