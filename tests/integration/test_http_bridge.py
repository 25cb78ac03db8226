"""``mcp-gateway connect http://…/mcp``: the stdio bridge as a Streamable HTTP client, for stdio
clients of either era (real SDK clients in their own processes, the bridge a subprocess)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import trio
from helpers import ROOT, fixture_backend, make_config, run_gateway

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT)


async def test_only_json_rpc_messages_reach_a_legacy_clients_stdout() -> None:
    """The Python SDK 1.x on stdio through the bridge, 2025-11-25: each SSE answer opens with a
    priming event (an id, empty data), which is not a message: nothing but JSON-RPC messages is
    written to stdout, so the SDK parses every line it reads."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    async with run_gateway(make_config(fixture_backend())) as gw:
        params = StdioServerParameters(command=sys.executable, cwd=ROOT, env=_env(),
                                       args=["-m", "gateway", "connect", gw.http_url])
        unparsed: list[Exception] = []
        progress: list[float] = []

        async def on_message(m: Any) -> None:
            if isinstance(m, Exception):  # a stdout line the SDK could not parse
                unparsed.append(m)

        async def on_progress(p: float, total: float | None, message: str | None) -> None:
            progress.append(p)

        with trio.fail_after(30):
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write, message_handler=on_message) as s:
                assert (await s.initialize()).protocolVersion == "2025-11-25"
                await s.call_tool("fx__progress", {"steps": 2}, progress_callback=on_progress)
                r = await s.call_tool("fx__echo", {"message": "hi"})
                assert r.content[0].text == "hi"  # type: ignore[union-attr]
    assert progress == [1, 2]
    assert unparsed == []
