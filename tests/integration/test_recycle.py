"""Recycling a shared child that leaves a cancelled call unanswered (README "Attribution").

A spec-following server never answers a cancelled request, and where attribution matters the
gateway must not guess that the call is over: past ``cancel_grace`` it recycles the child.  A
recycle drains first (no new calls; the calls already in flight, other clients' included, end
normally), is not a failure (never FATAL, however many), and is reported as ``recycled``.
Meanwhile the abandoned call stays in the attribution set: the child's requests stay refused.
"""

from __future__ import annotations

import json

import trio
from helpers import (
    Client,
    connect,
    fixture_backend,
    http_request,
    make_config,
    run_gateway,
    text_of,
    wait_instance,
)

ELICIT_CAPS = {"elicitation": {"form": {}}}


async def metric(port: int | None, name: str, **labels: str) -> float:
    _status, body = await http_request(port, "/metrics")
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in body.decode().splitlines():
        if line.startswith(f"mcp_gateway_{name}{{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def start_sleep(c: Client, id: str, seconds: float) -> None:
    await c.send({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                  "params": {"name": "fx__sleep",
                             "arguments": {"seconds": seconds, "message": id}}})


async def test_unanswered_cancels_recycle_without_hurting_bystanders_or_going_fatal() -> None:
    """The hostile-tester repro: A calls a slow tool and cancels it while bystander B has a call
    in flight.  B's call completes normally; eight such cancels in a row (more than
    max_restarts = 5 within the window) leave the backend RUNNING, counted as recycles."""
    cfg = make_config(fixture_backend("fx", cancel_grace=0.2, request_timeout=30.0))
    rounds = 8
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw, connect(gw.url) as a, connect(gw.url) as b:
            port = gw.bound.admin_port
            for i in range(rounds):
                pid = json.loads(text_of(await b.call("fx__client_info")))["pid"]
                await start_sleep(a, f"a{i}", 30)
                await start_sleep(b, f"b{i}", 1.5)
                await wait_instance(port, lambda s: s["inflight"] == 2)
                await a.notify("notifications/cancelled", {"requestId": f"a{i}"})
                # past cancel_grace: the instance drains (B's call is still in flight)
                await wait_instance(port, lambda s: s["draining"])
                assert f"b{i}" not in b.responses
                # a new call now waits for the recycled child instead of joining the drained one
                await a.send({"jsonrpc": "2.0", "id": f"n{i}", "method": "tools/call",
                              "params": {"name": "fx__client_info", "arguments": {}}})
                r = await b.response(f"b{i}")
                assert text_of(r) == f"b{i}", r  # the bystander's call ended normally
                new = await a.response(f"n{i}")
                assert json.loads(text_of(new))["pid"] != pid, new  # served by the next child
                inst = await wait_instance(port, lambda s,
                                         n=i + 1: s["recycles"] == n and s["state"] == "RUNNING")
                assert not inst["draining"]
            assert f"a{rounds - 1}" not in a.responses  # a cancelled call gets no response
            inst = await wait_instance(port, lambda s: s["state"] == "RUNNING")
            assert (inst["restarts"], inst["recycles"]) == (rounds, rounds), inst
            assert inst["last_exit"].startswith("recycled"), inst
            assert await metric(port, "backend_exits_total", backend="fx",
                                reason="recycled") == rounds
            assert await metric(port, "backend_exits_total", backend="fx", reason="unhealthy") == 0
            assert text_of(await b.call("fx__echo", {"message": "still up"})) == "still up"


async def test_a_call_during_a_long_drain_gets_a_retryable_backend_unavailable() -> None:
    """New calls wait for a draining instance as for a restarting one: up to restart_wait,
    then -32001 with retryable: true, while the call in flight still ends normally."""
    cfg = make_config(fixture_backend("fx", cancel_grace=0.2, request_timeout=30.0),
                      gateway="restart_wait = 0.3")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as a, connect(gw.url) as b:
            port = gw.bound.admin_port
            await start_sleep(a, "a", 30)
            await start_sleep(b, "b", 3)
            await wait_instance(port, lambda s: s["inflight"] == 2)
            await a.notify("notifications/cancelled", {"requestId": "a"})
            await wait_instance(port, lambda s: s["draining"])
            r = await a.call("fx__echo", {"message": "x"})
            assert r["error"]["code"] == -32001, r
            assert r["error"]["data"]["reason"] == "backend_unavailable" and r["error"]["data"][
                "retryable"] is True, r
            assert "b" not in b.responses
            assert text_of(await b.response("b")) == "b"
            await wait_instance(port, lambda s: s["recycles"] == 1 and s["state"] == "RUNNING")
            assert text_of(await a.call("fx__echo", {"message": "y"})) == "y"


async def test_a_childs_request_while_draining_is_still_refused() -> None:
    """After cancel_grace, while another connection's call is in flight on the draining child,
    a server->client request from the child is not attributed to anybody: A's abandoned call
    may be the one asking.  The child is answered decline and the refusal is counted."""
    cfg = make_config(fixture_backend("fx", cancel_grace=0.2, request_timeout=30.0))
    with trio.fail_after(30):
        async with (run_gateway(cfg) as gw, connect(gw.url, capabilities=ELICIT_CAPS) as a,
                    connect(gw.url, capabilities=ELICIT_CAPS) as b):
            port = gw.bound.admin_port
            await start_sleep(a, "a", 30)
            await b.send({"jsonrpc": "2.0", "id": "b", "method": "tools/call",
                          "params": {"name": "fx__elicit",
                                     "arguments": {"message": "who?", "delay": 2.0}}})
            await wait_instance(port, lambda s: s["inflight"] == 2)
            await a.notify("notifications/cancelled", {"requestId": "a"})
            await wait_instance(port, lambda s: s["draining"])
            assert "b" not in b.responses  # the elicitation is asked only after the drain began
            r = await b.response("b")
            assert json.loads(text_of(r))["action"] == "decline", r
            assert not a.requests and not b.requests  # nobody was asked
            assert await metric(port, "unroutable_server_requests_total", backend="fx",
                                method="elicitation/create", reason="unattributable") == 1
            await wait_instance(port, lambda s: s["recycles"] == 1 and s["state"] == "RUNNING")
