"""/mcp POSTs on one keep-alive connection, byte by byte: the connection's task reads the next
request while a call is answered; pipelined requests, a next request bigger than what is kept
while a response streams, an answer the client does not read at once, a client that leaves
while its call runs, and stateless flows that end with their answer on a connection kept
open."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import trio
from helpers import HTTP_INIT, fixture_backend, make_config, run_gateway, text_of, wait_status

pytestmark = pytest.mark.system


def _post(body: dict[str, Any], sid: str | None = None, headers: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    head = (b"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"accept: application/json, text/event-stream\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n" % len(data)) + headers
    if sid is not None:
        head += b"mcp-session-id: %s\r\nmcp-protocol-version: 2025-11-25\r\n" % sid.encode()
    return head + b"\r\n" + data


MODERN = "2026-07-28"


def _modern(id: int, message: str) -> bytes:
    """A stateless (2026-07-28) ``tools/call`` of echo, with its headers."""
    body = _call(id, message)
    body["params"]["_meta"] = {"io.modelcontextprotocol/protocolVersion": MODERN,
                               "io.modelcontextprotocol/clientCapabilities": {}}
    return _post(body, headers=b"mcp-protocol-version: %s\r\nmcp-method: tools/call\r\n"
                               b"mcp-name: fx__echo\r\n" % MODERN.encode())


def _call(id: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "fx__echo", "arguments": {"message": message}}}


class _Reader:
    """Whole HTTP responses (``content-length`` framed) off one stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self.buf += await self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers["content-length"])
        while len(self.buf) < length:
            self.buf += await self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, body

    async def _more(self) -> bytes:
        data = await self.stream.receive_some(1 << 16)
        assert data, "the gateway closed the connection"
        return data


async def _session(stream: trio.SocketStream, reader: _Reader) -> str:
    await stream.send_all(_post(HTTP_INIT))
    status, headers, _ = await reader.response()
    assert status == 200
    sid = headers["mcp-session-id"]
    await stream.send_all(_post({"jsonrpc": "2.0", "method": "notifications/initialized"}, sid))
    status, _, _ = await reader.response()
    assert status == 202
    return sid


def _text(body: bytes) -> str:
    return text_of(json.loads(body))


async def test_keepalive_posts_pipelined_big_and_unread() -> None:
    async with run_gateway(make_config(fixture_backend())) as gw:
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
            reader = _Reader(stream)
            sid = await _session(stream, reader)
            for i in range(20):  # one after another: each read while the last was answered
                await stream.send_all(_post(_call(10 + i, f"m{i}"), sid))
                status, _, body = await reader.response()
                assert (status, _text(body)) == (200, f"m{i}")
            # two requests in one write: the second is kept while the first is answered
            with trio.fail_after(5):  # well before the first keep-alive comment's time
                await stream.send_all(_post(_call(40, "a"), sid) + _post(_call(41, "b"), sid))
                got = {json.loads((await reader.response())[2])["id"] for _ in range(2)}
            assert got == {40, 41}
            # a request bigger than what is kept of a pipelined one, after an answered POST
            big = "x" * 100_000
            await stream.send_all(_post(_call(50, big), sid))
            status, _, body = await reader.response()
            assert (status, _text(body)) == (200, big)
            # an answer far bigger than the sockets take at once (held, then flushed), then another
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            huge = "y" * 1_800_000  # twice in the answer: under max_message_bytes
            await stream.send_all(_post(_call(60, huge), sid))
            status, _, body = await reader.response()
            assert (status, _text(body)) == (200, huge)
            await stream.send_all(_post(_call(61, "after"), sid))
            status, _, body = await reader.response()
            assert (status, _text(body)) == (200, "after")
            await stream.aclose()


async def test_client_leaving_while_reading_ahead_frees_the_connection() -> None:
    """A client that leaves after its answer, or while its call runs: its connection ends (the
    gateway serves new connections and the session goes on)."""
    async with run_gateway(make_config(fixture_backend())) as gw:
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
            reader = _Reader(stream)
            sid = await _session(stream, reader)
            await stream.send_all(_post(_call(2, "one"), sid))
            assert _text((await reader.response())[2]) == "one"
            await stream.aclose()  # after its answer
            stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
            await stream.send_all(_post(_call(3, "two"), sid))
            await stream.aclose()  # before its answer
            await gw.status_until(lambda st: st["connections"]["http"] <= 1)
            stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
            reader = _Reader(stream)
            await stream.send_all(_post(_call(4, "three"), sid))
            assert _text((await reader.response())[2]) == "three"
            await stream.aclose()


async def test_stateless_flows_end_with_their_answer_on_an_open_connection() -> None:
    async with run_gateway(make_config(fixture_backend())) as gw:
        with trio.fail_after(20):
            port = gw.bound.admin_port
            stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
            reader = _Reader(stream)
            for i in range(20):
                await stream.send_all(_modern(i, f"s{i}"))
                status, _, body = await reader.response()
                assert (status, _text(body)) == (200, f"s{i}")
            with trio.fail_after(5):  # pipelined: the second waits for nothing
                await stream.send_all(_modern(40, "a") + _modern(41, "b"))
                got = {json.loads((await reader.response())[2])["id"] for _ in range(2)}
            assert got == {40, 41}
            big = "x" * 100_000
            await stream.send_all(_modern(50, big))
            assert _text((await reader.response())[2]) == big
            await stream.send_all(_modern(51, "small"))
            assert _text((await reader.response())[2]) == "small"
            # the connection stays open, idle: every flow is over, none waits for its next request
            with trio.fail_after(5):  # well before the first keep-alive comment's time
                await wait_status(port, lambda st: st["client_requests_in_flight"] == 0
                                  and st["connections"].get("http", 0) == 0)
            await stream.send_all(_modern(60, "after"))
            assert _text((await reader.response())[2]) == "after"
            await stream.aclose()


async def test_headers_judged_again_when_they_change_on_a_connection() -> None:
    """Host, Accept and Content-Type judged acceptable once on a connection are not taken for
    granted when a later request on it sends others."""
    async with run_gateway(make_config(fixture_backend())) as gw:
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
            reader = _Reader(stream)
            sid = await _session(stream, reader)
            good = _post(_call(2, "ok"), sid)
            for old, new, status in [(b"host: 127.0.0.1", b"host: evil.example", 403),
                                     (b"accept: application/json, text/event-stream",
                                      b"accept: application/json", 406),
                                     (b"content-type: application/json",
                                      b"content-type: text/plain", 415)]:
                await stream.send_all(good)
                assert (await reader.response())[0] == 200
                assert old in good
                await stream.send_all(good.replace(old, new))
                assert (await reader.response())[0] == status
            await stream.aclose()
