"""JSON-RPC envelopes: decode once, classify, encode; payloads pass through as Raw bytes."""

from __future__ import annotations

import json

import msgspec
import pytest
from msgspec import UNSET, Raw

from gateway import errors
from gateway.protocol import jsonrpc


def _msg(**fields: object) -> bytes:
    return json.dumps({"jsonrpc": "2.0", **fields}).encode()


# ---- classify ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (_msg(id=1, method="tools/list"), "request"),
        (_msg(id="abc", method="tools/call", params={"name": "x"}), "request"),
        (_msg(id=0, method="ping"), "request"),
        (_msg(method="notifications/initialized"), "notification"),
        (_msg(method="notifications/progress", params={"progressToken": 1}), "notification"),
        (_msg(id=1, result={}), "response"),
        (_msg(id="r", result=None), "response"),  # a JSON null result is still a result
        (_msg(id=1, error={"code": -32601, "message": "nope"}), "error"),
        (_msg(id=None, error={"code": -32700, "message": "parse"}), "error"),  # null id allowed
    ],
)
def test_classify_kinds(data: bytes, kind: str) -> None:
    assert jsonrpc.classify(jsonrpc.decode(data)) == kind


def test_id_absent_and_null_are_different() -> None:
    assert jsonrpc.decode(_msg(method="m")).id is UNSET
    assert jsonrpc.decode(_msg(id=None, method="m")).id is None


def test_request_with_null_id_is_invalid() -> None:
    env = jsonrpc.decode(_msg(id=None, method="tools/list"))
    with pytest.raises(errors.InvalidRequest) as info:
        jsonrpc.classify(env)
    assert info.value.code == errors.INVALID_REQUEST


@pytest.mark.parametrize("bad_id", [True, False, 1.5, [1], {"a": 1}])
def test_non_int_non_str_id_is_invalid_request(bad_id: object) -> None:
    # msgspec is strict: a bool is not an int, a float is not an int.
    with pytest.raises(errors.InvalidRequest) as info:
        jsonrpc.decode(_msg(id=bad_id, method="m"))
    assert info.value.code == errors.INVALID_REQUEST
    assert "$.id" in str(info.value)


def test_missing_jsonrpc_version_is_invalid_and_keeps_the_id() -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        jsonrpc.decode(b'{"id": 7, "method": "ping"}')
    assert info.value.data["id"] == 7  # so the error reply can still name the request


@pytest.mark.parametrize("version", ["1.0", "2", "2.0 ", ""])
def test_wrong_jsonrpc_version_is_invalid(version: str) -> None:
    data = json.dumps({"jsonrpc": version, "id": "x", "method": "ping"}).encode()
    with pytest.raises(errors.InvalidRequest) as info:
        jsonrpc.decode(data)
    assert info.value.data["id"] == "x"


def test_wrong_version_with_null_id_has_no_id() -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        jsonrpc.decode(b'{"jsonrpc": "1.0", "id": null, "method": "ping"}')
    assert info.value.data["id"] is None


def test_jsonrpc_of_wrong_type_is_invalid() -> None:
    with pytest.raises(errors.InvalidRequest):
        jsonrpc.decode(b'{"jsonrpc": 2.0, "id": 1, "method": "ping"}')


@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b'{"jsonrpc": "2.0", "id": 1', b"{'a': 1}", b"\xff\xfe", b'{"a":1} x'],
)
def test_decode_error_is_parse_error(data: bytes) -> None:
    with pytest.raises(errors.ParseError) as info:
        jsonrpc.decode(data)
    assert info.value.code == errors.PARSE_ERROR


@pytest.mark.parametrize("data", [b"[]", b"1", b'"s"', b"null", b"true"])
def test_valid_json_that_is_not_an_object_is_invalid_request(data: bytes) -> None:
    with pytest.raises(errors.InvalidRequest):
        jsonrpc.decode(data)


