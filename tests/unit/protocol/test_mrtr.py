"""The signed requestState of era bridging (gateway.protocol.mrtr), without sockets."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from msgspec import Raw

from gateway import errors
from gateway.protocol import mrtr

CLAIMS = mrtr.Claims(flow="f1", round=2, expires=1_000, backend="fx", keys=("user_name",),
                     digest="d", principal=None)


def refused(codec: mrtr.StateCodec, state: object, now: float = 0) -> str:
    with pytest.raises(errors.InvalidParams) as info:
        codec.verify(state, now)
    assert info.value.code == -32602 and info.value.reason == "invalid_state"
    return info.value.message


def test_a_state_verifies_only_unchanged_unexpired_and_from_its_own_replica() -> None:
    codec = mrtr.StateCodec(b"k" * 32, "r1")
    state = codec.sign(CLAIMS)
    assert state.startswith("r1.") and state.count(".") == 2  # <replica>.<payload>.<mac>
    assert codec.verify(state, 999) == CLAIMS
    assert "expired" in refused(codec, state, now=1_000)
    assert "signature" in refused(codec, state + "-TAMPERED")
    replica, _payload, mac = state.split(".")
    forged = codec.sign(dataclasses.replace(CLAIMS, round=3))
    # payload swapped
    assert "signature" in refused(codec, f"{replica}.{forged.split('.')[1]}.{mac}")
    assert "signature" in refused(mrtr.StateCodec(b"x" * 32, "r1"), state)  # another key
    assert "replica 'r1'" in refused(mrtr.StateCodec(b"k" * 32, "r2"), state)
    for junk in (None, 3, "", "r1", "r1..", "x" * 5000):
        refused(codec, junk)
    assert codec.peek(state + "-TAMPERED") == "f1" and codec.peek("r2.x.y") is None


def test_issued_tells_the_gateways_own_states_from_a_backends() -> None:
    """A modern backend's own requestState passes through to it; one the gateway signed (a
    consent round for that backend's call) continues the gateway's flow, expired or not."""
    codec = mrtr.StateCodec(b"k" * 32, "r1")
    state = codec.sign(CLAIMS)
    assert codec.issued(state)  # expired at any now > 1000: still ours (verify says expired)
    assert not codec.issued(state + "x") and not codec.issued(f"r1.{state.split('.')[1]}.")
    assert not mrtr.StateCodec(b"x" * 32, "r1").issued(state)
    for junk in (None, 3, "", "r1", "r1..", "r1.é.x", "x" * 5000, "eyJzIjoxfQ.abcdef"):
        assert not codec.issued(junk)


def test_the_digest_names_the_call_not_its_round_trip_or_envelope() -> None:
    def params(**kw: object) -> dict[str, Raw]:
        return {k: Raw(msgspec.json.encode(v)) for k, v in kw.items()}

    base = mrtr.params_digest("tools/call", params(name="t", arguments={"a": 1, "b": [1, 2]}))
    same = mrtr.params_digest("tools/call", params(arguments={"b": [1, 2], "a": 1}, name="t",
                                                   _meta={"x": 1}, requestState="s",
                                                   inputResponses={"k": {}}))
    assert base == same
    assert base != mrtr.params_digest("tools/call",
                                      params(name="t", arguments={"a": 2, "b": [1, 2]}))
    assert base != mrtr.params_digest("prompts/get",
                                      params(name="t", arguments={"a": 1, "b": [1, 2]}))
    assert mrtr.input_responses(params(inputResponses={"k": {"action": "accept"}})) == {
        "k": Raw(b'{"action":"accept"}')}
    for bad in ({"k": 12345}, None, [1], {"k": "x"}):
        with pytest.raises(errors.InvalidParams):
            mrtr.input_responses(params(inputResponses=bad))
