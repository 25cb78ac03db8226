"""What one principal may hold at once ([[auth.limits]] max_sessions, max_connections,
max_listens, max_parked_flows): Alice at small caps, Bob at the defaults, anonymous callers at
the daemon-wide caps only.

The caps the core counts (listens, parked flows) run the gateway in-process on virtual time
(tests/memharness.py: memory backends, clients on memory streams bound to the principal their
bearer token authenticates as).  The caps a listener counts stay on real listeners and a real
child (``system``): HTTP sessions, WebSocket upgrades, HTTP keep-alive connections, unix peers.
"""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import (
    HTTP_HEADERS,
    HTTP_INIT,
    UPGRADE,
    Client,
    bearer_auth,
    connect,
    fixture_backend,
    make_config,
    run_gateway,
    unix_connect,
)
from memharness import backend, memory_config, running

from gateway import events

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]
Clock = trio.testing.MockClock

TOKENS = {"alice": "alice-caps-token-1", "bob": "bob-caps-token-2"}
AUTH = bearer_auth(TOKENS)
V = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": V,
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}


def alice_caps(**caps: int) -> str:
    return ('[[auth.limits]]\nprincipal = "alice"\n'
            + "".join(f"{k} = {v}\n" for k, v in caps.items()))


def bearer(name: str) -> dict[str, str]:
    return dict(HTTP_HEADERS, authorization=f"Bearer {TOKENS[name]}")


def capped(body: Any, limit: str, value: int) -> bool:
    error = body.get("error") or {}
    return error.get("code") == -32006 and error.get("data") == {
        "reason": "rate_limited", "limit": limit, "value": value}


async def upgrade(port: int | None, token: str) -> tuple[int, bytes]:
    """A raw WebSocket upgrade: its status and body (the connection stays open on a 101)."""
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    extra = f"Authorization: Bearer {token}\r\n"
    await stream.send_all(UPGRADE.replace(b"\r\n\r\n", f"\r\n{extra}\r\n".encode()))
    data = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        if status != 101:
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length and (chunk := await stream.receive_some(65536)):
                body += chunk
    await stream.aclose()
    return status, body


@pytest.mark.system
async def test_http_sessions_beyond_a_principals_max_sessions_get_503() -> None:
    cfg = make_config(fixture_backend("fx"), extra=AUTH + alice_caps(max_sessions=2))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            sids = []
            for _ in range(2):
                r = await c.post(gw.http_url, headers=bearer("alice"), json=HTTP_INIT)
                assert r.status_code == 200, r.text
                sids.append(r.headers["mcp-session-id"])
            r = await c.post(gw.http_url, headers=bearer("alice"), json=HTTP_INIT)
            assert r.status_code == 503 and capped(r.json(), "max_sessions", 2), r.text
            r = await c.post(gw.http_url, headers=bearer("bob"), json=HTTP_INIT)
            assert r.status_code == 200  # Bob's own count
            # a session that ends gives its place back
            headers = dict(bearer("alice"), **{"mcp-session-id": sids[0]})
            mark = gw.events.count
            assert (await c.delete(gw.http_url, headers=headers)).status_code == 200
            await gw.events.wait(events.ConnectionClosed, transport="http", since=mark)
            r = await c.post(gw.http_url, headers=bearer("alice"), json=HTTP_INIT)
            assert r.status_code == 200, r.text


@pytest.mark.system
async def test_websocket_connections_beyond_a_principals_max_connections_get_503() -> None:
    cfg = make_config(fixture_backend("fx"), extra=AUTH + alice_caps(max_connections=2))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, AsyncExitStack() as stack:
            first = await stack.enter_async_context(connect(gw.url, token=TOKENS["alice"]))
            mark = gw.events.count
            async with connect(gw.url, token=TOKENS["alice"]):
                status, body = await upgrade(gw.bound.websocket_port, TOKENS["alice"])
                assert status == 503 and capped(json.loads(body), "max_connections", 2), body
                async with connect(gw.url, token=TOKENS["bob"]) as bob:  # Bob's own count
                    assert "result" in await bob.request("ping")
            # the closed one gave its place back (bob's closed too)
            await gw.events.wait(events.ConnectionClosed, since=mark, count=2)
            assert (await upgrade(gw.bound.websocket_port, TOKENS["alice"]))[0] == 101
            assert "result" in await first.request("ping")


@asynccontextmanager
async def keepalive(url: str, token: str
                    ) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.Response]]:
    """One keep-alive HTTP connection that has sent one authenticated request."""
    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=1)) as c:
        headers = {"accept": "text/event-stream", "authorization": f"Bearer {token}"}
        r = await c.get(url, headers=headers)
        yield c, r


@pytest.mark.system
async def test_http_connections_count_toward_the_principal_of_their_requests() -> None:
    cfg = make_config(fixture_backend("fx"), extra=AUTH + alice_caps(max_connections=2))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, AsyncExitStack() as stack:
            for _ in range(2):  # no session id: 400, after the connection was counted
                _c, r = await stack.enter_async_context(keepalive(gw.http_url, TOKENS["alice"]))
                assert r.status_code == 400
            async with keepalive(gw.http_url, TOKENS["alice"]) as (_c, r):
                assert r.status_code == 503 and capped(r.json(), "max_connections", 2), r.text
            async with keepalive(gw.http_url, TOKENS["bob"]) as (_c, r):
                assert r.status_code == 400
            await stack.aclose()  # Alice's connections close: their places come back
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)  # the gateway saw them close
            async with keepalive(gw.http_url, TOKENS["alice"]) as (_c, r):
                assert r.status_code == 400, r.text


