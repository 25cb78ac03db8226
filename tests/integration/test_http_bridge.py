"""``mcp-gateway connect http://…/mcp``: the stdio bridge as a Streamable HTTP client, for stdio
clients of either era (real SDK clients in their own processes, the bridge a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from helpers import DEPS, ROOT, fixture_backend, make_config, run_gateway

from gateway import events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

PY2 = os.path.join(DEPS, "venv-mcp2", "bin", "python")
PY2_STDIO_CLIENT = os.path.join(ROOT, "tests", "interop", "py2_stdio_client.py")
CONNECT = [sys.executable, "-m", "gateway", "connect"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT)


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[bytes]:
    """The lines a process writes (without their newlines)."""
    buf = b""
    while chunk := await stream.receive_some(65536):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line


async def test_a_2026_client_lists_calls_answers_input_is_cancelled_and_listens() -> None:
    """The Python SDK 2.x pinned to 2026-07-28 on stdio, its server the bridge: every request is
    POSTed stateless with its headers; the elicitation comes as an input-required round the SDK
    answers; giving up on a call (``notifications/cancelled``) closes its POST stream, which
    cancels it at the backend; a listen stream is relayed message by message."""
    assert os.path.exists(PY2), "missing .deps/venv-mcp2: run scripts/setup --test"  # noqa: ASYNC240 - a skip check on a local path
    async with run_gateway(make_config(fixture_backend())) as gw:
        proc = await trio.lowlevel.open_process([PY2, PY2_STDIO_CLIENT, *CONNECT, gw.http_url],
                                                cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            lines = _lines(proc.stdout)
            with trio.fail_after(30):
                assert await lines.__anext__() == b"cancelled"
            # the sleep was cancelled at the backend while the client goes on (not left to run
            # its 30 s, nor cancelled only when the bridge exits)
            await gw.events.wait(events.RequestFinished, backend="fx", method="tools/call",
                                 outcome=events.RequestOutcome.CANCELLED, principal="_none")
            await gw.status_until(lambda st: st["client_requests_in_flight"] == 0)
            await proc.stdin.send_all(b"go\n")
            with trio.fail_after(30):
                got: dict[str, Any] = json.loads(await lines.__anext__())
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert got["protocolVersion"] == "2026-07-28"
    assert {"fx__echo", "fx__elicit", "fx__sleep"} <= set(got["tools"])
    assert got["echo"]["content"] == [{"type": "text", "text": "hi"}]
    assert json.loads(got["elicit"]["content"][0]["text"])["content"] == {"answer": "proceed?"}
    assert got["cancelled"] is True
    assert got["event"] == "ToolsListChanged"


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
                assert r.content[0].text == "hi"  # type: ignore[union-attr]  # the fixture answers text
    assert progress == [1, 2]
    assert unparsed == []


async def test_raw_2026_lines_a_named_request_in_base64_and_a_listen_ended_from_stdin() -> None:
    """Raw lines on the bridge's stdin: a ``tools/call`` whose name is not plain ASCII reaches the
    gateway (its ``Mcp-Name`` in base64) and gets the gateway's answer, not -32020; a
    ``notifications/cancelled`` for a listen closes its stream and the client gets the closing
    result, as on the gateway's own stdio-framed listeners; only JSON lines come out."""
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}

    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps({"jsonrpc": "2.0", **obj}).encode() + b"\n"

    async with run_gateway(make_config(fixture_backend())) as gw:
        proc = await trio.lowlevel.open_process([*CONNECT, gw.http_url], cwd=ROOT, env=_env(),
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            lines = _lines(proc.stdout)
            with trio.fail_after(20):
                await proc.stdin.send_all(line({"id": 1, "method": "tools/call", "params": {
                    "name": "fx__\u00e9cho", "arguments": {}, "_meta": meta}}))
                answer = json.loads(await lines.__anext__())
                assert answer["id"] == 1 and answer["error"]["code"] == -32602, answer
                listen = {"notifications": {"toolsListChanged": True}, "_meta": meta}
                await proc.stdin.send_all(line({"id": "l", "method": "subscriptions/listen",
                                                "params": listen}))
                ack = json.loads(await lines.__anext__())
                assert ack["method"] == "notifications/subscriptions/acknowledged", ack
                await gw.status_until(lambda st: st["client_requests_in_flight"] == 1)
                await proc.stdin.send_all(line({"method": "notifications/cancelled",
                                                "params": {"requestId": "l"}}))
                closing = json.loads(await lines.__anext__())
                tag = {"io.modelcontextprotocol/subscriptionId": "l"}
                assert closing == {"jsonrpc": "2.0", "id": "l",
                                   "result": {"resultType": "complete", "_meta": tag}}
                await gw.status_until(lambda st: st["client_requests_in_flight"] == 0)
                await proc.stdin.aclose()
                assert [x async for x in lines] == []
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
