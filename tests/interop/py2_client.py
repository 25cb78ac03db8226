"""The official Python SDK 2.x client (``mcp.Client``; pinned in scripts/setup, its own venv)
against an MCP Streamable HTTP endpoint: connect in MODE (``auto`` probes ``server/discover``
first and falls back to ``initialize``; ``legacy`` does ``initialize`` only), list the tools,
call one.
Prints one JSON line: {"protocolVersion", "tools": [names], "result": <tools/call result>}.

Usage: python py2_client.py URL MODE TOOL JSON_ARGS
"""

import json
import sys

import anyio
from mcp import Client


async def main(url: str, mode: str, tool: str, args: str) -> None:
    async with Client(url, mode=mode) as client:
        tools = [t.name for t in (await client.list_tools()).tools]
        result = await client.call_tool(tool, json.loads(args))
        out = {"protocolVersion": client.protocol_version, "tools": tools,
               "result": result.model_dump(mode="json", by_alias=True, exclude_none=True)}
    print(json.dumps(out))


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:5])
