"""Issue 9, modern backends: the pure decisions (era detection from a child's answers, the
envelope a modern child gets, reading an InputRequiredResult and building its retry)."""

from __future__ import annotations

import json

import pytest
from msgspec import Raw

from gateway import errors
from gateway.core.inputs import input_requests, retry_params
from gateway.protocol import era, jsonrpc


def test_era_detection_envelopes_and_the_input_required_round_trip() -> None:
    # initialize refused by a modern-only child -> try server/discover; other errors do not
    assert era.refuses_legacy(-32601, None)
    assert era.refuses_legacy(-32022, {"supported": ["2026-07-28"]})
    assert era.refuses_legacy(-32602, {"supported": ["2026-07-28"]})  # lists modern versions only
    # dual: a real error
    assert not era.refuses_legacy(-32602, {"supported": ["2025-11-25", "2026-07-28"]})
    assert not era.refuses_legacy(-32603, None)
    assert era.speaks_modern(["2025-11-25", "2026-07-28"]) and not era.speaks_modern(["2027-01-01"])
    assert not era.speaks_modern("2026-07-28")
    # the envelope goes into _meta beside the keys already there (progressToken stays)
    params = {"name": Raw(b'"t"'), "_meta": Raw(b'{"progressToken":"gw-1"}')}
    era.add_envelope(params, era.envelope({"elicitation": {}}, log_level="info"))
    meta = json.loads(bytes(params["_meta"]))
    assert meta == {"progressToken": "gw-1", era.VERSION_KEY: "2026-07-28",
                    era.CAPABILITIES_KEY: {"elicitation": {}}, era.LOG_LEVEL_KEY: "info"}
    # a modern client's envelope loses the input kinds the backend may not ask for
    env = era.envelope({"sampling": {}, "elicitation": {"form": {}}, "extensions": {"x/y": {}}})
    caps = json.loads(
        bytes(era.restrict_envelope(env, frozenset({"elicitation"}))[era.CAPABILITIES_KEY]))
    assert caps == {"elicitation": {"form": {}}, "extensions": {"x/y": {}}}
    # InputRequiredResult: recognised, read, its requestState passed back byte for byte
    state = b'"opaque.\\u00e9.mac"'
    result = Raw(b'{"resultType":"input_required","requestState":' + state + b',"inputRequests":'
                 b'{"user_name":{"method":"elicitation/create","params":{"message":"name?"}}}}')
    assert era.is_input_required(result)
    assert not era.is_input_required(
        Raw(b'{"content":[{"type":"text","text":"\\"input_required\\""}]}'))
    asks, got_state = input_requests(result)
    assert asks == {"user_name": ("elicitation/create", {"message": "name?"})}
    assert got_state is not None and bytes(got_state) == state
    retry = retry_params({"name": Raw(b'"t"'), "inputResponses": Raw(b"{}")},
                         {"user_name": Raw(b'{"action":"accept"}')}, got_state)
    assert bytes(jsonrpc.encode_dict(retry)) == (
        b'{"name":"t","inputResponses":{"user_name":{"action":"accept"}},"requestState":'
        + state + b"}")
    for bad in (b'{"resultType":"input_required"}',
                b'{"resultType":"input_required","inputRequests":[]}',
                b'{"resultType":"input_required","inputRequests":{"k":{"params":{}}}}'):
        with pytest.raises(errors.BackendProtocolError):
            input_requests(Raw(bad))
