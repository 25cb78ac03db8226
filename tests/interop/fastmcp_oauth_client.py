"""FastMCP's client (PyPI ``fastmcp``, pinned in scripts/setup, its own venv) with
``auth="oauth"`` against an MCP Streamable HTTP endpoint that answers 401: lists the tools, or
records the error it reports.  Prints one JSON line: ``{"connected": bool, "error": str|null}``.

Usage: python fastmcp_oauth_client.py URL  (run with a scratch HOME and a BROWSER that only
records: nothing may open a real browser or keep tokens).
"""

from __future__ import annotations

import asyncio
import json
import sys

from fastmcp import Client


async def main(url: str) -> dict[str, object]:
    try:
        async with Client(url, auth="oauth", timeout=20) as client:
            await client.list_tools()
        return {"connected": True, "error": None}
    except Exception as exc:  # what the client reports is the result
        return {"connected": False, "error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
