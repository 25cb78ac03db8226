#!/usr/bin/env python3
"""A lean stdio MCP server for bench/growth.py: N generated tools, one `echo`, nothing else.

    python3 -S bench/lean_server.py [--tools N] [--page 1000]

Stdlib only, one thread: newline-delimited JSON-RPC on stdin/stdout.  It declares the tools
capability only and answers ``initialize``, ``ping``, ``tools/list`` (``--tools`` tools ``t0``,
``t1``, ... each with a one-field input schema, ``--page`` per page, the cursor an offset) and
``tools/call`` (every tool echoes ``arguments.message``); any other request gets -32601 and
notifications are ignored.  It exits on stdin EOF.  Its small footprint (one process, about
10 MiB resident) lets a run put 100 of them behind the gateway.
"""

from __future__ import annotations

import argparse
import json
import sys

SCHEMA = {"type": "object", "properties": {"message": {"type": "string"}}}
VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")


def tool(i: int) -> dict[str, object]:
    return {"name": f"t{i}", "description": f"generated tool {i}: echoes its message",
            "inputSchema": SCHEMA}


def answer(msg: dict[str, object], tools: int, page: int) -> dict[str, object] | None:
    """The response to one message (None for a notification)."""
    rid = msg.get("id")
    method = msg.get("method")
    if rid is None or not isinstance(method, str):
        return None
    params = msg.get("params")
    params = params if isinstance(params, dict) else {}
    if method == "initialize":
        wanted = params.get("protocolVersion")
        result: dict[str, object] = {
            "protocolVersion": wanted if wanted in VERSIONS else VERSIONS[-1],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "lean-bench-server", "version": "1"}}
    elif method == "ping":
        result = {}
    elif method == "tools/list":
        cursor = params.get("cursor")
        start = int(cursor) if isinstance(cursor, str) and cursor.isdigit() else 0
        end = min(tools, start + page)
        result = {"tools": [tool(i) for i in range(start, end)]}
        if end < tools:
            result["nextCursor"] = str(end)
    elif method == "tools/call":
        args = params.get("arguments")
        text = str(args.get("message", "")) if isinstance(args, dict) else ""
        result = {"content": [{"type": "text", "text": text}]}
    else:
        return {"jsonrpc": "2.0", "id": rid,
                "error": {"code": -32601, "message": f"method not found: {method}"}}
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tools", type=int, default=1)
    ap.add_argument("--page", type=int, default=1000)
    args = ap.parse_args()
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict):
            continue
        reply = answer(msg, args.tools, max(1, args.page))
        if reply is not None:
            out.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
            out.flush()


if __name__ == "__main__":
    main()
