"""gateway.protocol.subscriptions: a listen's filter and the messages on its stream (pure)."""

from __future__ import annotations

import json

import pytest
from msgspec import UNSET, Raw

from gateway import errors
from gateway.protocol import jsonrpc
from gateway.protocol.subscriptions import (
    MAX_URIS,
    Filter,
    acknowledged,
    closing_result,
    parse_filter,
    tagged,
)

TAG = "io.modelcontextprotocol/subscriptionId"


def params(notifications: object) -> dict[str, Raw]:
    return jsonrpc.params_dict(jsonrpc.encode_dict({"notifications": notifications}))


def test_a_listen_filter_its_acknowledgement_and_tagged_notifications() -> None:
    f = parse_filter(params({"toolsListChanged": True, "promptsListChanged": False,
                             "resourceSubscriptions": ["file:///a/", "file:///a/", "x://b"]}))
    assert f == Filter(frozenset({"tools"}), ("file:///a/", "x://b"))  # duplicates once
    assert f.wants_uri("file:///a/b/c") and f.wants_uri("x://b") and not f.wants_uri("x://bc")
    for bad in (None, [], {"toolsListChanged": "yes"}, {"resourceSubscriptions": "x://b"},
                {"resourceSubscriptions": [""]}, {"resourceSubscriptions": ["u"] * (MAX_URIS + 1)}):
        with pytest.raises(errors.InvalidParams):
            parse_filter(params(bad) if bad is not None else {})
    ack = json.loads(acknowledged(f, "L1"))
    assert ack == {"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged",
                   "params": {"notifications": {"toolsListChanged": True,
                                                "resourceSubscriptions": ["file:///a/", "x://b"]},
                              "_meta": {TAG: "L1"}}}
    # the child's params pass through, its own _meta keys kept beside the tag
    child = Raw(b'{"uri":"x://b","_meta":{"k":1}}')
    assert json.loads(tagged("notifications/resources/updated", child, 7))["params"] == {
        "uri": "x://b", "_meta": {"k": 1, TAG: 7}}
    assert json.loads(tagged("notifications/tools/list_changed", UNSET, 7))["params"] == {
        "_meta": {TAG: 7}}
    assert json.loads(bytes(closing_result(7))) == {"resultType": "complete", "_meta": {TAG: 7}}
