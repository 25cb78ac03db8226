"""Three replicas behind HAProxy, all real processes on 127.0.0.1 (tests/fleetutil.py):
HAProxy runs packaging/haproxy/mcp-gateway.cfg as shipped (ports and certificate swapped),
terminates TLS, and the replicas authenticate every request ([[auth.bearer]]).

Which replica served a call: the fixture's ``client_info`` tool returns its child's pid, and each
replica's ``/status`` names the pid of its one ``fx`` child.  Backend ``fe`` (the fixture again)
serves only the era-bridged flows, so the other traffic (on ``fx``) cannot make its elicitation
unattributable.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from fleetutil import TOKEN, Fleet
from helpers import Client, connect, http_json, metric, poll, text_of

pytestmark = [pytest.mark.fleet, pytest.mark.filterwarnings("ignore::ResourceWarning")]

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
AUTH = {"authorization": f"Bearer {TOKEN}"}
POST = {**AUTH, "accept": "application/json, text/event-stream", "content-type": "application/json"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(Path(tmp_path_factory.mktemp("fleet")), backends=("fx", "fe"))
    f.start()
    try:
        yield f
    finally:
        f.stop()


async def pids(fleet: Fleet) -> dict[int, str]:
    """The pid of each live replica's fx child -> the replica's name."""
    out = {}
    for r in fleet.replicas.values():
        if r.proc is not None and r.proc.poll() is None:
            st = await http_json(r.admin, "/status")
            fx, = (b for b in st["backends"] if b["name"] == "fx")
            out[fx["instances"][0]["pid"]] = r.name
    return out


def served_by(resp: dict[str, Any], by_pid: dict[int, str]) -> str:
    return by_pid[json.loads(text_of(resp))["pid"]]


async def ws_clients(stack: AsyncExitStack, fleet: Fleet, n: int) -> list[Client]:
    ctx = fleet.certs.client_context()
    return [await stack.enter_async_context(connect(fleet.ws_url, token=TOKEN, ssl_context=ctx))
            for _ in range(n)]


class Session:
    """A legacy Streamable HTTP session through HAProxy."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http, self.url, self.id, self.next = http, url, "", 1

    async def post(self, body: dict[str, Any]) -> httpx.Response:
        headers = dict(POST)
        if self.id:
            headers |= {"mcp-session-id": self.id, "mcp-protocol-version": LEGACY}
        return await self.http.post(self.url, headers=headers, json=body)

    async def open(self) -> None:
        self.id = ""
        r = await self.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": LEGACY, "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"}}})
        assert r.status_code == 200, r.text
        self.id = r.headers["mcp-session-id"]
        r = await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert r.status_code == 202, r.text

    async def call(self, name: str, args: dict[str, Any] | None = None) -> httpx.Response:
        self.next += 1
        return await self.post({"jsonrpc": "2.0", "id": self.next, "method": "tools/call",
                                "params": {"name": name, "arguments": args or {}}})


async def modern_call(http: httpx.AsyncClient, url: str, name: str, args: dict[str, Any],
                      **extra: Any) -> httpx.Response:
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}
    headers = {**POST, "mcp-protocol-version": MODERN, "mcp-method": "tools/call", "mcp-name": name}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": name, "arguments": args, **extra, "_meta": meta}}
    return await http.post(url, headers=headers, json=body)


def https(fleet: Fleet) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=fleet.certs.client_context(), timeout=10)


