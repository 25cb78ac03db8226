"""Hostile clients of the Streamable HTTP endpoint ``/mcp`` on the real daemon, by raw sockets:
header values no browser sends, concurrent batches of one session, a request cancelled while its
POST stream is open.  Each answer is specific and bounded in time, and afterwards the invariants
of tests/invariants.py hold (nothing held, the daemon alive, a bystander served)."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from helpers import fixture_backend
from invariants import Daemon, DaemonSlot, baseline, check

pytestmark = pytest.mark.system

HTTP_PORT = re.compile(r"ready: .* http port (\d+)")
HEADERS = (b"Host: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"accept: application/json, text/event-stream\r\n")
ANSWER_BOUND = 5.0  # seconds for any answer here (echo, ping, a refusal)


class HttpDaemon(Daemon):
    """The hardening daemon with the ``/mcp`` listener on."""

    def write_config(self, backends: str) -> None:
        super().write_config(backends)
        text = self.config_path.read_text().replace('http = ""', 'http = "127.0.0.1:0"')
        self.config_path.write_text(text)

    @property
    def http_port(self) -> int:
        (port,) = {int(m.group(1)) for line in self.lines if (m := HTTP_PORT.search(line))}
        return port


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("http"), fixture_backend("fx", cancel_grace=1.0),
                   daemon_type=HttpDaemon)
    yield s
    s.close()


def post(body: Any, headers: bytes = b"", method: bytes = b"POST") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (method + b" /mcp HTTP/1.1\r\n" + HEADERS + headers
            + b"content-length: %d\r\n\r\n" % len(data) + data)


class Response:
    def __init__(self, status: int, headers: dict[bytes, bytes], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        if self.headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            messages = [json.loads(line[6:]) for line in self.body.decode().splitlines()
                        if line.startswith("data: ")]
            return messages[-1] if messages else None
        return json.loads(self.body)


class Conn:
    """One keep-alive HTTP/1.1 connection read response by response (Content-Length or chunked)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    @classmethod
    async def open(cls, port: int, rcvbuf: int | None = None) -> Conn:
        if rcvbuf is None:
            return cls(await trio.open_tcp_stream("127.0.0.1", port))
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # a small window
        await sock.connect(("127.0.0.1", port))
        return cls(trio.SocketStream(sock))

    async def _more(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError(f"connection closed; unparsed {self.buf[:200]!r}")
        self.buf += data

    async def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            await self._more()
        part, self.buf = self.buf.split(sep, 1)
        return part

    async def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._more()
        part, self.buf = self.buf[:n], self.buf[n:]
        return part

    async def response(self, *, head_only: bool = False) -> Response:
        head = await self._until(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines)}
        if head_only:  # the answer to HEAD
            body = b""
        elif headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while size := int(await self._until(b"\r\n"), 16):
                body += await self._take(size)
                await self._take(2)
            await self._take(2)
        else:
            body = await self._take(int(headers.get(b"content-length", b"0")))
        return Response(int(status_line.split()[1]), headers, body)

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def exchange(self, data: bytes) -> Response:
        await self.send(data)
        with trio.fail_after(ANSWER_BOUND):
            return await self.response()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def open_session(port: int, version: str = "2025-11-25") -> tuple[Conn, bytes]:
    """A connection and the headers of an initialized session on it."""
    c = await Conn.open(port)
    params = {"protocolVersion": version, "capabilities": {},
              "clientInfo": {"name": "t", "version": "0"}}
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
    r = await c.exchange(post(init))
    assert r.status == 200, r.body
    session = b"mcp-session-id: " + r.headers[b"mcp-session-id"] + b"\r\nmcp-protocol-version: " \
        + version.encode() + b"\r\n"
    r = await c.exchange(post({"jsonrpc": "2.0", "method": "notifications/initialized"}, session))
    assert r.status == 202
    return c, session


