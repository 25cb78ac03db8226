"""ByteBudget, ConnectionSlots and PrincipalCaps: the daemon-wide and per-principal limits, as plain
data (no trio)."""

from __future__ import annotations

import pytest

from gateway.limits import (
    DEFAULT_CAPS,
    ByteBudget,
    CapReached,
    ConnectionSlots,
    Held,
    PrincipalCaps,
    PrincipalLimit,
)


def test_charge_and_release_move_the_total_and_the_account() -> None:
    budget = ByteBudget(1000)
    a, b = budget.open("a", lambda: None), budget.open("child b")
    a.charge(100)
    b.charge(50)
    assert (budget.total, a.held, b.held) == (150, 100, 50)
    a.release(60)
    assert (budget.total, a.held) == (90, 40)


def test_close_releases_what_is_left_exactly_once() -> None:
    budget = ByteBudget(1000)
    a = budget.open("a", lambda: None)
    a.charge(300)
    a.release(100)
    a.close()
    assert budget.total == 0 and a.held == 0
    a.release(200)  # the writer finishing after the drop: already released
    a.close()
    a.charge(10)  # a closed account takes nothing
    assert budget.total == 0
    assert a not in budget.accounts


def test_admits_refusable_bytes_only_while_they_fit() -> None:
    budget = ByteBudget(100)
    a = budget.open("a", lambda: None)
    a.charge(60)
    assert budget.admits(40)
    assert not budget.admits(41)


def test_overrun_evicts_the_client_account_holding_the_most() -> None:
    evicted: list[str] = []
    budget = ByteBudget(100)
    small = budget.open("small", lambda: evicted.append("small"))
    big = budget.open("big", lambda: evicted.append("big"))
    child = budget.open("child")  # holds the most, but is not a connection
    small.charge(10)
    big.charge(30)
    child.charge(60)
    assert evicted == []  # at the limit, not over it
    small.charge(1)
    assert evicted == ["big"]
    assert budget.evicting is big and budget.evictions == 1


def test_one_eviction_at_a_time_until_the_victim_is_closed() -> None:
    evicted: list[str] = []
    budget = ByteBudget(100)
    a = budget.open("a", lambda: evicted.append("a"))
    b = budget.open("b", lambda: evicted.append("b"))
    a.charge(70)
    b.charge(40)
    assert evicted == ["a"]
    b.charge(10)  # still over, but a's bytes are about to go: nobody else is cut off
    assert evicted == ["a"]
    a.close()
    assert budget.evicting is None and budget.total == 50
    b.charge(60)
    assert evicted == ["a", "b"]


def test_overrun_with_no_client_bytes_evicts_nobody() -> None:
    budget = ByteBudget(10)
    idle = budget.open("idle", lambda: (_ for _ in ()).throw(AssertionError("evicted")))
    child = budget.open("child")
    child.charge(20)
    assert budget.overrun() is None
    assert idle.held == 0


def test_every_account_closed_brings_the_total_back_to_zero() -> None:
    budget = ByteBudget(10**6)
    accounts = [budget.open(f"a{i}", lambda: None) for i in range(5)] + [budget.open("child")]
    for i, account in enumerate(accounts):
        account.charge(100 * (i + 1))
        account.release(10)
    for account in accounts:
        account.close()
    assert budget.total == 0 and not budget.accounts


def test_connection_slots_refuse_beyond_the_limit_and_count_it() -> None:
    refused: list[str] = []
    slots = ConnectionSlots(2, refused.append)
    assert slots.acquire("websocket") and slots.acquire("unix")
    assert not slots.acquire("websocket")
    assert not slots.acquire("unix")
    assert refused == ["websocket", "unix"] and slots.used == 2
    slots.release()
    assert slots.acquire("unix")
    assert refused == ["websocket", "unix"]


