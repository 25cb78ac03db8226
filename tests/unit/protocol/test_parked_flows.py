"""Parked bridged flows on a shared child, decided without I/O: which ones another caller's call
that may ask for input waits for, which are preempted and when (gateway.protocol.mrtr.park_wait),
and a preempted flow's call given up without ``notifications/cancelled`` (the routing core)."""

from __future__ import annotations

import math

from msgspec import Raw

from gateway.protocol.mrtr import ParkWait, park_wait
from gateway.protocol.routing import CallState, ChildRouter, Finished, Settled

LIMIT = 30.0


def test_nothing_parked_nothing_waits() -> None:
    assert park_wait({}, False, now=100, limit=LIMIT) is None


def test_a_flow_parked_less_than_the_limit_is_waited_for_never_preempted() -> None:
    assert park_wait({"alice": 100}, False, now=105, limit=LIMIT) == ParkWait((), 130)
    assert park_wait({"alice": 100}, False, now=129.999, limit=LIMIT) == ParkWait((), 130)


def test_a_flow_parked_the_limit_or_longer_is_preempted_now() -> None:
    assert park_wait({"alice": 100}, False, now=130, limit=LIMIT) == ParkWait(("alice",), math.inf)
    # several: the due ones now, the next at its own limit
    decision = park_wait({"alice": 100, "carol": 110, "dave": 90}, False, now=131, limit=LIMIT)
    assert decision == ParkWait(("alice", "dave"), 140)


def test_a_preempted_flows_call_still_at_the_child_is_waited_for() -> None:
    assert park_wait({}, True, now=100, limit=LIMIT) == ParkWait((), math.inf)


def test_a_given_up_call_leaves_the_attribution_set_with_the_childs_reply_untold() -> None:
    r = ChildRouter("b", timeout=60)
    call = r.open_call("tools/call", owner="alice", handle=None, now=0)
    r.submit(call, b"line")
    actions = r.cancel(call, 5, notify=False)
    assert actions == [Finished(call, None, None)]  # no notifications/cancelled for the child
    assert call.state is CallState.ABANDONED and r.attribution() == {"alice"}
    assert r.reply(call.gid, Raw(b'{"content":[]}'), None) == [Settled()]  # dropped
    assert r.attribution() == set()