@pytest.mark.parametrize(
    "data",
    [
        _msg(id=1, result={}, error={"code": 1, "message": "m"}),  # both result and error
        _msg(id=1),  # neither
        _msg(method="m", id=1, result={}),  # method and result
        _msg(method="m", error={"code": 1, "message": "m"}),  # method and error
        _msg(result={}),  # response without id
        _msg(id=None, result={}),  # result with null id
        _msg(),  # nothing at all
    ],
)
def test_malformed_shapes_are_invalid_request(data: bytes) -> None:
    with pytest.raises(errors.InvalidRequest):
        jsonrpc.classify(jsonrpc.decode(data))


def test_error_object_fields_are_typed() -> None:
    with pytest.raises(errors.InvalidRequest):
        jsonrpc.decode(_msg(id=1, error={"code": "x", "message": "m"}))
    env = jsonrpc.decode(_msg(id=1, error={"code": -1, "message": "m", "data": {"k": [1]}}))
    assert isinstance(env.error, jsonrpc.ErrorObject)
    assert (env.error.code, env.error.message, env.error.data) == (-1, "m", {"k": [1]})


def test_unknown_top_level_keys_are_ignored() -> None:
    env = jsonrpc.decode(b'{"jsonrpc":"2.0","id":1,"method":"m","extra":{"x":1}}')
    assert jsonrpc.classify(env) == "request"


# ---- Raw pass-through -------------------------------------------------------------------

# Key order, escapes, big integers, float spelling and whitespace must survive untouched.
PAYLOAD = (
    b'{"z": 1, "a": "caf\\u00e9 \\ud83d\\ude00", "big": 12345678901234567890, '
    b'"f": 1.0e10, "neg": -0.0, "nested": {"y": [1, 2.50, "x"], "b": null}}'
)


def test_result_passes_through_byte_for_byte() -> None:
    data = b'{"jsonrpc":"2.0","id":"c-1","result":' + PAYLOAD + b"}"
    env = jsonrpc.decode(data)
    assert isinstance(env.result, Raw)
    assert bytes(env.result) == PAYLOAD
    out = jsonrpc.encode_result(42, env.result)
    assert out == b'{"jsonrpc":"2.0","id":42,"result":' + PAYLOAD + b"}"


def test_params_pass_through_byte_for_byte() -> None:
    data = b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":' + PAYLOAD + b"}"
    env = jsonrpc.decode(data)
    assert isinstance(env.params, Raw)
    assert bytes(env.params) == PAYLOAD
    assert jsonrpc.encode_request(9, "tools/call", env.params) == (
        b'{"jsonrpc":"2.0","id":9,"method":"tools/call","params":' + PAYLOAD + b"}"
    )
    assert jsonrpc.encode_notification("n", env.params) == (
        b'{"jsonrpc":"2.0","method":"n","params":' + PAYLOAD + b"}"
    )


def test_params_dict_keeps_values_raw() -> None:
    fields = jsonrpc.params_dict(Raw(PAYLOAD))
    assert list(fields) == ["z", "a", "big", "f", "neg", "nested"]
    assert bytes(fields["big"]) == b"12345678901234567890"
    assert bytes(fields["f"]) == b"1.0e10"
    assert bytes(fields["a"]) == b'"caf\\u00e9 \\ud83d\\ude00"'
    assert bytes(jsonrpc.encode_dict(fields)).replace(b" ", b"") == PAYLOAD.replace(b" ", b"")


def test_params_dict_absent_and_non_object() -> None:
    assert jsonrpc.params_dict(UNSET) == {}
    with pytest.raises(errors.InvalidRequest):
        jsonrpc.params_dict(Raw(b"[1, 2]"))
    with pytest.raises(errors.InvalidRequest):
        jsonrpc.params_dict(Raw(b'"str"'))


def test_bytes_accepted_as_raw_by_encoders() -> None:
    assert jsonrpc.encode_result("a", b'{"k":1.50}') == (
        b'{"jsonrpc":"2.0","id":"a","result":{"k":1.50}}'
    )
    assert jsonrpc.encode_request(1, "m", b"[1]") == (
        b'{"jsonrpc":"2.0","id":1,"method":"m","params":[1]}'
    )
    assert jsonrpc.encode_request(1, "m") == b'{"jsonrpc":"2.0","id":1,"method":"m"}'
    assert jsonrpc.encode_notification("m") == b'{"jsonrpc":"2.0","method":"m"}'


