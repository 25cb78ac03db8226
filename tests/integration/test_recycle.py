"""Recycling a shared child that leaves a cancelled call unanswered (README "Attribution").

A spec-following server never answers a cancelled request, and where attribution matters the
gateway must not guess that the call is over: past ``cancel_grace`` it recycles the child.  A
recycle drains first (no new calls; the calls already in flight, other clients' included, end
normally), is not a failure (never FATAL, however many), and is reported as ``recycled``.
Meanwhile the abandoned call stays in the attribution set: the child's requests stay refused.

The gateway runs in-process on virtual time (tests/memharness.py: a memory backend that never
answers a cancelled call, clients on memory streams).  One recycle stays on a real child over a
real WebSocket (``system``): the child is stopped and a new process serves the next call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    Client,
    connect,
    fixture_backend,
    make_config,
    run_gateway,
    text_of,
    wait_instance,
)
from memharness import Harness, backend, elapse, memory_config, running, settle

Clock = trio.testing.MockClock
ELICIT_CAPS = {"elicitation": {"form": {}}}


async def start_sleep(c: Client, id: str, seconds: float) -> None:
    await c.send({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                  "params": {"name": "fx__sleep",
                             "arguments": {"seconds": seconds, "message": id}}})


async def instance(gw: Harness, pred: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """The backend's instance once ``pred`` holds for it (re-checked at every bus event)."""
    def holds() -> dict[str, Any] | None:
        inst = gw.instance("fx")
        return inst if pred(inst) else None
    found: dict[str, Any] = await gw.until(holds)
    return found


async def drains_at_cancel_grace(gw: Harness) -> None:
    """Return once the instance drains, checking that it does so ``cancel_grace`` (0.2 s) after
    the cancel just sent (its drain is seen in the status, not on the bus)."""
    await elapse(0.19)
    await settle()
    assert not gw.instance("fx")["draining"]
    await elapse(0.02)
    await settle()
    assert gw.instance("fx")["draining"]


def exits(gw: Harness, reason: str) -> float:
    return gw.metric("mcp_gateway_backend_exits_total", backend="fx", reason=reason)


async def test_unanswered_cancels_recycle_without_hurting_bystanders_or_going_fatal(
        autojump_clock: Clock) -> None:
    """The hostile-tester repro: A calls a slow tool and cancels it while bystander B has a call
    in flight.  B's call completes normally; eight such cancels in a row (more than
    max_restarts = 5 within the window) leave the backend RUNNING, counted as recycles."""
    cfg = memory_config(backend("fx", cancel_grace=0.2, request_timeout=30.0))
    rounds = 8
    async with running(cfg) as gw, gw.connect() as a, gw.connect() as b:
        for i in range(rounds):
            pid = json.loads(text_of(await b.call("fx__client_info")))["pid"]
            await start_sleep(a, f"a{i}", 30)
            await start_sleep(b, f"b{i}", 1.5)
            await instance(gw, lambda s: s["inflight"] == 2)
            await a.notify("notifications/cancelled", {"requestId": f"a{i}"})
            # past cancel_grace: the instance drains (B's call is still in flight)
            await drains_at_cancel_grace(gw)
            assert f"b{i}" not in b.responses
            # a new call now waits for the recycled child instead of joining the drained one
            await a.send({"jsonrpc": "2.0", "id": f"n{i}", "method": "tools/call",
                          "params": {"name": "fx__client_info", "arguments": {}}})
            r = await b.response(f"b{i}")
            assert text_of(r) == f"b{i}", r  # the bystander's call ended normally
            new = await a.response(f"n{i}")
            assert json.loads(text_of(new))["pid"] != pid, new  # served by the next child
            inst = await instance(gw, lambda s, n=i + 1: s["recycles"] == n
                                  and s["state"] == "RUNNING")
            assert not inst["draining"]
        assert f"a{rounds - 1}" not in a.responses  # a cancelled call gets no response
        inst = gw.instance("fx")
        assert inst["state"] == "RUNNING"
        assert (inst["restarts"], inst["recycles"]) == (rounds, rounds), inst
        assert inst["last_exit"].startswith("recycled"), inst
        assert len(gw.links("fx")) == rounds + 1  # one new generation per recycle
        assert exits(gw, "recycled") == rounds
        assert exits(gw, "unhealthy") == 0
        assert text_of(await b.call("fx__echo", {"message": "still up"})) == "still up"


