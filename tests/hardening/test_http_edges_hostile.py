"""Hostile edges of the HTTP layer on the real daemon, by raw sockets: the admin listener's
connection cap against idle connections, request heads and bodies framed to slip past a bound,
batches, the stdio bridge fed what no client sends.  Each answer is specific and bounded in time."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial

import jwt as pyjwt
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric import ec
from helpers import ROOT, fixture_backend, make_config, run_gateway
from invariants import Daemon, DaemonSlot, baseline, check
from test_http_hostile import ANSWER_BOUND, Conn, HttpDaemon, open_session, post

from gateway.auth import jwt as jwts
from gateway.config import OAuthSection
from gateway.limits import ADMIN_CONNECTIONS
from gateway.protocol.supervision import STARVED_BACKOFF_MAX, RestartPolicy, State, Supervision
from gateway.transports.bridge_http import _Response

pytestmark = pytest.mark.system

PROBE = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nconnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("edges"), fixture_backend("fx", cancel_grace=1.0),
                   daemon_type=HttpDaemon)
    yield s
    s.close()


async def _probe(port: int) -> int:
    c = await Conn.open(port)
    try:
        return (await c.exchange(PROBE)).status
    finally:
        await c.aclose()


async def test_idle_admin_connections_cannot_starve_healthz(daemon: Daemon) -> None:
    """The admin listener serves at most ADMIN_CONNECTIONS connections; any local process could
    hold them all idle (reopening each as it is closed) and every health check was then closed
    unanswered.  A new connection now closes the oldest one waiting for its request."""
    base = await baseline(daemon)
    port = daemon.admin_port
    # (the listener accepts in connection order: all of these before the probes)
    idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(ADMIN_CONNECTIONS)]
    for _ in range(3):
        assert await _probe(daemon.admin_port) == 200
    with trio.fail_after(ANSWER_BOUND):  # the oldest idle ones were closed to make room
        assert await idle[0].receive_some(100) == b""
    for s in idle:
        await s.aclose()
    await check(daemon, base)


async def test_a_batch_reusing_an_id_in_flight_in_another_batch_is_refused(daemon: Daemon) -> None:
    """Two batch POSTs of one session carrying the same request id: the second one's
    "already in flight" error was matched to the first POST (the batch with those ids) and
    answered it at once, while the first call's result went to the second POST."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port, "2025-03-26")
    slow, other = await Conn.open(port), await Conn.open(port)
    sleep = {"name": "fx__sleep", "arguments": {"seconds": 1.0}}
    await slow.send(post([{"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": sleep}],
                         session))
    with trio.fail_after(ANSWER_BOUND):  # the slow batch's call is in flight
        await daemon.instance_until("fx", lambda i: i["inflight"])
    ping = {"jsonrpc": "2.0", "id": 9, "method": "ping"}
    for clash in ([ping], ping):
        r = await other.exchange(post(clash, session))
        assert r.status == 400 and "already in flight" in r.json()["error"]["message"], r.body
        await other.aclose()  # a refusal closes the connection
        other = await Conn.open(port)
    with trio.fail_after(ANSWER_BOUND):
        r = await slow.response()
    slept = {"content": [{"type": "text", "text": "slept"}]}
    assert r.json() == [{"jsonrpc": "2.0", "id": 9, "result": slept}]
    r = await other.exchange(post([ping], session))
    assert r.status == 200 and r.json() == [{"jsonrpc": "2.0", "id": 9, "result": {}}], r.body
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    for conn in (c, slow, other):
        await conn.aclose()
    await check(daemon, base)


async def test_a_modern_batch_is_refused_as_a_batch(daemon: Daemon) -> None:
    """A 2026-07-28 POST whose body is a batch was told "missing Mcp-Session-Id header:
    initialize first" (sessionless, there is nothing to initialize), or with a session id that
    2026-07-28 was "unsupported" while error.data.supported listed it."""
    c, session = await open_session(daemon.http_port, "2025-03-26")
    modern = b"mcp-protocol-version: 2026-07-28\r\nmcp-method: ping\r\n"
    for extra in (modern, session.split(b"\r\n")[0] + b"\r\n" + modern):
        r = await c.exchange(post([{"jsonrpc": "2.0", "id": 1, "method": "ping"}], extra))
        assert r.status == 400 and "batches" in r.json()["error"]["message"], r.body
        await c.aclose()
        c = await Conn.open(daemon.http_port)
    await c.aclose()