async def test_an_origin_port_that_is_not_ascii_digits_gets_403(daemon: Daemon) -> None:
    """``"²".isdigit()`` is true and ``int()`` of 5000 digits raises: either used to escape the
    checks as an exception (no answer, the connection dropped, a traceback logged per request)."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port)
    ping = {"jsonrpc": "2.0", "id": 7, "method": "ping"}
    for origin in [b"http://127.0.0.1:\xb2", b"http://localhost:" + b"1" * 5000,
                   b"http://127.0.0.1:%d\xb9" % port]:
        r = await c.exchange(post(ping, session + b"origin: " + origin + b"\r\n"))
        assert r.status == 403, (origin[:40], r.status, r.body)
    r = await c.exchange(post(ping, session))  # the same keep-alive connection goes on
    assert r.status == 200 and r.json() == {"jsonrpc": "2.0", "id": 7, "result": {}}
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    await c.aclose()
    assert not [line for line in daemon.lines if "connection failed" in line], daemon.tail()
    await check(daemon, base)


async def test_concurrent_batch_posts_each_get_their_own_answers(daemon: Daemon) -> None:
    """A 2025-03-26 session with two batch POSTs open: the one answered first must not be sent
    on the older POST's stream (each POST's answers go on its own stream)."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port, "2025-03-26")
    slow, fast = await Conn.open(port), await Conn.open(port)
    sleep = {"name": "fx__sleep", "arguments": {"seconds": 1.0}}
    await slow.send(post([{"jsonrpc": "2.0", "id": "slow-1", "method": "tools/call",
                           "params": sleep}], session))
    with trio.fail_after(ANSWER_BOUND):  # the slow batch is the older open batch POST
        await daemon.instance_until("fx", lambda i: i["inflight"])
    r = await fast.exchange(post([{"jsonrpc": "2.0", "id": "fast-1", "method": "tools/call",
                                   "params": {"name": "fx__echo", "arguments": {"message": "f"}}},
                                  {"jsonrpc": "2.0", "id": "fast-2", "method": "ping"}], session))
    assert r.status == 200
    assert sorted(m["id"] for m in r.json()) == ["fast-1", "fast-2"], r.body
    with trio.fail_after(ANSWER_BOUND):
        r = await slow.response()
    assert [m["id"] for m in r.json()] == ["slow-1"], r.body
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    for conn in (c, slow, fast):
        await conn.aclose()
    await check(daemon, base)


async def recycled(daemon: Daemon, since: int) -> None:
    """Wait until the child that still runs the cancelled call (the fixture's sleep ignores the
    cancel) is recycled after ``cancel_grace`` and its successor is ready: the scenario's own
    aftermath, which ``check`` must not mistake for a leak nor the next scenario inherit."""
    with trio.fail_after(ANSWER_BOUND):
        line = await daemon.line_until(lambda x: "fx/0: RUNNING -> STARTING (recycled" in x, since)
        await daemon.line_until(lambda x: "fx/0: STARTING -> RUNNING" in x,
                                daemon.lines.index(line, since))


async def test_a_cancelled_request_ends_its_post_stream(daemon: Daemon) -> None:
    """A request the client cancels gets no JSON-RPC response; its POST's HTTP response must
    still end (else it hangs, kept open by keep-alive comments, and the session never idles)."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port)
    call = await Conn.open(port)
    await call.send(post({"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                          "params": {"name": "fx__sleep", "arguments": {"seconds": 30}}}, session))
    with trio.fail_after(ANSWER_BOUND):  # the call reached the backend (polled: from outside)
        await daemon.instance_until("fx", lambda i: i["inflight"])
    since = len(daemon.lines)
    r = await c.exchange(post({"jsonrpc": "2.0", "method": "notifications/cancelled",
                               "params": {"requestId": 5, "reason": "user"}}, session))
    assert r.status == 202
    with trio.fail_after(ANSWER_BOUND):
        r = await call.response()
    assert r.status == 200 and r.json() is None, r.body  # an empty stream: no response
    r = await call.exchange(post({"jsonrpc": "2.0", "id": 6, "method": "ping"}, session))
    assert r.status == 200 and r.json()["id"] == 6  # the connection is reusable
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    for conn in (c, call):
        await conn.aclose()
    await recycled(daemon, since)
    await check(daemon, base)


async def test_a_batch_with_every_request_cancelled_ends_its_post_stream(daemon: Daemon) -> None:
    """The same for a batch POST (2025-03-26): with every request in it cancelled it gets no
    answer at all, so its stream must end; a batch with a request left is answered as usual."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port, "2025-03-26")
    sleep = {"name": "fx__sleep", "arguments": {"seconds": 30}}
    call = await Conn.open(port)
    await call.send(post([{"jsonrpc": "2.0", "id": f"b{i}", "method": "tools/call", "params": sleep}
                          for i in range(2)], session))
    with trio.fail_after(ANSWER_BOUND):  # both calls reached the backend (polled: from outside)
        await daemon.instance_until("fx", lambda i: i["inflight"] == 2)
    since = len(daemon.lines)
    for i in range(2):
        r = await c.exchange(post({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                   "params": {"requestId": f"b{i}"}}, session))
        assert r.status == 202
    with trio.fail_after(ANSWER_BOUND):
        r = await call.response()
    assert r.status == 200 and r.json() is None, r.body  # an empty stream: no answers
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    for conn in (c, call):
        await conn.aclose()
    await recycled(daemon, since)
    await check(daemon, base)


