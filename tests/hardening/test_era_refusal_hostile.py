"""The documented refusal of era bridging on a modern (2026-07-28) WebSocket or unix-socket
connection with several requests in flight (README, era bridging): a legacy child's server
request cannot be proven to come from one of them, so the gateway answers the child itself,
``sampling/createMessage`` with -32007 ``data.reason = "unattributable"``, ``elicitation/create``
with ``decline``.  The refusal must stay clean: the asking call gets the child's answer to it,
the other requests are unaffected, nothing hangs, nothing is logged above a warning, and the
connection bridges again once one request is in flight."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from helpers import Client, fixture_backend, text_of
from invariants import Daemon, DaemonSlot, baseline, check

pytestmark = pytest.mark.system

V = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": V,
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}, "sampling": {}}}
SLEEP = 0.5  # seconds the other request stays in flight
BOUND = 5.0  # seconds for every request of a scenario to be answered
SAMPLED = {"role": "assistant", "content": {"type": "text", "text": "sampled"}, "model": "m"}


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("era"), fixture_backend("fx"))
    yield s
    s.close()


async def call(c: Client, tool: str, args: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A modern tools/call on ``c`` (its own _meta, no initialize)."""
    return await c.request("tools/call", {"name": tool, "arguments": args, "_meta": META, **extra})


async def together(daemon: Daemon, c: Client,
                   *calls: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` sent one after another, each once the one before is at the child (polled:
    the daemon is another process), all in flight at once; their answers, in order."""
    at_child = (await daemon.instance("fx"))["inflight"]
    ids = []
    for i, (tool, args) in enumerate(calls):
        ids.append(rid := f"together-{secrets.token_hex(4)}")
        await c.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                      "params": {"name": tool, "arguments": args, "_meta": META}})
        if i < len(calls) - 1:
            at_child += 1
            await daemon.instance_until("fx", lambda inst, n=at_child: inst["inflight"] >= n)
    return [await c.response(rid, timeout=BOUND) for rid in ids]


def refused_sampling(answer: dict[str, Any], in_flight: int) -> None:
    """The child's sampling request was answered -32007 unattributable by the gateway."""
    result = answer["result"]
    assert result["isError"] is True and result["resultType"] == "complete", result
    error = result["structuredContent"]["error"]
    assert error["code"] == -32007 and error["data"] == {"reason": "unattributable"}, error
    message = f"{in_flight} requests of the calling modern connection are in flight"
    assert message in error["message"], error


@pytest.mark.parametrize("transport", ["websocket", "unix"])
async def test_several_requests_in_flight_refuse_bridging_cleanly(daemon: Daemon,
                                                                 transport: str) -> None:
    """On one modern connection: a sleep in flight, then a sampling call: refused -32007
    (unattributable), the sleep answered as usual.  Two sleeps and an elicitation: declined.
    A parked flow (input_required) counts as in flight: a sampling call beside it is refused,
    and the parked flow still completes on its retry.  Alone again, a sampling call is bridged."""
    base, mark = await baseline(daemon), len(daemon.lines)
    refusals = await daemon.metric("mcp_gateway_unroutable_server_requests_total",
                                   reason="unattributable")
    async with daemon.client(transport, initialize=False) as c:
        with trio.fail_after(BOUND):
            start = trio.current_time()
            slept, sampled = await together(daemon, c, ("fx__sleep", {"seconds": SLEEP}),
                                            ("fx__sample", {"prompt": "p"}))
            assert text_of(slept) == "slept" and "isError" not in slept["result"], slept
            refused_sampling(sampled, 2)
            assert trio.current_time() - start < SLEEP + 2.0  # the sample did not wait for it

            *sleeps, elicited = await together(daemon, c, ("fx__sleep", {"seconds": SLEEP}),
                                               ("fx__sleep", {"seconds": SLEEP}),
                                               ("fx__elicit", {"message": "name?"}))
            assert [text_of(s) for s in sleeps] == ["slept", "slept"]
            assert json.loads(text_of(elicited))["action"] == "decline", elicited

            parked = (await call(c, "fx__elicit", {"message": "who?"}))["result"]
            assert parked["resultType"] == "input_required", parked
            refused_sampling(await call(c, "fx__sample", {"prompt": "p"}), 2)
            (key,) = parked["inputRequests"]
            accept = {"action": "accept", "content": {"answer": "Ada"}}
            done = await call(c, "fx__elicit", {"message": "who?"},
                              requestState=parked["requestState"], inputResponses={key: accept})
            assert json.loads(text_of(done))["content"] == {"answer": "Ada"}, done

            alone = (await call(c, "fx__sample", {"prompt": "p"}))["result"]
            assert alone["resultType"] == "input_required", alone
            (key,) = alone["inputRequests"]
            done = await call(c, "fx__sample", {"prompt": "p"}, requestState=alone["requestState"],
                              inputResponses={key: SAMPLED})
            assert json.loads(text_of(done))["content"]["text"] == "sampled", done
    assert await daemon.metric("mcp_gateway_unroutable_server_requests_total",
                               reason="unattributable") == refusals + 3
    await check(daemon, base)
    assert not daemon.failures(mark), daemon.failures(mark)


@pytest.mark.parametrize("transport", ["websocket", "unix"])
async def test_an_open_listen_does_not_count_as_a_call_in_flight(daemon: Daemon,
                                                                 transport: str) -> None:
    """A modern client keeps ``subscriptions/listen`` open for its connection's life; the
    gateway serves it, no child ever sees it.  It counted as a request in flight, so with a
    listen open every child's elicitation was declined and every sampling refused -32007
    ("2 requests ... in flight"): bridging never happened on such a connection.  Now a lone
    call is bridged beside a listen, and a sleep plus a sampling call are two, not three."""
    base, mark = await baseline(daemon), len(daemon.lines)
    async with daemon.client(transport, initialize=False) as c:
        with trio.fail_after(BOUND):
            await c.send({"jsonrpc": "2.0", "id": "listen", "method": "subscriptions/listen",
                          "params": {"notifications": {"toolsListChanged": True}, "_meta": META}})
            await c.wait_for(lambda: c.notifications)  # acknowledged: the listen is open
            parked = (await call(c, "fx__elicit", {"message": "who?"}))["result"]
            assert parked["resultType"] == "input_required", parked
            (key,) = parked["inputRequests"]
            accept = {"action": "accept", "content": {"answer": "Ada"}}
            done = await call(c, "fx__elicit", {"message": "who?"},
                              requestState=parked["requestState"], inputResponses={key: accept})
            assert json.loads(text_of(done))["content"] == {"answer": "Ada"}, done
            slept, sampled = await together(daemon, c, ("fx__sleep", {"seconds": SLEEP}),
                                            ("fx__sample", {"prompt": "p"}))
            assert text_of(slept) == "slept"
            refused_sampling(sampled, 2)
            await c.notify("notifications/cancelled", {"requestId": "listen"})
            await c.response("listen")  # the listen's closing result
    await check(daemon, base)
    assert not daemon.failures(mark), daemon.failures(mark)
