"""gateway.protocol.era: the 2026-07-28 request checks and result decoration (pure)."""

from __future__ import annotations

import json

import pytest
from msgspec import Raw

from gateway import errors
from gateway.protocol import era, jsonrpc


def params(**meta: object) -> dict[str, Raw]:
    return {"_meta": jsonrpc.encode_dict(meta)} if meta else {}


def test_the_first_request_pins_the_era() -> None:
    assert era.era_of("initialize", {}) is era.Era.LEGACY
    assert era.era_of("tools/list", params(**{era.VERSION_KEY: "2026-07-28"})) is era.Era.MODERN
    assert era.era_of("server/discover", {}) is era.Era.MODERN
    assert era.era_of("tools/list", params(progressToken=1)) is era.Era.LEGACY


def test_modern_meta_refuses_removed_methods_first_then_version_then_capabilities() -> None:
    good = {era.VERSION_KEY: "2026-07-28", era.CAPABILITIES_KEY: {"sampling": {}}}
    assert era.modern_meta("tools/call", params(**good)).caps == {"sampling": {}}
    with pytest.raises(errors.MethodNotFound):
        era.modern_meta("initialize", {})  # no _meta: still "method not found", not -32602
    with pytest.raises(errors.InvalidParams):
        era.modern_meta("tools/list", params(**{era.CAPABILITIES_KEY: {}}))
    with pytest.raises(errors.UnsupportedVersion) as info:
        era.modern_meta("tools/list", params(**{**good, era.VERSION_KEY: "2025-11-25"}))
    assert info.value.code == -32022 and info.value.error_data()["supported"][0] == "2026-07-28"
    with pytest.raises(errors.InvalidParams):
        era.modern_meta("tools/list", params(**{era.VERSION_KEY: "2026-07-28"}))


def test_complete_adds_what_the_revision_requires_and_keeps_what_is_there() -> None:
    out = json.loads(bytes(era.complete("tools/call", Raw(b'{"content":[],"n":1.0e10}'))))
    assert out == {"content": [], "n": 1.0e10, "resultType": "complete"}
    out = json.loads(bytes(era.complete("resources/read", Raw(b'{"contents":[]}'))))
    assert (out["ttlMs"], out["cacheScope"]) == (0, "private")  # a child's: the safe reading
    out = json.loads(bytes(era.complete("tools/list", Raw(b'{"tools":[],"ttlMs":5}'))))
    assert (out["ttlMs"], out["cacheScope"], out["resultType"]) == (5, "public", "complete")
    kept = json.loads(bytes(era.complete("tools/call", Raw(b'{"resultType":"input_required"}'))))
    assert kept["resultType"] == "input_required"
    assert bytes(era.complete("tools/call", Raw(b"[1]"))) == b"[1]"  # not an object: untouched
    # a call's result is spliced, not decoded: its bytes pass as they came after resultType
    assert bytes(era.complete("tools/call", Raw(b'{"n":1.0e10, "s":"\xc3\xa9"}'))) == (
        b'{"resultType":"complete","n":1.0e10, "s":"\xc3\xa9"}')
    assert bytes(era.complete("tools/call", Raw(b"{ }"))) == b'{"resultType":"complete"}'
    # the name deeper down, or an escape that could spell it at the top: read, set only if absent
    for raw, want in ((b'{"a":{"resultType":"x"}}', "complete"),
                      (b'{"result\\u0054ype":"input_required"}', "input_required")):
        assert json.loads(bytes(era.complete("tools/call", Raw(raw))))["resultType"] == want


@pytest.mark.parametrize("value", ["fx__echo", "a b", "fixture://item/1", "fx__\u00e9", " edge",
                                   "tab\there", "=?base64?eA==?=", ""])
def test_a_header_value_is_plain_visible_ascii_or_base64_and_reads_back(value: str) -> None:
    encoded = era.header_value(value)
    assert encoded.isascii() and encoded.isprintable() and encoded == encoded.strip()
    assert (encoded == value) == (value.isascii() and value.isprintable() and value == value.strip()
                                  and not value.startswith("=?base64?"))
    body = {**params(**{era.VERSION_KEY: "2026-07-28", era.CAPABILITIES_KEY: {}}),
            "name": Raw(json.dumps(value).encode())}
    headers = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call",
               "mcp-name": encoded}
    assert era.check_http("tools/call", body, headers) == (({}, None), None)  # read back


GOOD = {era.VERSION_KEY: "2026-07-28", era.CAPABILITIES_KEY: {"sampling": {}}}
HEADERS = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "fx__a"}


def named(**meta: object) -> dict[str, Raw]:
    return {**params(**meta), "name": Raw(b'"fx__a"')}


def test_check_http_reads_the_caps_and_the_progress_token_of_a_matching_request() -> None:
    assert era.check_http("tools/call", named(**GOOD, progressToken=7), HEADERS) == (
        ({"sampling": {}}, None), 7)
    assert era.check_http("tools/call", named(**GOOD, progressToken="t"), HEADERS).progress == "t"
    for bad in (True, 1.5, None, {"a": 1}):
        assert era.check_http("tools/call", named(**GOOD, progressToken=bad),
                              HEADERS).progress is None


def test_check_http_judges_the_meta_as_the_core_would() -> None:
    """The core serves a stateless request with what the edge judged (no second decode)."""
    for meta in (GOOD, {**GOOD, era.LOG_LEVEL_KEY: "debug"}, {**GOOD, era.CAPABILITIES_KEY: {}}):
        body = named(**meta)
        judged = era.check_http("tools/call", body, HEADERS).judged
        assert judged == era.modern_meta("tools/call", body)
    assert era.check_http("tools/call", named(**GOOD, **{era.LOG_LEVEL_KEY: "debug"}),
                          HEADERS).judged.log_level == "debug"


def test_check_http_refuses_a_version_mismatch_before_judging_either_version() -> None:
    with pytest.raises(errors.HeaderMismatch) as info:
        era.check_http("tools/call", named(**{**GOOD, era.VERSION_KEY: "2025-11-25"}), HEADERS)
    assert info.value.data["header"] == "mcp-protocol-version"
    with pytest.raises(errors.UnsupportedVersion):  # the header agrees: the version is judged
        era.check_http("tools/call", named(**{**GOOD, era.VERSION_KEY: "2025-11-25"}),
                       {**HEADERS, "mcp-protocol-version": "2025-11-25"})


@pytest.mark.parametrize(("body", "headers", "refusal"), [
    (named(**{era.VERSION_KEY: "2026-07-28"}), HEADERS, errors.InvalidParams),  # no caps
    ({"_meta": Raw(b"[1]"), "name": Raw(b'"fx__a"')}, HEADERS, errors.InvalidParams),
    (named(), HEADERS, errors.InvalidParams),  # no _meta at all
    (named(**GOOD), {**HEADERS, "mcp-method": "tools/list"}, errors.HeaderMismatch),
    (named(**GOOD), {**HEADERS, "mcp-name": "fx__b"}, errors.HeaderMismatch),
    (named(**GOOD), {**HEADERS, "mcp-name": None}, errors.HeaderMismatch),
])
def test_check_http_refuses_what_the_modern_checks_refuse(
        body: dict[str, Raw], headers: dict[str, str | None],
        refusal: type[errors.GatewayError]) -> None:
    with pytest.raises(refusal):
        era.check_http("tools/call", body, headers)
