"""Streamable HTTP at /mcp, legacy shape (2025-03-26 … 2025-11-25)."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

import httpx
import pytest
import trio
from helpers import (
    HTTP_HEADERS,
    HTTP_INIT,
    fixture_backend,
    http_json,
    make_config,
    metric,
    run_gateway,
    wait_status,
)
from mcp import ClientSession, types
from mcp.client.streamable_http import streamable_http_client

# httpx (and the SDK on it) leaves streams it did not read to the end (an SSE stream the client
# stops reading) to the garbage collector as async generators; under trio that warns. Client
# side only, nothing of the gateway's.
pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore::ResourceWarning",
                                         "ignore::pytest.PytestUnraisableExceptionWarning")]

H, INIT = HTTP_HEADERS, HTTP_INIT


async def _open(c: httpx.AsyncClient, url: str) -> dict[str, str]:
    """Initialize a session by hand; the headers every later request carries."""
    r = await c.post(url, headers=H, json=INIT)
    assert r.status_code == 200, r.text
    headers = dict(H, **{"mcp-session-id": r.headers["mcp-session-id"],
                         "mcp-protocol-version": "2025-11-25"})
    r = await c.post(url, headers=headers,
                     json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert r.status_code == 202 and r.content == b""
    return headers


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _sse_messages(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


async def test_sdk_client_tools_progress_and_elicitation() -> None:
    """The official Python SDK (1.x) over /mcp: list, call, progress, an elicitation answered."""
    async with run_gateway(make_config(fixture_backend())) as gw:
        progress: list[float] = []
        prompts: list[str] = []

        async def on_progress(p: float, total: float | None, message: str | None) -> None:
            progress.append(p)

        async def on_elicit(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
            prompts.append(params.message)
            return types.ElicitResult(action="accept", content={"answer": "yes"})

        with trio.fail_after(30):
            async with streamable_http_client(gw.http_url) as (read, write, get_sid), \
                    ClientSession(read, write, elicitation_callback=on_elicit) as session:
                init = await session.initialize()
                assert init.protocolVersion == "2025-11-25"
                assert get_sid()
                names = {t.name for t in (await session.list_tools()).tools}
                assert {"fx__echo", "fx__progress", "fx__elicit"} <= names
                r = await session.call_tool("fx__echo", {"message": "hi"})
                assert r.content[0].text == "hi"  # type: ignore[union-attr]  # the fixture answers text
                r = await session.call_tool("fx__progress", {"steps": 3},
                                            progress_callback=on_progress)
                assert progress == [1, 2, 3]
                r = await session.call_tool("fx__elicit", {"message": "proceed?"})
                assert json.loads(r.content[0].text)["content"] == {"answer": "yes"}  # type: ignore[union-attr]  # the fixture answers text
                assert prompts == ["proceed?"]
                status = await http_json(gw.bound.admin_port, "/status")
                assert status["connections"].get("http") == 1
        with trio.fail_after(10):  # the SDK DELETEs its session on exit
            await wait_status(gw.bound.admin_port, lambda st: not st["connections"].get("http"))


async def test_bad_requests_get_their_status() -> None:
    cfg = make_config(fixture_backend(), gateway="max_message_bytes = 4096")
    async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
        url = gw.http_url
        headers = await _open(c, url)
        ping = {"jsonrpc": "2.0", "id": 5, "method": "ping"}
        r = await c.post(url, headers=dict(headers, **{"content-type": "text/plain"}), json=ping)
        assert r.status_code == 415
        r = await c.post(url, headers=dict(headers, accept="application/json"), json=ping)
        assert r.status_code == 406
        r = await c.post(url, headers={k: v for k, v in headers.items() if k != "mcp-session-id"},
                         json=ping)
        assert r.status_code == 400
        r = await c.post(url, headers=dict(headers, **{"mcp-session-id": "nope"}), json=ping)
        assert r.status_code == 404
        r = await c.post(url, headers=dict(headers, **{"mcp-protocol-version": "1999-01-01"}),
                         json=ping)
        assert r.status_code == 400
        r = await c.post(url, headers=dict(headers, origin="http://evil.example"), json=ping)
        assert r.status_code == 403
        port = gw.bound.http_port
        r = await c.post(url, headers=dict(headers, origin=f"http://localhost:{port + 1}"),
                         json=ping)
        assert r.status_code == 403  # another server on this machine is another origin
        r = await c.post(url, headers=dict(headers, origin=f"http://127.0.0.1:{port}"), json=ping)
        assert r.status_code == 200  # this server itself (the conformance suite sends it)
        r = await c.post(url, headers=dict(headers, host="evil.example"), json=ping)
        assert r.status_code == 403
        r = await c.post(url, headers=headers, content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == -32700
        r = await c.post(url, headers=headers,
                         content=b'[{"jsonrpc":"2.0","id":9,"method":"ping"}]')
        assert r.status_code == 400 and r.json()["error"]["code"] == -32600  # batch on 2025-11-25
        r = await c.put(url, headers=headers)
        assert r.status_code == 405
        r = await c.post(url.replace("/mcp", "/other"), headers=headers, json=ping)
        assert r.status_code == 404
        # a load balancer's probes, under any Host; never /status or /metrics on this listener
        for path, body in [("/healthz", b"ok\n"), ("/readyz", b"ready\n")]:
            r = await c.get(url.replace("/mcp", path), headers={"host": "lb.example"})
            assert (r.status_code, r.content) == (200, body)
        for path in ("/status", "/metrics"):
            assert (await c.get(url.replace("/mcp", path))).status_code == 404
        # the session still works; absent MCP-Protocol-Version is accepted (2025-03-26 assumed)
        r = await c.post(url, headers={k: v for k, v in headers.items()
                                       if k != "mcp-protocol-version"}, json=ping)
        assert r.status_code == 200 and r.json() == {"jsonrpc": "2.0", "id": 5, "result": {}}
        # oversize body: refused by its Content-Length, before the body is read
        stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
        async with stream:
            await stream.send_all(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"content-type: application/json\r\n"
                                  b"accept: application/json, text/event-stream\r\n"
                                  b"content-length: 5000\r\n\r\n{")
            with trio.fail_after(5):
                reply = await stream.receive_some(4096)
            assert reply.startswith(b"HTTP/1.1 413 ")
        # a second GET stream on one session: 409
        async with c.stream("GET", url, headers=dict(headers, accept="text/event-stream")) as first:
            assert first.status_code == 200
            r = await c.get(url, headers=dict(headers, accept="text/event-stream"))
            assert r.status_code == 409


async def test_get_stream_carries_list_changed_and_post_carries_related() -> None:
    async with (run_gateway(make_config(fixture_backend())) as gw,
                httpx.AsyncClient(timeout=10) as c):
        url = gw.http_url
        headers = await _open(c, url)
        got: list[dict[str, Any]] = []
        async with c.stream("GET", url,
                            headers=dict(headers, accept="text/event-stream")) as stream:
            assert stream.headers["content-type"] == "text/event-stream"
            r = await c.post(url, headers=headers, json={
                "jsonrpc": "2.0", "id": 1, "method": "logging/setLevel",
                "params": {"level": "info"}})
            assert r.json()["result"] == {}
            r = await c.post(url, headers=headers, json={
                "jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "fx__log", "arguments": {"level": "error", "data": "on-post"}}})
            on_post = _sse_messages(r.text)
            # log, then result
            assert [m.get("method") for m in on_post] == ["notifications/message", None]
            r = await c.post(url, headers=headers, json={
                "jsonrpc": "2.0", "id": 3, "method": "tools/call",
                "params": {"name": "fx__notify_list_changed", "arguments": {"kind": "tools"}}})
            assert r.status_code == 200
            with trio.fail_after(10):
                async with aclosing(stream.aiter_lines()) as lines:
                    async for line in lines:
                        if line.startswith("data: "):
                            got.append(json.loads(line[6:]))
                            break
        assert got[0]["method"] == "notifications/tools/list_changed"


async def test_delete_ends_session_and_cancels_its_calls() -> None:
    async with (run_gateway(make_config(fixture_backend())) as gw,
                httpx.AsyncClient(timeout=10) as c):
        url = gw.http_url
        headers = await _open(c, url)
        call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                "params": {"name": "fx__sleep", "arguments": {"seconds": 30}}}
        async with trio.open_nursery() as nursery:
            result: list[httpx.Response] = []

            async def post() -> None:
                result.append(await c.post(url, headers=headers, json=call))

            nursery.start_soon(post)
            with trio.fail_after(10):
                await wait_status(gw.bound.admin_port,
                                  lambda st: st["client_requests_in_flight"] == 1)
            r = await c.delete(url, headers=headers)
            assert r.status_code == 200
        with trio.fail_after(10):  # the session is gone, its call cancelled
            await wait_status(gw.bound.admin_port, lambda st: not st["connections"].get("http")
                              and not st["client_requests_in_flight"])
        assert await metric(gw.bound.admin_port, "mcp_gateway_requests_total", backend="fx",
                            method="tools/call", outcome="cancelled", principal="_none") == 1
        assert result[0].status_code in (200, 404)  # the POST's stream ended with its session
        r = await c.post(url, headers=headers, json={"jsonrpc": "2.0", "id": 8, "method": "ping"})
        assert r.status_code == 404


async def test_idle_session_expires() -> None:
    cfg = make_config(fixture_backend(), listen="http_session_idle_timeout = 0.3")
    async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
        headers = await _open(c, gw.http_url)
        with trio.fail_after(10):
            await wait_status(gw.bound.admin_port, lambda st: not st["connections"].get("http"))
        r = await c.post(gw.http_url, headers=headers,
                         json={"jsonrpc": "2.0", "id": 2, "method": "ping"})
        assert r.status_code == 404


async def test_2000_short_sessions_leave_nothing_behind() -> None:
    """Many short sessions (initialize, call, DELETE): /status and resident memory stay flat."""
    async with run_gateway(make_config(fixture_backend())) as gw:
        url = gw.http_url
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)

        async def batch(n: int) -> None:
            async with httpx.AsyncClient(timeout=20, limits=limits) as c:
                async def one() -> None:
                    headers = await _open(c, url)
                    r = await c.post(url, headers=headers, json={
                        "jsonrpc": "2.0", "id": 2, "method": "tools/call",
                        "params": {"name": "fx__echo", "arguments": {"message": "m"}}})
                    assert r.status_code == 200
                    assert (await c.delete(url, headers=headers)).status_code == 200

                for _ in range(n // 16):
                    async with trio.open_nursery() as nursery:
                        for _ in range(16):
                            nursery.start_soon(one)

        await batch(400)  # warm up (allocator arenas, caches)
        before = rss_bytes()
        with trio.fail_after(120):
            await batch(2000)
        st = await http_json(gw.bound.admin_port, "/status")
        assert not st["connections"].get("http")
        assert st["client_requests_in_flight"] == 0 and st["buffered_bytes"] == 0
        assert st["connection_slots"] == 0 or st["connection_slots"] <= 16
        grown = rss_bytes() - before
        assert grown < 8 * 2**20, f"resident memory grew by {grown} bytes over 2000 sessions"
