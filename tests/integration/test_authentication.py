"""Authentication on real sockets: bearer tokens and OAuth JWTs on /mcp and on the
WebSocket upgrade, the principal bound to what it opens, reload, ``connect --token-file``, and
the token never reaching a child."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from helpers import (
    HTTP_HEADERS,
    HTTP_INIT,
    ROOT,
    connect,
    fixture_backend,
    http_json,
    make_config,
    metric,
    run_gateway,
    text_of,
    ws_upgrade,
)
from jwt.algorithms import RSAAlgorithm

from gateway import config
from gateway.core.policy import Policy

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore::ResourceWarning",
                                         "ignore::pytest.PytestUnraisableExceptionWarning")]

H, INIT = HTTP_HEADERS, HTTP_INIT
TOKENS = {"alice": "alice-secret-token-1", "bob": "bob-secret-token-2",
          "carol": "carol-secret-token-3"}
MODERN = {"accept": "application/json, text/event-stream", "content-type": "application/json",
          "mcp-protocol-version": "2026-07-28"}


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_toml(*names: str, tokens_file: Path | None = None) -> str:
    out = "".join(f'[[auth.bearer]]\nprincipal = "{n}"\ntoken_sha256 = "{sha(TOKENS[n])}"\n'
                  'groups = ["dev"]\n'
                  for n in names)
    if tokens_file is not None:
        out = f'[auth]\ntokens_file = "{tokens_file}"\n' + out
    return out


def auth(token: str | None) -> dict[str, str]:
    return dict(H, authorization=f"Bearer {token}") if token else dict(H)


async def test_bearer_tokens_on_http_and_websocket(tmp_path: Path) -> None:
    """401 without / with a bad token on both transports (WWW-Authenticate pointing at the
    metadata), each principal's token works, a session is bound to its creator, /status shows
    the auth section, and no token ever reaches the child (its environment and stdin)."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"carol:{sha(TOKENS['carol'])}:ops\n")
    tokens_file.chmod(0o600)
    transcript = tmp_path / "child.transcript"
    cfg = make_config(fixture_backend(env={"FIXTURE_TRANSCRIPT": str(transcript)}),
                      gateway='name = "team-gw"',
                      extra=bearer_toml("alice", "bob", tokens_file=tokens_file))
    async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
        url, port = gw.http_url, gw.bound.http_port
        # bearer tokens only: no authorization server to send a client to, so no metadata (an
        # OAuth client would try to register with the gateway): a realm, and 404 there
        r = await c.post(url, headers=H, json=INIT)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == 'Bearer realm="team-gw"'
        r = await c.post(url, headers=auth("wrong"), json=INIT)
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith('Bearer realm="team-gw", '
                                                        'error="invalid_token"')
        for path in ("/.well-known/oauth-protected-resource",
                     "/.well-known/oauth-protected-resource/mcp"):
            assert (await c.get(f"http://127.0.0.1:{port}{path}")).status_code == 404
        sessions = {}
        for name in ("alice", "bob", "carol"):  # carol from the tokens file
            r = await c.post(url, headers=auth(TOKENS[name]), json=INIT)
            assert r.status_code == 200, r.text
            sessions[name] = r.headers["mcp-session-id"]
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "fx__echo", "arguments": {"message": "hi"}}}
        h = dict(auth(TOKENS["alice"]),
                 **{"mcp-session-id": sessions["alice"], "mcp-protocol-version": "2025-11-25"})
        r = await c.post(url, headers=h, json=call)
        assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == "hi"
        # alice's session presented by bob, by nobody, by a bad token: as if it did not exist
        r = await c.post(url, headers=dict(h, authorization=f"Bearer {TOKENS['bob']}"), json=call)
        assert r.status_code == 404 and "unknown or ended session" in r.text
        unknown = await c.post(url, headers=dict(h, **{"mcp-session-id": "nope"}), json=call)
        assert unknown.status_code == 404 and unknown.text == r.text  # indistinguishable
        assert (await c.get(url, headers={k: v for k, v in h.items()
                                          if k != "authorization"})).status_code == 401
        assert (await c.delete(
            url, headers=dict(h, authorization=f"Bearer {TOKENS['bob']}"))).status_code == 404
        # a modern (stateless) request needs the token too
        ping = {"jsonrpc": "2.0", "id": 7, "method": "tools/list",
                "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}}
        assert (await c.post(url, headers=dict(MODERN, **{"mcp-method": "tools/list"}),
                             json=ping)).status_code == 401

        # WebSocket: the token on the upgrade
        for token in (None, "wrong"):
            status, headers = await ws_upgrade(gw.bound.websocket_port, token)
            assert status == 401 and headers["www-authenticate"].startswith(
                'Bearer realm="team-gw"')
        assert (await ws_upgrade(gw.bound.websocket_port, TOKENS["alice"]))[0] == 101
        async with connect(gw.url, token=TOKENS["bob"]) as ws:
            r2 = await ws.call("fx__echo", {"message": "over ws"})
            assert text_of(r2) == "over ws"
            st = await http_json(gw.bound.admin_port, "/status")
        a = st["auth"]
        assert a["configured"] is True and a["bearer"]["count"] == 3 and a["bearer"][
            "tokens_file"] == str(tokens_file)
        assert (a["listeners"]["websocket"]["auth_required"]
                and a["listeners"]["http"]["auth_required"])
        assert a["refusals"] >= 6
        assert await metric(gw.bound.admin_port, "mcp_gateway_client_connections_refused_total",
                            transport="websocket", reason="unauthorized") == 2
    seen = transcript.read_bytes()
    assert b'"environ"' in seen and b"over ws" in seen and b"tools/call" in seen  # it did capture
    for token in TOKENS.values():
        assert token.encode() not in seen and sha(token).encode() not in seen


class Issuer:
    """A local OAuth issuer: RSA keys, their JWKS served on 127.0.0.1 (counting fetches)."""

    def __init__(self) -> None:
        self.keys = {"k1": rsa.generate_private_key(public_exponent=65537, key_size=2048)}
        self.published = ["k1"]
        self.fetches = 0
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                issuer.fetches += 1
                body = json.dumps(
                    {"keys": [dict(json.loads(RSAAlgorithm.to_jwk(issuer.keys[k].public_key())),
                                   kid=k, use="sig", alg="RS256")
                              for k in issuer.published]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @contextmanager
    def running(self) -> Iterator[Issuer]:
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join()

    def token(self, kid: str = "k1", **claims: Any) -> str:
        now = int(time.time())
        base = {"iss": self.url + "/", "aud": AUDIENCE, "sub": "dana", "exp": now + 300,
                "nbf": now - 5, "groups": ["dev"], "scope": "tools:read"}
        base.update(claims)
        base = {k: v for k, v in base.items() if v is not None}
        key = self.keys.setdefault(kid,
                                   rsa.generate_private_key(public_exponent=65537, key_size=2048))
        return jwt.encode(base, key, algorithm="RS256", headers={"kid": kid})


AUDIENCE = "https://gateway.test/mcp"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def oauth_toml(issuer: Issuer) -> str:
    return (f'[auth.oauth]\nissuer = "{issuer.url}/"\njwks_uri = "{issuer.url}/jwks.json"\n'
            f'audience = "{AUDIENCE}"\ngroups_claim = "groups"\nscopes_supported = ["tools:read", '
            '"tools:write"]\n'
            'jwks_refresh_min_interval = 0.2\nleeway = 5\n')


async def test_oauth_jwts_from_a_local_issuer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid JWT authenticates (principal, groups, scopes); expired, wrong audience, wrong
    issuer, unknown key, tampered, alg none and HS256-with-the-public-key are refused with
    invalid_token; a rotated key is picked up by the refetch; a policy scope rule gives 403
    insufficient_scope with the scopes to step up to."""
    seen: list[Any] = []

    real = Policy.missing_scopes

    def missing_scopes(self: Policy, principal: Any, method: str, params: Any) -> list[str] | None:
        seen.append(principal)  # a spy: the principal the token gave
        return real(self, principal, method, params)

    monkeypatch.setattr(Policy, "missing_scopes", missing_scopes)
    rules = ('[policy]\ndefault = "deny"\n[[policy.rules]]\nmatch = "fx__*"\naction = "allow"\n'
             'scopes = ["tools:write"]\n')
    with Issuer().running() as issuer:
        cfg = make_config(fixture_backend(), gateway='name = "oauth-gw"',
                          extra=oauth_toml(issuer) + rules)
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            url = gw.http_url
            assert issuer.fetches == 1  # fetched at start
            port = gw.bound.http_port
            meta = (await c.get(f"http://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp")
                    ).json()
            assert meta == {"resource": AUDIENCE, "authorization_servers": [issuer.url + "/"],
                            "bearer_methods_supported": ["header"],
                            "scopes_supported": ["tools:read", "tools:write"],
                            "resource_name": "oauth-gw"}  # gateway.name
            r = await c.post(url, headers=auth(issuer.token()), json=INIT)
            assert r.status_code == 200, r.text
            sid = r.headers["mcp-session-id"]
            assert (seen[-1].name == "dana" and seen[-1].groups == {"dev"}
                    and seen[-1].scopes == {"tools:read"})
            assert seen[-1].via == "oauth" and seen[-1].label == "other"  # not a configured name

            good = issuer.token()
            head, payload, signature = good.split(".")
            forged = json.loads(base64.urlsafe_b64decode(payload + "=="))
            forged["sub"] = "admin"
            none_alg = jwt.encode({"iss": issuer.url + "/", "aud": AUDIENCE, "sub": "dana",
                                   "exp": int(time.time()) + 60}, None, algorithm="none")
            pem = issuer.keys["k1"].public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo)
            hs_head = _b64(json.dumps({"alg": "HS256", "kid": "k1", "typ": "JWT"}).encode())
            hs_body = _b64(json.dumps({"iss": issuer.url + "/", "aud": AUDIENCE, "sub": "dana",
                                       "exp": int(time.time()) + 60}).encode())
            hs = f"{hs_head}.{hs_body}." + _b64(hmac.new(pem, f"{hs_head}.{hs_body}".encode(),
                                                         hashlib.sha256).digest())
            bad = {
                "expired": issuer.token(exp=int(time.time()) - 60),
                "audience": issuer.token(aud="https://other.test/mcp"),
                "issuer": issuer.token(iss="https://evil.test/"),
                "not yet": issuer.token(nbf=int(time.time()) + 600),
                "tampered": f"{head}.{_b64(json.dumps(forged).encode())}.{signature}",
                "signature": f"{head}.{payload}.{signature[:-4]}AAAA",
                "none": none_alg,
                "hs256": hs,
                "no exp": issuer.token(exp=None),
                # PyJWT takes a string exp; the principal would have no expiry for its streams
                "string exp": issuer.token(exp=str(int(time.time()) + 300)),
                "string iat": issuer.token(iat=str(int(time.time()))),
            }
            for why, token in bad.items():
                r = await c.post(url, headers=auth(token), json=INIT)
                assert r.status_code == 401, why
                assert 'error="invalid_token"' in r.headers["www-authenticate"], why
                assert ('resource_metadata="https://gateway.test/.well-known/'
                        'oauth-protected-resource/mcp"') in r.headers["www-authenticate"]
            # an unknown kid: refused (one refetch at most per interval), then the issuer
            # rotates its keys and the new kid is picked up by the next refetch
            fetches = issuer.fetches
            k2 = issuer.token(kid="k2")
            for _ in range(5):
                assert (await c.post(url, headers=auth(k2), json=INIT)).status_code == 401
            assert issuer.fetches - fetches <= 2  # 5 unknown-kid tokens within ~0.2 s
            issuer.published.append("k2")
            with trio.fail_after(5):
                while (r := await c.post(url, headers=auth(k2), json=INIT)).status_code != 200:
                    assert r.status_code == 401
                    # real-clock: the JWKS refetch interval (real HTTP to the issuer) must pass
                    await trio.sleep(0.05)

            # 403 insufficient_scope: the scope rule wants tools:write; a stepped-up token passes
            h = dict(auth(issuer.token()),
                     **{"mcp-session-id": sid, "mcp-protocol-version": "2025-11-25"})
            call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                    "params": {"name": "fx__echo", "arguments": {"message": "up"}}}
            r = await c.post(url, headers=h, json=call)
            assert r.status_code == 403
            assert 'error="insufficient_scope"' in r.headers["www-authenticate"]
            assert 'scope="tools:write"' in r.headers["www-authenticate"]
            r = await c.post(url, headers=dict(
                h, authorization=f"Bearer {issuer.token(scope='tools:read tools:write')}"),
                             json=call)
            assert r.status_code == 200 and r.json()["result"]["content"][0]["text"] == "up", r.text
            # a GET stream opened with a JWT ends with the token (the session goes on)
            short = issuer.token(exp=int(time.time()) + 2)
            r = await c.post(url, headers=auth(short), json=INIT)
            sid2 = r.headers["mcp-session-id"]
            get_h = dict(auth(short),
                         **{"mcp-session-id": sid2, "mcp-protocol-version": "2025-11-25",
                                         "accept": "text/event-stream"})
            with trio.fail_after(8):
                async with c.stream("GET", url, headers=get_h) as stream:
                    assert stream.status_code == 200
                    async for _ in stream.aiter_bytes():
                        pass  # ends when the token expires
            # WebSocket: the JWT on the upgrade; an expired one is refused
            status, headers = await ws_upgrade(gw.bound.websocket_port, bad["expired"])
            # the metadata is the HTTP listener's (the audience's), never the WebSocket port's
            assert status == 401 and headers["www-authenticate"].startswith(
                'Bearer resource_metadata="https://gateway.test/.well-known/oauth-protected-resource/mcp"')
            status, headers = await ws_upgrade(gw.bound.websocket_port, bad["string exp"])
            assert status == 401 and "'exp' claim is not a number" in headers["www-authenticate"]
            async with connect(gw.url, token=issuer.token(scope="tools:write")) as ws:
                assert text_of(await ws.call("fx__echo", {"message": "jwt ws"})) == "jwt ws"
            async with connect(gw.url, token=issuer.token(exp=int(time.time()) + 2)) as ws:
                with trio.fail_after(6):  # the connection ends with its token
                    while not ws.closed:
                        await ws._changed.wait()
                assert ws.ws.closed is not None and ws.ws.closed.code == 1008
            st = await http_json(gw.bound.admin_port, "/status")
            assert (st["auth"]["oauth"]["issuer"] == issuer.url + "/"
                    and st["auth"]["oauth"]["jwks_keys"] == 2)


def _gateway_toml(auth_toml: str) -> str:
    return ('[listen]\nwebsocket = "127.0.0.1:0"\nhttp = "127.0.0.1:0"\n[admin]\n'
            'listen = "127.0.0.1:0"\n'
            f'{auth_toml}{fixture_backend()}')


async def modern_call(c: httpx.AsyncClient, url: str, token: str, id: int,
                      **extra: Any) -> httpx.Response:
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "fx__elicit", "arguments": {"message": "go?"}, **extra,
                       "_meta": meta}}
    headers = dict(MODERN, authorization=f"Bearer {token}",
                   **{"mcp-method": "tools/call", "mcp-name": "fx__elicit"})
    with trio.fail_after(10):
        return await c.post(url, headers=headers, json=body)


async def test_bridged_state_bound_and_reload_revokes(tmp_path: Path) -> None:
    """A bridged flow's requestState is bound to its principal (another's retry: -32602
    invalid_state; the owner's goes through); a reload that removes alice's token closes her
    WebSocket with 1008 and her HTTP session's next request gets 401, bob is untouched."""
    path = tmp_path / "gateway.toml"
    path.write_text(_gateway_toml(bearer_toml("alice", "bob")))
    cfg = config.load(path.read_text(), base_dir=ROOT)
    async with run_gateway(cfg, config_path=str(path)) as gw, httpx.AsyncClient(timeout=10) as c:
        url = gw.http_url
        r = await modern_call(c, url, TOKENS["alice"], 1)
        state = r.json()["result"]["requestState"]
        answer = {"srv-1": {"action": "accept", "content": {"answer": "yes"}}}
        r = await modern_call(c, url, TOKENS["bob"], 2, inputResponses=answer, requestState=state)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == -32602 and error["data"][
            "reason"] == "invalid_state"
        assert "another principal" in error["message"]
        r = await modern_call(c, url, TOKENS["alice"], 3, inputResponses=answer, requestState=state)
        assert r.status_code == 200 and r.json()["result"]["resultType"] == "complete", r.text
        assert await metric(gw.bound.admin_port, "mcp_gateway_request_states_refused_total",
                            reason="principal") == 1

        r = await c.post(url, headers=auth(TOKENS["alice"]), json=INIT)
        h = dict(auth(TOKENS["alice"]), **{"mcp-session-id": r.headers["mcp-session-id"],
                                           "mcp-protocol-version": "2025-11-25"})
        async with (connect(gw.url, token=TOKENS["alice"]) as alice,
                    connect(gw.url, token=TOKENS["bob"]) as bob):
            path.write_text(_gateway_toml(bearer_toml("bob")))
            gw.control.reload()
            with trio.fail_after(10):
                while not alice.closed:
                    await alice._changed.wait()
            assert alice.ws.closed is not None and alice.ws.closed.code == 1008
            assert text_of(await bob.call("fx__echo", {"message": "still here"})) == "still here"
            ping = {"jsonrpc": "2.0", "id": 9, "method": "ping"}
            r = await c.post(url, headers=h, json=ping)
            assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
            st = await http_json(gw.bound.admin_port, "/status")
            assert st["auth"]["bearer"]["count"] == 1 and st["connections"] == {"websocket": 1}


async def test_connect_with_token_file(tmp_path: Path) -> None:
    """``mcp-gateway connect URL --token-file FILE`` authenticates over WebSocket and HTTP; without
    the token the gateway refuses it."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS["alice"] + "\n")
    cfg = make_config(fixture_backend(), extra=bearer_toml("alice"))
    lines = [json.dumps(INIT),
             json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
             json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                         "params": {"name": "fx__echo", "arguments": {"message": "bridged"}}})]
    env = dict(os.environ, PYTHONPATH=ROOT)

    def bridge(url: str, *extra: str) -> list[dict[str, Any]]:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "connect", url, *extra], cwd=ROOT,
                                env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        out: list[dict[str, Any]] = []
        for line in lines:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            if '"id"' in line:
                raw = proc.stdout.readline()
                if not raw:
                    break
                out.append(json.loads(raw))
        proc.stdin.close()
        proc.wait(timeout=20)
        proc.stdout.close()
        assert proc.stderr is not None
        proc.stderr.close()
        return out

    async with run_gateway(cfg) as gw:
        for url in (gw.url, gw.http_url):
            out = await trio.to_thread.run_sync(bridge, url, "--token-file", str(token_file))
            assert out[-1]["result"]["content"][0]["text"] == "bridged", (url, out)
        out = await trio.to_thread.run_sync(bridge, gw.http_url)
        assert "HTTP 401" in out[0]["error"]["message"]
