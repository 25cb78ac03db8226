"""FairQueue: a bound on calls in flight to a child, owners taking turns beyond it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.fairness import FairQueue


def test_round_robin_between_owners_fifo_within_one() -> None:
    q: FairQueue[str, str] = FairQueue(1)
    assert q.try_admit()
    for item in ("a1", "a2", "a3"):
        q.enqueue("a", item)
    q.enqueue("b", "b1")
    q.enqueue("c", "c1")
    assert not q.try_admit()  # full, and others are queued
    order = [q.release() for _ in range(5)]
    assert order == ["a1", "b1", "c1", "a2", "a3"]
    assert q.release() is None and q.inflight == 0 and q.waiting == 0


def test_withdraw_and_drain() -> None:
    q: FairQueue[str, str] = FairQueue(1)
    assert q.try_admit()
    q.enqueue("a", "a1")
    q.enqueue("a", "a2")
    assert q.withdraw("a", "a1") and not q.withdraw("a", "a1")
    assert q.waiting == 1
    assert q.drain() == ["a2"] and q.inflight == 2 and q.waiting == 0
    with pytest.raises(ValueError):
        FairQueue(0)


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 4),
       steps=st.lists(st.tuples(st.sampled_from(["call", "end", "give_up"]), st.integers(0, 3)),
                      max_size=60))
def test_never_over_the_limit_and_no_owner_waits_more_than_one_round(
    limit: int, steps: list[tuple[str, int]]
) -> None:
    q: FairQueue[int, int] = FairQueue(limit)
    running: list[int] = []
    queued: list[tuple[int, int]] = []  # (owner, item) in the order they queued
    others_served: Counter[int] = Counter()  # per queued item: slots given to other owners meanwhile
    own_served: Counter[int] = Counter()  # per queued item: slots given to its own owner meanwhile
    owners = 4
    next_item = 0
    for action, owner in steps:
        if action == "call":
            next_item += 1
            if q.try_admit():
                running.append(next_item)
            else:
                q.enqueue(owner, next_item)
                queued.append((owner, next_item))
        elif action == "end" and running:
            running.pop(0)
            item = q.release()
            if item is not None:
                owner_of = dict((i, o) for o, i in queued)[item]
                queued.remove((owner_of, item))
                running.append(item)
                for o, i in queued:
                    (own_served if o == owner_of else others_served)[i] += 1
        elif action == "give_up" and queued:
            o, i = queued.pop()
            assert q.withdraw(o, i)
        assert len(running) == q.inflight <= limit
        assert q.waiting == len(queued)
        for _, i in queued:  # round-robin: between two turns of its owner, each other owner
            # gets at most one slot
            assert others_served[i] <= (own_served[i] + 1) * (owners - 1)