async def test_connections_and_sessions_stay_on_their_replica(fleet: Fleet) -> None:
    """WebSocket connections are spread by connection (leastconn) and each stays on its replica;
    a legacy session's every request lands on the replica that minted its id."""
    by_pid = await pids(fleet)
    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            clients = await ws_clients(stack, fleet, 6)
            homes = []
            for c in clients:
                seen = {served_by(await c.call("fx__client_info"), by_pid) for _ in range(3)}
                assert len(seen) == 1
                homes.append(seen.pop())
            assert sorted(Counter(homes).values()) == [2, 2, 2]  # leastconn, 6 held open
            for r in fleet.replicas.values():  # what each replica itself counts
                assert (await http_json(r.admin, "/status"))["connections"].get("websocket") == 2

            async with https(fleet) as http:
                sessions = [Session(http, fleet.http_url) for _ in range(6)]
                for s in sessions:
                    await s.open()
                tags = Counter(s.id.split(".", 1)[0] for s in sessions)
                assert set(tags) == set(fleet.replicas)  # balanced when the session is made
                for _ in range(3):
                    for s in sessions:
                        r = await s.call("fx__client_info")
                        assert r.status_code == 200, r.text
                        assert served_by(r.json(), by_pid) == s.id.split(".")[0]
                for r in fleet.replicas.values():
                    st = await http_json(r.admin, "/status")
                    assert st["connections"].get("http") == tags[r.name]
                for s in sessions:
                    r = await http.delete(fleet.http_url, headers={**AUTH, "mcp-session-id": s.id,
                                                                   "mcp-protocol-version": LEGACY})
                    assert r.status_code == 200, r.text


async def test_stateless_requests_spread_and_bridged_retries_find_their_replica(
    fleet: Fleet) -> None:
    """2026-07-28 requests are balanced one by one; a retry carrying a requestState reaches the
    replica holding the waiting child (HAProxy reads the state's replica id from the body), with
    other traffic going on; sent straight to another replica it gets -32602 invalid_state."""
    by_pid = await pids(fleet)
    with trio.fail_after(60):
        async with https(fleet) as http:
            seen = Counter()
            for _ in range(9):
                r = await modern_call(http, fleet.http_url, "fx__client_info", {})
                assert r.status_code == 200, r.text
                seen[served_by(r.json(), by_pid)] += 1
            assert set(seen) == set(fleet.replicas), seen

            stop = trio.Event()
            traffic = Counter()

            async def other_traffic() -> None:
                async with https(fleet) as mine:
                    while not stop.is_set():
                        r = await modern_call(mine, fleet.http_url, "fx__echo", {"message": "m"})
                        assert r.status_code == 200, r.text
                        traffic["calls"] += 1

            async def bridged(n: int) -> str:
                args = {"message": f"flow {n}?"}
                r = await modern_call(http, fleet.http_url, "fe__elicit", args)
                first = r.json()["result"]
                assert first["resultType"] == "input_required", r.text
                (key, _), = first["inputRequests"].items()
                answer = {key: {"action": "accept", "content": {"answer": f"a{n}"}}}
                r = await modern_call(http, fleet.http_url, "fe__elicit", args,
                                      inputResponses=answer, requestState=first["requestState"])
                done = r.json()["result"]
                assert done["resultType"] == "complete", r.text
                assert json.loads(text_of(r.json()))["content"] == {"answer": f"a{n}"}
                return first["requestState"].split(".", 1)[0]

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(other_traffic)
                holders = Counter([await bridged(n) for n in range(9)])
                stop.set()
            assert len(holders) >= 2 and traffic["calls"] > 0, (holders, traffic)
            for r in fleet.replicas.values():
                assert await metric(r.admin, "mcp_gateway_request_states_refused_total",
                                    reason="foreign") == 0

            # a retry that reaches the wrong replica all the same (sent straight to it)
            args = {"message": "wrong door"}
            first = (await modern_call(http, fleet.http_url, "fe__elicit", args)).json()["result"]
            holder = fleet.replicas[first["requestState"].split(".", 1)[0]]
            other = next(r for r in fleet.replicas.values() if r is not holder)
            (key, _), = first["inputRequests"].items()
            answer = {key: {"action": "accept", "content": {"answer": "late"}}}
            async with httpx.AsyncClient(timeout=10) as plain:
                r = await modern_call(plain, f"http://127.0.0.1:{other.http}/mcp", "fe__elicit",
                                      args, inputResponses=answer,
                                      requestState=first["requestState"])
            error = r.json()["error"]
            assert r.status_code == 400 and error["code"] == -32602, r.text
            assert error["data"]["reason"] == "invalid_state" and holder.name in error["message"]
            assert await metric(other.admin, "mcp_gateway_request_states_refused_total",
                                reason="foreign") == 1
            # the holder still has the flow: the same retry through HAProxy completes it
            r = await modern_call(http, fleet.http_url, "fe__elicit", args,
                                  inputResponses=answer, requestState=first["requestState"])
            assert r.json()["result"]["resultType"] == "complete", r.text