async def test_head_requests_get_their_status_without_a_body(daemon: Daemon) -> None:
    """HEAD is answered like GET minus the body: writing the refusal's body used to be a
    LocalProtocolError in h11, so the connection was dropped without a word."""
    base = await baseline(daemon)
    c = await Conn.open(daemon.http_port)
    for path, status in [(b"/mcp", 405), (b"/other", 404)]:
        await c.send(b"HEAD " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        with trio.fail_after(ANSWER_BOUND):
            r = await c.response(head_only=True)
        assert r.status == status
        assert int(r.headers[b"content-length"]) > 0  # what a GET would have carried
    assert (await c.exchange(post(b"", method=b"DELETE"))).status == 400  # still in step
    await c.aclose()
    await check(daemon, base)


async def test_parked_messages_flow_out_when_the_get_stream_opens(daemon: Daemon) -> None:
    """What was parked while a session had no stream open (here: progress of a call whose POST
    stream the client closed) is written when a GET stream opens; what the socket did not take
    at once must follow as the client reads, not wait for the next keep-alive comment (15 s)."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port)
    call = await Conn.open(port)
    await call.send(post({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "fx__progress", "arguments": {"steps": 60, "delay": 0.01},
        "_meta": {"progressToken": "t" * 30_000}}}, session))
    await call.aclose()  # the call goes on; its progress has no stream: parked (at most 1 MiB)
    with trio.fail_after(ANSWER_BOUND):
        st = await daemon.status_until(lambda st: st["client_requests_in_flight"] == 0
                                       and st["buffered_bytes"] > 512 * 1024)
    parked = st["buffered_bytes"]
    get = await Conn.open(port, rcvbuf=4096)
    accept_sse = HEADERS.replace(b"application/json, ", b"")
    await get.send(b"GET /mcp HTTP/1.1\r\n" + accept_sse + session + b"\r\n")
    with trio.fail_after(ANSWER_BOUND):
        head = await get._until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        while len(get.buf) < parked:  # SSE framing only adds bytes
            await get._more()
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    for conn in (c, get):
        await conn.aclose()
    await check(daemon, base)


async def test_refusals_name_the_request_and_smuggling_is_refused(daemon: Daemon) -> None:
    """Leftovers of the hostile tester: (a) a session refusal echoes the request's id, not null;
    (b) ``initialize`` with an unknown version header is 400 with the supported versions, not the
    modern shape's 404; (c) ``Transfer-Encoding`` with ``Content-Length`` is 400 and the
    connection closed (RFC 9112 6.1); (d) a progress token already in use by an open request of
    the session is refused with -32602 (the first call is unharmed)."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port)
    ping = {"jsonrpc": "2.0", "id": "p-1", "method": "ping"}
    sid = session.split(b"\r\n")[0] + b"\r\n"
    for headers, status in [(b"", 400), (b"mcp-session-id: nope\r\n", 404),
                            (sid + b"mcp-protocol-version: 1999-01-01\r\n", 400)]:
        r = await c.exchange(post(ping, headers))
        assert (r.status, r.json()["id"]) == (status, "p-1"), (headers, r.status, r.body)  # (a)
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"}}}
    r = await c.exchange(post(init, b"mcp-protocol-version: 1999-01-01\r\n"))
    assert r.status == 400 and "2025-11-25" in r.json()["error"]["data"]["supported"], r.body  # (b)
    data = json.dumps(ping).encode()
    smuggled = await Conn.open(port)
    await smuggled.send(b"POST /mcp HTTP/1.1\r\n" + HEADERS + session + b"content-length: %d\r\n"
                        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
                            len(data), len(data), data))
    with trio.fail_after(ANSWER_BOUND):
        r = await smuggled.response()
        assert r.status == 400 and r.headers[b"connection"] == b"close", r.body  # (c)
        with pytest.raises(EOFError):
            await smuggled._more()
    slow = await Conn.open(port)
    meta = {"_meta": {"progressToken": "tok"}}
    await slow.send(post({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "fx__sleep", "arguments": {"seconds": 1.0}, **meta}}, session))
    with trio.fail_after(ANSWER_BOUND):  # the first call is open (polled: from outside)
        await daemon.instance_until("fx", lambda i: i["inflight"])
    r = await c.exchange(post({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "fx__echo", "arguments": {"message": "x"}, **meta}}, session))
    assert r.json()["id"] == 2 and r.json()["error"]["code"] == -32602, r.body  # (d)
    with trio.fail_after(ANSWER_BOUND):
        r = await slow.response()
    assert r.json()["id"] == 1 and "result" in r.json(), r.body
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    for conn in (c, slow, smuggled):
        await conn.aclose()
    await check(daemon, base)


