"""The routing headers a client sends with a 2026-07-28 Streamable HTTP request, pure.

``Mcp-Protocol-Version`` (the version its ``_meta`` names), ``Mcp-Method``, ``Mcp-Name`` (the
param :data:`~gateway.protocol.era.NAMED` says) and one ``Mcp-Param-{X}`` per argument of a
``tools/call`` that the tool's input schema marks ``"x-mcp-header": "X"`` (present and not null).
Values are encoded by :func:`~gateway.protocol.era.header_value`, the inverse of what the
gateway's own server side decodes (:func:`~gateway.protocol.era.check_http`).  A mark is valid
only as a non-empty RFC 9110 token, on a ``string``/``integer``/``boolean`` property reached
from the root through ``properties`` alone, unique ignoring case: an HTTP client drops a tool
with an invalid one (:func:`param_paths` says why).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gateway.protocol.era import NAMED, header_value

ANNOTATION = "x-mcp-header"
PARAM_PREFIX = "mcp-param-"
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TYPES = frozenset({"string", "integer", "boolean"})
#: JSON Schema keywords holding one schema, a list of them, a map of them: a mark under any of
#: them is off the ``properties`` chain (``$ref`` is never followed).
_ONE = frozenset({"items", "contains", "unevaluatedItems", "additionalProperties",
                  "propertyNames", "unevaluatedProperties", "not", "if", "then", "else",
                  "contentSchema"})
_MANY = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_MAP = frozenset({"patternProperties", "dependentSchemas", "$defs", "definitions"})
#: Schema positions looked at in one input schema at most (a bigger one is refused).
MAX_POSITIONS = 10000
#: The integers a header carries (JSON's exact range).
MAX_INT = 2**53 - 1

Paths = dict[tuple[str, ...], str]


class InvalidAnnotation(ValueError):
    """An ``x-mcp-header`` mark the spec does not allow (the message says where and why)."""


def param_paths(schema: Any) -> Paths:
    """The marked arguments of a tool's input schema: property path → header suffix.

    Raises:
        InvalidAnnotation: a mark is invalid (the tool is dropped by an HTTP client).
    """
    found: Paths = {}
    seen: dict[str, str] = {}
    stack: list[tuple[tuple[str, ...] | None, Any]] = [((), schema)]
    positions = 0
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        positions += 1
        if positions > MAX_POSITIONS:
            raise InvalidAnnotation(f"the input schema has more than {MAX_POSITIONS} positions")
        if ANNOTATION in node:
            where, token = _check(path, node, seen)
            found[where] = token
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                stack.extend(((*path, name) if path is not None else None, sub)
                             for name, sub in value.items())
            elif key in _ONE:
                stack.append((None, value))
            elif key in _MANY and isinstance(value, list):
                stack.extend((None, sub) for sub in value)
            elif key in _MAP and isinstance(value, dict):
                stack.extend((None, sub) for sub in value.values())
    return found


def _check(path: tuple[str, ...] | None, node: dict[str, Any], seen: dict[str, str]
           ) -> tuple[tuple[str, ...], str]:
    if not path:
        raise InvalidAnnotation(f"{ANNOTATION} outside a chain of properties from the root")
    where = ".".join(path)
    token = node[ANNOTATION]
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        shown = repr(token)[:60] if isinstance(token, str) else type(token).__name__
        raise InvalidAnnotation(f"property {where!r}: {ANNOTATION} {shown} is not an "
                                "HTTP token")
    kind = node.get("type")
    if not isinstance(kind, str) or kind not in _TYPES:
        raise InvalidAnnotation(f"property {where!r}: {ANNOTATION} on a property of type "
                                f"{kind!r}, not string, integer or boolean")
    lower = token.lower()
    if lower in seen:
        raise InvalidAnnotation(f"property {where!r}: {ANNOTATION} {token!r} repeats the one "
                                f"of {seen[lower]!r}")
    seen[lower] = where
    return path, token


def param_value(value: Any) -> str | None:
    """An argument as a header value (None: none is sent: null, or not a string, an integer
    in JSON's exact range or a boolean)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value) if -MAX_INT <= value <= MAX_INT else None
    if isinstance(value, str):
        return header_value(value)
    return None


def _at(arguments: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(arguments, dict):
            return None
        arguments = arguments.get(key)
    return arguments


def request_headers(method: str, version: str, params: Mapping[str, Any],
                    paths: Paths | None = None) -> list[tuple[str, str]]:
    """The routing headers of one request: ``params`` decoded (``name``/``uri``, and for a
    ``tools/call`` its ``arguments`` when the tool has marked ones, ``paths``)."""
    head = [("mcp-protocol-version", header_value(version)), ("mcp-method", header_value(method))]
    field = NAMED.get(method)
    if field is not None and isinstance(params.get(field), str):
        head.append(("mcp-name", header_value(params[field])))
    if paths and method == "tools/call":
        arguments = params.get("arguments")
        for path, token in paths.items():
            rendered = param_value(_at(arguments, path))
            if rendered is not None:
                head.append((PARAM_PREFIX + token.lower(), rendered))
    return head


def split_tools(tools: list[Any]) -> tuple[list[Any], dict[str, Paths], list[tuple[str, str]]]:
    """A ``tools/list`` page as an HTTP client keeps it: the tools kept, the marked arguments
    of each (only tools that have some), and the tools dropped with why."""
    kept: list[Any] = []
    marked: dict[str, Paths] = {}
    dropped: list[tuple[str, str]] = []
    for tool in tools:
        name = tool.get("name") if isinstance(tool, dict) else None
        schema = tool.get("inputSchema") if isinstance(tool, dict) else None
        try:
            paths = param_paths(schema)
        except InvalidAnnotation as exc:
            dropped.append((str(name)[:200], str(exc)))
            continue
        kept.append(tool)
        if paths and isinstance(name, str):
            marked[name] = paths
    return kept, marked, dropped
