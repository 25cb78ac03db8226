"""The contract every client listener keeps: WebSocket, unix socket, Streamable HTTP (a legacy
session, and stateless 2026-07-28), the stdio bridge (``mcp-gateway connect``) and the
harness's memory streams, each where it applies.  One message in, one out; a batch only from a
2025-03-26 client; an oversize message gets its specific refusal and the connection the fate its
transport documents; malformed JSON -32700; an unknown method -32601; a draining gateway refuses
new work (-32005 ``shutdown``, retryable), finishes the calls it had read, then closes.

Real sockets (the listeners are the point), backends on memory connectors (tests/memharness.py),
and no sleep: a call in flight is a memory tool held until the test releases it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from helpers import ROOT, LineSocket, fixture_backend, make_config
from memharness import Harness, running

from gateway.backend.memory import MemoryLink, Script, echo

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning")]

KINDS = ["memory", "websocket", "unix", "http-legacy", "http-stateless", "bridge"]
MODERN = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {}}
HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
LIMIT = 65536  # gateway.max_message_bytes here
RETRYABLE = {"reason": "shutdown", "retryable": True}
BOUND = 30.0  # every test's deadline (real clock; nothing waits on it)


class Held:
    """A memory tool that stays in flight until :meth:`release` (the test's own clock)."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.released = trio.Event()

    async def __call__(self, link: MemoryLink, args: dict[str, Any]) -> Any:
        self.entered.set()
        await self.released.wait()
        return {"content": [{"type": "text", "text": "held"}]}

    def release(self) -> None:
        self.released.set()


class Wire:
    """One client connection over one listener: ``exchange`` sends one transport message and
    returns the HTTP status (None off HTTP) and the one message that answers it."""

    kind: str
    modern = False

    def body(self, id: Any, method: str, params: dict[str, Any] | None = None) -> bytes:
        params = dict(params or {})
        if self.modern:
            params["_meta"] = META
        return json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()

    def call(self, id: Any, tool: str, **arguments: Any) -> bytes:
        return self.body(id, "tools/call", {"name": tool, "arguments": arguments})

    async def exchange(self, data: bytes) -> tuple[int | None, Any]:
        raise NotImplementedError

    async def closed(self) -> str:
        """How the gateway ended the connection: a WebSocket close code, or "eof"."""
        raise NotImplementedError


class LinesWire(Wire):
    """A message stream of its own: WebSocket frames or newline-delimited lines."""

    def __init__(self, kind: str, stream: Any) -> None:
        self.kind = kind
        self.stream = stream

    async def send(self, data: bytes) -> None:
        await self.stream.send_message(data.decode())

    async def receive(self) -> Any:
        return json.loads(await self.stream.get_message())

    async def exchange(self, data: bytes) -> tuple[int | None, Any]:
        await self.send(data)
        return None, await self.receive()

    async def closed(self) -> str:
        with pytest.raises(trio_websocket.ConnectionClosed) as info:
            await self.stream.get_message()
        reason = info.value.reason
        return "eof" if reason is None else str(reason.code)

    async def initialize(self, version: str) -> None:
        _, r = await self.exchange(self.body(0, "initialize", {
            "protocolVersion": version, "capabilities": {},
            "clientInfo": {"name": "contract", "version": "0"}}))
        assert r["result"]["protocolVersion"] == version, r
        await self.send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')


class ProcessLines:
    """``mcp-gateway connect``'s stdio with :class:`LineSocket`'s calls."""

    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self.lines = LineSocket(trio.StapledStream(proc.stdin, proc.stdout))  # type: ignore[arg-type]

    async def send_message(self, message: str) -> None:
        await self.lines.send_message(message)

    async def get_message(self) -> str:
        return await self.lines.get_message()


class HttpWire(Wire):
    """POSTs to /mcp: in a legacy session (after initialize), or stateless (``modern``)."""

    def __init__(self, kind: str, client: httpx.AsyncClient, url: str) -> None:
        self.kind = kind
        self.modern = kind == "http-stateless"
        self.client = client
        self.url = url
        self.headers = dict(HEADERS)
        self.last: httpx.Response | None = None

    async def exchange(self, data: bytes) -> tuple[int | None, Any]:
        headers = dict(self.headers)
        if self.modern:
            headers["mcp-protocol-version"] = MODERN
            try:
                sent = json.loads(data)
            except ValueError:
                sent = {}
            if isinstance(sent, dict) and "method" in sent:
                headers["mcp-method"] = sent["method"]
                if sent["method"] == "tools/call":
                    headers["mcp-name"] = sent["params"]["name"]
        r = self.last = await self.client.post(self.url, headers=headers, content=data)
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            (answer,) = [json.loads(line[6:]) for line in r.text.splitlines()
                         if line.startswith("data: ") and "method" not in json.loads(line[6:])]
            return r.status_code, answer
        return r.status_code, r.json()

    async def initialize(self, version: str) -> None:
        status, r = await self.exchange(self.body(0, "initialize", {
            "protocolVersion": version, "capabilities": {},
            "clientInfo": {"name": "contract", "version": "0"}}))
        assert status == 200 and r["result"]["protocolVersion"] == version, r
        assert self.last is not None
        self.headers.update({"mcp-session-id": self.last.headers["mcp-session-id"],
                             "mcp-protocol-version": version})
        r2 = await self.client.post(self.url, headers=self.headers,
                                    json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert r2.status_code == 202


@asynccontextmanager
async def gateway(tmp_path: Path, script: Script) -> AsyncIterator[Harness]:
    """The daemon with every client listener bound, its one backend ``fx`` on ``script``."""
    cfg = make_config(fixture_backend("fx"), unix=str(tmp_path / "gw.sock"),
                      gateway=f"max_message_bytes = {LIMIT}\ndrain_delay = 0.0\n"
                              "drain_grace = 30.0")
    async with running(cfg, {"fx": script}) as gw:
        yield gw


@asynccontextmanager
async def wire(gw: Harness, kind: str, version: str = "2025-11-25") -> AsyncIterator[Wire]:
    """A connection of ``kind`` to ``gw``, initialized at ``version`` (not stateless HTTP)."""
    bound = gw.bound
    if kind == "memory":
        socket = gw.attach()
        try:
            w = LinesWire(kind, socket)
            await w.initialize(version)
            yield w
        finally:
            with trio.CancelScope(shield=True):
                await socket.stream.aclose()
    elif kind == "websocket":
        async with trio_websocket.open_websocket_url(
                f"ws://127.0.0.1:{bound.websocket_port}/", subprotocols=["mcp"],
                max_message_size=4 * LIMIT) as ws:
            w = LinesWire(kind, ws)
            await w.initialize(version)
            yield w
    elif kind == "unix":
        assert bound.unix_path is not None
        async with await trio.open_unix_socket(bound.unix_path) as stream:
            w = LinesWire(kind, LineSocket(stream))
            await w.initialize(version)
            yield w
    elif kind == "bridge":
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "gateway", "connect", f"ws://127.0.0.1:{bound.websocket_port}/"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL)
        try:
            w = LinesWire(kind, ProcessLines(proc))
            await w.initialize(version)
            yield w
        finally:
            assert proc.stdin is not None
            await proc.stdin.aclose()  # EOF: the bridge closes the WebSocket and exits
            with trio.CancelScope(shield=True):
                await proc.wait()
    else:
        async with httpx.AsyncClient(timeout=BOUND) as client:
            w = HttpWire(kind, client, f"http://127.0.0.1:{bound.http_port}/mcp")
            if not w.modern:
                await w.initialize(version)
            yield w


def text_of(message: dict[str, Any]) -> str:
    text: str = message["result"]["content"][0]["text"]
    return text


@pytest.mark.parametrize("kind", KINDS)
async def test_one_message_in_one_answer_out(kind: str, tmp_path: Path) -> None:
    with trio.fail_after(BOUND):
        async with gateway(tmp_path, Script()) as gw, wire(gw, kind) as w:
            for i in range(1, 4):
                status, r = await w.exchange(w.call(i, "fx__echo", n=i))
                assert status in (None, 200)
                assert r["id"] == i and text_of(r) == json.dumps({"n": i}), r
            assert len([m for m in gw.link("fx").received if m.get("method") == "tools/call"]) == 3


@pytest.mark.parametrize("kind", KINDS)
async def test_a_batch_only_from_a_2025_03_26_client(kind: str, tmp_path: Path) -> None:
    with trio.fail_after(BOUND):
        async with gateway(tmp_path, Script()) as gw:
            if kind != "http-stateless":
                async with wire(gw, kind, "2025-03-26") as w:
                    batch = b"[" + w.call("a", "fx__echo", n=1) + b"," + w.call("b", "fx__echo",
                                                                                 n=2) + b"]"
                    status, r = await w.exchange(batch)
                    assert status in (None, 200)
                    assert isinstance(r, list) and sorted(m["id"] for m in r) == ["a", "b"], r
            async with wire(gw, kind) as w:  # 2025-11-25 (or stateless 2026-07-28): refused
                batch = b"[" + w.call("a", "fx__echo", n=1) + b"]"
                status, r = await w.exchange(batch)
                assert status in (None, 400)
                assert r["id"] is None and r["error"]["code"] == -32600, r
                status, r = await w.exchange(w.call("next", "fx__echo", n=3))  # still serving
                assert r["id"] == "next" and "result" in r


@pytest.mark.parametrize("kind", KINDS)
async def test_malformed_json_is_32700_and_the_connection_goes_on(kind: str,
                                                                   tmp_path: Path) -> None:
    with trio.fail_after(BOUND):
        async with gateway(tmp_path, Script()) as gw, wire(gw, kind) as w:
            status, r = await w.exchange(b'{"jsonrpc": "2.0", "id": 1, "method": ')
            assert status in (None, 400)
            assert r["id"] is None and r["error"]["code"] == -32700, r
            status, r = await w.exchange(w.call(2, "fx__echo", n=2))
            assert r["id"] == 2 and "result" in r


@pytest.mark.parametrize("kind", KINDS)
async def test_unknown_method_is_32601(kind: str, tmp_path: Path) -> None:
    with trio.fail_after(BOUND):
        async with gateway(tmp_path, Script()) as gw, wire(gw, kind) as w:
            status, r = await w.exchange(w.body("m1", "no/such/method"))
            assert status in (None, 200 if kind == "http-legacy" else 404)
            assert r["id"] == "m1" and r["error"]["code"] == -32601, r
            assert not [m for m in gw.link("fx").received if m.get("method") == "no/such/method"]


@pytest.mark.parametrize("kind", ["websocket", "unix"])
async def test_oversize_message_is_refused_then_the_connection_closes(kind: str,
                                                                      tmp_path: Path) -> None:
    """WebSocket: -32600 ``message_too_large``, then close 1009; unix: the same error, then EOF."""
    with trio.fail_after(BOUND):
        async with gateway(tmp_path, Script()) as gw, wire(gw, kind) as w:
            fits = w.call("ok", "fx__echo", pad="")
            _, r = await w.exchange(fits.replace(b'"pad": ""',
                                                 b'"pad": "' + b"y" * (LIMIT - 200) + b'"'))
            assert r["id"] == "ok" and "result" in r  # just under the limit passes
            _, r = await w.exchange(w.call("big", "fx__echo", pad="z" * (LIMIT + 1)))
            assert r["id"] is None and r["error"]["code"] == -32600, r
            assert r["error"]["data"]["reason"] == "message_too_large"
            assert await w.closed() == ("1009" if kind == "websocket" else "eof")


@pytest.mark.parametrize("kind", ["http-legacy", "http-stateless"])
async def test_oversize_body_is_413_before_it_is_read(kind: str, tmp_path: Path) -> None:
    """HTTP: refused by its Content-Length (413), and that connection is closed after it."""
    with trio.fail_after(BOUND):
        async with gateway(tmp_path, Script()) as gw, wire(gw, kind) as w:
            assert isinstance(w, HttpWire)
            head = "".join(f"{k}: {v}\r\n" for k, v in w.headers.items())
            async with await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port) as stream:
                await stream.send_all(f"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\n{head}"
                                      f"content-length: {LIMIT + 1}\r\n\r\n{{".encode())
                reply = b""
                while chunk := await stream.receive_some(65536):  # until the gateway closes
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
            status, r = await w.exchange(w.call(2, "fx__echo", n=2))  # other connections go on
            assert status == 200 and r["id"] == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_drain_refuses_new_work_finishes_calls_in_flight_then_closes(
        kind: str, tmp_path: Path) -> None:
    held = Held()
    with trio.fail_after(BOUND):
        async with gateway(tmp_path, Script(tools={"echo": echo, "hold": held})) as gw:
            async with wire(gw, kind) as w, trio.open_nursery() as nursery:
                answers: dict[str, Any] = {}
                answered = trio.Event()

                async def in_flight() -> None:
                    answers["held"] = await w.exchange(w.call("h", "fx__hold"))
                    answered.set()

                if isinstance(w, HttpWire):
                    nursery.start_soon(in_flight)
                else:
                    await w.send(w.call("h", "fx__hold"))
                await held.entered.wait()
                gw.control.stop()
                await gw.draining.wait()
                # new work: refused at once, safe to retry elsewhere
                status, r = await w.exchange(w.call("late", "fx__echo", n=1))
                assert r["id"] == "late" and r["error"]["code"] == -32005, r
                assert r["error"]["data"] == RETRYABLE
                if isinstance(w, HttpWire):
                    assert status == 503 and w.last is not None
                    assert w.last.headers["retry-after"] == "1"
                held.release()  # the call read before the drain is answered
                if isinstance(w, HttpWire):
                    await answered.wait()
                    status, r = answers["held"]
                    assert status == 200
                else:
                    assert isinstance(w, LinesWire)
                    r = await w.receive()
                assert r["id"] == "h" and text_of(r) == "held"
                assert [m["params"]["name"] for m in gw.link("fx").received
                        if m.get("method") == "tools/call"] == ["hold"]  # "late" never started
                if isinstance(w, LinesWire):  # then it closes: 1012 service restart, or EOF
                    assert await w.closed() == {"websocket": "1012", "unix": "eof",
                                                "bridge": "eof", "memory": "eof"}[kind]