async def cancelled_calls(fleet: Fleet) -> float:
    """Calls to fx that the replicas (all of them) ended as cancelled, the child told."""
    return sum(
        [await metric(r.admin, "mcp_gateway_requests_total", backend="fx", method="tools/call",
                      outcome="cancelled", principal="fleet")
         for r in fleet.replicas.values() if r.proc is not None and r.proc.poll() is None])


async def test_a_modern_client_cancels_by_closing_its_response_stream(fleet: Fleet) -> None:
    """A 2026-07-28 client cancels a call by closing its response stream: HAProxy must tell the
    replica (option abortonclose), which cancels the call at its backend within moments, not
    when the tool ends 30 s later."""
    before = await cancelled_calls(fleet)
    async with https(fleet) as http:
        with trio.move_on_after(0.2):  # the client gives up: its response stream closes
            await modern_call(http, fleet.http_url, "fx__sleep", {"seconds": 30})
    closed = trio.current_time()
    async def cancelled() -> bool:  # seen on the real replicas' /metrics
        return await cancelled_calls(fleet) != before

    with trio.fail_after(5):
        await poll(cancelled)
    took = trio.current_time() - closed
    assert took < 1.0, (f"the replica cancelled the call {took:.2f} s after the client closed its "
                        "stream")


async def test_a_replica_killed_with_sigkill(fleet: Fleet) -> None:
    """Its WebSocket clients see their connection drop, its sessions get 404, and both carry on
    on another replica; every other client sees nothing. (Last in this module: it kills r2.)"""
    by_pid = await pids(fleet)
    victim = fleet.replicas["r2"]
    with trio.fail_after(60):
        async with AsyncExitStack() as stack:
            http = await stack.enter_async_context(https(fleet))
            clients = await ws_clients(stack, fleet, 6)
            home = {c: served_by(await c.call("fx__client_info"), by_pid) for c in clients}
            sessions = [Session(http, fleet.http_url) for _ in range(6)]
            for s in sessions:
                await s.open()
            assert "r2" in home.values() and any(s.id.startswith("r2.") for s in sessions)

            victim.signal(signal.SIGKILL)
            victim.wait_exit(10)
            # at once, before HAProxy's checks notice: a stateless call is sent elsewhere (the
            # refused connection is retried on another replica), nothing reaches the client
            for _ in range(6):
                r = await modern_call(http, fleet.http_url, "fx__echo", {"message": "m"})
                assert r.status_code == 200, r.text
            for c in clients:
                if home[c] == "r2":
                    await c.wait_for(lambda c=c: c.closed)
                else:  # untouched: the same connection, the same replica
                    assert served_by(await c.call("fx__client_info"), by_pid) == home[c]
                    assert not c.closed
            for s in sessions:
                r = await s.call("fx__echo", {"message": "m"})
                if s.id.startswith("r2."):
                    assert r.status_code == 404, r.text  # another replica: no such session
                    await s.open()
                    assert not s.id.startswith("r2.")
                    r = await s.call("fx__echo", {"message": "again"})
                assert r.status_code == 200, r.text
            fleet.replica_up("r2", up=False)
            # the dropped WebSocket clients connect again: a live replica takes them
            for _ in [c for c in clients if home[c] == "r2"]:
                again = await stack.enter_async_context(
                    connect(fleet.ws_url, token=TOKEN, ssl_context=fleet.certs.client_context()))
                assert served_by(await again.call("fx__client_info"), by_pid) in ("r1", "r3")
            assert not any(c.closed for c in clients if home[c] != "r2")
