"""An OAuth token's time claims (``exp``, ``nbf``, ``iat``) are JSON numbers, or it is refused:
PyJWT takes ``"exp": "1764590000"`` (a string) and the principal would then carry no expiry, so
streams opened with it would outlive it."""

from __future__ import annotations

import time
from typing import Any

import jwt as pyjwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from gateway.auth import jwt as jwts
from gateway.config import OAuthSection

OAUTH = OAuthSection(issuer="https://id.example", jwks_uri="https://id.example/jwks",
                     audience="https://gw.example/mcp")
PRIVATE = ec.generate_private_key(ec.SECP256R1())
KEY = jwts.Key("k1", "ES256", PRIVATE.public_key())


def _token(**claims: Any) -> str:
    now = int(time.time())
    payload = {"iss": OAUTH.issuer, "aud": OAUTH.audience, "sub": "alice", "exp": now + 600,
               **claims}
    return pyjwt.encode(payload, PRIVATE, algorithm="ES256", headers={"kid": "k1"})


def test_numeric_time_claims_give_the_principal_its_expiry() -> None:
    exp = int(time.time()) + 600
    claims = jwts.verify(_token(exp=exp, nbf=exp - 900, iat=float(exp - 900)), KEY, "ES256", OAUTH)
    principal = jwts.principal_of(claims, OAUTH, frozenset(), "c")
    assert principal.expires == float(exp)


@pytest.mark.parametrize("claim", ["exp", "nbf", "iat"])
@pytest.mark.parametrize("value", ["future", "past", True, False, None, [1], {"t": 1}])
def test_a_time_claim_that_is_not_a_number_is_refused(claim: str, value: Any) -> None:
    now = int(time.time())
    if value == "future":
        value = str(now + 600) if claim == "exp" else str(now - 600)  # otherwise a valid time
    elif value == "past":
        value = str(now - 600) if claim == "exp" else str(now - 900)
    with pytest.raises(jwts.TokenRefused) as refused:
        jwts.verify(_token(**{claim: value}), KEY, "ES256", OAUTH)
    assert refused.value.kind in ("claims", "invalid", "expired",
                                  "not_yet_valid"), refused.value.kind


def test_a_string_exp_in_the_future_is_refused_as_not_a_number() -> None:
    token = _token(exp=str(int(time.time()) + 600))
    with pytest.raises(jwts.TokenRefused, match="'exp' claim is not a number") as refused:
        jwts.verify(token, KEY, "ES256", OAUTH)
    assert refused.value.kind == "claims"