def test_sse_replay_log_is_bounded_in_bytes_and_knows_what_fell_out() -> None:
    """The replay log behind ``Last-Event-ID`` (gateway.transports.replay): ids unique per
    session and naming their stream; the oldest events pushed out past the byte bound, the
    change in bytes reported for the session's account, a resumption below the floor told."""
    from gateway.transports.replay import ReplayLog, format_id, parse_id

    log = ReplayLog(100)
    assert log.record(1, b"a" * 40, False) == (1, 40)
    assert log.next_seq() == 2  # a priming event's id: nothing kept
    assert log.record(0, b"b" * 40, False) == (3, 40)
    assert log.record(1, b"c" * 40, True) == (4, 40 - 40)  # pushed "a" out
    assert (log.bytes, log.floor) == (80, 1)
    assert [e.message[:1] for e in log.after(1, 0)] == [b"c"] and log.after(1, 4) == []
    assert log.record(2, b"x" * 101, False) == (5, 0) and log.floor == 5  # too big to keep
    assert parse_id(format_id(12, 345).decode()) == (12, 345)
    for bad in ("", "12", "-3", "1-²", "1-" + "9" * 50, "a-1"):
        assert parse_id(bad) is None, bad
    assert log.clear() == 80 and not log.entries


# ---- per principal: what each holds at once ----------------------------------------------------


def test_each_principal_holds_at_most_its_caps_defaults_unless_an_entry_says_otherwise() -> None:
    caps = PrincipalCaps([PrincipalLimit("ci-*", caps=(("max_sessions", 2),))])
    assert {cap: caps.cap_for(cap, "alice") for cap in DEFAULT_CAPS} == {
        "max_sessions": 64, "max_connections": 256, "max_listens": 64, "max_parked_flows": 16}
    assert caps.cap_for("max_sessions", "ci-7") == 2
    assert caps.cap_for("max_connections", "ci-7") == 256  # not set by the entry: the default
    held = [caps.acquire("max_sessions", "ci-7") for _ in range(2)]
    with pytest.raises(CapReached) as refused:
        caps.acquire("max_sessions", "ci-7")
    assert refused.value.code == -32006
    assert refused.value.error_data() == {"reason": "rate_limited", "limit": "max_sessions",
                                          "value": 2}
    assert caps.acquire("max_sessions", "ci-8") is not None  # another principal: its own count
    assert caps.acquire("max_connections", "ci-7") is not None  # another cap: its own count
    held[0].release()
    held[0].release()  # once only
    assert caps.held("max_sessions", "ci-7") == 1
    caps.acquire("max_sessions", "ci-7")
    with pytest.raises(CapReached):
        caps.acquire("max_sessions", "ci-7")


def test_anonymous_callers_are_not_counted() -> None:
    caps = PrincipalCaps([PrincipalLimit("*", caps=(("max_listens", 1),))])
    for _ in range(5):
        caps.acquire("max_listens", None).release()
        caps.acquire("max_listens", None)
    assert caps.held("max_listens", "") == 0


def test_a_reload_changes_the_caps_not_the_counts() -> None:
    caps = PrincipalCaps()
    held = [caps.acquire("max_parked_flows", "bob") for _ in range(3)]
    caps.reconfigure([PrincipalLimit("bob", caps=(("max_parked_flows", 3),))])
    with pytest.raises(CapReached):
        caps.acquire("max_parked_flows", "bob")
    for h in held:
        h.release()
    assert caps.held("max_parked_flows", "bob") == 0


def test_the_count_is_exact_under_any_interleaving_of_acquires_and_releases() -> None:
    import random
    rng = random.Random(7)
    caps = PrincipalCaps([PrincipalLimit("p", caps=(("max_connections", 5),))])
    live: list[Held] = []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            live.pop(rng.randrange(len(live))).release()
        else:
            try:
                live.append(caps.acquire("max_connections", "p"))
            except CapReached:
                assert len(live) == 5
        assert caps.held("max_connections", "p") == len(live) <= 5
