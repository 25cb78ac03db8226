"""The official Python SDK 2.x client (``mcp.Client``) pinned to 2026-07-28, as a stdio client of
a server COMMAND (``mcp-gateway connect URL`` in the tests): lists the tools, calls ``fx__echo``,
calls ``fx__elicit`` (its elicitation callback answers the input-required round), gives up on
``fx__sleep`` after 1 s (the SDK sends ``notifications/cancelled``), then prints the line
``cancelled`` and waits for a line on stdin (the caller looks at the gateway meanwhile), opens a
``subscriptions/listen`` for tool list changes and waits for one.
Then prints one JSON line: {"protocolVersion", "tools", "echo", "elicit", "cancelled", "event"}.

Usage: python py2_stdio_client.py COMMAND [ARG...]
"""

import json
import os
import sys

import anyio
import mcp_types as types
from mcp import Client, StdioServerParameters


async def on_elicit(context, params: types.ElicitRequestParams) -> types.ElicitResult:
    return types.ElicitResult(action="accept", content={"answer": params.message})


def dump(result) -> dict:
    return result.model_dump(mode="json", by_alias=True, exclude_none=True)


async def main(command: str, *args: str) -> None:
    server = StdioServerParameters(command=command, args=list(args), env=dict(os.environ),
                                   cwd=os.getcwd())
    out = {}
    with anyio.fail_after(60):
        async with Client(server, mode="2026-07-28", elicitation_callback=on_elicit) as client:
            out["protocolVersion"] = client.protocol_version
            out["tools"] = [t.name for t in (await client.list_tools()).tools]
            out["echo"] = dump(await client.call_tool("fx__echo", {"message": "hi"}))
            out["elicit"] = dump(await client.call_tool("fx__elicit", {"message": "proceed?"}))
            out["cancelled"] = True
            with anyio.move_on_after(1.0):
                await client.call_tool("fx__sleep", {"seconds": 30})
                out["cancelled"] = False
            print("cancelled", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)
            async with client.listen(tools_list_changed=True) as sub:
                await client.call_tool("fx__notify_list_changed", {"kind": "tools"})
                with anyio.fail_after(10):
                    out["event"] = type(await sub.__anext__()).__name__
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:])