async def test_a_broken_post_stream_is_resumed_by_get_with_last_event_id(daemon: Daemon) -> None:
    """SSE resumption (2025-11-25): a POST stream opens with a priming event, its events carry
    ids naming the stream; the client's connection breaks mid-call; the response, which comes
    after, is kept, and a GET with the last id it saw replays it on a new connection.  A
    malformed id, and an id of a stream with nothing left, are 400 (a client retries those a
    bounded number of times; an empty stream would have it reconnect for ever)."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port)
    call = await Conn.open(port)
    await call.send(post({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {
        "name": "fx__progress", "arguments": {"steps": 3, "delay": 0.3},
        "_meta": {"progressToken": "p"}}}, session))
    with trio.fail_after(ANSWER_BOUND):
        assert (await call._until(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        while b'"progress":1' not in call.buf:
            await call._more()
    ids = re.findall(rb"id: (\d+)-(\d+)\n", call.buf)
    assert b"data:\n\n" in call.buf and len(ids) == 2 and ids[0][0] == ids[1][0], call.buf  # primed
    await call.aclose()  # the connection breaks; the call goes on
    with trio.fail_after(ANSWER_BOUND):
        await daemon.instance_until("fx", lambda i: not i["inflight"])
    accept_sse = HEADERS.replace(b"application/json, ", b"")
    get = await Conn.open(port)
    last = b"%s-%s" % ids[1]
    r = await get.exchange(
        b"GET /mcp HTTP/1.1\r\n" + accept_sse + session + b"last-event-id: " + last + b"\r\n\r\n")
    assert r.status == 200 and r.json() == {"jsonrpc": "2.0", "id": 9, "result": {
        "content": [{"type": "text", "text": "done"}]}}, r.body
    assert re.search(rb"id: %s-\d+\n" % ids[1][0], r.body), r.body  # the same stream's ids
    for bad in (b"x", b"999-1", last.split(b"-")[0] + b"-999999"):
        r = await get.exchange(b"GET /mcp HTTP/1.1\r\n" + accept_sse + session
                               + b"last-event-id: " + bad + b"\r\n\r\n")
        assert r.status == 400, (bad, r.body)
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    for conn in (c, get):
        await conn.aclose()
    await check(daemon, base)
