"""``[backends.NAME.token_exchange]``: its key-path errors, the client authentication keys shared
with ``[oauth]``, and the refusal while the http connector opens no per-principal sessions."""

from __future__ import annotations

import pytest

from gateway import config, errors

URL = "https://mcp.example.com/mcp"


def refused(table: str) -> list[str]:
    with pytest.raises(errors.ConfigError) as err:
        config.load(f'[backends.r]\nurl = "{URL}"\n{table}')
    return err.value.errors


def test_token_exchange_keys_are_checked_by_path() -> None:
    got = refused('[backends.r.token_exchange]\nclient_secret = "hunter2"\n'
                  'resource = "ftp://x"\n')
    assert got[:5] == [
        "backends.r.token_exchange.client_id: required",
        "backends.r.token_exchange.token_url: required (the authorization server's token "
        "endpoint)",
        "backends.r.token_exchange.resource: expected an absolute http(s) URI without a fragment",
        'backends.r.token_exchange.client_secret: never a literal in the config: use '
        '{ file = "/path" } or { env = "VAR" }',
        "backends.r.token_exchange: needs per-principal upstream sessions, which this build's "
        "http connector does not open yet (the source is gateway.backend.tokenexchange)"]
    got = refused('[backends.r.oauth]\nclient_id = "c"\nclient_secret = { env = "S" }\n'
                  '[backends.r.token_exchange]\nclient_id = "c"\ntoken_url = "http://as/t"\n'
                  'auth_method = "private_key_jwt"\n')
    assert got[:4] == [
        "backends.r.token_exchange.token_url: expected an https:// URL (or http:// to "
        "127.0.0.1), got 'http://as/t'",
        "backends.r.token_exchange: set audience or resource (what the exchanged token is for)",
        "backends.r.token_exchange.private_key: required for auth_method = 'private_key_jwt'",
        "backends.r.token_exchange: a remote's token is either the gateway's own (oauth) or "
        "each principal's (token_exchange), not both"]


def test_a_complete_table_is_refused_only_for_the_missing_wiring() -> None:
    got = refused('[backends.r.token_exchange]\nclient_id = "gw"\n'
                  'client_secret = { file = "gw.secret" }\n'
                  'token_url = "https://as.example/token"\naudience = "https://mcp.example.com"\n')
    assert got == ["backends.r.token_exchange: needs per-principal upstream sessions, which "
                   "this build's http connector does not open yet (the source is "
                   "gateway.backend.tokenexchange)"]
