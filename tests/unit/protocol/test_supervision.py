"""The backend lifecycle state machine: the transition table, backoff, crash-loop detection."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gateway.protocol.supervision import (
    RENEW_AFTER,
    STABLE_AFTER,
    IllegalTransition,
    RestartPolicy,
    State,
    Supervision,
    Transition,
)

S = State

Op = Callable[[Supervision], Transition]

OPS: dict[str, Op] = {
    "start": lambda s: s.start(),
    "ready": lambda s: s.ready(0.0),
    "missed_ping": lambda s: s.missed_ping(),
    "healthy": lambda s: s.healthy(),
    "exited": lambda s: s.exited(0.0, "crashed"),
    "recycled": lambda s: s.recycled(0.0),
    "renewed": lambda s: s.renewed(5.0, "session expired"),
    "starved": lambda s: s.starved("spawn failed for lack of resources"),
    "authorizing": lambda s: s.authorizing("awaiting authorization"),
    "stop": lambda s: s.stop(),
    "stopped": lambda s: s.stopped(),
}

# (operation, state before) -> state after; every pair not listed is illegal.
LEGAL: dict[tuple[str, State], State] = {
    ("start", S.STOPPED): S.STARTING,
    ("start", S.BACKOFF): S.STARTING,
    ("start", S.FATAL): S.STARTING,
    ("start", S.AUTHORIZING): S.STARTING,
    ("authorizing", S.STARTING): S.AUTHORIZING,
    ("authorizing", S.RUNNING): S.AUTHORIZING,
    ("authorizing", S.UNHEALTHY): S.AUTHORIZING,
    ("stop", S.AUTHORIZING): S.STOPPING,
    ("ready", S.STARTING): S.RUNNING,
    ("missed_ping", S.RUNNING): S.UNHEALTHY,
    ("missed_ping", S.UNHEALTHY): S.UNHEALTHY,
    ("healthy", S.UNHEALTHY): S.RUNNING,
    ("exited", S.STARTING): S.BACKOFF,
    ("exited", S.RUNNING): S.BACKOFF,
    ("exited", S.UNHEALTHY): S.BACKOFF,
    ("recycled", S.RUNNING): S.STARTING,
    ("recycled", S.UNHEALTHY): S.STARTING,
    ("renewed", S.RUNNING): S.STARTING,
    ("renewed", S.UNHEALTHY): S.STARTING,
    ("starved", S.STARTING): S.BACKOFF,
    ("stop", S.STARTING): S.STOPPING,
    ("stop", S.RUNNING): S.STOPPING,
    ("stop", S.UNHEALTHY): S.STOPPING,
    ("stop", S.BACKOFF): S.STOPPING,
    ("stop", S.FATAL): S.STOPPING,
    ("stopped", S.STOPPING): S.STOPPED,
}

# How to reach each state through legal operations only.
PATHS: dict[State, list[str]] = {
    S.STOPPED: [],
    S.STARTING: ["start"],
    S.RUNNING: ["start", "ready"],
    S.UNHEALTHY: ["start", "ready", "missed_ping"],
    S.BACKOFF: ["start", "exited"],
    S.FATAL: ["start", "exited"],  # with max_restarts=0 the first exit is fatal
    S.STOPPING: ["start", "stop"],
    S.AUTHORIZING: ["start", "authorizing"],
}


def machine_in(state: State) -> Supervision:
    policy = RestartPolicy(max_restarts=0 if state is S.FATAL else 5)
    sup = Supervision(policy, random.Random(0))
    for op in PATHS[state]:
        OPS[op](sup)
    assert sup.state is state
    return sup


ALL_PAIRS = [(op, state) for op in OPS for state in State]


@pytest.mark.parametrize(("op", "state"), [p for p in ALL_PAIRS if p in LEGAL])
def test_legal_transitions(op: str, state: State) -> None:
    sup = machine_in(state)
    t = OPS[op](sup)
    expected = LEGAL[(op, state)]
    assert (t.old, t.new) == (state, expected)
    assert sup.state is expected
    assert isinstance(t.reason, str) and t.reason
    if expected is S.BACKOFF:
        assert t.delay is not None and t.delay > 0
    else:
        assert t.delay is None


@pytest.mark.parametrize(("op", "state"), [p for p in ALL_PAIRS if p not in LEGAL])
def test_illegal_transitions_raise_and_change_nothing(op: str, state: State) -> None:
    sup = machine_in(state)
    with pytest.raises(IllegalTransition):
        OPS[op](sup)
    assert sup.state is state


def test_exit_can_be_fatal_from_every_live_running_state() -> None:
    for path in (["start"], ["start", "ready"], ["start", "ready", "missed_ping"]):
        sup = Supervision(RestartPolicy(max_restarts=0), random.Random(0))
        for op in path:
            OPS[op](sup)
        t = sup.exited(0.0, "crashed")
        assert t.new is S.FATAL and t.delay is None
        assert "crashed" in t.reason


def test_start_counts_starts() -> None:
    sup = Supervision(RestartPolicy(), random.Random(0))
    sup.start()
    sup.exited(1.0, "crashed")
    sup.start()
    assert sup.starts == 2


def test_uptime_only_while_up() -> None:
    sup = Supervision(RestartPolicy(), random.Random(0))
    assert sup.uptime(5.0) is None
    sup.start()
    assert sup.uptime(5.0) is None
    sup.ready(10.0)
    assert sup.uptime(12.5) == 2.5
    sup.missed_ping()
    assert sup.uptime(13.0) == 3.0
    sup.stop()
    assert sup.uptime(14.0) is None


# ---- backoff ----------------------------------------------------------------------------


def crash_loop(
    sup: Supervision, count: int, *, spacing: float = 0.0, run_for: float = 0.0
) -> list[float]:
    """``count`` start → (ready) → exit cycles; returns the BACKOFF delays."""
    delays = []
    now = 0.0
    for _ in range(count):
        sup.start()
        if run_for:
            sup.ready(now)
            now += run_for
        t = sup.exited(now, "crashed")
        assert t.new is S.BACKOFF
        assert t.delay is not None
        delays.append(t.delay)
        now += spacing
    return delays


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    policy = RestartPolicy(backoff_initial=0.5, backoff_max=10.0, max_restarts=1000, window=60.0)
    delays = crash_loop(Supervision(policy, random.Random(42)), 12)
    bases = [min(10.0, 0.5 * 2**i) for i in range(12)]  # 0.5 1 2 4 8 10 10 …
    ref = random.Random(42)
    for delay, base in zip(delays, bases, strict=True):
        assert base / 2 <= delay <= base
        assert delay == pytest.approx(base * (0.5 + 0.5 * ref.random()))
    assert max(delays) <= 10.0


@pytest.mark.parametrize("seed", range(20))
def test_jitter_stays_within_half_to_full_base(seed: int) -> None:
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=4.0, max_restarts=1000)
    delays = crash_loop(Supervision(policy, random.Random(seed)), 6)
    for delay, base in zip(delays, [1.0, 2.0, 4.0, 4.0, 4.0, 4.0], strict=True):
        assert base / 2 <= delay <= base


def test_same_seed_same_delays() -> None:
    policy = RestartPolicy(max_restarts=100)
    a = crash_loop(Supervision(policy, random.Random(7)), 5)
    b = crash_loop(Supervision(policy, random.Random(7)), 5)
    assert a == b


def test_stable_run_resets_the_backoff() -> None:
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=60.0, max_restarts=1000, window=1.0)
    sup = Supervision(policy, random.Random(3))
    delays = crash_loop(sup, 4, spacing=2.0)  # 1, 2, 4, 8 (bases)
    assert delays[-1] >= 4.0
    # A run of exactly STABLE_AFTER counts as stable: back to the initial delay.
    sup.start()
    sup.ready(100.0)
    t = sup.exited(100.0 + STABLE_AFTER, "crashed")
    assert t.delay is not None and 0.5 <= t.delay <= 1.0
    # A short run right after does not reset again: the backoff grows from there.
    sup.start()
    sup.ready(200.0)
    t = sup.exited(200.0 + STABLE_AFTER / 2, "crashed")
    assert t.delay is not None and 1.0 <= t.delay <= 2.0


def test_short_runs_do_not_reset_the_backoff() -> None:
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=60.0, max_restarts=1000, window=1.0)
    sup = Supervision(policy, random.Random(3))
    delays = crash_loop(sup, 4, spacing=100.0, run_for=STABLE_AFTER - 0.5)
    assert 4.0 <= delays[-1] <= 8.0


# ---- crash loop -------------------------------------------------------------------------


def test_more_than_max_restarts_within_the_window_is_fatal() -> None:
    policy = RestartPolicy(max_restarts=3, window=60.0)
    sup = Supervision(policy, random.Random(0))
    for i in range(3):
        sup.start()
        assert sup.exited(float(i), "crashed").new is S.BACKOFF
    sup.start()
    t = sup.exited(3.0, "crashed")
    assert t.new is S.FATAL
    assert "4 failures" in t.reason
    with pytest.raises(IllegalTransition):
        sup.exited(4.0, "crashed")


def test_failures_older_than_the_window_are_forgotten() -> None:
    policy = RestartPolicy(max_restarts=2, window=60.0)
    sup = Supervision(policy, random.Random(0))
    for now in (0.0, 20.0):
        sup.start()
        assert sup.exited(now, "crashed").new is S.BACKOFF
    # t=60: the failure at 0 is exactly a window old, so out; the one at 20 is in.
    sup.start()
    assert sup.exited(60.0, "crashed").new is S.BACKOFF
    # t=71: failures at 20, 60, 71 → 3 > 2 → FATAL.
    sup.start()
    assert sup.exited(71.0, "crashed").new is S.FATAL


def test_failures_spread_out_never_become_fatal() -> None:
    policy = RestartPolicy(max_restarts=1, window=10.0)
    sup = Supervision(policy, random.Random(0))
    for i in range(20):
        sup.start()
        assert sup.exited(i * 10.0, "crashed").new is S.BACKOFF


def test_start_from_fatal_clears_history() -> None:
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=60.0, max_restarts=2, window=60.0)
    sup = Supervision(policy, random.Random(0))
    for i in range(2):
        sup.start()
        sup.exited(float(i), "crashed")
    sup.start()
    assert sup.exited(2.0, "crashed").new is S.FATAL
    t = sup.start("operator restart")
    assert (t.old, t.new, t.reason) == (S.FATAL, S.STARTING, "operator restart")
    # History and backoff are fresh: the next exit within the same window is a BACKOFF
    # with the initial delay.
    t = sup.exited(3.0, "crashed")
    assert t.new is S.BACKOFF
    assert t.delay is not None and 0.5 <= t.delay <= 1.0
    sup.start()
    assert sup.exited(4.0, "crashed").new is S.BACKOFF
    sup.start()
    assert sup.exited(5.0, "crashed").new is S.FATAL


def test_stop_from_fatal_and_start_again() -> None:
    sup = Supervision(RestartPolicy(max_restarts=0), random.Random(0))
    sup.start()
    assert sup.exited(0.0, "crashed").new is S.FATAL
    sup.stop()
    sup.stopped()
    assert sup.start().new is S.STARTING


# ---- recycles (a restart the gateway chose) -----------------------------------------------


def test_recycles_never_count_toward_the_crash_loop() -> None:
    # max_restarts = 1: two failures in the window are FATAL; a hundred recycles are not.
    sup = Supervision(RestartPolicy(max_restarts=1, window=60.0), random.Random(0))
    sup.start()
    for i in range(100):
        sup.ready(float(i))
        t = sup.recycled(i + 0.5)
        assert (t.old, t.new, t.delay) == (S.RUNNING, S.STARTING, None)
    assert (sup.starts, sup.recycles) == (101, 100)
    sup.ready(200.0)
    assert sup.exited(200.1, "crashed").new is S.BACKOFF  # the first real failure: backoff only
    sup.start()
    sup.ready(200.2)
    assert sup.exited(200.3, "crashed").new is S.FATAL  # the second one within the window


def test_recycles_do_not_grow_the_backoff() -> None:
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=60.0, max_restarts=1000)
    sup = Supervision(policy, random.Random(3))
    sup.start()
    for i in range(10):
        sup.ready(float(i))
        sup.recycled(i + 0.1)
    sup.ready(20.0)
    t = sup.exited(20.1, "crashed")
    assert t.delay is not None and 0.5 <= t.delay <= 1.0


def test_a_session_is_renewed_at_once_unless_a_renewal_began_it_and_it_was_young() -> None:
    # A remote ending sessions that ran a while: a new one at once, never a failure; one
    # ending each at once: every other one a failure (backoff, then FATAL), not a tight loop.
    sup = Supervision(RestartPolicy(max_restarts=1, window=60.0), random.Random(0))
    sup.start()
    sup.ready(0.0)
    assert sup.renewed(0.1, "session expired").new is S.STARTING  # begun by a start: renewed
    for i in range(1, 10):
        sup.ready(10.0 * i)
        t = sup.renewed(10.0 * i + RENEW_AFTER, "session expired")
        assert (t.old, t.new, t.delay) == (S.RUNNING, S.STARTING, None)
    assert (sup.starts, sup.renewals, sup.recycles) == (11, 10, 0)
    sup.ready(200.0)
    assert sup.renewed(200.5, "session expired").new is S.BACKOFF  # young, begun by a renewal
    sup.start()
    sup.ready(201.0)
    assert sup.renewed(201.1, "session expired").new is S.STARTING  # begun by a start again
    sup.ready(201.2)
    assert sup.renewed(201.3, "session expired").new is S.FATAL
