"""``[backends.NAME.token_exchange]``: its key-path errors, the client authentication keys shared
with ``[oauth]``, and its place as a per-principal remote's one credential source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tlsutil import make_certs

from gateway import config, errors
from gateway.auth.principal import Principal
from gateway.backend.credentials import CredentialsUnavailable
from gateway.backend.pool import Backend, _credential_source
from gateway.backend.tokenexchange import TokenExchangeSource
from gateway.events import EventBus
from gateway.hub import Hub

URL = "https://mcp.example.com/mcp"
ONLY = ('backends.r.token_exchange: only with credentials = "per-principal" (each principal\'s '
        "token on an upstream session of its own)")
TABLE = ('[backends.r.token_exchange]\nclient_id = "gw"\nclient_secret = { file = "gw.secret" }\n'
         'token_url = "https://as.example/token"\naudience = "https://mcp.example.com"\n')


def refused(table: str) -> list[str]:
    with pytest.raises(errors.ConfigError) as err:
        config.load(f'[backends.r]\nurl = "{URL}"\n{table}')
    return err.value.errors


def test_token_exchange_keys_are_checked_by_path() -> None:
    assert refused('[backends.r.token_exchange]\nclient_secret = "hunter2"\n'
                   'resource = "ftp://x"\n') == [
        "backends.r.token_exchange.client_id: required",
        "backends.r.token_exchange.token_url: required (the authorization server's token "
        "endpoint)",
        "backends.r.token_exchange.resource: expected an absolute http(s) URI without a fragment",
        'backends.r.token_exchange.client_secret: never a literal in the config: use '
        '{ file = "/path" } or { env = "VAR" }', ONLY]
    assert refused('[backends.r.oauth]\nclient_id = "c"\nclient_secret = { env = "S" }\n'
                   '[backends.r.token_exchange]\nclient_id = "c"\ntoken_url = "http://as/t"\n'
                   'auth_method = "private_key_jwt"\n') == [
        "backends.r.token_exchange.token_url: expected an https:// URL (or http:// to "
        "127.0.0.1), got 'http://as/t'",
        "backends.r.token_exchange: set audience or resource (what the exchanged token is for)",
        "backends.r.token_exchange.private_key: required for auth_method = 'private_key_jwt'",
        "backends.r.token_exchange: a remote's token is either the gateway's own (oauth) or "
        "each principal's (token_exchange), not both", ONLY]


def test_it_is_a_per_principal_remotes_one_source(tmp_path: object) -> None:
    assert refused(TABLE) == [ONLY]
    assert refused('credentials = "per-principal"\ntoken_files = "t/{principal}.token"\n'
                   + TABLE) == ["backends.r.credentials: one source: token_files, "
                                '[token_exchange] or [oauth] grant = "authorization_code"']
    assert refused('credentials = "per-principal"\n') == [
        'backends.r.credentials: "per-principal" needs a source: set token_files, '
        '[token_exchange] or [oauth] grant = "authorization_code"']
    cfg = config.load(f'[backends.r]\nurl = "{URL}"\ncredentials = "per-principal"\n' + TABLE,
                      base_dir=str(tmp_path)).backends["r"]
    assert cfg.token_exchange is not None
    assert cfg.token_exchange.client_secret == {"file": f"{tmp_path}/gw.secret"}
    source = _credential_source("r", cfg)
    assert isinstance(source, TokenExchangeSource) and source.kind == "token_exchange"


async def test_a_reload_has_the_token_exchange_read_its_ca_file_again(tmp_path: Path) -> None:
    """``Backend.refresh`` (a reload that kept the backend) reaches its per-principal source: a
    ``ca_file`` changed since is read at the next exchange."""
    certs = make_certs(tmp_path)
    ca = tmp_path / "as-ca.pem"
    ca.write_bytes(certs.ca.read_bytes())
    (tmp_path / "gw.secret").write_text("s3cret")
    os.chmod(tmp_path / "gw.secret", 0o600)
    table = TABLE.replace("https://as.example/token", "https://127.0.0.1:1/token")
    cfg = config.load(f'[backends.r]\nurl = "{URL}"\ncredentials = "per-principal"\n{table}'
                      f'ca_file = "{ca}"\n', base_dir=str(tmp_path))
    backend = Backend("r", cfg.backends["r"], "r", Hub(cfg, EventBus()))
    source = backend.credentials
    assert isinstance(source, TokenExchangeSource)
    alice = Principal("alice", via="oauth", token="inbound-token")
    with pytest.raises(CredentialsUnavailable) as first:
        await source.headers(alice)
    assert "ca_file" not in first.value.detail  # the CA read; the endpoint unreachable
    ca.write_text("not a certificate\n")
    with pytest.raises(CredentialsUnavailable) as kept:
        await source.headers(alice)
    assert "ca_file" not in kept.value.detail  # read once, not at each exchange
    backend.refresh()
    with pytest.raises(CredentialsUnavailable) as again:
        await source.headers(alice)
    assert f"ca_file {ca}" in again.value.detail
