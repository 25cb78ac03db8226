"""The 2026-07-28 routing headers a client sends (gateway.protocol.mcpheaders): the cases of the
conformance scenarios http-standard-headers, http-custom-headers and http-invalid-tool-headers,
and a round trip through the gateway's own server-side check (era.check_http)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from gateway.protocol import era, jsonrpc, mcpheaders
from gateway.protocol.mcpheaders import InvalidAnnotation, param_paths, request_headers

V = "2026-07-28"


def b64(text: str) -> str:
    return f"=?base64?{base64.b64encode(text.encode()).decode()}?="


def schema(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props}


def test_standard_headers_name_the_method_and_the_item() -> None:
    assert request_headers("tools/list", V, {}) == [("mcp-protocol-version", V),
                                                    ("mcp-method", "tools/list")]
    for method, field, value in (("tools/call", "name", "echo"), ("prompts/get", "name", "p"),
                                 ("resources/read", "uri", "file:///a b.txt")):
        head = dict(request_headers(method, V, {field: value}))
        assert head["mcp-name"] == value and head["mcp-method"] == method
    assert dict(request_headers("resources/read", V, {"uri": "file:///é"}))["mcp-name"] == b64(
        "file:///é")


CUSTOM = schema(
    region={"type": "string", "x-mcp-header": "Region"},
    priority={"type": "integer", "x-mcp-header": "Priority"},
    verbose={"type": "boolean", "x-mcp-header": "Verbose"},
    debug={"type": "boolean", "x-mcp-header": "Debug"},
    empty_val={"type": "string", "x-mcp-header": "EmptyVal"},
    float_val={"type": "number"},
    non_ascii_val={"type": "string", "x-mcp-header": "NonAscii"},
    whitespace_val={"type": "string", "x-mcp-header": "Whitespace"},
    internal_space_val={"type": "string", "x-mcp-header": "InternalSpace"},
    crlf_val={"type": "string", "x-mcp-header": "CrLf"},
    tab_val={"type": "string", "x-mcp-header": "Tab"},
    looks_encoded={"type": "string", "x-mcp-header": "Sentinel"},
    nested={"type": "object", "properties": {"zone": {"type": "string", "x-mcp-header": "Zone"}}},
    query={"type": "string"})


def test_custom_headers_mirror_marked_arguments_encoded() -> None:
    paths = param_paths(CUSTOM)
    assert paths[("nested", "zone")] == "Zone" and ("query",) not in paths
    args = {"region": "us-west1", "priority": 42, "verbose": False, "debug": True,
            "empty_val": "", "float_val": 3.14159, "non_ascii_val": "Hello, 世界",
            "whitespace_val": " padded ", "internal_space_val": "us west 1",
            "crlf_val": "line1\r\nline2", "tab_val": "\tindented", "looks_encoded": b64("x"),
            "nested": {"zone": "b"}, "query": "SELECT 1"}
    head = dict(request_headers("tools/call", V, {"name": "t", "arguments": args}, paths))
    params = {k[len("mcp-param-"):]: v for k, v in head.items() if k.startswith("mcp-param-")}
    assert params == {
        "region": "us-west1", "priority": "42", "verbose": "false", "debug": "true",
        "emptyval": "", "nonascii": b64("Hello, 世界"), "whitespace": b64(" padded "),
        "internalspace": "us west 1", "crlf": b64("line1\r\nline2"), "tab": b64("\tindented"),
        "sentinel": b64(b64("x")), "zone": "b"}
    # null or absent: no header; a value no header can carry (an object): none either
    head = dict(request_headers("tools/call", V, {"name": "t", "arguments": {
        "region": None, "priority": {"a": 1}, "verbose": 2**60}}, paths))
    assert not [k for k in head if k.startswith("mcp-param-")]


@pytest.mark.parametrize(("prop", "why"), [
    ({"type": "string", "x-mcp-header": ""}, "not an HTTP token"),
    ({"type": "object", "x-mcp-header": "Data"}, "type 'object'"),
    ({"type": "array", "items": {"type": "string"}, "x-mcp-header": "Items"}, "type 'array'"),
    ({"type": "null", "x-mcp-header": "Nil"}, "type 'null'"),
    ({"type": "number", "x-mcp-header": "Score"}, "type 'number'"),
    ({"x-mcp-header": "Untyped"}, "type None"),
    ({"type": "string", "x-mcp-header": "My Region"}, "not an HTTP token"),
    ({"type": "string", "x-mcp-header": "Region:Primary"}, "not an HTTP token"),
    ({"type": "string", "x-mcp-header": "Région"}, "not an HTTP token"),
    ({"type": "string", "x-mcp-header": "Region\t1"}, "not an HTTP token"),
    ({"type": "string", "x-mcp-header": 5}, "int is not an HTTP token"),
])
def test_an_invalid_mark_is_refused(prop: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidAnnotation, match=why):
        param_paths(schema(value=prop))


def test_marks_off_the_properties_chain_or_repeated_are_refused() -> None:
    mark = {"type": "string", "x-mcp-header": "X"}
    for bad in ({"type": "object", "x-mcp-header": "Root"},
                schema(a={"type": "array", "items": mark}),
                {"type": "object", "oneOf": [schema(a=mark)]},
                {"type": "object", "$defs": {"d": mark}},
                {"type": "object", "if": schema(a=mark)},
                schema(a=mark, b={"type": "string", "x-mcp-header": "x"})):
        with pytest.raises(InvalidAnnotation):
            param_paths(bad)
    # a $ref is never followed; marks in "default"/"examples" data are not marks
    assert param_paths(schema(a={"$ref": "#/$defs/x", "default": {"x-mcp-header": "D"}})) == {}
    assert param_paths(None) == {} and param_paths({"type": "object"}) == {}


def test_split_tools_keeps_valid_tools_and_says_why_others_went() -> None:
    tools = [{"name": "valid_tool", "inputSchema": schema(
                 region={"type": "string", "x-mcp-header": "Region"})},
             {"name": "plain", "inputSchema": schema()},
             {"name": "invalid_duplicate_diff_case", "inputSchema": schema(
                 f1={"type": "string", "x-mcp-header": "MyField"},
                 f2={"type": "string", "x-mcp-header": "myfield"})}]
    kept, marked, dropped = mcpheaders.split_tools(tools)
    assert [t["name"] for t in kept] == ["valid_tool", "plain"]
    assert marked == {"valid_tool": {("region",): "Region"}}
    assert dropped[0][0] == "invalid_duplicate_diff_case" and "repeats" in dropped[0][1]


def test_the_gateways_own_server_side_accepts_what_its_client_side_sends() -> None:
    meta = {era.VERSION_KEY: V, era.CAPABILITIES_KEY: {}}
    for method, extra in (("tools/call", {"name": "ünï", "arguments": {}}),
                          ("resources/read", {"uri": " spaced "}), ("tools/list", {})):
        params = jsonrpc.raw_dict(jsonrpc.encode_dict({**extra, "_meta": meta}))
        head = dict(request_headers(method, V, extra))
        era.check_http(method, params, dict(head))  # raises HeaderMismatch when they differ
