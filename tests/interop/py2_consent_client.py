"""The official Python SDK 2.x client (``mcp.Client``, 2026-07-28 over Streamable HTTP) with an
elicitation callback that answers every prompt with ANSWER (``accept``: approve = true, or
``decline``), calling a tool the gateway's policy asks consent for.
Prints one JSON line: {"protocolVersion", "prompts": [messages seen], "outcome"}: ``ran: <text>``
or ``error <code> <data.reason>``.

Usage: python py2_consent_client.py URL TOOL JSON_ARGS ANSWER
"""

import json
import sys

import anyio
from mcp import Client, MCPError, types


async def main(url: str, tool: str, args: str, answer: str) -> None:
    prompts: list[str] = []

    async def on_elicit(ctx: object, params: types.ElicitRequestParams) -> types.ElicitResult:
        prompts.append(params.message)
        if answer == "accept":
            return types.ElicitResult(action="accept", content={"approve": True})
        return types.ElicitResult(action="decline")

    async with Client(url, elicitation_callback=on_elicit) as client:
        try:
            result = await client.call_tool(tool, json.loads(args))
            outcome = f"ran: {result.content[0].text}"
        except MCPError as exc:
            reason = (exc.error.data or {}).get("reason")
            outcome = f"error {exc.error.code} {reason}"
        out = {"protocolVersion": client.protocol_version, "prompts": prompts, "outcome": outcome}
    print(json.dumps(out))


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:5])
