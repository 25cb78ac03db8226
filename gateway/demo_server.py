"""A tiny stdio MCP server shipped with the gateway (``python -m gateway.demo_server``).

It gives a fresh install something to serve: tools ``echo`` and ``add``.  Standard library only.
"""

from __future__ import annotations

import json
import sys
from typing import Any

VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")

TOOLS = [
    {
        "name": "echo",
        "description": "Return the message unchanged.",
        "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}},
                        "required": ["message"]},
        "annotations": {"readOnlyHint": True},
    },
    {
        "name": "add",
        "description": "Add two numbers.",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
        "annotations": {"readOnlyHint": True},
    },
]


class UnknownMethod(Exception):
    pass


def _text(text: str, error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": error}


def handle(method: str, params: dict[str, Any]) -> dict[str, Any]:
    if method == "initialize":
        asked = params.get("protocolVersion")
        return {
            "protocolVersion": asked if asked in VERSIONS else VERSIONS[-1],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "mcp-gateway-demo", "version": "1.0"},
        }
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        args = params.get("arguments") or {}
        name = params.get("name")
        if name == "echo":
            return _text(str(args.get("message", "")))
        if name == "add":
            try:
                return _text(repr(float(args["a"]) + float(args["b"])))
            except (KeyError, TypeError, ValueError):
                return _text("add needs numbers a and b", error=True)
        raise LookupError(f"unknown tool {name!r}")
    raise UnknownMethod(method)


def main() -> None:
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            print(json.dumps({"jsonrpc": "2.0", "id": None,
                              "error": {"code": -32700, "message": "parse error"}}),
                  flush=True)
            continue
        if not isinstance(msg, dict) or "id" not in msg or "method" not in msg:
            continue  # notifications and responses need no answer
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": msg["id"]}
        try:
            reply["result"] = handle(msg["method"], msg.get("params") or {})
        except LookupError as exc:
            reply["error"] = {"code": -32602, "message": str(exc)}
        except UnknownMethod:
            reply["error"] = {"code": -32601, "message": f"method {msg['method']!r} not found"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
