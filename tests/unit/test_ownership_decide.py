"""ownership.decide(): the pure routing decision for a child's server→client request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from gateway import errors
from gateway.core.ownership import DECLINE, Answer, Forward, decide
from gateway.protocol.mcp import ClientCaps

ALL = frozenset({"roots", "sampling", "elicitation"})
ROOTS = ["file:///srv/data", "file:///home/shared"]


class FakeOwner:
    """Stands in for a ClientSession: decide() only reads ``caps``, ``mrtr``, ``era`` and, for
    a modern caller, its calls in flight (their ``caps``)."""

    def __init__(self, caps: dict[str, Any], mrtr: object = None, inflight: int = 1) -> None:
        self.caps = ClientCaps(caps)
        self.mrtr = mrtr  # a modern caller's bridge
        self.inflight = {n: SimpleNamespace(caps=self.caps) for n in range(inflight)}
        self.era = None  # not pinned yet: a legacy one's rules

    def calls(self) -> list[Any]:
        return list(self.inflight.values())


BRIDGE = SimpleNamespace(full=False)  # a modern caller's bridge with room for a parked call
FULL = {"roots": {}, "sampling": {}, "elicitation": {"form": {}, "url": {}}}


def run(
    method: str,
    params: dict[str, Any] | None = None,
    *,
    sharing: str = "shared",
    owners: set[Any] | None = None,
    declared: frozenset[str] = ALL,
) -> Answer | Forward:
    return decide(
        method,
        params or {},
        sharing=sharing,
        config_roots=ROOTS,
        owners=owners if owners is not None else set(),
        declared=declared,
    )


def roots_of(answer: Answer | Forward) -> list[str]:
    assert isinstance(answer, Answer) and answer.result is not None
    return [r["uri"] for r in msgspec.json.decode(answer.result)["roots"]]


# ---- roots ------------------------------------------------------------------------------


@pytest.mark.parametrize("sharing", ["shared", "affine"])
def test_roots_are_answered_from_config_in_shared_modes(sharing: str) -> None:
    owner = FakeOwner(FULL)
    for owners in (set(), {owner}, {owner, FakeOwner(FULL)}):
        answer = run("roots/list", sharing=sharing, owners=owners)
        assert roots_of(answer) == ROOTS
        assert isinstance(answer, Answer) and answer.reason == ""  # not a refusal


def test_roots_from_config_can_be_empty() -> None:
    answer = decide("roots/list", {}, sharing="shared", config_roots=[], owners=set(), declared=ALL)
    assert isinstance(answer, Answer) and answer.result is not None
    assert msgspec.json.decode(answer.result) == {"roots": []}


def test_roots_forwarded_to_the_owner_in_per_session_mode() -> None:
    owner = FakeOwner({"roots": {"listChanged": True}})
    assert run("roots/list", sharing="per-session", owners={owner}) == Forward(owner)


def test_per_session_roots_owner_without_roots_capability() -> None:
    answer = run("roots/list", sharing="per-session", owners={FakeOwner({"sampling": {}})})
    assert isinstance(answer, Answer)
    assert answer.code == errors.UNROUTABLE and answer.reason == "no_capability"


def test_per_session_roots_not_declared_to_the_child() -> None:
    answer = run("roots/list", sharing="per-session", owners={FakeOwner(FULL)},
                 declared=frozenset({"sampling"}))
    assert isinstance(answer, Answer) and answer.code == errors.METHOD_NOT_FOUND


# ---- no owner / several owners ----------------------------------------------------------


def test_no_owner_elicitation_is_declined() -> None:
    answer = run("elicitation/create", {"message": "?", "requestedSchema": {}})
    assert isinstance(answer, Answer)
    assert answer.result is not None and bytes(answer.result) == bytes(DECLINE)
    assert msgspec.json.decode(answer.result) == {"action": "decline"}
    assert answer.reason  # a refusal: logged and counted


@pytest.mark.parametrize("sharing", ["shared", "affine", "per-session"])
def test_no_owner_sampling_is_an_unroutable_error(sharing: str) -> None:
    answer = run("sampling/createMessage", {"messages": []}, sharing=sharing)
    assert isinstance(answer, Answer)
    assert answer.result is None
    assert answer.code == errors.UNROUTABLE == -32007
    assert answer.reason


@pytest.mark.parametrize("method", ["elicitation/create", "sampling/createMessage"])
def test_two_owners_are_unattributable(method: str) -> None:
    a, b = FakeOwner(FULL), FakeOwner(FULL)
    answer = run(method, {}, owners={a, b})
    assert isinstance(answer, Answer)
    assert answer.reason == "unattributable"
    if method == "elicitation/create":
        assert answer.result is not None
        assert msgspec.json.decode(answer.result) == {"action": "decline"}
    else:
        assert answer.result is None and answer.code == errors.UNROUTABLE


def test_a_refusal_names_the_owners_there_only_for_a_cancelled_call() -> None:
    """Not only "use affine": when an owner is in the set only for a call it cancelled, the
    refusal says so and when that ends (the usual case on a quiet shared child)."""
    owners = {FakeOwner(FULL), FakeOwner(FULL)}
    plain = decide("elicitation/create", {}, sharing="shared", config_roots=[], owners=owners,
                   declared=ALL)
    assert isinstance(plain, Answer) and "cancel" not in plain.message
    answer = decide("elicitation/create", {}, sharing="shared", config_roots=[], owners=owners,
                    declared=ALL, cancelled=1, cancel_grace=10.0)
    assert isinstance(answer, Answer) and answer.reason == "unattributable"
    assert msgspec.json.decode(answer.result or b"") == {"action": "decline"}
    assert ("1 of them only for a cancelled call the child has not answered: it is recycled "
            "if that lasts cancel_grace (10s)") in answer.message, answer.message


# ---- one owner --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("elicitation/create", {"message": "?", "requestedSchema": {}}),
        ("elicitation/create", {"mode": "form", "message": "?"}),
        ("elicitation/create", {"mode": "url", "url": "https://x", "elicitationId": "e1"}),
        ("sampling/createMessage", {"messages": [], "maxTokens": 5}),
    ],
)
def test_one_capable_owner_is_forwarded(method: str, params: dict[str, Any]) -> None:
    owner = FakeOwner(FULL)
    assert run(method, params, owners={owner}) == Forward(owner)


def test_legacy_empty_elicitation_capability_means_form() -> None:
    owner = FakeOwner({"elicitation": {}})
    assert run("elicitation/create", {"message": "?"}, owners={owner}) == Forward(owner)
    answer = run("elicitation/create", {"mode": "url"}, owners={owner})
    assert isinstance(answer, Answer) and answer.code == errors.INVALID_PARAMS


@pytest.mark.parametrize(
    ("method", "caps"),
    [
        ("sampling/createMessage", {"roots": {}, "elicitation": {}}),
        ("elicitation/create", {"sampling": {}}),
        ("sampling/createMessage", {"sampling": True}),  # not an object: not declared
    ],
)
def test_owner_lacking_the_capability_gets_an_error(method: str, caps: dict[str, Any]) -> None:
    answer = run(method, {}, owners={FakeOwner(caps)})
    assert isinstance(answer, Answer)
    assert answer.result is None
    assert answer.code == errors.UNROUTABLE
    assert answer.reason == "no_capability"
    two = run(method, owners={FakeOwner(FULL, mrtr=BRIDGE, inflight=2)})  # which one asks?
    assert isinstance(two, Answer) and two.reason == "unattributable"
    bridged = run(method, owners={FakeOwner(caps, mrtr=BRIDGE)})  # a modern caller (2026-07-28)
    assert isinstance(bridged, Answer) and bridged.code == errors.MISSING_CAPABILITY
    assert bridged.data == {"requiredCapabilities": {bridged.message.split()[-2]: {}}}
    # max_parked_flows
    full = run(method, owners={FakeOwner(FULL, mrtr=SimpleNamespace(full=True))})
    assert isinstance(full, Answer) and full.reason == "overloaded"


def test_form_only_owner_asked_for_url_mode_is_invalid_params() -> None:
    owner = FakeOwner({"elicitation": {"form": {}}})
    answer = run("elicitation/create", {"mode": "url", "url": "https://x"}, owners={owner})
    assert isinstance(answer, Answer)
    assert answer.code == errors.INVALID_PARAMS == -32602
    assert "url" in answer.message


def test_url_only_owner_asked_for_form_mode_is_invalid_params() -> None:
    owner = FakeOwner({"elicitation": {"url": {}}})
    answer = run("elicitation/create", {"message": "?"}, owners={owner})
    assert isinstance(answer, Answer) and answer.code == errors.INVALID_PARAMS


# ---- capabilities the gateway did not declare / unknown methods --------------------------


@pytest.mark.parametrize(
    ("method", "capability"),
    [("sampling/createMessage", "sampling"), ("elicitation/create", "elicitation")],
)
def test_undeclared_capability_is_method_not_found(method: str, capability: str) -> None:
    owner = FakeOwner(FULL)
    declared = ALL - {capability}
    for owners in (set(), {owner}, {owner, FakeOwner(FULL)}):
        answer = run(method, {}, owners=owners, declared=declared)
        assert isinstance(answer, Answer)
        assert answer.result is None
        assert answer.code == errors.METHOD_NOT_FOUND == -32601


def test_unknown_method_is_method_not_found() -> None:
    answer = run("tasks/get", {}, owners={FakeOwner(FULL)})
    assert isinstance(answer, Answer) and answer.code == errors.METHOD_NOT_FOUND
