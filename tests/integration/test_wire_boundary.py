"""The decoding boundary (issue 7, defects 1–3 and 5–7): what a backend or a client sends that
the gateway will not pass on gets a specific error at once, is counted, and ends nothing else.

Backend lines are written by the fixture's ``raw`` tool, so each test states the exact bytes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import connect, fixture_backend, http_request, make_config, run_gateway, text_of

pytestmark = pytest.mark.system

DEEP = 1000


def hexes(*lines: bytes) -> list[str]:
    return [line.hex() for line in lines]


def reply(result: bytes, *, id_last: bool = False) -> bytes:
    if id_last:
        return b'{"result":' + result + b',"jsonrpc":"2.0","id":{ID}}'
    return b'{"jsonrpc":"2.0","id":{ID},"result":' + result + b"}"


def text_result(text: bytes) -> bytes:
    return b'{"content":[{"type":"text","text":"' + text + b'"}]}'


class LineClient:
    """A raw newline-delimited JSON-RPC client on the gateway's unix socket."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data + b"\n")

    async def receive(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = await self.stream.receive_some(65536)
            assert chunk, "connection closed"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        line.decode()  # whatever the gateway writes is UTF-8
        return json.loads(line)

    async def request(self, id: Any, method: str, params: Any) -> dict[str, Any]:
        await self.send(
            json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode())
        return await self.receive()


@asynccontextmanager
async def unix_client(path: str) -> AsyncIterator[LineClient]:
    stream = await trio.open_unix_socket(path)
    async with stream:
        c = LineClient(stream)
        r = await c.request("init", "initialize",
                            {"protocolVersion": "2025-11-25", "capabilities": {},
                                                   "clientInfo": {"name": "t", "version": "0"}})
        assert r["result"]["protocolVersion"] == "2025-11-25"
        await c.send(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        yield c


async def protocol_errors(port: int | None, kind: str) -> float:
    status, body = await http_request(port, "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(
            "mcp_gateway_backend_protocol_errors_total{") and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


BAD_REPLIES = {
    "invalid_utf8": reply(text_result(b"caf\xc3 \xff\xfe")),
    # an encoded surrogate
    "invalid_utf8_id_last": reply(text_result(b"\xed\xa0\xbd"), id_last=True),
    "too_deep": reply(b"[" * DEEP + b"]" * DEEP),
    "too_deep_id_last": reply(b'{"a":' * DEEP + b"1" + b"}" * DEEP, id_last=True),
}


async def test_backend_reply_that_cannot_be_passed_on_fails_its_call_with_32009(
    tmp_path: Path) -> None:
    sock = str(tmp_path / "gw.sock")
    cfg = make_config(fixture_backend("fx", request_timeout=30.0), unix=sock)
    with trio.fail_after(40):
        async with run_gateway(cfg) as gw, connect(gw.url) as ws, unix_client(sock) as ux:
            for n, (name, line) in enumerate(BAD_REPLIES.items()):
                kind = name.removesuffix("_id_last")
                before = await protocol_errors(gw.bound.admin_port, kind)
                started = trio.current_time()
                if n % 2:
                    r = await ux.request(n, "tools/call",
                                         {"name": "fx__raw", "arguments": {"lines": hexes(line)}})
                else:
                    r = await ws.call("fx__raw", {"lines": hexes(line)})
                # at once, not after request_timeout
                assert trio.current_time() - started < 5.0, name
                assert r["error"]["code"] == -32009, (name, r)
                assert r["error"]["data"] == {"reason": "backend_protocol_error", "backend": "fx",
                                              "detail": kind}, name
                assert await protocol_errors(gw.bound.admin_port, kind) == before + 1
            # the backend was not restarted, and both connections still work
            assert text_of(await ws.call("fx__echo", {"message": "ws"})) == "ws"
            r = await ux.request("e", "tools/call",
                                 {"name": "fx__echo", "arguments": {"message": "ux"}})
            assert text_of(r) == "ux"
            _status, body = await http_request(gw.bound.admin_port, "/status")
            instance = json.loads(body)["backends"][0]["instances"][0]
            assert instance["restarts"] == 0 and instance["inflight"] == 0, instance


async def test_deep_notification_is_dropped_and_counted_the_call_goes_on() -> None:
    cfg = make_config(fixture_backend("fx"))
    deep_log = (
        b'{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"error","data":'
                + b"[" * DEEP + b"]" * DEEP + b"}}")
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            r = await c.call("fx__raw", {"lines": hexes(deep_log, reply(text_result(b"after")))})
            assert text_of(r) == "after"
            assert await protocol_errors(gw.bound.admin_port, "too_deep") == 1
            assert not c.notifications


async def test_unpaired_surrogate_escapes_pass_through() -> None:
    cfg = make_config(fixture_backend("fx", request_timeout=30.0))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            for text in (rb"\ud83d", rb"\ude00 and \ud83d\ude00", rb"x\uDBFF"):
                started = trio.current_time()
                r = await c.call("fx__raw", {"lines": hexes(reply(text_result(text)))})
                assert trio.current_time() - started < 5.0
                assert text_of(r) == json.loads(b'"' + text + b'"')
            assert await protocol_errors(gw.bound.admin_port, "not_json") == 0


async def test_unpaired_surrogate_from_a_client_reaches_the_backend_and_comes_back() -> None:
    cfg = make_config(fixture_backend("fx", request_timeout=30.0))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            await c.send('{"jsonrpc":"2.0","id":"s","method":"tools/call",'
                         '"params":{"name":"fx__echo","arguments":{"message":"x\\ud83d"}}}')
            r = await c.response("s")
            assert text_of(r) == "x\ud83d", r  # params split and forwarded with the escape kept


@pytest.mark.parametrize("id_last", [False, True], ids=["id_first", "id_last"])
async def test_oversize_reply_fails_at_once_and_leaves_no_abandoned_call(id_last: bool) -> None:
    cfg = make_config(fixture_backend("fx", request_timeout=30.0, cancel_grace=0.2),
                      gateway="max_message_bytes = 65536")
    big = reply(text_result(b"{PAD}"), id_last=id_last)
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            started = trio.current_time()
            r = await c.call("fx__raw", {"lines": hexes(big), "pad": 70000})
            assert trio.current_time() - started < 5.0
            assert r["error"]["code"] == -32008, r
            # nothing is left in the attribution set, so nothing can restart the backend
            _status, body = await http_request(gw.bound.admin_port, "/status")
            instance = json.loads(body)["backends"][0]["instances"][0]
            assert instance["inflight"] == 0, instance
            assert text_of(await c.call("fx__echo", {"message": "next"})) == "next"


async def test_client_json_too_deep_or_not_utf8_gets_an_error_and_the_connection_stays(
    tmp_path: Path) -> None:
    sock = str(tmp_path / "gw.sock")
    cfg = make_config(fixture_backend("fx"), unix=sock)
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, unix_client(sock) as ux:
            # a slow call in flight must survive the bad messages that follow it
            await ux.send(b'{"jsonrpc":"2.0","id":"slow","method":"tools/call",'
                          b'"params":{"name":"fx__sleep","arguments":{"seconds":0.5,"message":"kept"}}}')
            deep = (
                b'{"jsonrpc":"2.0","id":"deep","method":"tools/call","params":{"name":"fx__echo",'
                    b'"arguments":{"message":"x","extra":' + b"[" * DEEP + b"]" * DEEP + b"}}}")
            await ux.send(deep)
            r = await ux.receive()
            assert r["error"]["code"] == -32600 and r["error"]["data"]["reason"] == "too_deep", r
            await ux.send(b'{"jsonrpc":"2.0","id":"bad","method":"tools/call",'
                          b'"params":{"name":"fx__echo","arguments":{"message":"\xff\xfe"}}}')
            r = await ux.receive()
            assert r["error"]["code"] == -32700 and r["error"]["data"][
                "reason"] == "invalid_utf8", r
            assert r["id"] is None  # refused before decoding: the id was not read
            r = await ux.receive()
            assert r["id"] == "slow" and text_of(r) == "kept"
            # the same over WebSocket (a text frame cannot carry invalid UTF-8, so: depth only)
            async with connect(gw.url) as ws:
                await ws.send('{"jsonrpc":"2.0","id":7,"method":"ping","params":{"x":'
                              + "[" * DEEP + "]" * DEEP + "}}")
                r = await ws.wait_for(lambda: [m for m in ws.received if "error" in m])
                assert r[0]["error"]["data"]["reason"] == "too_deep"
                assert text_of(await ws.call("fx__echo", {"message": "ws"})) == "ws"


async def test_progress_token_that_is_not_a_string_or_integer_is_invalid_params() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            for n, token in enumerate(("1e400", "true", "{}", "1.5")):
                await c.send('{"jsonrpc":"2.0","id":' + str(100 + n) + ',"method":"tools/call",'
                             '"params":{"name":"fx__echo","arguments":{"message":"m"},'
                             '"_meta":{"progressToken":' + token + '}}}')
                r = await c.response(100 + n)
                # was -32603 and a traceback for 1e400
                assert r["error"]["code"] == -32602, (token, r)
            r = await c.call("fx__echo", {"message": "m"}, id=200)
            assert text_of(r) == "m"
