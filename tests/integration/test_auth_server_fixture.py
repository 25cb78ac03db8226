"""The tests' Authlib authorization server does what other tests rely on: the authorization code
flow with PKCE (auto-approved, ``iss`` in the redirect, codes single-use), refresh tokens
(rotated, revoked on command), client credentials, and JWTs its JWKS verifies."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import jwt
import pytest
import trio
from authserverutil import AuthServer, auth_server

REDIRECT = "http://127.0.0.1:9/callback"
RESOURCE = "http://127.0.0.1:9911/mcp"

pytestmark = pytest.mark.system


async def request(srv: AuthServer, method: str, path: str, form: dict[str, str] | None = None,
                  auth: str | None = None) -> tuple[int, dict[str, str], Any]:
    def go() -> tuple[int, dict[str, str], Any]:
        parts = urlsplit(srv.issuer)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
        head = {"content-type": "application/x-www-form-urlencoded"}
        if auth is not None:
            head["authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
        conn.request(method, path, urlencode(form).encode() if form else None, head)
        answer = conn.getresponse()
        body = answer.read()
        conn.close()
        doc = json.loads(body) if answer.getheader("content-type", "").startswith(
            "application/json") else None
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, doc
    return await trio.to_thread.run_sync(go)


async def test_code_with_pkce_refresh_revocation_and_client_credentials() -> None:
    async with auth_server("--client", "pub", "--client", "svc:svc-secret") as srv:
        status, _, meta = await request(srv, "GET", "/.well-known/oauth-authorization-server")
        assert status == 200 and meta["issuer"] == srv.issuer
        assert meta["token_endpoint"] == srv.token_url and "S256" in meta[
            "code_challenge_methods_supported"]
        _, _, jwks = await request(srv, "GET", "/jwks")
        key = jwt.PyJWK(jwks["keys"][0]).key

        verifier = "v" * 50
        challenge = base64.urlsafe_b64encode(
            hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
        query = urlencode({"response_type": "code", "client_id": "pub", "state": "s1",
                           "redirect_uri": REDIRECT, "code_challenge": challenge,
                           "code_challenge_method": "S256", "login_hint": "alice",
                           "resource": RESOURCE})
        status, head, _ = await request(srv, "GET", f"/authorize?{query}")
        assert status == 302 and head["location"].startswith(REDIRECT + "?")
        back = {k: v[0] for k, v in parse_qs(urlsplit(head["location"]).query).items()}
        assert back["state"] == "s1" and back["iss"] == srv.issuer
        redeem = {"grant_type": "authorization_code", "client_id": "pub", "code": back["code"],
                  "redirect_uri": REDIRECT}
        status, _, doc = await request(srv, "POST", "/token", {**redeem, "code_verifier": "w" * 50})
        assert status == 400 and doc["error"] == "invalid_grant"  # the wrong verifier
        status, _, tokens = await request(srv, "POST", "/token", {**redeem,
                                                                  "code_verifier": verifier})
        assert status == 200, tokens
        claims = jwt.decode(tokens["access_token"], key, algorithms=["RS256"], audience=RESOURCE,
                            issuer=srv.issuer)
        assert claims["sub"] == "alice"
        status, _, doc = await request(srv, "POST", "/token", {**redeem,
                                                               "code_verifier": verifier})
        assert status == 400 and doc["error"] == "invalid_grant"  # a code is used once

        again = {"grant_type": "refresh_token", "client_id": "pub"}
        status, _, renewed = await request(srv, "POST", "/token", {
            **again, "refresh_token": tokens["refresh_token"]})
        assert status == 200 and renewed["refresh_token"] != tokens["refresh_token"]
        status, _, _ = await request(srv, "POST", "/token", {
            **again, "refresh_token": tokens["refresh_token"]})
        assert status == 400  # rotated: the old one is spent
        await srv.revoke(renewed["refresh_token"])
        status, _, doc = await request(srv, "POST", "/token", {
            **again, "refresh_token": renewed["refresh_token"]})
        assert status == 400 and doc["error"] == "invalid_grant"

        cc = {"grant_type": "client_credentials", "resource": RESOURCE}
        assert (await request(srv, "POST", "/token", cc, auth="svc:wrong"))[0] == 401
        status, _, doc = await request(srv, "POST", "/token", cc, auth="svc:svc-secret")
        assert status == 200 and jwt.decode(doc["access_token"], key, algorithms=["RS256"],
                                            audience=RESOURCE)["sub"] == "svc"
        assert [(r["grant_type"], r["sub"]) for r in await srv.issued()] == [
            ("authorization_code", "alice"), ("refresh_token", "alice"),
            ("client_credentials", "svc")]