# ---- errors -----------------------------------------------------------------------------


def test_encode_error_omits_data_when_none() -> None:
    out = jsonrpc.encode_error(1, -32601, "not found", None)
    assert msgspec.json.decode(out) == {
        "jsonrpc": "2.0",
        "id": 1,
        "error": {"code": -32601, "message": "not found"},
    }
    assert b"data" not in out
    assert b"data" not in jsonrpc.encode_error(1, -32601, "not found")


def test_encode_error_with_data_and_null_id() -> None:
    out = jsonrpc.encode_error(None, -32003, "timeout", {"reason": "timeout"})
    assert msgspec.json.decode(out) == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32003, "message": "timeout", "data": {"reason": "timeout"}},
    }


def test_encoded_messages_decode_back_to_their_kind() -> None:
    pairs = [
        (jsonrpc.encode_request("r", "m", b"{}"), "request"),
        (jsonrpc.encode_notification("m"), "notification"),
        (jsonrpc.encode_result(1, jsonrpc.EMPTY_RESULT), "response"),
        (jsonrpc.encode_error("r", -1, "x", {"a": 1}), "error"),
        (jsonrpc.encode_error(None, -1, "x"), "error"),
    ]
    for data, kind in pairs:
        assert jsonrpc.classify(jsonrpc.decode(data)) == kind


# ---- batches ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "batch"),
    [
        (b"[]", True),
        (b'[{"jsonrpc":"2.0","method":"m"}]', True),
        (b'   \n\t\r [{"jsonrpc":"2.0","method":"m"}]', True),
        (b'{"jsonrpc":"2.0","method":"m"}', False),
        (b'  {"a": ["["]}', False),
        (b"", False),
        (b"   ", False),
    ],
)
def test_batch_detection(data: bytes, batch: bool) -> None:
    assert jsonrpc.is_batch(data) is batch


def test_split_batch_keeps_elements_raw() -> None:
    a = b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"big":12345678901234567890}}'
    b = b'{"jsonrpc":"2.0","method":"n"}'
    parts = jsonrpc.split_batch(b"  \n[" + a + b" ,\n " + b + b"]")
    assert [bytes(p) for p in parts] == [a, b]
    assert [jsonrpc.classify(jsonrpc.decode(p)) for p in parts] == ["request", "notification"]


def test_split_batch_parse_error() -> None:
    with pytest.raises(errors.ParseError):
        jsonrpc.split_batch(b'[{"a": 1},')


def test_decode_batch_answers_each_invalid_entry_and_keeps_the_valid_ones() -> None:
    data = b'[1, "x", null, {"jsonrpc":"1.0","id":5,"method":"p"}, ' + _msg(id=1, method="ping") + \
        b", " + _msg(method="notifications/initialized") + b"]"
    entries = jsonrpc.decode_batch(data, jsonrpc.BATCH_VERSION, 64)
    assert [e.kind for e in entries] == [None, None, None, None, "request", "notification"]
    for e in entries[:4]:
        assert e.env is None and isinstance(e.error, errors.InvalidRequest)
        assert "id" not in e.error.data  # answered with id null, even when one could be salvaged
    ping = entries[4]
    assert ping.env is not None and ping.env.id == 1 and ping.size == len(_msg(id=1, method="ping"))


@pytest.mark.parametrize(
    ("data", "version", "error", "reason"),
    [
        (b"[1]", "2025-11-25", errors.InvalidRequest, None),  # batches are 2025-03-26 only
        (b"[1]", None, errors.InvalidRequest, None),
        (b"[]", jsonrpc.BATCH_VERSION, errors.InvalidRequest, None),
        (b"[1, 2, 3]", jsonrpc.BATCH_VERSION, errors.InvalidRequest, "batch_too_large"),
        (b"[1,", jsonrpc.BATCH_VERSION, errors.ParseError, None),
    ],
)
def test_decode_batch_refuses_what_cannot_be_a_batch(
        data: bytes, version: str | None, error: type[errors.GatewayError],
        reason: str | None) -> None:
    with pytest.raises(error) as refused:
        jsonrpc.decode_batch(data, version, 2)
    assert refused.value.reason == reason
