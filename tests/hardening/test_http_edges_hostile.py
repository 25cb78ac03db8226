"""Hostile edges of the HTTP layer on the real daemon, by raw sockets: the admin listener's
connection cap against idle connections, request heads and bodies framed to slip past a bound,
batches, the stdio bridge fed what no client sends.  Each answer is specific and bounded in time."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator

import jwt as pyjwt
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric import ec
from helpers import fixture_backend
from invariants import Daemon, DaemonSlot, baseline, check
from test_http_hostile import ANSWER_BOUND, Conn, HttpSlot, open_session, post

from gateway.auth import jwt as jwts
from gateway.config import OAuthSection
from gateway.limits import ADMIN_CONNECTIONS

pytestmark = pytest.mark.system

PROBE = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nconnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = HttpSlot(tmp_path_factory.mktemp("edges"), fixture_backend("fx", cancel_grace=1.0))
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
    idle = [await trio.open_tcp_stream("127.0.0.1", daemon.admin_port) for _ in range(ADMIN_CONNECTIONS)]
    await trio.sleep(0.2)  # all of them accepted and waiting
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
    await slow.send(post([{"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                           "params": {"name": "fx__sleep", "arguments": {"seconds": 1.0}}}], session))
    await trio.sleep(0.3)  # the slow batch's call is in flight
    for clash in ([{"jsonrpc": "2.0", "id": 9, "method": "ping"}], {"jsonrpc": "2.0", "id": 9, "method": "ping"}):
        r = await other.exchange(post(clash, session))
        assert r.status == 400 and "already in flight" in r.json()["error"]["message"], r.body
        await other.aclose()  # a refusal closes the connection
        other = await Conn.open(port)
    with trio.fail_after(ANSWER_BOUND):
        r = await slow.response()
    assert r.json() == [{"jsonrpc": "2.0", "id": 9, "result": {"content": [{"type": "text", "text": "slept"}]}}]
    r = await other.exchange(post([{"jsonrpc": "2.0", "id": 9, "method": "ping"}], session))
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
    claims = {"iss": oauth.issuer, "aud": oauth.audience, "sub": "alice", "exp": int(time.time()) + 600}
    claims.pop(claim, None)
    payload = json.dumps(claims)[:-1].encode() + f', "{claim}": {value}}}'.encode()
    with pytest.raises(jwts.TokenRefused) as refused:
        jwts.verify(_signed(payload, private), jwts.Key("k1", "ES256", private.public_key()), "ES256", oauth)
    assert refused.value.kind == "claims", refused.value
