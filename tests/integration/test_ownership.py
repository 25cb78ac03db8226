"""Server→client requests reach only their owner; sharing modes; spoofed answers.

The gateway runs in-process on virtual time (tests/memharness.py: memory backends that ask what
the fixture server asks, clients on memory streams).  One test stays on a real per-session child
over a real WebSocket (``system``): sampling forwarded with ``includeContext: none``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
import trio
import trio.testing
from helpers import Client, connect, fixture_backend, make_config, run_gateway, text_of
from memharness import Harness, backend, memory_config, running, sent, settle

from gateway.events import BackendExited

Clock = trio.testing.MockClock

ELICIT_CAPS = {"elicitation": {"form": {}}}


async def answer_own_prompts(client: Client, nonce: str, seen: list[dict[str, Any]]) -> None:
    """Answer every elicitation this client gets with its own nonce; record each prompt."""
    answered: set[Any] = set()
    while True:
        await client.wait_for(lambda: [r for r in client.requests if r["id"] not in answered])
        for req in [r for r in client.requests if r["id"] not in answered]:
            answered.add(req["id"])
            seen.append(req)
            await client.send({"jsonrpc": "2.0", "id": req["id"],
                               "result": {"action": "accept",
                                          "content": {"answer": f"answer-{nonce}"}}})


async def many_clients_elicit(gw: Harness,
                              n: int) -> list[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
    results: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = []

    async def one(i: int) -> None:
        nonce = f"n{i}-{secrets.token_hex(4)}"
        seen: list[dict[str, Any]] = []
        async with gw.connect(capabilities=ELICIT_CAPS) as c, trio.open_nursery() as nursery:
            nursery.start_soon(answer_own_prompts, c, nonce, seen)
            r = await c.call("fx__elicit", {"message": f"question-{nonce}"}, timeout=30)
            results.append((nonce, seen, r))
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


def check_own(results: list[tuple[str, list[dict[str, Any]], dict[str, Any]]], n: int) -> None:
    assert len(results) == n
    for nonce, seen, r in results:
        assert len(seen) == 1, f"{nonce} saw {len(seen)} prompts"
        assert seen[0]["method"] == "elicitation/create"
        assert seen[0]["params"]["message"] == f"question-{nonce}"  # only its own prompt
        body = json.loads(text_of(r))
        assert body == {"action": "accept", "content": {"answer": f"answer-{nonce}"},
                        "message": f"question-{nonce}"}


@pytest.mark.parametrize("mode", ["affine", "per-session"])
async def test_8_clients_elicit_concurrently(mode: str, autojump_clock: Clock) -> None:
    extra = {"sharing": mode, "instances": 2} if mode == "affine" else {"sharing": mode}
    cfg = memory_config(backend("fx", **extra))
    with trio.fail_after(60):
        async with running(cfg) as gw:
            results = await many_clients_elicit(gw, 8)
    check_own(results, 8)


async def test_per_session_children_are_distinct_and_capped(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", sharing="per-session", max_sessions=2))
    with trio.fail_after(30):
        async with running(cfg) as gw:
            async with gw.connect() as a, gw.connect() as b, gw.connect() as c:
                pid_a = json.loads(text_of(await a.call("fx__client_info")))["pid"]
                pid_b = json.loads(text_of(await b.call("fx__client_info")))["pid"]
                assert pid_a != pid_b
                over = await c.call("fx__client_info")
                assert over["error"]["code"] == -32006
                assert over["error"]["data"]["reason"] == "overloaded"
            # connections closed: their children are stopped, so a new connection fits again
            await settle()
            assert all(link.returncode == 0 for link in gw.links("fx")[1:])  # the probe stays
            async with gw.connect() as d:
                r = await d.call("fx__client_info")
                assert json.loads(text_of(r))["pid"] not in (pid_a, pid_b)


async def test_shared_two_connections_in_flight_is_refused_and_counted(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw:
            async with (gw.connect(capabilities=ELICIT_CAPS) as a,
                        gw.connect(capabilities=ELICIT_CAPS) as b):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(b.call, "fx__sleep", {"seconds": 1})
                    await settle()
                    r = await a.call("fx__elicit", {"message": "who-am-i"})
                # b's call has been answered: its connection left the attribution set
                # refused: the child got "decline"; nobody was asked
                assert json.loads(text_of(r))["action"] == "decline"
                assert a.requests == [] and b.requests == []
                # one connection in flight: routed to it
                seen: list[dict[str, Any]] = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(answer_own_prompts, a, "solo", seen)
                    r = await a.call("fx__elicit", {"message": "solo"})
                    nursery.cancel_scope.cancel()
                assert json.loads(text_of(r))["content"] == {"answer": "answer-solo"}
                assert len(seen) == 1 and b.requests == []
            metrics = gw.metrics_text()
            assert ('mcp_gateway_unroutable_server_requests_total{backend="fx",'
                    'method="elicitation/create",reason="unattributable"} 1.0') in metrics


async def test_answer_from_another_connection_is_refused(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw:
            async with gw.connect(capabilities=ELICIT_CAPS) as a, gw.connect() as b:
                async with trio.open_nursery() as nursery:
                    async def call() -> None:
                        nonlocal result
                        result = await a.call("fx__elicit", {"message": "mine"}, timeout=20)
                    result: dict[str, Any] = {}
                    nursery.start_soon(call)
                    prompt = await a.wait_for(lambda: a.requests and a.requests[0])
                    # b guesses a's id and answers it: refused, never reaches the child
                    await b.send({"jsonrpc": "2.0", "id": prompt["id"],
                                  "result": {"action": "accept", "content": {"answer": "stolen"}}})
                    await settle()
                    assert result == {}
                    assert [m for m in gw.link("fx").received if "method" not in m] == []
                    await a.send({"jsonrpc": "2.0", "id": prompt["id"],
                                  "result": {"action": "accept", "content": {"answer": "genuine"}}})
                assert json.loads(text_of(result))["content"] == {"answer": "genuine"}
            assert 'mcp_gateway_refused_answers_total{reason="unknown_id"} 1.0' in gw.metrics_text()


async def test_owner_disconnect_cancels_pending_prompt(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw:
            async with gw.connect(capabilities=ELICIT_CAPS) as a:
                await a.send({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                              "params": {"name": "fx__elicit", "arguments": {"message": "bye"}}})
                await a.wait_for(lambda: a.requests)
            # the owner left: the child was answered "cancel" and is free for the next client
            async with gw.connect(capabilities=ELICIT_CAPS) as c:
                r = await c.call("fx__echo", {"message": "still here"})
                assert text_of(r) == "still here"
                assert gw.status()["pending_server_requests"] == 0
                (answer,) = [m for m in gw.link("fx").received if "method" not in m]
                assert answer["result"] == {"action": "cancel"}


async def test_child_cancels_its_request_owner_is_told(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw:
            async with gw.connect(capabilities=ELICIT_CAPS) as a:
                await a.send({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                              "params": {"name": "fx__elicit", "arguments": {"message": "m"}}})
                prompt = await a.wait_for(lambda: a.requests and a.requests[0])
                # client cancels the call: the fixture withdraws its elicitation
                await a.notify("notifications/cancelled", {"requestId": 9})
                note = await a.wait_for(lambda: [n for n in a.notifications
                                                 if n["method"] == "notifications/cancelled"])
                assert note[0]["params"]["requestId"] == prompt["id"]
                await settle()
                assert 9 not in a.responses  # a cancelled call gets no response


async def test_client_without_capability_gets_clean_error(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw, gw.connect() as a:
            r = await a.call("fx__sample", {"prompt": "p"})
            assert "-32007" in text_of(r) and r["result"]["isError"] is True
            assert a.requests == []


async def test_roots_answered_from_config_in_shared_mode(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", roots=["file:///srv/data"]))
    with trio.fail_after(30):
        async with running(cfg) as gw, gw.connect(capabilities={"roots": {}}) as a:
            r = await a.call("fx__roots")
            assert json.loads(text_of(r)) == {"roots": [{"uri": "file:///srv/data"}]}
            assert a.requests == []  # never forwarded in shared mode


@pytest.mark.system
async def test_sampling_forwarded_with_include_context_none() -> None:
    cfg = make_config(fixture_backend("fx", sharing="per-session"))
    with trio.fail_after(30):
        async with (run_gateway(cfg) as gw,
                    connect(gw.url, capabilities={"sampling": {}, "roots": {}}) as a):
            async def answer() -> None:
                req = await a.wait_for(lambda: a.requests and a.requests[0])
                assert req["params"]["includeContext"] == "none"
                await a.send({"jsonrpc": "2.0", "id": req["id"], "result": {
                    "role": "assistant", "model": "m",
                    "content": {"type": "text", "text": "sampled"}}})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer)
                r = await a.call("fx__sample", {"prompt": "p"})
            assert json.loads(text_of(r))["content"]["text"] == "sampled"


async def test_per_session_child_stops_when_idle_and_restarts_on_use(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", sharing="per-session", idle_timeout=0.5))
    with trio.fail_after(30):
        async with running(cfg) as gw, gw.connect() as a:
            first = json.loads(text_of(await a.call("fx__client_info")))["pid"]
            # a call longer than the idle timeout keeps its child
            assert text_of(await a.call("fx__sleep", {"seconds": 1.0})) == "slept"
            assert json.loads(text_of(await a.call("fx__client_info")))["pid"] == first
            idle_from = trio.current_time()
            await gw.until(lambda: [e for e in gw.events if isinstance(e, BackendExited)])
            assert trio.current_time() - idle_from == pytest.approx(0.5)  # at idle_timeout
            await settle()  # idle: the child is stopped ...
            st = gw.status()
            assert [i["name"] for i in st["backends"][0]["instances"]] == ["fx/0"]  # only the probe
            second = json.loads(text_of(await a.call("fx__client_info")))["pid"]
            assert second != first  # ... and a new one starts on the next call


async def test_per_session_roots_are_the_clients_own(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx", sharing="per-session"))
    with trio.fail_after(30):
        async with (running(cfg) as gw,
                    gw.connect(capabilities={"roots": {"listChanged": True}}) as a):
            async def answer() -> None:
                req = await a.wait_for(lambda: [r for r in a.requests
                                                if r["method"] == "roots/list"])
                await a.send({"jsonrpc": "2.0", "id": req[0]["id"],
                              "result": {"roots": [{"uri": "file:///home/a"}]}})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer)
                r = await a.call("fx__roots")
            assert json.loads(text_of(r)) == {"roots": [{"uri": "file:///home/a"}]}
            await a.notify("notifications/roots/list_changed")
            await settle()
            (child,) = [link for link in gw.links("fx") if sent(link, "tools/call")]
            assert len(sent(child, "notifications/roots/list_changed")) == 1
            assert all(not sent(link, "notifications/roots/list_changed")
                       for link in gw.links("fx") if link is not child)  # its own child only
