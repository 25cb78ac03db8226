"""Real third-party MCP servers (PyPI mcp-server-time, npm server-everything) behind one
in-process gateway, driven by the official MCP Python SDK 1.x: its WebSocket client (in a
worker thread running asyncio) and its stdio client through ``mcp-gateway connect`` (over the
WebSocket listener and over the unix socket listener)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from helpers import EVERYTHING, ROOT, TIME_SERVER, make_config, run_gateway
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.websocket import websocket_client

pytestmark = [
    pytest.mark.system,
    pytest.mark.filterwarnings(
        "ignore:The WebSocket client transport is deprecated:DeprecationWarning"
    ),
]

T = TypeVar("T")
SDK_TIMEOUT = 40.0
CONFIG_ROOT = "file:///srv/gateway-config-root"

TIME_BACKEND = f"""
[backends.time]
command = {json.dumps(TIME_SERVER)}
"""
BOTH_BACKENDS = (
    TIME_BACKEND
    + f"""
[backends.everything]
command = "node"
args = [{json.dumps(EVERYTHING)}, "stdio"]
roots = [{json.dumps(CONFIG_ROOT)}]
"""
)


def nonce() -> str:
    return secrets.token_hex(6)


async def in_asyncio(fn: Callable[[], Awaitable[T]]) -> T:
    """Run an asyncio coroutine function (the SDK) in a worker thread, bounded on both sides."""

    async def bounded() -> T:
        async with asyncio.timeout(SDK_TIMEOUT):
            return await fn()

    return await trio.to_thread.run_sync(asyncio.run, bounded(), abandon_on_cancel=True)


def text(result: types.CallToolResult) -> str:
    assert not result.isError, result
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def test_sdk_websocket_client_against_time_and_everything() -> None:
    cfg = make_config(BOTH_BACKENDS)
    tag = nonce()
    seen: dict[str, Any] = {"elicit": [], "sample": [], "roots": 0, "progress": []}

    async def on_elicit(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        seen["elicit"].append(params)
        return types.ElicitResult(action="accept", content={"name": f"name-{tag}", "check": True})

    async def on_sample(
        ctx: Any, params: types.CreateMessageRequestParams
    ) -> types.CreateMessageResult:
        seen["sample"].append(params)
        return types.CreateMessageResult(
            role="assistant",
            model=f"model-{tag}",
            content=types.TextContent(type="text", text=f"sampled-{tag}"),
        )

    async def on_roots(ctx: Any) -> types.ListRootsResult:
        seen["roots"] += 1
        return types.ListRootsResult(roots=[types.Root(uri=f"file:///client/{tag}")])  # type: ignore[arg-type]  # pydantic coerces the str to FileUrl

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen["progress"].append((progress, total))

    async def session() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with (
            websocket_client(url) as (read, write),
            ClientSession(
                read,
                write,
                elicitation_callback=on_elicit,
                sampling_callback=on_sample,
                list_roots_callback=on_roots,
            ) as s,
        ):
            init = await s.initialize()
            out["server"] = init.serverInfo.name
            out["tools"] = [t.name for t in (await s.list_tools()).tools]
            out["time"] = await s.call_tool("time__get_current_time", {"timezone": "UTC"})
            out["echo"] = await s.call_tool("everything__echo", {"message": tag})
            out["long"] = await s.call_tool(
                "everything__trigger-long-running-operation",
                {"duration": 0.6, "steps": 3},
                progress_callback=on_progress,
            )
            out["elicit"] = await s.call_tool("everything__trigger-elicitation-request", {})
            out["sample"] = await s.call_tool(
                "everything__trigger-sampling-request", {"prompt": f"prompt-{tag}", "maxTokens": 20}
            )
            out["roots"] = await s.call_tool("everything__get-roots-list", {})
            out["convert"] = await s.call_tool(
                "time__convert_time",
                {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
            )
        return out

    with trio.fail_after(60):
        async with run_gateway(cfg) as gw:
            url = gw.url
            out = await in_asyncio(session)

    assert out["server"] == "mcp-gateway"
    tools = out["tools"]
    assert len(tools) == len(set(tools))
    assert "time__get_current_time" in tools and "time__convert_time" in tools
    everything = [t for t in tools if t.startswith("everything__")]
    # 17: the tools server-everything registers only for clients declaring elicitation,
    # sampling and roots are there because the gateway declares them
    assert len(everything) == 17, everything
    for name in (
        "echo",
        "trigger-elicitation-request",
        "trigger-sampling-request",
        "get-roots-list",
        "trigger-long-running-operation",
    ):
        assert f"everything__{name}" in tools

    now = json.loads(text(out["time"]))
    assert now["timezone"] == "UTC"
    assert (
        abs((datetime.fromisoformat(now["datetime"]).timestamp()) - datetime.now().timestamp())
        < 120
    )
    assert json.loads(text(out["convert"]))["target"]["timezone"] == "Asia/Tokyo"
    assert text(out["echo"]) == f"Echo: {tag}"

    assert "Duration: 0.6 seconds, Steps: 3" in text(out["long"])
    assert seen["progress"] == [(1.0, 3.0), (2.0, 3.0), (3.0, 3.0)]

    assert len(seen["elicit"]) == 1
    assert "name" in seen["elicit"][0].requestedSchema["properties"]
    assert f"- Name: name-{tag}" in text(out["elicit"])

    assert len(seen["sample"]) == 1
    sample = seen["sample"][0]
    assert (
        sample.includeContext == "none"
    )  # set by the gateway: no client context leaks to a shared child
    assert f"prompt-{tag}" in json.dumps(sample.model_dump(mode="json"))
    assert f"sampled-{tag}" in text(out["sample"])

    # roots come from config in shared mode; the client's own roots never reach the child
    assert CONFIG_ROOT in text(out["roots"])
    assert tag not in text(out["roots"])
    assert seen["roots"] == 0


def bridge_params(target: str) -> StdioServerParameters:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return StdioServerParameters(
        command=sys.executable, args=["-m", "gateway", "connect", target], cwd=ROOT, env=env
    )


async def bridge_session(target: str, errlog: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with (
        stdio_client(bridge_params(target), errlog=errlog) as (read, write),
        ClientSession(read, write) as s,
    ):
        init = await s.initialize()
        out["server"] = init.serverInfo.name
        out["protocol"] = init.protocolVersion
        out["tools"] = sorted(t.name for t in (await s.list_tools()).tools)
        out["now"] = await s.call_tool("time__get_current_time", {"timezone": "Europe/Paris"})
        out["bad"] = await s.call_tool("time__get_current_time", {"timezone": "Not/AZone"})
        await s.send_ping()
    return out


def check_bridge(out: dict[str, Any]) -> None:
    assert out["server"] == "mcp-gateway"
    assert out["tools"] == ["time__convert_time", "time__get_current_time"]
    assert json.loads(text(out["now"]))["timezone"] == "Europe/Paris"
    assert out["bad"].isError  # the backend's own tool error passes through


async def test_stdio_bridge_over_websocket_and_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "gw.sock"
    cfg = make_config(TIME_BACKEND, unix=str(sock))
    # the SDK's stdio client wants a real file for the bridge's stderr
    with trio.fail_after(60), open(tmp_path / "bridge.log", "w+") as errlog:  # noqa: ASYNC230 - the bridge's stderr log: a local file, opened once
        async with run_gateway(cfg) as gw:
            assert gw.bound.unix_path == str(sock)
            over_ws = await in_asyncio(lambda: bridge_session(gw.url, errlog))
            over_unix = await in_asyncio(lambda: bridge_session(f"unix:{sock}", errlog))
        errlog.seek(0)
        log = errlog.read()
    check_bridge(over_ws)
    check_bridge(over_unix)
    assert "Traceback" not in log, log