def _signed(payload: bytes, key: ec.EllipticCurvePrivateKey) -> str:
    """A JWT over ``payload`` as it is (JSON no encoder writes: a 400-digit integer)."""
    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")
    signing = b64(b'{"alg":"ES256","kid":"k1","typ":"JWT"}') + b"." + b64(payload)
    signature = pyjwt.algorithms.ECAlgorithm(pyjwt.algorithms.ECAlgorithm.SHA256).sign(signing, key)
    return (signing + b"." + b64(signature)).decode()


@pytest.mark.parametrize(("claim", "value"), [("exp", "1" + "0" * 400), ("nbf", "-" + "1" * 400),
                                              ("iat", "-" + "1" * 400)])
def test_a_time_claim_too_big_for_a_float_is_refused(claim: str, value: str) -> None:
    """A signed token whose exp is a 400-digit integer in the future (or nbf/iat one far in the
    past) passed PyJWT, and the NumericDate check raised OverflowError out of verify(): the
    request's connection was dropped with a traceback instead of a 401."""
    oauth = OAuthSection(issuer="https://id.example", jwks_uri="https://id.example/jwks",
                         audience="https://gw.example/mcp")
    private = ec.generate_private_key(ec.SECP256R1())
    claims = {"iss": oauth.issuer, "aud": oauth.audience, "sub": "alice",
              "exp": int(time.time()) + 600}
    claims.pop(claim, None)
    payload = json.dumps(claims)[:-1].encode() + f', "{claim}": {value}}}'.encode()
    with pytest.raises(jwts.TokenRefused) as refused:
        key = jwts.Key("k1", "ES256", private.public_key())
        jwts.verify(_signed(payload, private), key, "ES256", oauth)
    assert refused.value.kind == "claims", refused.value


# ---- the HTTP stdio bridge (mcp-gateway connect http://…) against a server that misbehaves -----

