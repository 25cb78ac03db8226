"""Every interleaving of answers, disconnects, cancels and timeouts closes a consent prompt once.

Hypothesis draws a sequence of events; the first decisive one must decide the outcome, nothing
after it may change it, and exactly one ServerRequestFinished is emitted.  Mock clock, no I/O.
"""

from __future__ import annotations

import json

import msgspec
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import config, errors
from gateway.core.policy import Policy
from gateway.core.session import ClientSession
from gateway.events import EventBus, ServerRequestFinished
from gateway.protocol import jsonrpc, mcp

TIMEOUT = 60.0
CFG = config.load(f'[policy]\nelicitation_timeout = {TIMEOUT}\nrules = [{{ match = "t", action = '
                  f'"ask" }}]\n')

ANSWERS = {
    "approve": {"result": {"action": "accept", "content": {"approve": True}}},
    "refuse": {"result": {"action": "accept", "content": {"approve": False}}},
    "decline": {"result": {"action": "decline"}},
    "dismiss": {"result": {"action": "cancel"}},
    "error": {"error": {"code": -32603, "message": "boom"}},
}
EVENT = st.one_of(
    st.sampled_from([*ANSWERS, "disconnect", "client_cancel", "spoof"]),
    st.floats(min_value=0.0, max_value=2 * TIMEOUT).map(lambda s: ("wait", s)),
)


def expected(events: list[object]) -> str:
    clock = 0.0
    for e in events:
        if isinstance(e, tuple):
            clock += e[1]
            if clock >= TIMEOUT:
                return "timeout"
        elif e == "approve":
            return "ok"
        elif e in ("refuse", "decline", "dismiss", "error", "disconnect"):
            return "declined"
        elif e == "client_cancel":
            return "cancelled"
    return "timeout"  # silence is not consent


async def scenario(events: list[object]) -> tuple[str, list[ServerRequestFinished], list[dict]]:
    bus = EventBus()
    finished: list[ServerRequestFinished] = []
    bus.subscribe(lambda e: finished.append(e) if isinstance(e, ServerRequestFinished) else None)
    policy = Policy(CFG.policy, bus, CFG)
    session = ClientSession("memory", outbound_capacity=64, max_inflight=8)
    session.initialize("2025-06-18", mcp.ClientCaps({"elicitation": {}}))
    outcome = "pending"
    scope = trio.CancelScope()

    async def call() -> None:
        nonlocal outcome
        with scope:
            try:
                await policy.authorize(session, "t", {"a": 1})
                outcome = "ok"
            except errors.Denied as exc:
                outcome = str(exc.reason)
            return
        outcome = "cancelled"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        prompt = json.loads(await session.outbound.receive())
        for e in events:
            if outcome != "pending":
                break
            if isinstance(e, tuple):
                await trio.sleep(e[1])  # virtual-time: trio.run with a MockClock below
            elif e in ANSWERS:
                session.on_answer(jsonrpc.decode(
                    msgspec.json.encode({"jsonrpc": "2.0", "id": prompt["id"], **ANSWERS[e]})))
            elif e == "spoof":
                other = ClientSession("memory", outbound_capacity=4, max_inflight=1)
                assert other.on_answer(jsonrpc.decode(msgspec.json.encode(
                    {"jsonrpc": "2.0", "id": prompt["id"], **ANSWERS["approve"]}))) == "refused"
            elif e == "disconnect":
                session.end_all_requests("owner_gone")
                session.close("client_closed")
            elif e == "client_cancel":
                scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
    sent = []
    while True:
        try:
            sent.append(json.loads(session.outbound.receive_nowait()))
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return outcome, finished, sent


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENT, max_size=6))
def test_every_interleaving_closes_exactly_once(events: list[object]) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    outcome, finished, sent = trio.run(scenario, events, clock=clock)
    assert outcome == expected(events)
    assert len(finished) == 1
    withdrawn = [m for m in sent if m.get("method") == "notifications/cancelled"]
    if outcome in ("timeout", "cancelled"):
        # the gateway withdraws its own prompt (unless the owner is already gone)
        assert len(withdrawn) == 1
    else:
        assert withdrawn == []
