"""An abandoned bridged flow on a ``shared`` backend does not hold the child's attribution for
``state_ttl``: another caller's call that asks for input waits for it, and once it has been parked
``gateway.shared_park_limit`` seconds it is preempted (its child request answered cancel, its call
given up, its retry refused ``invalid_state`` / ``preempted``) and the other caller gets its
prompt.  A flow whose caller retries within the limit is never preempted.

Most run the gateway in-process on virtual time (tests/memharness.py: a memory backend that asks
what the fixture server asks, each caller on a memory stream), so the wait is exactly the limit.
One stays on a real child over stateless HTTP (``system``): the HTTP bridge's flows, the 400 of
a preempted retry, and the limit on the real clock.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import Client, fixture_backend, make_config, metric, run_gateway, wait_status
from memharness import Harness, backend, memory_config, running, settle

from gateway import events
from gateway.core.bridge import GATHER

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]
Clock = trio.testing.MockClock

V = "2026-07-28"
CAPS = {"elicitation": {}}
LIMIT = 1.0


async def call(c: httpx.AsyncClient, url: str, message: str, *, id: int = 1,
               **extra: Any) -> httpx.Response:
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "fx__elicit"}
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": CAPS}
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "fx__elicit", "arguments": {"message": message}, **extra,
                       "_meta": meta}}
    with trio.fail_after(10):
        return await c.post(url, headers=headers, json=body)


def config() -> Any:
    return make_config(fixture_backend("fx", sharing="shared", instances=1),
                       gateway=f"shared_park_limit = {LIMIT}")


def asked(r: httpx.Response, message: str) -> tuple[str, str]:
    """The (key, state) of an InputRequiredResult that asks ``message``."""
    result = r.json()["result"]
    assert result["resultType"] == "input_required", r.text
    (key, ask), = result["inputRequests"].items()
    assert ask["params"]["message"] == message
    return key, result["requestState"]


def answered(r: httpx.Response) -> Any:
    result = r.json()["result"]
    assert result["resultType"] == "complete", r.text
    return json.loads(result["content"][0]["text"])


def memory_setup() -> Any:
    return memory_config(backend("fx", sharing="shared", instances=1),
                         gateway=f"shared_park_limit = {LIMIT}")


async def ask(c: Client, message: str, *, id: int = 1, **extra: Any) -> dict[str, Any]:
    """A modern ``fx__elicit`` call on connection ``c``: its answer."""
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": CAPS}
    return await c.request("tools/call", {"name": "fx__elicit", "arguments": {"message": message},
                                          **extra, "_meta": meta}, id=id, timeout=60)


def prompt_of(r: dict[str, Any], message: str) -> tuple[str, str]:
    """The (key, state) of an InputRequiredResult that asks ``message``."""
    result = r["result"]
    assert result["resultType"] == "input_required", r
    (key, ask), = result["inputRequests"].items()
    assert ask["params"]["message"] == message
    return key, result["requestState"]


def answer_of(r: dict[str, Any]) -> Any:
    result = r["result"]
    assert result["resultType"] == "complete", r
    return json.loads(result["content"][0]["text"])


def accept(key: str, answer: str) -> dict[str, Any]:
    return {key: {"action": "accept", "content": {"answer": answer}}}


async def quiet(gw: Harness) -> None:
    """Nothing is left in flight (every call answered, nothing parked on the child)."""
    await settle()
    assert gw.status()["client_requests_in_flight"] == 0


@pytest.mark.system
async def test_an_abandoned_flow_is_preempted_for_another_callers_prompt() -> None:
    async with run_gateway(config()) as gw, httpx.AsyncClient() as c:
        port = gw.bound.admin_port
        _key, alice_state = asked(await call(c, gw.http_url, "alice?"), "alice?")
        parked = trio.current_time()  # alice never retries (in time)
        r = await call(c, gw.http_url, "bob?", id=2)
        waited = trio.current_time() - parked
        bob_key, bob_state = asked(r, "bob?")  # bob's prompt: not declined as unattributable
        print(f"bob's prompt {waited:.2f}s after alice's flow parked (limit {LIMIT}s)")
        assert LIMIT <= waited < LIMIT + 1
        r = await call(c, gw.http_url, "bob?", id=3, requestState=bob_state,
                       inputResponses={bob_key: {"action": "accept", "content": {"answer": "B"}}})
        assert answered(r)["content"] == {"answer": "B"}
        r = await call(c, gw.http_url, "alice?", id=4, requestState=alice_state,
                       inputResponses={"srv-1": {"action": "accept", "content": {"answer": "A"}}})
        error = r.json()["error"]
        assert r.status_code == 400 and error["data"]["reason"] == "invalid_state", r.text
        assert "shared_park_limit" in error["message"]
        assert await metric(port, "mcp_gateway_request_states_refused_total",
                            reason="preempted") == 1
        assert await metric(port, "mcp_gateway_unroutable_server_requests_total", backend="fx",
                            method="elicitation/create", reason="unattributable") == 0
        with trio.fail_after(5):
            await wait_status(port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)



async def test_a_flow_whose_caller_retries_within_the_limit_is_not_preempted(
        autojump_clock: Clock) -> None:
    async with (running(memory_setup()) as gw, gw.connect(initialize=False) as alice,
                gw.connect(initialize=False) as bob):
        alice_key, alice_state = prompt_of(await ask(alice, "alice?"), "alice?")
        parked = trio.current_time()
        async with trio.open_nursery() as nursery:
            got: list[dict[str, Any]] = []

            async def bob_calls() -> None:
                got.append(await ask(bob, "bob?", id=2))

            mark = len(gw.events)
            nursery.start_soon(bob_calls)
            # bob's call is in, waiting for alice's parked flow
            await gw.until(lambda: [e for e in gw.events[mark:]
                                    if isinstance(e, events.RequestStarted) and e.backend == "fx"])
            await settle()
            assert got == []
            r = await ask(alice, "alice?", id=3, requestState=alice_state,
                          inputResponses=accept(alice_key, "A"))
            assert trio.current_time() - parked < LIMIT  # retried within the limit
            assert answer_of(r)["content"] == {"answer": "A"}
        bob_key, bob_state = prompt_of(got[0], "bob?")
        r = await ask(bob, "bob?", id=4, requestState=bob_state,
                      inputResponses=accept(bob_key, "B"))
        assert answer_of(r)["content"] == {"answer": "B"}
        assert gw.metric("mcp_gateway_request_states_refused_total", reason="preempted") == 0
        await quiet(gw)


async def test_a_connections_parked_flow_is_preempted_and_the_connection_goes_on(
        autojump_clock: Clock) -> None:
    async with (running(memory_setup()) as gw, gw.connect(initialize=False) as alice,
                gw.connect(initialize=False) as bob):
        _key, alice_state = prompt_of(await ask(alice, "alice?"), "alice?")
        parked = trio.current_time()  # alice never retries (in time)
        r = await ask(bob, "bob?", id=2)
        # preempted at the limit; bob's round then gathers its requests for GATHER
        assert trio.current_time() - parked == pytest.approx(LIMIT + GATHER)
        bob_key, bob_state = prompt_of(r, "bob?")  # bob's prompt: not declined as unattributable
        late = await ask(alice, "alice?", id=3, requestState=alice_state,
                         inputResponses={"s1": {"action": "decline"}})
        error = late["error"]
        assert error["data"]["reason"] == "invalid_state", late
        assert "shared_park_limit" in error["message"]
        meta = {"io.modelcontextprotocol/protocolVersion": V,
                "io.modelcontextprotocol/clientCapabilities": CAPS}
        echo = await alice.request("tools/call", {"name": "fx__echo",
                                                  "arguments": {"message": "on"}, "_meta": meta},
                                   id=4)
        assert echo["result"]["content"][0]["text"] == "on"  # the connection goes on
        r = await ask(bob, "bob?", id=5, requestState=bob_state,
                      inputResponses=accept(bob_key, "B"))
        assert answer_of(r)["content"] == {"answer": "B"}
        assert gw.metric("mcp_gateway_request_states_refused_total", reason="preempted") == 1
        assert gw.metric("mcp_gateway_unroutable_server_requests_total", backend="fx",
                         method="elicitation/create", reason="unattributable") == 0
        await quiet(gw)