_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def _result(rid: int, text: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": rid, "result": {"text": text}}).encode()


async def _misbehave(stream: trio.SocketStream) -> None:
    """One POST answered as its request id says (see the table in the test)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        if not (data := await stream.receive_some(65536)):
            return
        buf += data
    head, body = buf.split(b"\r\n\r\n", 1)
    if not head.startswith(b"POST"):
        await stream.send_all(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
        return
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += await stream.receive_some(65536)
    message = json.loads(body)
    rid = message.get("id")
    if message.get("method") == "initialize":
        answer = json.dumps({"jsonrpc": "2.0", "id": rid, "result": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "serverInfo": {"name": "x", "version": "0"}}}).encode()
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"mcp-session-id: s\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(answer), answer))
    elif rid == 1:  # SSE with bare CR line ends
        await stream.send_all(_SSE_HEAD + b": c\r\rdata: " + _result(1, "cr") + b"\r\r")
    elif rid == 2:  # CRLF line ends, the event's last CRLF split between two writes
        await stream.send_all(_SSE_HEAD + b"data: " + _result(2, "split") + b"\r\n\r")
        # the bridge (another process) must read this write alone; its reads cannot be seen
        await trio.sleep(0.2)  # real-clock: a pause another process's read must fall into
        await stream.send_all(b"\ndata: " + _result(99, "next") + b"\r\n\r\n")
    elif rid == 3:  # a 200 in HTML
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\n"
                              b"content-length: 4\r\n\r\n<p/>")
    elif rid == 4:  # a JSON body that is not JSON
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: 9\r\n\r\n{not json")
    elif rid == 5:  # an event stream that ends without the answer
        await stream.send_all(_SSE_HEAD + b": nothing\n\n")
    elif rid == 6:  # the connection reset mid-stream
        await stream.send_all(_SSE_HEAD + b": x\n\n")
        await trio.sleep(0.1)  # real-clock: as above, the bridge reads the head before the reset
        linger = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # on, 0 s: the close is a reset
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    else:  # 7: an ordinary answer
        answer = _result(rid, "ok")
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(answer), answer))


async def test_the_http_bridge_answers_every_request_once_whatever_the_server_sends() -> None:
    """Before: a reset connection (trio.BrokenResourceError, not an OSError) crashed the bridge
    with a traceback; an SSE stream with CR line ends, or a CRLF split between reads, lost its
    messages; a 200 in HTML, an event stream that ended without the answer and the like left the
    request unanswered (the stdio client waited forever); a JSON body that was not JSON went to
    stdout as it was."""
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, _misbehave, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "gateway", "connect", f"http://127.0.0.1:{port}/mcp"], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=ROOT))
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"}}}
        lines = [init] + [{"jsonrpc": "2.0", "id": i, "method": "ping"} for i in range(1, 8)]
        await proc.stdin.send_all(json.dumps(lines[0]).encode() + b"\n")
        out = b""
        with trio.fail_after(10):
            while out.count(b"\n") < 1:
                out += await proc.stdout.receive_some(65536)
            await proc.stdin.send_all(b"".join(json.dumps(m).encode() + b"\n" for m in lines[1:]))
            while out.count(b"\n") < 9:  # the answers to 1-7 and the extra event after 2's
                out += await proc.stdout.receive_some(65536)
            await proc.stdin.aclose()
            err = b""
            while chunk := await proc.stderr.receive_some(65536):
                err += chunk
            assert await proc.wait() == 0, err.decode()
        nursery.cancel_scope.cancel()
    messages = [json.loads(line) for line in out.splitlines()]  # every line is JSON
    by_id: dict[int, list[dict[str, object]]] = {}
    for m in messages:
        by_id.setdefault(m["id"], []).append(m)
    assert sorted(by_id) == [0, 1, 2, 3, 4, 5, 6, 7, 99], out
    assert all(len(v) == 1 for v in by_id.values()), out
    assert by_id[1][0]["result"] == {"text": "cr"} and by_id[2][0]["result"] == {"text": "split"}
    assert by_id[7][0]["result"] == {"text": "ok"}
    for rid in (3, 4, 5, 6):
        assert by_id[rid][0]["error"]["code"] == -32603, by_id[rid]
    assert b"Traceback" not in err, err.decode()


async def test_a_cancellation_inside_a_batch_ends_the_cancelled_post_stream(daemon: Daemon) -> None:
    """notifications/cancelled alone in a POST ended the cancelled request's POST stream; in a
    batch (2025-03-26) it reached the backend but the stream stayed open for ever, with keep-
    alive comments, and its id stayed "in flight" on the session."""
    base = await baseline(daemon)
    port = daemon.http_port
    c, session = await open_session(port, "2025-03-26")
    sleep = {"name": "fx__sleep", "arguments": {"seconds": 30}}
    ping = {"jsonrpc": "2.0", "id": 70, "method": "ping"}
    for rid, with_request in ((50, False), (60, True)):
        call = await Conn.open(port)
        await call.send(post({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": sleep},
                             session))
        with trio.fail_after(ANSWER_BOUND):  # the call reached the backend
            await daemon.instance_until("fx", lambda i: i["inflight"])
        cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                  "params": {"requestId": rid}}
        r = await c.exchange(post([cancel, ping] if with_request else [cancel], session))
        if with_request:
            assert r.status == 200 and r.json() == [{"jsonrpc": "2.0", "id": 70, "result": {}}]
        else:
            assert r.status == 202, r.body
        with trio.fail_after(ANSWER_BOUND):
            r = await call.response()
        assert r.status == 200 and r.json() is None, r.body  # an empty stream: no response
        await call.aclose()
        with trio.fail_after(ANSWER_BOUND):  # recycled (the fixture's sleep ignores a cancel)
            await daemon.instance_until("fx", lambda i: not i["inflight"])
    r = await c.exchange(post(b"", session, method=b"DELETE"))
    assert r.status == 200
    await c.aclose()
    await check(daemon, base)


def test_an_hour_out_of_fds_does_not_overflow_the_starved_backoff() -> None:
    """A spawn that fails for lack of fds backs off up to 5 s and is retried for as long as it
    lasts; the delay was computed as ``backoff_initial * 2 ** (failures - 1)``, a float overflow
    at the 1,025th failure in a row (about an hour out of fds): OverflowError out of the
    backend's supervisor instead of the next retry."""
    sup = Supervision(RestartPolicy())
    for _ in range(1100):
        sup.start()
        t = sup.starved("spawn failed for lack of resources")
        assert t.new is State.BACKOFF and t.delay is not None and t.delay <= STARVED_BACKOFF_MAX


def test_a_child_crashing_slowly_for_days_does_not_overflow_the_backoff() -> None:
    """The same doubling for a child that crashes too seldom for FATAL (fewer than max_restarts
    within the window) and too soon to count as stable: it overflowed at the 1,025th crash."""
    sup = Supervision(RestartPolicy())
    now = 0.0
    for _ in range(1100):
        sup.start()
        sup.ready(now)
        t = sup.exited(now + 5.0, "crashed")  # up 5 s (not stable), 3 crashes a minute (not FATAL)
        now += 20.0
        assert t.new is State.BACKOFF and t.delay is not None and t.delay <= 30.0


async def test_a_401_off_mcp_does_not_point_at_a_host_that_is_not_allowed() -> None:
    """A path other than /mcp is answered 401 before any Host check; with an audience that is
    not an http(s) URL and no public_url the challenge's resource_metadata was built from the
    request's Host, whatever it was: http://evil.example/.well-known/… (on /mcp that Host gets
    403 first)."""
    oauth = ('[auth.oauth]\nissuer = "https://id.example/"\njwks_uri = "https://id.example/jwks"\n'
             'audience = "urn:mcp:gateway"\n')
    async with run_gateway(make_config(fixture_backend(), extra=oauth)) as gw:
        port = gw.bound.http_port
        for host, points in ((b"evil.example", False), (b"127.0.0.1:%d" % port, True)):
            c = await Conn.open(port)
            r = await c.exchange(b"POST /register HTTP/1.1\r\nHost: " + host
                                 + b"\r\ncontent-length: 0\r\n\r\n")
            await c.aclose()
            challenge = r.headers[b"www-authenticate"]
            assert r.status == 401 and (b"resource_metadata" in challenge) is points, challenge
            assert b"evil" not in challenge


async def test_chunk_extensions_and_trailers_are_bounded_like_a_head(daemon: Daemon) -> None:
    """h11 bounds a chunk-size line or a trailer section only when it arrives in pieces (past
    16 KiB unfinished): 20 KiB of either in one read was taken (the head's own bound, 431
    "however it arrives", did not cover them)."""
    port = daemon.http_port
    body = b'{"jsonrpc":"2.0","id":1,"method":"ping"}'
    head = (b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"accept: application/json, text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    size = b"%x" % len(body)
    ext = size + b";x=" + b"e" * 20000 + b"\r\n" + body + b"\r\n0\r\n\r\n"
    trailers = size + b"\r\n" + body + b"\r\n0\r\n" + b"x-t: t\r\n" * 4000 + b"\r\n"
    modest = size + b";x=y\r\n" + body + b"\r\n0\r\nx-t: t\r\n\r\n"
    for framed, status in ((ext, 431), (trailers, 431), (modest, 400)):
        c = await Conn.open(port)
        r = await c.exchange(head + framed)  # 400: served, no session (the framing is fine)
        await c.aclose()
        assert r.status == status, (status, r.body)


async def test_the_bridge_reads_an_event_cut_in_small_pieces_in_linear_time() -> None:
    """The bridge's SSE reader appended each piece to a bytes buffer and searched it whole for
    the event's end: quadratic, so a 2 MB event arriving 50 bytes at a time (a slow link, a
    proxy, a hostile server) took about a minute of CPU."""
    payload = b'data: {"jsonrpc":"2.0","id":1,"result":"' + b"a" * 2_000_000 + b'"}\r\n\r\n'

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 50):
            if i % 50_000 == 0:
                await trio.lowlevel.checkpoint()  # where fail_after can end the test
            yield payload[i:i + 50]

    with trio.fail_after(5):
        events = [e async for e in _Response(200, {}, pieces()).events(8 * 2**20)]
    assert len(events) == 1 and json.loads(events[0])["result"] == "a" * 2_000_000
