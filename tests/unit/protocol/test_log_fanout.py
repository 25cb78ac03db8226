"""Who receives a backend's log line: its callers, else those who may see the backend; an owned
child speaks only to its owner; never a session whose view holds nothing of the backend."""

from __future__ import annotations

from gateway.protocol.catalog import BackendLists, backends_of, build_catalog
from gateway.protocol.logfanout import LogListener, log_recipients
from gateway.protocol.mcp import LOG_RANK

INFO, DEBUG, ERROR = LOG_RANK["info"], LOG_RANK["debug"], LOG_RANK["error"]


def lis(name: str, level: int = DEBUG, *, modern: bool = False,
        sees: bool = True) -> LogListener[str]:
    return LogListener(name, level, modern, sees)


def test_a_line_during_alices_call_goes_to_alice_only() -> None:
    listeners = [lis("alice"), lis("bob")]
    assert log_recipients(INFO, listeners, {"alice"}, "shared", None) == ["alice"]


def test_with_no_call_in_flight_it_goes_to_those_who_see_the_backend() -> None:
    listeners = [lis("alice"), lis("bob"), lis("hidden", sees=False)]
    assert log_recipients(INFO, listeners, set(), "shared", None) == ["alice", "bob"]


def test_never_to_a_caller_whose_view_holds_nothing_of_the_backend() -> None:
    # even one with a call in flight (a view changed by a reload while its call runs)
    assert log_recipients(INFO, [lis("bob", sees=False)], {"bob"}, "shared", None) == []
    assert log_recipients(INFO, [lis("bob", sees=False)], set(), "shared", None) == []


def test_the_level_each_asked_for() -> None:
    listeners = [lis("quiet", ERROR), lis("chatty", DEBUG)]
    assert log_recipients(INFO, listeners, set(), "shared", None) == ["chatty"]
    assert log_recipients(ERROR, listeners, set(), "shared", None) == ["quiet", "chatty"]


def test_a_modern_request_gets_lines_only_while_it_runs_at_the_child() -> None:
    listeners = [lis("m", modern=True), lis("legacy")]
    assert log_recipients(INFO, listeners, set(), "shared", None) == ["legacy"]
    assert log_recipients(INFO, listeners, {"m"}, "shared", None) == ["m"]


def test_an_owned_child_speaks_only_to_its_owner() -> None:
    listeners = [lis("alice"), lis("bob")]
    for sharing in ("affine", "per-session"):
        assert log_recipients(INFO, listeners, set(), sharing, "alice") == ["alice"]
        assert log_recipients(INFO, listeners, {"alice"}, sharing, "alice") == ["alice"]
        assert log_recipients(INFO, listeners, set(), sharing, None) == []  # held by nobody
        # a stale attribution member that is not the owner gets nothing either
        assert log_recipients(INFO, listeners, {"bob"}, sharing, "alice") == []


def test_backends_of_a_view_maps_each_item_through_the_routes() -> None:
    fx = BackendLists(tools=[{"name": "echo"}], resources=[{"uri": "fixture://a"}])
    other = BackendLists(prompts=[{"name": "greet"}], templates=[{"uriTemplate": "o://{id}"}])
    cat, _ = build_catalog([("fx", "fx", fx), ("other", "other", other)], "__")
    assert backends_of(cat, cat.tools, cat.prompts, cat.resources, cat.templates) == {"fx", "other"}
    assert backends_of(cat, [], [], [], cat.templates) == {"other"}
    assert backends_of(cat, [], [], cat.resources, []) == {"fx"}
    assert backends_of(cat, [{"name": "nope"}], [], [], []) == frozenset()