async def test_listens_beyond_a_principals_max_listens_are_refused_minus_32006(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"), extra=AUTH + alice_caps(max_listens=2))
    tag = "io.modelcontextprotocol/subscriptionId"
    async with (running(cfg) as gw,
                gw.connect(token=TOKENS["alice"], initialize=False) as c):
        listen = {"notifications": {"toolsListChanged": True}, "_meta": META}

        async def opened(id: int) -> None:
            await c.send({"jsonrpc": "2.0", "id": id, "method": "subscriptions/listen",
                          "params": listen})
            await c.wait_for(lambda: [n for n in c.notifications
                                      if n["params"]["_meta"] == {tag: id}])

        for id in (1, 2):
            await opened(id)
        r = await c.request("subscriptions/listen", listen, id=3)
        assert capped(r, "max_listens", 2), r
        async with gw.connect(token=TOKENS["alice"], initialize=False) as other:
            r = await other.request("subscriptions/listen", listen, id=3)  # per principal
            assert capped(r, "max_listens", 2), r
        async with gw.connect(token=TOKENS["bob"], initialize=False) as bob:
            await bob.send({"jsonrpc": "2.0", "id": 3, "method": "subscriptions/listen",
                            "params": listen})  # Bob's own count: his listen opens
            await bob.wait_for(lambda: [n for n in bob.notifications
                                        if n["params"]["_meta"] == {tag: 3}])
            assert 3 not in bob.responses
        await c.notify("notifications/cancelled", {"requestId": 1})
        assert "result" in await c.response(1)
        await opened(4)


def modern_call(id: int, **extra: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "fx__elicit", "arguments": {"message": "name?"}, **extra,
                       "_meta": META}}


async def test_parked_flows_beyond_a_principals_max_parked_flows_are_refused(
        autojump_clock: Clock) -> None:
    # per-session: each flow's call is provably its own (a shared child with two flows' calls
    # in flight could not attribute its elicitation)
    cfg = memory_config(backend("fx", sharing="per-session"),
                        extra=AUTH + alice_caps(max_parked_flows=1),
                        gateway="drain_grace = 0.5")  # two flows are left parked
    async with running(cfg) as gw, AsyncExitStack() as stack:
        conns: dict[str, Client] = {}

        async def call(conn: str, id: int, **extra: Any) -> dict[str, Any]:
            """A call on connection ``conn`` ("alice-1", ...: Alice's first), kept open: a
            retry comes on the connection of its call, each new flow on one of its own."""
            if conn not in conns:
                conns[conn] = await stack.enter_async_context(
                    gw.connect(token=TOKENS[conn.split("-")[0]], initialize=False))
            await conns[conn].send(modern_call(id, **extra))
            return dict(await conns[conn].response(id))

        first = (await call("alice-1", 1))["result"]
        assert first["resultType"] == "input_required"
        r = await call("alice-2", 2)
        assert capped(r, "max_parked_flows", 1), r
        r = await call("bob-1", 3)
        assert r["result"]["resultType"] == "input_required"  # Bob's own count
        # the parked one resumes (its place comes back), then another may park
        (key,) = first["inputRequests"]
        answer = {key: {"action": "accept", "content": {"answer": "Ada"}}}
        r = await call("alice-1", 4, inputResponses=answer, requestState=first["requestState"])
        assert r["result"]["resultType"] == "complete", r
        r = await call("alice-3", 5)
        assert r["result"]["resultType"] == "input_required", r


@pytest.mark.system
async def test_anonymous_callers_keep_the_daemon_wide_caps_only() -> None:
    cfg = make_config(fixture_backend("fx"), extra='[[auth.limits]]\nprincipal = "*"\n'
                      'max_sessions = 1\nmax_connections = 1\n')
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            for _ in range(3):
                r = await c.post(gw.http_url, headers=HTTP_HEADERS, json=HTTP_INIT)
                assert r.status_code == 200, r.text
            async with connect(gw.url) as a, connect(gw.url) as b:
                assert "result" in await a.request("ping")
                assert "result" in await b.request("ping")


@pytest.mark.system
async def test_unix_connections_beyond_the_peers_max_connections_get_an_error_line(
        tmp_path: Path) -> None:
    sock = str(tmp_path / "gw.sock")
    me = pwd.getpwuid(os.getuid()).pw_name
    cfg = make_config(fixture_backend("fx"), unix=sock,
                      extra=f'[[auth.limits]]\nprincipal = "{me}"\nmax_connections = 1\n')
    with trio.fail_after(30):
        async with run_gateway(cfg), unix_connect(sock) as first:
            stream = await trio.open_unix_socket(sock)
            async with stream:
                data = b""
                while chunk := await stream.receive_some(65536):  # one line, then EOF
                    data += chunk
            assert capped(json.loads(data), "max_connections", 1), data
            assert "result" in await first.request("ping")
