"""Authorization as pure decisions: policy rules per caller, the per-principal limiter."""

from __future__ import annotations

import fnmatch

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.limits import INFLIGHT_RETRY_AFTER, LimitRefusal, PrincipalLimit, PrincipalLimits
from gateway.protocol.policy import (
    Caller,
    Decision,
    Rule,
    RuleIndex,
    decide,
    literal_prefix,
    names,
    visible,
)

ALICE_WS = Caller("ws", "alice", frozenset({"dev"}), frozenset({"repo:read"}))
CI_UNIX = Caller("unix", "ci-7", frozenset({"ci"}))
NOBODY_WS = Caller("ws")  # authentication not configured: no principal

RULES = [
    Rule("git__push", "allow", principal="ci-*"),
    Rule("git__push", "ask", group="dev", scopes=frozenset({"repo:write"})),
    Rule("git__*", "allow", group="dev"),
    Rule("git__*", "deny", transport="unix"),
    Rule("git__*", "ask"),
    Rule("fx__greet", "deny", kind="prompt", transport="ws"),
    Rule("file:///etc/*", "deny", kind="resource"),
    Rule("fx__wipe", "allow", principal="alice"),
]


def test_rules_match_principal_group_transport_kind_and_scopes_first_match_wins() -> None:
    def d(name: str, caller: Caller, kind: str = "tool", default: str = "deny",
          sensitive: bool = False) -> Decision:
        return decide(name, RULES, default, sensitive=sensitive, caller=caller, kind=kind)  # type: ignore[arg-type]  # str for the Literals

    # principal glob; first match wins over the later, broader rules
    assert d("git__push", CI_UNIX) == Decision("allow", "git__push")
    # alice lacks repo:write: the scoped rule does not match, the group rule after it does
    assert d("git__push", ALICE_WS) == Decision("allow", "git__*")
    with_scope = Caller("ws", "alice", frozenset({"dev"}), frozenset({"repo:write"}))
    assert d("git__push", with_scope) == Decision("ask", "git__push")
    # transport: a unix caller outside group dev is denied, nobody on ws is asked
    assert d("git__log", CI_UNIX) == Decision("deny", "git__*")
    assert d("git__log", NOBODY_WS) == Decision("ask", "git__*")
    # without a principal, rules naming principal/group/scopes never match
    assert d("git__push", NOBODY_WS) == Decision("ask", "git__*")
    assert d("git__push", Caller("unix")) == Decision("deny", "git__*")
    # insufficient scope: denied, and the decision names the scopes that would let it in
    bob = Caller("unix", "bob", frozenset({"dev"}))
    strict = [Rule("git__push", "allow", scopes=frozenset({"repo:write", "repo:read"})),
              Rule("git__*", "deny")]
    assert decide("git__push", strict, "allow", sensitive=False, caller=bob) == Decision(
        "deny", "git__*", scopes=("repo:read", "repo:write"))
    assert decide("git__push", strict, "allow", sensitive=False, caller=NOBODY_WS).scopes == ()
    # kinds: a prompt or resource rule never decides a tool, and the reverse
    assert d("fx__greet", NOBODY_WS, "prompt") == Decision("deny", "fx__greet")
    # not the tool default
    assert d("fx__greet", Caller("unix"), "prompt") == Decision("allow", None)
    assert d("fx__greet", NOBODY_WS, "tool", default="ask") == Decision("ask", None)
    assert d("file:///etc/passwd", CI_UNIX, "resource") == Decision("deny", "file:///etc/*")
    assert d("file:///tmp/x", CI_UNIX, "resource") == Decision("allow", None)
    assert d("file:///etc/passwd", CI_UNIX, "tool", default="allow") == Decision("allow", None)
    # sensitive: served only where a rule naming it matched for this caller
    assert d("fx__wipe", ALICE_WS, sensitive=True) == Decision("allow", "fx__wipe")
    assert d("fx__wipe", CI_UNIX, default="allow", sensitive=True) == Decision(
        "deny", None, sensitive_unruled=True)
    assert names("fx__wipe", RULES) and not names("fx__wipe", RULES, "prompt")
    assert not names("other__wipe", RULES)
    # what a caller sees is what it may call: ask is shown, deny hidden
    assert visible("git__log", RULES, "deny", sensitive=False, caller=NOBODY_WS, kind="tool")
    assert not visible("git__log", RULES, "allow", sensitive=False, caller=CI_UNIX, kind="tool")


