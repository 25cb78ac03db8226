"""Tool policy decisions: allow / ask / deny by glob, the sensitive-tool rule, consent."""

from __future__ import annotations

import tomllib

import pytest

from gateway.protocol.policy import (
    Decision,
    Rule,
    consent_granted,
    consent_schema,
    decide,
    is_sensitive,
    suggested_rules,
)

RULES = [
    Rule("fs__delete_*", "deny"),
    Rule("fs__*", "ask"),
    Rule("time__*", "allow"),
    Rule("danger__wipe", "allow"),
]


@pytest.mark.parametrize(
    ("tool", "action", "rule"),
    [
        ("fs__delete_file", "deny", "fs__delete_*"),  # first matching rule wins
        ("fs__read_file", "ask", "fs__*"),
        ("time__now", "allow", "time__*"),
        ("danger__wipe", "allow", "danger__wipe"),
    ],
)
def test_first_matching_rule_decides(tool: str, action: str, rule: str) -> None:
    for default in ("allow", "ask", "deny"):
        assert decide(tool, RULES, default, sensitive=False) == Decision(action, rule)


@pytest.mark.parametrize("default", ["allow", "ask", "deny"])
def test_default_applies_when_no_rule_matches(default: str) -> None:
    assert decide("other__tool", RULES, default, sensitive=False) == Decision(default, None)
    assert decide("other__tool", [], default, sensitive=False) == Decision(default, None)


def test_globs_are_case_sensitive() -> None:
    assert decide("FS__read", RULES, "allow", sensitive=False) == Decision("allow", None)


@pytest.mark.parametrize("default", ["allow", "ask", "deny"])
def test_sensitive_without_a_rule_is_denied_whatever_the_default(default: str) -> None:
    d = decide("other__rm_rf", RULES, default, sensitive=True)
    assert d.action == "deny"
    assert d.rule is None
    assert d.sensitive_unruled is True


@pytest.mark.parametrize(
    ("tool", "action"), [("danger__wipe", "allow"), ("fs__x", "ask"), ("fs__delete_x", "deny")]
)
def test_sensitive_tool_named_by_a_rule_follows_the_rule(tool: str, action: str) -> None:
    d = decide(tool, RULES, "deny", sensitive=True)
    assert d.action == action and d.rule is not None and not d.sensitive_unruled


def test_default_rule_never_names_a_sensitive_tool() -> None:
    # A tool that is allowed by default becomes a deny the moment it is sensitive.
    assert decide("x__t", [], "allow", sensitive=False).action == "allow"
    assert decide("x__t", [], "allow", sensitive=True) == Decision(
        "deny", None, sensitive_unruled=True
    )


def test_is_sensitive() -> None:
    assert is_sensitive({"annotations": {"destructiveHint": True}}, [], "t")
    assert not is_sensitive({"annotations": {"destructiveHint": False}}, [], "t")
    assert not is_sensitive({"annotations": {"destructiveHint": "true"}}, [], "t")  # explicit only
    assert not is_sensitive({"annotations": {"destructiveHint": 1}}, [], "t")
    assert not is_sensitive({"annotations": {}}, [], "t")  # spec default is not "declared"
    assert not is_sensitive({}, [], "t")
    assert not is_sensitive({"annotations": "junk"}, [], "t")
    # Backend config globs match the backend's own name, not the namespaced one.
    assert is_sensitive({}, ["delete_*"], "delete_file")
    assert not is_sensitive({}, ["delete_*"], "fs__delete_file")
    assert is_sensitive({}, ["wipe"], "wipe")
    assert not is_sensitive({}, ["wipe"], "wipe2")


@pytest.mark.parametrize(
    ("answer", "granted"),
    [
        ({"action": "accept", "content": {"approve": True}}, True),
        ({"action": "accept", "content": {"approve": True, "extra": 1}}, True),
        ({"action": "accept", "content": {"approve": False}}, False),
        ({"action": "accept", "content": {"approve": "true"}}, False),
        ({"action": "accept", "content": {"approve": 1}}, False),
        ({"action": "accept", "content": {}}, False),
        ({"action": "accept"}, False),
        ({"action": "accept", "content": None}, False),
        ({"action": "accept", "content": [True]}, False),
        ({"action": "decline", "content": {"approve": True}}, False),
        ({"action": "cancel", "content": {"approve": True}}, False),
        ({"action": "ACCEPT", "content": {"approve": True}}, False),
        ({"content": {"approve": True}}, False),
        (None, False),
        ("accept", False),
        ([], False),
    ],
)
def test_consent_granted_only_for_accept_and_approve_true(answer: object, granted: bool) -> None:
    assert consent_granted(answer) is granted


def test_consent_schema_is_one_required_boolean() -> None:
    schema = consent_schema()
    assert schema["type"] == "object"
    assert schema["required"] == ["approve"]
    assert schema["properties"]["approve"]["type"] == "boolean"
    assert schema["properties"]["approve"]["default"] is False


def test_the_suggested_rules_are_toml_in_both_forms() -> None:
    snippet = suggested_rules(["fx__wipe", "git__push-force"])
    assert tomllib.loads(snippet) == {"policy": {"rules": [
        {"match": "fx__wipe", "action": "ask"}, {"match": "git__push-force", "action": "ask"}]}}
    inline = [line.removeprefix("#   ") for line in snippet.splitlines() if line.startswith("#   ")]
    existing = ('[policy]\nrules = [\n  { match = "x", action = "deny" },\n'
                + "\n".join(inline) + "\n]\n")
    assert tomllib.loads(existing)["policy"]["rules"][1:] == [
        {"match": "fx__wipe", "action": "ask"}, {"match": "git__push-force", "action": "ask"}]