@pytest.mark.system
async def test_a_real_child_is_recycled_and_a_new_process_serves_the_next_call() -> None:
    cfg = make_config(fixture_backend("fx", cancel_grace=0.2, request_timeout=30.0))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as a, connect(gw.url) as b:
            port = gw.bound.admin_port
            pid = json.loads(text_of(await b.call("fx__client_info")))["pid"]
            await start_sleep(a, "a", 30)
            await start_sleep(b, "b", 1.5)
            await wait_instance(port, lambda s: s["inflight"] == 2)
            await a.notify("notifications/cancelled", {"requestId": "a"})
            await wait_instance(port, lambda s: s["draining"])
            assert "b" not in b.responses
            assert text_of(await b.response("b")) == "b"  # the bystander's call ended normally
            new = await a.call("fx__client_info")
            assert json.loads(text_of(new))["pid"] != pid, new  # served by the next child
            inst = await wait_instance(port, lambda s: s["recycles"] == 1
                                       and s["state"] == "RUNNING")
            assert inst["last_exit"].startswith("recycled"), inst
            assert "a" not in a.responses  # a cancelled call gets no response


async def test_a_call_during_a_long_drain_gets_a_retryable_backend_unavailable(
        autojump_clock: Clock) -> None:
    """New calls wait for a draining instance as for a restarting one: up to restart_wait,
    then -32001 with retryable: true, while the call in flight still ends normally."""
    cfg = memory_config(backend("fx", cancel_grace=0.2, request_timeout=30.0),
                        gateway="restart_wait = 0.3")
    async with running(cfg) as gw, gw.connect() as a, gw.connect() as b:
        await start_sleep(a, "a", 30)
        await start_sleep(b, "b", 3)
        await instance(gw, lambda s: s["inflight"] == 2)
        await a.notify("notifications/cancelled", {"requestId": "a"})
        await drains_at_cancel_grace(gw)
        start = trio.current_time()
        r = await a.call("fx__echo", {"message": "x"})
        assert trio.current_time() - start == pytest.approx(0.3)  # restart_wait
        assert r["error"]["code"] == -32001, r
        assert r["error"]["data"]["reason"] == "backend_unavailable" and r["error"]["data"][
            "retryable"] is True, r
        assert "b" not in b.responses
        assert text_of(await b.response("b")) == "b"
        await instance(gw, lambda s: s["recycles"] == 1 and s["state"] == "RUNNING")
        assert text_of(await a.call("fx__echo", {"message": "y"})) == "y"


async def test_a_childs_request_while_draining_is_still_refused(autojump_clock: Clock) -> None:
    """After cancel_grace, while another connection's call is in flight on the draining child,
    a server->client request from the child is not attributed to anybody: A's abandoned call
    may be the one asking.  The child is answered decline and the refusal is counted."""
    cfg = memory_config(backend("fx", cancel_grace=0.2, request_timeout=30.0))
    async with (running(cfg) as gw, gw.connect(capabilities=ELICIT_CAPS) as a,
                gw.connect(capabilities=ELICIT_CAPS) as b):
        await start_sleep(a, "a", 30)
        await b.send({"jsonrpc": "2.0", "id": "b", "method": "tools/call",
                      "params": {"name": "fx__elicit",
                                 "arguments": {"message": "who?", "delay": 2.0}}})
        await instance(gw, lambda s: s["inflight"] == 2)
        await a.notify("notifications/cancelled", {"requestId": "a"})
        await drains_at_cancel_grace(gw)
        assert "b" not in b.responses  # the elicitation is asked only after the drain began
        r = await b.response("b")
        assert json.loads(text_of(r))["action"] == "decline", r
        assert not a.requests and not b.requests  # nobody was asked
        assert gw.metric("mcp_gateway_unroutable_server_requests_total", backend="fx",
                         method="elicitation/create", reason="unattributable") == 1
        await instance(gw, lambda s: s["recycles"] == 1 and s["state"] == "RUNNING")