async def test_principal_limits_token_bucket_and_inflight(
    autojump_clock: trio.testing.MockClock) -> None:
    limits = PrincipalLimits([
        PrincipalLimit("ci-*", max_inflight=2),
        PrincipalLimit("alice", calls_per_second=2.0),
        PrincipalLimit("*", calls_per_second=0.5),
    ])
    now = trio.current_time
    # max_inflight across all of the principal's requests; the first matching entry applies
    assert limits.admit("ci-1", now()) is None and limits.admit("ci-1", now()) is None
    assert limits.admit("ci-1", now()) == LimitRefusal("max_inflight", 2, INFLIGHT_RETRY_AFTER)
    assert limits.admit("ci-2", now()) is None  # another principal, its own count
    limits.release("ci-1")
    assert limits.admit("ci-1", now()) is None
    # calls_per_second: a burst of one second's worth, then one token per 1/rate seconds
    assert limits.admit("alice", now()) is None and limits.admit("alice", now()) is None
    refused = limits.admit("alice", now())
    assert refused is not None and refused.limit == "calls_per_second"
    assert abs(refused.retry_after - 0.5) < 1e-9
    await trio.sleep(0.25)
    refused = limits.admit("alice", now())
    assert refused is not None and abs(refused.retry_after - 0.25) < 1e-9
    await trio.sleep(0.25)
    assert limits.admit("alice", now()) is None
    await trio.sleep(10)  # the bucket holds at most one second's worth
    assert [limits.admit("alice", now()) is None for _ in range(3)] == [True, True, False]
    # a rate under one per second still lets one call through (burst at least 1)
    assert limits.admit("bob", now()) is None
    refused = limits.admit("bob", now())
    assert refused is not None and abs(refused.retry_after - 2.0) < 1e-9
    # a reload keeps what is in flight counted
    reloaded = limits.reconfigured([PrincipalLimit("ci-*", max_inflight=2)])
    assert reloaded.inflight("ci-1") == 2
    assert reloaded.admit("ci-1", now()) is not None
    assert reloaded.admit("alice", now()) is None  # no entry matches any more: unlimited


GLOB = st.text(alphabet="ab_*?[]!", max_size=6)
NAME = st.text(alphabet="ab_[]!", max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(GLOB, st.sampled_from(["tool", "prompt", "resource"])), max_size=12),
       NAME, st.sampled_from(["tool", "prompt", "resource"]))
def test_rule_index_finds_exactly_the_rules_whose_glob_matches_in_order(
        globs: list[tuple[str, str]], name: str, kind: str) -> None:
    rules = [Rule(g, "allow", kind=k) for g, k in globs]  # type: ignore[arg-type]  # str for the Literal
    expected = [r for r in rules if r.kind == kind and fnmatch.fnmatchcase(name, r.match)]
    assert RuleIndex(rules).naming(name, kind) == expected  # type: ignore[arg-type]  # str for the Literal


def test_rule_index_files_a_rule_under_its_literal_prefix() -> None:
    assert [literal_prefix(g) for g in ("git__*", "a?b", "x[ab]", "exact", "*")] == [
        "git__", "a", "x", "exact", ""]
    rules = [Rule("git__*", "allow"), Rule("*push", "deny"), Rule("gi?__push", "ask"),
             Rule("git__push", "allow", kind="prompt")]
    assert RuleIndex(rules).naming("git__push", "tool") == rules[:3]
    assert RuleIndex(rules).naming("gh__push", "tool") == [rules[1]]
