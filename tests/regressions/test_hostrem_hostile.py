"""A hostile token endpoint and remote against a remote backend's client side: the real token
source and ``http`` link on trio memory streams (the in-process servers of the fixtures), on
the MockClock."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from fixtures.link_recorder import Recorder, request
from fixtures.token_server import Answer, AuthServer, Net, ProtectedRemote

from gateway import config
from gateway.backend import http, httpclient, oauth
from gateway.backend.connector import LinkContext
from gateway.events import EventBus
from gateway.limits import ByteBudget

AS = "http://127.0.0.1:9000"
URL = "http://localhost:8080/mcp"


def _source(tmp_path: Any, opener: Any = None) -> oauth.TokenSource:
    (tmp_path / "secret").write_text("s3cr3t\n")
    text = (f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\nclient_id = "c"\n'
            f'token_url = "{AS}/token"\nclient_secret = {{ file = "secret" }}\n')
    cfg = config.load(text, base_dir=str(tmp_path)).backends["r"]
    assert cfg.oauth is not None
    return oauth.TokenSource("r", URL, cfg.oauth, opener=opener)


@pytest.mark.parametrize("lifetime", [b"1e300", b"Infinity", b"NaN", b"100000000000000000000",
                                      b"1" + b"0" * 400])
async def test_a_token_lifetime_past_any_date_is_refused_and_status_still_answers(
        autojump_clock: trio.testing.MockClock, tmp_path: Any, lifetime: bytes) -> None:
    issued: list[int] = []

    def token_endpoint(method: str, target: str, headers: dict[str, str], body: bytes
                       ) -> Answer:
        issued.append(1)
        return 200, [("content-type", "application/json")], (
            b'{"access_token": "tok", "token_type": "Bearer", "expires_in": %s}' % lifetime)

    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": token_endpoint})
        source = _source(tmp_path, net.open)
        try:
            await source.fresh()
        except oauth.TokenFailed as exc:
            assert "expires_in" in exc.detail
        else:  # kept: then as a token valid for good, not one fetched again at every request
            await source.fresh()
            await source.fresh()
            assert len(issued) == 1
        json.dumps(source.status())  # /status shows it: no OverflowError, no ValueError
        nursery.cancel_scope.cancel()


async def test_resuming_with_retry_zero_and_an_event_each_time_is_not_a_busy_loop(
        autojump_clock: trio.testing.MockClock) -> None:
    # every resumed GET brings one notification with a new id and ``retry: 0``, then ends
    resumes: list[float] = []
    progress = (b'{"jsonrpc":"2.0","method":"notifications/message",'
                b'"params":{"level":"info","data":1}}')

    def remote(method: str, target: str, headers: dict[str, str], body: bytes) -> Answer:
        message = json.loads(body) if body else {}
        if method == "GET" and "last-event-id" not in headers:
            return 405, [], b""
        if method == "GET":
            resumes.append(trio.current_time())
            if len(resumes) >= 500:  # a busy loop: end the test rather than spin
                nursery.cancel_scope.cancel()
            return 200, [("content-type", "text/event-stream")], \
                b"id: e%d\nretry: 0\ndata: %s\n\n" % (len(resumes), progress)
        if message.get("method") == "initialize":
            return 200, [("content-type", "application/json"), ("mcp-session-id", "s1")], \
                json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {
                    "protocolVersion": "2025-11-25", "capabilities": {},
                    "serverInfo": {"name": "x", "version": "1"}}}).encode()
        if "id" not in message:
            return 202, [], b""
        return 200, [("content-type", "text/event-stream")], b"id: e0\nretry: 0\ndata:\n\n"

    cfg = config.load(f'[backends.r]\nurl = "{URL}"\n').backends["r"]
    receiver = Recorder()
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"localhost:8080": remote})
        link = await http.HttpConnector(cfg, opener=net.open, name="r").open(LinkContext(
            backend="r", instance="r#1", bus=EventBus(), max_line=65536,
            buffers=ByteBudget(10**7).open("r")))
        nursery.start_soon(link.run, receiver)
        link.send(request(1, "initialize"), 1)
        while not receiver.messages:
            await receiver.changed.wait()
        start = trio.current_time()
        link.send(request(2, "tools/call", {"name": "t", "arguments": {}}), 2)
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    # the server's retry is honoured down to a floor: a handful per second, not a spin
    assert 10 <= len(resumes) <= 10 / http.RESUME_WAIT_MIN + 1
    assert resumes[-1] - start >= (len(resumes) - 1) * http.RESUME_WAIT_MIN


async def test_routing_headers_of_huge_marked_arguments_are_not_kept_by_the_pool(
        autojump_clock: trio.testing.MockClock) -> None:
    # a remote marks a string argument ``x-mcp-header``: each call sends its value as a header;
    # calls with distinct megabyte values must not leave their heads held by the pool
    async def serve(stream: trio.abc.Stream) -> None:
        buf = b""
        while data := await stream.receive_some(1 << 20):
            buf += data
            while (end := buf.find(b"\r\n\r\n")) >= 0 and len(buf) >= end + 6:
                buf = buf[end + 6:]  # the head and its 2-byte body
                await stream.send_all(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        async def opener(host: str, port: int) -> trio.abc.Stream:
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(serve, server)
            return client

        pool = httpclient.Pool(httpclient.parse_url(URL), connect_timeout=5, idle_max=4,
                               opener=opener)
        for n in range(httpclient.HEADS_MAX - 1):
            conn = await pool.get()
            value = f"{n:08d}" + "v" * (1 << 20)
            response = await conn.request("POST", "/mcp", [("mcp-param-big", value)], b"{}")
            assert response.status == 202
            assert await conn.body(10) == b""
            await pool.put(conn)
        held = sum(len(raw) + sum(len(k) + len(v) for k, v in key[2])
                   for key, raw in pool.heads.items())
        assert held <= 2 * httpclient.HEADS_MAX * httpclient.HEAD_CACHED_MAX
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_the_get_stream_reopened_after_the_token_expired_does_not_end_the_session(
        autojump_clock: trio.testing.MockClock, tmp_path: Any) -> None:
    # tokens live 100 s; the remote's GET stream ends after one event each time and is
    # opened again; no POST for 200 s: the GET must carry a fresh token, not end the link
    auth = AuthServer(AS, secret="s3cr3t", lifetime=100)
    born: dict[str, float] = {}
    refused: list[str] = []
    revoked: set[str] = set()

    def accepted(token: str) -> bool:
        if token in auth.issued:
            born.setdefault(token, trio.current_time())
        return (token in born and trio.current_time() - born[token] < 100
                and token not in revoked)

    remote = ProtectedRemote(URL, AS, accepted)

    def serve(method: str, target: str, headers: dict[str, str], body: bytes) -> Answer:
        token = headers.get("authorization", "")[7:]
        if method == "GET" and target == "/mcp":
            if not accepted(token):
                refused.append(token)
                return 401, [("www-authenticate", 'Bearer error="invalid_token"')], b""
            return 200, [("content-type", "text/event-stream")], \
                b'data: {"jsonrpc":"2.0","method":"notifications/tools/list_changed"}\n\n'
        return remote(method, target, headers, body)

    (tmp_path / "secret").write_text("s3cr3t\n")
    text = (f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\nclient_id = "gw-client"\n'
            f'token_url = "{AS}/token"\nclient_secret = {{ file = "secret" }}\n')
    cfg = config.load(text, base_dir=str(tmp_path)).backends["r"]
    receiver = Recorder()
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth, "localhost:8080": serve})
        link = await http.HttpConnector(cfg, opener=net.open, name="r").open(LinkContext(
            backend="r", instance="r#1", bus=EventBus(), max_line=65536,
            buffers=ByteBudget(10**7).open("r")))
        nursery.start_soon(link.run, receiver)
        link.send(request(1, "initialize"), 1)
        while not receiver.messages:
            await receiver.changed.wait()
        await trio.sleep(200)
        assert link.closed is None, link.last_error
        assert len(auth.issued) >= 2 and not refused
        revoked.add(auth.issued[-1])  # refused before its time: one 401, a new token, no end
        issued = len(auth.issued)
        await trio.sleep(5)
        assert link.closed is None, link.last_error
        assert len(refused) == 1 and len(auth.issued) == issued + 1
        nursery.cancel_scope.cancel()
