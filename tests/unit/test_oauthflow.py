"""The authorization code flow's pure rules (gateway/protocol/oauthflow.py): the scope asked
for, the issuer checks, the challenge, PKCE, the metadata locations, the client authentication.
"""

from __future__ import annotations

import base64
import hashlib
from urllib.parse import parse_qs, urlsplit

import pytest

from gateway.protocol import oauthflow as f


def test_scope_from_the_challenge_else_scopes_supported_else_omitted_and_offline_access() -> None:
    assert f.scope_to_ask("mcp:basic", ["mcp:profile"], None) == "mcp:basic"
    assert f.scope_to_ask(None, ["a", "b"], None) == "a b"
    assert f.scope_to_ask(None, None, None) is None
    # a step-up keeps what was asked before; offline_access only where the server lists it
    assert f.scope_to_ask("mcp:write", None, None, asked_before="mcp:basic") \
        == "mcp:basic mcp:write"
    assert f.scope_to_ask(None, ["mcp:basic"], ["mcp:basic", "offline_access"]) \
        == "mcp:basic offline_access"
    assert f.scope_to_ask(None, ["mcp:basic"], ["mcp:basic"]) == "mcp:basic"
    assert f.scope_to_ask(None, ["mcp:basic"], ["offline_access"], offline=False) == "mcp:basic"
    assert f.covers("a b", "b") and not f.covers("a", "a c")


def test_issuers_compared_as_strings_and_iss_required_when_advertised() -> None:
    issuer = "http://localhost:9000"
    f.check_iss(issuer, issuer, advertised=True)
    f.check_iss(None, issuer, advertised=False)
    for iss, advertised in ((issuer + "/", True), ("https://evil.example.com", False),
                            (None, True)):
        with pytest.raises(f.FlowError):
            f.check_iss(iss, issuer, advertised)
    meta = {"issuer": "https://attacker.example.com", "authorization_endpoint": "http://x/a",
            "token_endpoint": "http://x/t"}
    with pytest.raises(f.FlowError, match="names issuer"):
        f.check_metadata(meta, issuer)
    f.check_metadata({**meta, "issuer": issuer}, issuer)
    assert f.resource_matches("http://h:1", "http://h:1/mcp")
    assert not f.resource_matches("https://evil.example.com/mcp", "http://h:1/mcp")


def test_the_authorization_server_protected_resource_metadata_names() -> None:
    url = "http://h:1/mcp"
    prm = {"resource": "http://h:1", "authorization_servers": ["https://as.example.com", "x"]}
    assert f.authorization_server(prm, url) == ("http://h:1", "https://as.example.com")
    with pytest.raises(f.FlowError, match="not this backend's url"):
        f.authorization_server({**prm, "resource": "https://evil.example.com/mcp"}, url)
    with pytest.raises(f.FlowError, match="names no authorization server"):
        f.authorization_server({**prm, "authorization_servers": []}, url)
    with pytest.raises(f.FlowError, match="is not an http"):
        f.authorization_server({**prm, "authorization_servers": ["file:///as"]}, url)


def test_challenge_locations_pkce_and_the_authorization_url() -> None:
    got = f.challenge('Bearer error="insufficient_scope", scope="a b", '
                      'resource_metadata="http://h/.well-known/oauth-protected-resource/mcp"')
    assert got == {"error": "insufficient_scope", "scope": "a b",
                   "resource_metadata": "http://h/.well-known/oauth-protected-resource/mcp"}
    assert f.challenge("Basic realm=x") == {}
    assert f.challenge('DPoP algs="ES256", Bearer resource_metadata="http://h/m", '
                       'scope="a"') == {"resource_metadata": "http://h/m", "scope": "a"}
    assert f.challenge("bearer") == {} and f.challenge('Bearerx scope="a"') == {}
    assert f.resource_metadata_urls("http://h/mcp", None) == [
        "http://h/.well-known/oauth-protected-resource/mcp",
        "http://h/.well-known/oauth-protected-resource"]
    assert f.metadata_urls("http://a/tenant1") == [
        "http://a/.well-known/oauth-authorization-server/tenant1",
        "http://a/.well-known/openid-configuration/tenant1",
        "http://a/tenant1/.well-known/openid-configuration"]
    assert f.legacy_metadata(f.legacy_issuer("http://h:8/mcp"))["token_endpoint"] \
        == "http://h:8/token"
    verifier, challenge = f.pkce()
    digest = hashlib.sha256(verifier.encode()).digest()
    assert challenge == base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    url = f.authorization_url("http://a/authorize", "c", "http://gw/cb", challenge, "st",
                              "http://h/mcp", None)
    query = parse_qs(urlsplit(url).query)
    assert query["code_challenge_method"] == ["S256"] and "scope" not in query
    assert query["resource"] == ["http://h/mcp"] and query["state"] == ["st"]


def test_client_authentication_and_token_answers() -> None:
    assert f.client_auth_method(None, True, ["none"]) == "none"
    assert f.client_auth_method(None, True, ["client_secret_post"]) == "client_secret_post"
    assert f.client_auth_method("client_secret_basic", True, None) == "client_secret_basic"
    assert f.client_auth_method(None, False, ["client_secret_basic"]) == "none"
    assert f.registration_body("http://127.0.0.1:1/cb", "gw", None)["application_type"] \
        == "native"
    answer = f.token_answer(200, {"access_token": "t", "token_type": "bearer",
                                  "expires_in": 60, "refresh_token": "r"}, "as")
    assert (answer.access_token, answer.lifetime, answer.refresh_token) == ("t", 60.0, "r")
    with pytest.raises(f.FlowError, match="invalid_grant"):
        f.token_answer(400, {"error": "invalid_grant"}, "as")
