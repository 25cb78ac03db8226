"""A remote backend's own access token (``[oauth]``): the real ``http`` link and token source
against an in-process authorization server and protected remote on memory streams, on the
MockClock."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jwt
import msgspec
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from fixtures.link_recorder import Recorder, request
from fixtures.token_server import AuthServer, Net, ProtectedRemote

from gateway import config, errors
from gateway.backend import http, httpclient, oauth
from gateway.backend.authcode import AuthorizationCode
from gateway.backend.connector import LinkContext
from gateway.events import EventBus
from gateway.limits import ByteBudget
from gateway.ops.metrics import _token_fetches
from gateway.status import BackendStatus, GatewayStatus

AS = "http://127.0.0.1:9000"
URL = "http://localhost:8080/mcp"
SECRET = "s3cr3t:with/odd+chars"


async def start(nursery: trio.Nursery, net: Net, oauth: str, tmp_path: Any,
                opener: Any = None) -> tuple[http.HttpConnector, http.HttpLink, Recorder]:
    text = f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\nclient_id = "gw-client"\n{oauth}'
    cfg = config.load(text, base_dir=str(tmp_path)).backends["r"]
    connector = http.HttpConnector(cfg, opener=opener or net.open, name="r")
    ctx = LinkContext(backend="r", instance="r#1", bus=EventBus(), max_line=65536,
                      buffers=ByteBudget(10**7).open("r"))
    link = await connector.open(ctx)
    receiver = Recorder()
    nursery.start_soon(link.run, receiver)
    link.send(request(1, "initialize"), 1)
    await receiver.answer(1)
    return connector, link, receiver


def secret_file(tmp_path: Any) -> str:
    (tmp_path / "secret").write_text(SECRET + "\n")
    return 'client_secret = { file = "secret" }\n'


def test_config_refuses_a_literal_secret_and_a_plain_http_token_url() -> None:
    base = f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\nclient_id = "c"\n'
    with pytest.raises(errors.ConfigError) as err:
        config.load(base + 'client_secret = "hunter2"\ntoken_url = "http://as.example/t"\n')
    assert err.value.errors == [
        "backends.r.oauth.token_url: expected an https:// URL (or http:// to 127.0.0.1), got "
        "'http://as.example/t'",
        'backends.r.oauth.client_secret: never a literal in the config: use { file = "/path" } '
        'or { env = "VAR" }']
    with pytest.raises(errors.ConfigError, match=r"backends.r.oauth.private_key: required"):
        config.load(base + 'auth_method = "private_key_jwt"\n')
    with pytest.raises(errors.ConfigError, match=r"backends.r.oauth.token_url: required for a "
                       "plain http:// url"):
        config.load(base.replace(URL, "http://mcp.example/mcp")
                    + 'client_secret = { env = "S" }\n')


async def test_basic_discovered_from_the_401_then_refreshed_before_expiry(
        autojump_clock: trio.testing.MockClock, tmp_path: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    auth = AuthServer(AS, secret=SECRET, lifetime=100)
    remote = ProtectedRemote(URL, AS, lambda tok: tok in auth.issued)
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth, "localhost:8080": remote})
        connector, link, receiver = await start(nursery, net, secret_file(tmp_path), tmp_path)
        # no token_url: the first POST's 401 named the metadata; then one token, Basic auth
        assert receiver.messages[0][0]["result"]["serverInfo"]["name"] == "protected"
        assert remote.unauthorized == 1 and auth.issued == ["tok-1"]
        form = auth.requests[0]
        assert form["resource"] == URL and "client_secret" not in form
        assert form["_authorization"].startswith("Basic ")
        assert remote.seen[-1] == ("initialize", "Bearer tok-1")
        await trio.sleep(70)  # 70 s of 100: the same token
        link.send(request(2, "tools/list"), 2)
        await receiver.answer(2)
        assert remote.seen[-1] == ("tools/list", "Bearer tok-1")
        await trio.sleep(15)  # past 80 %: the next request fetches a new one first
        link.send(request(3, "tools/list"), 3)
        await receiver.answer(3)
        assert remote.seen[-1] == ("tools/list", "Bearer tok-2")
        assert auth.issued == ["tok-1", "tok-2"] and not receiver.failures
        assert connector.auth is not None
        shown = connector.auth.status()
        assert shown["token_endpoint"] == f"{AS}/token" and shown["fetches"] == 2
        assert shown["valid_until"] is not None and shown["last_error"] is None
        snap = GatewayStatus("t", (BackendStatus("r", False, "shared", (), 0, 0, 0, 0,
                                                 oauth=shown),))
        samples = {(s.labels["outcome"]): s.value for s in _token_fetches(snap)[0].samples}
        assert samples == {"ok": 2, "failed": 0}
        nursery.cancel_scope.cancel()
    everything = json.dumps(shown) + caplog.text
    for secret in (SECRET, "tok-1", "tok-2"):
        assert secret not in everything


async def test_post_with_token_url_a_401_fetches_once_more_then_the_call_fails(
        autojump_clock: trio.testing.MockClock, tmp_path: Any) -> None:
    auth = AuthServer(AS, secret=SECRET)
    revoked: set[str] = set()
    remote = ProtectedRemote(URL, AS, lambda tok: tok in auth.issued and tok not in revoked)
    oauth = (secret_file(tmp_path) + f'token_url = "{AS}/token"\n'
             'auth_method = "client_secret_post"\nscope = "tools"\n')
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth, "localhost:8080": remote})
        _, link, receiver = await start(nursery, net, oauth, tmp_path)
        # token_url: the token before the first POST, no 401 at all
        assert remote.unauthorized == 0 and auth.issued == ["tok-1"]
        form = auth.requests[0]
        assert (form["client_id"], form["client_secret"], form["scope"]) == \
            ("gw-client", SECRET, "tools")
        assert form["_authorization"] is None
        await trio.sleep(60)
        revoked.add("tok-1")  # the remote stops taking it: one 401, one new token, one retry
        link.send(request(2, "tools/call"), 2)
        await receiver.answer(2)
        assert 2 not in receiver.failures and auth.issued == ["tok-1", "tok-2"]
        assert remote.unauthorized == 1 and remote.seen[-1] == ("tools/call", "Bearer tok-2")
        revoked.add("tok-2")  # and refuses the next one just fetched: the call fails, clearly
        await trio.sleep(1)
        link.send(request(3, "tools/call"), 3)
        await receiver.answer(3)
        assert auth.issued == ["tok-1", "tok-2"]  # the token was 1 s old: no fetch storm
        assert "refused an access token fetched 1s before (HTTP 401)" in \
            receiver.failures[3].message
        assert receiver.ended_
        nursery.cancel_scope.cancel()


async def test_a_post_carries_the_token_renewed_while_its_connection_was_opened(
        autojump_clock: trio.testing.MockClock, tmp_path: Any) -> None:
    auth = AuthServer(AS, secret=SECRET)
    revoked: set[str] = set()
    remote = ProtectedRemote(URL, AS, lambda tok: tok in auth.issued and tok not in revoked)
    slow = trio.Event()  # set: a connection to the remote takes 5 s to open

    async def opener(host: str, port: int) -> trio.abc.Stream:
        if slow.is_set() and port == 8080:
            await trio.sleep(5)
        return await net.open(host, port)

    oauth = secret_file(tmp_path) + f'token_url = "{AS}/token"\n'
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth, "localhost:8080": remote})
        connector, link, receiver = await start(nursery, net, oauth, tmp_path, opener)
        assert connector.auth is not None and auth.issued == ["tok-1"]
        await trio.sleep(60)  # the idle connections are gone: the next POST opens one
        slow.set()
        link.send(request(2, "tools/call"), 2)
        await trio.sleep(1)  # while it is being opened, the token is renewed (tok-1 revoked)
        revoked.add("tok-1")
        await connector.auth.renew("tok-1", None)
        await receiver.answer(2)
        assert 2 not in receiver.failures and auth.issued == ["tok-1", "tok-2"]
        assert remote.unauthorized == 0  # not sent with the token read before the wait
        assert remote.seen[-1] == ("tools/call", "Bearer tok-2")
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("algorithm", ["ES256", "RS256"])
async def test_private_key_jwt_assertion_is_signed_with_the_claims_the_server_checks(
        autojump_clock: trio.testing.MockClock, tmp_path: Any, algorithm: str) -> None:
    key: Any = (ec.generate_private_key(ec.SECP256R1()) if algorithm == "ES256"
                else rsa.generate_private_key(public_exponent=65537, key_size=2048))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    # ES256: discovered, the assertion's aud is the issuer; RS256: token_url given, aud is it
    explicit = algorithm == "RS256"
    auth = AuthServer(AS, public_key=key.public_key(),
                      audience=f"{AS}/token" if explicit else AS)
    remote = ProtectedRemote(URL, AS, lambda tok: tok in auth.issued)
    oauth = (f'auth_method = "private_key_jwt"\nalgorithm = "{algorithm}"\nkey_id = "k1"\n'
             'private_key = { file = "key.pem" }\n'
             + (f'token_url = "{AS}/token"\n' if explicit else ""))
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth, "localhost:8080": remote})
        _, _, receiver = await start(nursery, net, oauth, tmp_path)
        assert auth.refused == [] and auth.issued == ["tok-1"], auth.refused
        assert receiver.messages[0][0]["result"]["serverInfo"]["name"] == "protected"
        form = auth.requests[0]
        assert form["client_id"] == "gw-client" and form["_authorization"] is None
        assert jwt.get_unverified_header(form["client_assertion"])["kid"] == "k1"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("hint", ["http://127.0.0.1:99999/prm", "https:///prm"])
async def test_a_challenge_naming_an_unusable_metadata_url_fails_the_token_only(
        autojump_clock: trio.testing.MockClock, hint: str) -> None:
    cfg = config.load(f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\nclient_id = "c"\n'
                      'client_secret = { env = "S" }\n').backends["r"].oauth
    assert cfg is not None
    source = oauth.TokenSource("r", URL, cfg)
    with pytest.raises(oauth.TokenFailed, match="not an http"):
        await source.renew(None, f'Bearer resource_metadata="{hint}"')


async def test_an_authorization_server_that_is_not_an_http_url_is_refused(
        autojump_clock: trio.testing.MockClock) -> None:
    def remote(method: str, target: str, headers: dict[str, str], body: bytes) -> Any:
        doc = {"resource": URL, "authorization_servers": ["ftp://as.example"]}
        return 200, [("content-type", "application/json")], json.dumps(doc).encode()

    cfg = config.load(f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\n'
                      'grant = "authorization_code"\n').backends["r"].oauth
    assert cfg is not None
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"localhost:8080": remote})
        code_flow = AuthorizationCode("r", URL, cfg, net.open)
        with pytest.raises(oauth.TokenFailed, match="is not an http"):
            await code_flow.renew(None, "Bearer")
        nursery.cancel_scope.cancel()


async def test_metadata_naming_the_issuer_with_another_trailing_slash_is_refused(
        autojump_clock: trio.testing.MockClock) -> None:
    # RFC 8414 §3.3: the issuer is compared as a string, for client credentials as for the code
    auth = AuthServer(AS, secret=SECRET)  # its metadata says issuer "http://127.0.0.1:9000"
    remote = ProtectedRemote(URL, AS + "/", lambda tok: True)
    cfg = config.load(f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\nclient_id = "c"\n'
                      'client_secret = { env = "S" }\n').backends["r"].oauth
    assert cfg is not None
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth, "localhost:8080": remote})
        source = oauth.TokenSource("r", URL, cfg, opener=net.open)
        with pytest.raises(oauth.TokenFailed, match=r"names issuer 'http://127\.0\.0\.1:9000'"):
            await source.renew(None, "Bearer")
        assert auth.requests == []  # no token asked of it
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("doc", "why"), [
    ({"access_token": "a\tb", "token_type": "Bearer"}, "without a usable access_token"),
    ({"access_token": "t", "token_type": "Bearer", "refresh_token": 7}, "unusable refresh_token"),
    ({"access_token": "t", "token_type": "Bearer", "expires_in": float("nan")}, "expires_in"),
])
def test_a_client_credentials_answer_is_read_by_the_flow_rules(doc: Any, why: str) -> None:
    response = httpclient.Response(200, {})
    with pytest.raises(oauth.TokenFailed, match=why):
        oauth.parse_token(response, json.dumps(doc).encode(), "as")
    good = {"access_token": "t", "token_type": "bearer", "expires_in": 10**9}
    assert oauth.parse_token(response, json.dumps(good).encode(), "as") == ("t", oauth.MAX_LIFETIME)


@pytest.mark.parametrize("kind", ["fifo", "open to others", "too deep"])
async def test_an_unusable_authorization_state_file_is_ignored_at_once(
        tmp_path: Any, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    cfg = config.load(f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\n'
                      'grant = "authorization_code"\n').backends["r"].oauth
    assert cfg is not None
    path = tmp_path / "oauth" / "r.json"
    path.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.write_text("[" * 100_000 if kind == "too deep" else '{"meta": {}}')
        path.chmod(0o600 if kind == "too deep" else 0o644)
    code_flow = AuthorizationCode("r", URL, cfg)
    with trio.fail_after(10):  # real seconds: a FIFO opened for reading would block for ever
        await trio.to_thread.run_sync(code_flow.place, "http://gw/cb", str(tmp_path),
                                      abandon_on_cancel=True)
    assert code_flow.meta is None and "ignored" in caplog.text


def test_the_redirect_uri_is_one_a_browser_on_this_machine_reaches() -> None:
    text = (f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\ngrant = "authorization_code"\n')
    cfg = config.load(text)

    def uri(**listen: Any) -> str:
        return config.redirect_uri(msgspec.structs.replace(
            cfg, listen=msgspec.structs.replace(cfg.listen, **listen)))

    assert uri() == "http://127.0.0.1:8766/oauth/callback"
    assert uri(http="[::]:9", redirect_path="/cb") == "http://[::1]:9/cb"
    assert uri(http="0.0.0.0:9", tls_cert="c", tls_key="k") == "https://127.0.0.1:9/oauth/callback"
    assert uri(public_url="https://gw.example/mcp") == "https://gw.example/oauth/callback"
    with pytest.raises(errors.ConfigError, match=r"listen.http: off, but backend r has "
                       "oauth.grant = 'authorization_code'"):
        config.load('[listen]\nhttp = ""\n' + text)
