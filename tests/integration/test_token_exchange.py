"""RFC 8693 token exchange as a per-principal credential source, against the real Authlib
authorization server (``fixtures/auth_server.py``), which is also the inbound ``[auth.oauth]``
issuer: callers are authenticated by the gateway's own authenticator from JWTs it minted, and
their tokens exchanged for the upstream's audience; the source alone (time on trio's MockClock,
no autojump: it moves only when a test jumps it) and in the running gateway, in front of a
per-principal remote."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio.testing
from authserverutil import AuthServer, auth_server
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from fixtures.remote_server import RemoteServer
from helpers import backend_in, connect, make_config, run_gateway, text_of

from gateway.auth.authenticator import Authenticator
from gateway.auth.principal import Principal
from gateway.backend.credentials import CredentialsUnavailable, PrincipalCredentials
from gateway.backend.tokenexchange import TokenExchangeSource
from gateway.config import TokenExchange, load

GATEWAY = "http://127.0.0.1:8766/mcp"  # the gateway's own resource URI (the inbound aud)
UPSTREAM = "http://127.0.0.1:9911/mcp"  # the remote the exchanged tokens are for
EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"

pytestmark = pytest.mark.system


@asynccontextmanager
async def setup(tmp_path: Path, method: str = "client_secret_basic"
                ) -> AsyncIterator[tuple[AuthServer, Authenticator, TokenExchangeSource]]:
    """The server (clients ``gw``: a secret, ``gwk``: a key), an authenticator trusting it,
    and a source authenticating with ``method``."""
    secret = tmp_path / "gw.secret"
    secret.write_text("gw-secret\n")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "gwk.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (tmp_path / "gwk.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    async with auth_server("--client", "gw:gw-secret",
                           "--client-key", f"gwk={tmp_path / 'gwk.pub'}") as srv:
        authn = Authenticator(load(
            f'[listen]\nhttp = "127.0.0.1:8766"\n[auth.oauth]\nissuer = "{srv.issuer}"\n'
            f'jwks_uri = "{srv.issuer}/jwks"\naudience = "{GATEWAY}"\n'))
        await authn.start()
        if method == "private_key_jwt":
            cfg = TokenExchange(token_url=srv.token_url, client_id="gwk", auth_method=method,
                                private_key={"file": str(tmp_path / "gwk.pem")},
                                audience=UPSTREAM, scope="tools")
        else:
            cfg = TokenExchange(token_url=srv.token_url, client_id="gw", auth_method=method,
                                client_secret={"file": str(secret)}, audience=UPSTREAM,
                                scope="tools")
        yield srv, authn, TokenExchangeSource("up", cfg)


async def caller(srv: AuthServer, authn: Authenticator, sub: str, lifetime: int = 3600
                 ) -> Principal:
    principal = await authn.authenticate("Bearer " + await srv.mint(sub, GATEWAY, lifetime))
    assert principal is not None and principal.via == "oauth"
    return principal


@pytest.mark.parametrize("method", ["client_secret_post", "private_key_jwt"])
async def test_two_oauth_callers_get_their_own_exchanged_tokens(tmp_path: Path,
                                                                method: str) -> None:
    client = "gwk" if method == "private_key_jwt" else "gw"
    async with setup(tmp_path, method) as (srv, authn, source):
        checked: PrincipalCredentials = source
        alice, bob = await caller(srv, authn, "alice"), await caller(srv, authn, "bob")
        got: list[list[tuple[str, str]]] = []

        async def call(principal: Principal) -> None:
            got.append(await checked.headers(principal))

        async with trio.open_nursery() as nursery:  # concurrent calls: one exchange each
            for principal in (alice, bob, alice, alice, bob):
                nursery.start_soon(call, principal)
        a, b = await checked.headers(alice), await checked.headers(bob)
        assert sorted(got) == sorted([a, b, a, a, b])
        assert a != b and a[0][0] == b[0][0] == "authorization"
        issued = sorted((r for r in await srv.issued() if r["grant_type"] == EXCHANGE),
                        key=lambda r: str(r["sub"]))
        assert [(r["sub"], r["aud"], r["client_id"], r["scope"], r["subject_token_aud"])
                for r in issued] == [("alice", UPSTREAM, client, "tools", GATEWAY),
                                     ("bob", UPSTREAM, client, "tools", GATEWAY)]
        assert [f"Bearer {r['access_token']}" for r in issued] == [a[0][1], b[0][1]]
        assert alice.token not in a[0][1] and "alice" not in repr(source.status())


async def test_a_token_is_reused_until_its_or_the_inbound_tokens_lifetime_ends(
        tmp_path: Path, mock_clock: trio.testing.MockClock) -> None:
    async with setup(tmp_path) as (srv, authn, source):
        await srv.configure(lifetime=100)  # the exchanged token's: 100 s, renewed after 80
        alice = await caller(srv, authn, "alice")
        first = await source.headers(alice)
        mock_clock.jump(79)
        assert await source.headers(alice) == first
        mock_clock.jump(2)
        second = await source.headers(alice)
        assert second != first
        await srv.configure(lifetime=3600)  # now the inbound token's 600 s bound the cache
        bob = await caller(srv, authn, "bob", lifetime=600)
        held = await source.headers(bob)
        mock_clock.jump(470)
        assert await source.headers(bob) == held
        mock_clock.jump(20)
        assert await source.headers(bob) != held
        source.forget(alice.key)
        assert await source.headers(alice) != second
        subs = [r["sub"] for r in await srv.issued() if r["grant_type"] == EXCHANGE]
        assert subs == ["alice", "alice", "bob", "bob", "alice"]


@pytest.mark.parametrize("mode", ["503", "closed"])
async def test_the_authorization_server_down_is_retryable(tmp_path: Path, mode: str) -> None:
    async with setup(tmp_path) as (srv, authn, source):
        alice = await caller(srv, authn, "alice")
        await srv.down(mode)
        with pytest.raises(CredentialsUnavailable) as err:
            await source.headers(alice)
        assert err.value.retryable and "token exchange" in err.value.detail
        assert alice.token not in err.value.detail
        await srv.up()
        assert (await source.headers(alice))[0][0] == "authorization"


async def test_a_refused_exchange_and_a_bearer_caller_are_not_retryable(tmp_path: Path) -> None:
    async with setup(tmp_path) as (srv, _authn, source):
        bearer = Principal("alice", via="bearer", label="alice", credential="f" * 64)
        with pytest.raises(CredentialsUnavailable) as err:
            await source.headers(bearer)
        assert not err.value.retryable and err.value.url is None
        assert "bearer has none to exchange" in err.value.detail
        forged = Principal("mallory", via="oauth", token="a.b.c", expires=None)
        with pytest.raises(CredentialsUnavailable) as err:
            await source.headers(forged)
        assert not err.value.retryable and "HTTP 400" in err.value.detail
        assert [r for r in await srv.issued() if r["grant_type"] == EXCHANGE] == []


async def test_a_per_principal_remote_gets_each_oauth_callers_exchanged_token(
        tmp_path: Path) -> None:
    (tmp_path / "gw.secret").write_text("gw-secret\n")
    remote = RemoteServer()
    async with trio.open_nursery() as nursery, auth_server("--client", "gw:gw-secret") as srv:
        await nursery.start(remote.serve)
        url = f"http://127.0.0.1:{remote.port}/mcp"
        cfg = make_config(
            f'[backends.ev]\nurl = "{url}"\ncredentials = "per-principal"\n'
            'headers = { Authorization = "Bearer the-probe" }\n'
            f'[backends.ev.token_exchange]\ntoken_url = "{srv.token_url}"\nclient_id = "gw"\n'
            f'client_secret = {{ file = "{tmp_path}/gw.secret" }}\nresource = "{url}"\n',
            extra=f'[auth.oauth]\nissuer = "{srv.issuer}"\njwks_uri = "{srv.issuer}/jwks"\n'
                  f'audience = "{GATEWAY}"\n')
        inbound = {who: await srv.mint(who, GATEWAY) for who in ("alice", "bob")}
        with trio.fail_after(60):
            async with (run_gateway(cfg) as gw,
                        connect(gw.url, token=inbound["alice"]) as a,
                        connect(gw.url, token=inbound["bob"]) as b):
                assert text_of(await a.call("ev__echo", {"who": "alice"})) == '{"who": "alice"}'
                assert text_of(await b.call("ev__echo", {"who": "bob"})) == '{"who": "bob"}'
                issued = {r["sub"]: r for r in await srv.issued()}
                assert {r["aud"] for r in issued.values()} == {url}
                sent = {who: {seen.headers.get("authorization") for seen in remote.seen
                              if isinstance(seen.body, dict) and seen.body.get("params", {}).get(
                                  "arguments", {}).get("who") == who} for who in inbound}
                assert sent == {who: {f"Bearer {issued[who]['access_token']}"}
                                for who in inbound}
                assert not any(token in str(seen.headers) for seen in remote.seen
                               for token in inbound.values())
                st = await gw.status_until(
                    lambda s: backend_in(s, "ev")["token_exchange"]["exchanges"] == 2)
                assert backend_in(st, "ev")["token_exchange"]["principals"] == 2
                assert not any(r["access_token"] in json.dumps(st) for r in issued.values())
                # a 401 makes the gateway exchange again; with the server down: retryable
                await srv.down("closed")
                remote.refuse["tools/call"] = [401]
                r = await a.call("ev__echo", {"who": "alice-2"})
                assert r["error"]["code"] == -32001 and r["error"]["data"]["retryable"], r
                await srv.up()
                assert text_of(await a.call("ev__echo", {"who": "alice-3"})) == \
                    '{"who": "alice-3"}'
                assert [r["sub"] for r in await srv.issued()] == ["alice", "bob", "alice"]
        nursery.cancel_scope.cancel()
