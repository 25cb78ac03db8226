"""The per-principal authorization code source without a network: the config that makes it,
each principal's own state file (0600) deleted when a reload drops that principal alone, an
unknown or used authorize link or state refused, and a registration whose secret expired made
anew once for the backend (servers in memory)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import trio
import trio.testing
from fixtures.token_server import CodeAuthServer, Net, ProtectedRemote

from gateway import config
from gateway import errors as gw_errors
from gateway.auth.principal import Principal
from gateway.backend.credentials import CredentialsUnavailable
from gateway.backend.pool import _credential_source
from gateway.backend.principalauth import PrincipalAuthorizationCode

URL = "https://h.example/mcp"
BASE = f'[backends.r]\nurl = "{URL}"\ncredentials = "per-principal"\n[backends.r.oauth]\n'


def who(name: str) -> Principal:
    return Principal(name, via="bearer", label=name, credential="f" * 64)


def test_the_config_makes_it_and_refuses_client_credentials_beside_per_principal() -> None:
    cfg = config.load(BASE + 'grant = "authorization_code"\n')
    source = _credential_source("r", cfg.backends["r"])
    assert isinstance(source, PrincipalAuthorizationCode) and source.kind == "authorization_code"
    with pytest.raises(gw_errors.ConfigError) as err:
        config.load(BASE + 'token_url = "https://h.example/token"\nclient_id = "c"\n'
                           'client_secret = { env = "S" }\n')
    assert "backends.r.oauth: the backend's own token is not used with credentials = " \
        '"per-principal" (each principal authorizes with grant = "authorization_code"); ' \
        "remove one" in err.value.errors


@pytest.mark.trio
async def test_each_principal_has_its_own_state_file_dropped_with_it_alone(
        tmp_path: Path) -> None:
    cfg = config.load(BASE + 'grant = "authorization_code"\n').backends["r"]
    assert cfg.oauth is not None
    source = PrincipalAuthorizationCode("r", URL, cfg.oauth)
    source.place("http://127.0.0.1:8766/oauth/callback", str(tmp_path))
    for name in ("alice", "bob"):
        flow = source._flow(who(name))
        flow.refresh_token = f"refresh-of-{name}"
        flow.meta = {"token_endpoint": "https://as.example/token"}
        flow._save()
    paths = {n: tmp_path / "oauth" / "r" / f"bearer-{n}.json" for n in ("alice", "bob")}
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths.values())
    source.forget(who("alice").key)  # a stopped instance: the refresh token stays
    assert source._flow(who("alice")).refresh_token == "refresh-of-alice"
    assert source.drop_unless(lambda p: p.name != "alice") == 1
    assert not paths["alice"].exists() and paths["bob"].exists()
    # an unknown or used link, an unknown state: refused, nothing stored
    assert source.start_page("nope", "x", None).status == 400
    url = source._start_url(who("bob"))
    start = url.rpartition("start=")[2]
    assert source._start_url(who("bob")) == url  # one open link per principal
    shown = source.start_page(start, None, None)
    assert shown.status == 200
    jar = dict(shown.headers)["set-cookie"].split(";", 1)[0]
    token = jar.partition("=")[2]
    assert f"consent={token}" in shown.body
    first = source.start_page(start, token, jar)
    assert first.status == 409  # nothing discovered yet: no authorization server to send to
    assert source.start_page(start, token, jar).status == 400  # used up
    page = await source.complete({"state": "x", "code": "y"}, None)
    assert page.status == 400 and source.refused == 1


async def test_a_client_secret_expired_registers_anew_once_and_drops_the_principals_grants(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    auth_url, url = "http://127.0.0.1:9000", "http://localhost:8080/mcp"
    auth = CodeAuthServer(auth_url, secret_lifetime=3600)
    cfg = config.load(BASE.replace(URL, url) + 'grant = "authorization_code"\n').backends["r"]
    assert cfg.oauth is not None
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": auth,
                            "localhost:8080": ProtectedRemote(url, auth_url, lambda tok: True)})
        source = PrincipalAuthorizationCode("r", url, cfg.oauth, net.open)
        source.place("http://127.0.0.1:8766/oauth/callback", str(tmp_path))
        for name in ("alice", "bob"):
            with pytest.raises(CredentialsUnavailable):
                await source.headers(who(name))  # no token: the backend learns and registers
        assert len(auth.registered) == 1
        flows = [source._flow(who(name)) for name in ("alice", "bob")]
        for flow in flows:
            flow.refresh_token = "ref-old"  # a grant each holds
            flow.client_secret_expires_at = time.time() - 1
        source._shared.client_secret_expires_at = time.time() - 1
        for name in ("alice", "bob"):
            with pytest.raises(CredentialsUnavailable) as exc:
                await source.headers(who(name))
            assert exc.value.url is not None and not exc.value.retryable
        assert len(auth.registered) == 2 and "refresh_token" not in auth.grants
        for flow in flows:
            assert flow.refresh_token is None
            source._copy(flow)  # (what her authorize page does first)
            assert flow.client_id == auth.registered[1]
        nursery.cancel_scope.cancel()
