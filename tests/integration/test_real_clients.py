"""Real MCP clients, each in its own process, list the tools and call ``fx__echo`` through
the gateway's Streamable HTTP ``/mcp``.

The clients are pinned and installed by ``scripts/setup --test``: the TypeScript SDK and the MCP
Inspector in ``.deps/interop`` (the Inspector needs node >= 22.19: the node 22 of
``.deps/conformance``), the Python SDK 2.x in ``.deps/venv-mcp2``.  The 1.x Python SDK is tested
in-process in test_http_legacy.py.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import trio
from helpers import (
    DEPS,
    INSPECTOR,
    INTEROP,
    NODE22,
    ROOT,
    fixture_backend,
    make_config,
    need_deps,
    run_gateway,
)

pytestmark = pytest.mark.system

TS_CLIENT = os.path.join(ROOT, "tests", "interop", "ts_client.mjs")
PY2 = os.path.join(DEPS, "venv-mcp2", "bin", "python")
PY2_CLIENT = os.path.join(ROOT, "tests", "interop", "py2_client.py")
ECHO = {"content": [{"type": "text", "text": "hi"}], "structuredContent": {"message": "hi"}}


async def _run(argv: list[str]) -> str:
    """Run a client to completion (60 s at most); its stdout.  A failure shows its stderr."""
    with trio.fail_after(60):
        proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False,
                                      env=dict(os.environ, NO_COLOR="1"))
    assert proc.returncode == 0, (argv, proc.returncode, proc.stdout.decode()[-2000:],
                                  proc.stderr.decode()[-4000:])
    return proc.stdout.decode()


def _last_json(out: str) -> Any:
    return json.loads(out.strip().splitlines()[-1])


async def test_typescript_sdk_client() -> None:
    """``Client`` + ``StreamableHTTPClientTransport`` of @modelcontextprotocol/sdk, on the system
    node (20 is enough): a 2025-11-25 session, list, call, DELETE."""
    need_deps(TS_CLIENT, os.path.join(INTEROP, "@modelcontextprotocol", "sdk", "package.json"))
    async with run_gateway(make_config(fixture_backend())) as gw:
        argv = ["node", TS_CLIENT, INTEROP, gw.http_url, "fx__echo", '{"message": "hi"}']
        got = _last_json(await _run(argv))
    assert got["protocolVersion"] == "2025-11-25" and got["sessionId"]
    assert {"fx__echo", "fx__progress"} <= set(got["tools"])
    assert got["result"] == ECHO


async def test_inspector_cli() -> None:
    """``mcp-inspector --cli URL --transport http`` (@modelcontextprotocol/inspector): tools/list,
    then tools/call with --tool-arg."""
    need_deps(NODE22, INSPECTOR)
    async with run_gateway(make_config(fixture_backend())) as gw:
        cli = [NODE22, INSPECTOR, "--cli", gw.http_url, "--transport", "http"]
        listed = json.loads(await _run([*cli, "--method", "tools/list"]))
        called = json.loads(await _run([*cli, "--method", "tools/call", "--tool-name", "fx__echo",
                                        "--tool-arg", "message=hi"]))
    assert {"fx__echo", "fx__progress"} <= {t["name"] for t in listed["tools"]}
    assert called == ECHO


@pytest.mark.parametrize(("mode", "version"), [("auto", "2026-07-28"), ("legacy", "2025-11-25")])
async def test_python_sdk_2(mode: str, version: str) -> None:
    """``mcp.Client(url)`` of the Python SDK 2.x: ``auto`` probes ``server/discover`` and stays in
    the 2026-07-28 era (stateless POSTs); ``legacy`` initializes a 2025-11-25 session."""
    need_deps(PY2, PY2_CLIENT)
    async with run_gateway(make_config(fixture_backend())) as gw:
        argv = [PY2, PY2_CLIENT, gw.http_url, mode, "fx__echo", '{"message": "hi"}']
        got = _last_json(await _run(argv))
    assert got["protocolVersion"] == version
    assert {"fx__echo", "fx__progress"} <= set(got["tools"])
    assert got["result"]["content"] == ECHO["content"]
    assert got["result"]["structuredContent"] == ECHO["structuredContent"]


async def test_gateway_connect_http_bridge() -> None:
    """``mcp-gateway connect http://…/mcp``: a stdio client (the Python SDK 1.x) through the bridge
    lists, calls, gets progress, answers an elicitation (a request on the call's SSE answer,
    its answer POSTed); a list_changed comes on the GET stream; on exit the session is deleted."""
    from helpers import http_json, wait_status
    from mcp import ClientSession, StdioServerParameters, types
    from mcp.client.stdio import stdio_client

    async with run_gateway(make_config(fixture_backend())) as gw:
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "PYTHONPATH") if k in os.environ}
        params = StdioServerParameters(command=sys.executable, cwd=ROOT, env=env,
                                       args=["-m", "gateway", "connect", gw.http_url])
        progress: list[float] = []
        changed = trio.Event()

        async def on_progress(p: float, total: float | None, message: str | None) -> None:
            progress.append(p)

        async def on_elicit(ctx: Any, p: types.ElicitRequestParams) -> types.ElicitResult:
            return types.ElicitResult(action="accept", content={"answer": p.message})

        async def on_message(m: Any) -> None:
            if isinstance(m, types.ServerNotification) and \
                    isinstance(m.root, types.ToolListChangedNotification):
                changed.set()

        with trio.fail_after(30):
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write, elicitation_callback=on_elicit,
                                  message_handler=on_message) as s:
                assert (await s.initialize()).protocolVersion == "2025-11-25"
                assert {"fx__echo",
                        "fx__progress"} <= {t.name for t in (await s.list_tools()).tools}
                r = await s.call_tool("fx__echo", {"message": "hi"})
                assert r.model_dump(mode="json", exclude_none=True,
                                    include={"content", "structuredContent"}) \
                    == ECHO
                await s.call_tool("fx__progress", {"steps": 3}, progress_callback=on_progress)
                assert progress == [1, 2, 3]
                r = await s.call_tool("fx__elicit", {"message": "proceed?"})
                assert json.loads(r.content[0].text)["content"] == {"answer": "proceed?"}  # type: ignore[union-attr]  # the fixture answers text
                await s.call_tool("fx__notify_list_changed", {"kind": "tools"})
                await changed.wait()
                assert (await http_json(gw.bound.admin_port,
                                        "/status"))["connections"].get("http") == 1
        with trio.fail_after(10):  # the bridge DELETEs its session when stdin closes
            await wait_status(gw.bound.admin_port, lambda st: not st["connections"].get("http"))
