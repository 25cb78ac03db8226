"""OAuth 2.1 access tokens as JWTs (pure; PyJWT does the JOSE work): the JWKS document parsed
into verification keys, and a token checked against them.

A token's header names its key (``kid``); only RS256 and ES256 are accepted, and only the one
that key's type verifies, so a token cannot choose how it is checked.  PyJWT then verifies the
signature, ``iss``, ``aud`` (this gateway's resource URI, RFC 8707), ``exp`` (required) and
``nbf`` with ``leeway`` seconds of skew; the time claims must be JSON numbers (a string ``exp``
would leave the principal's long-lived streams without an expiry).  The principal, groups and
scopes come from the configured claims.  A failure is :class:`TokenRefused` with a short
``kind`` for logs and a description safe to send back in ``WWW-Authenticate``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jwt as pyjwt
from jwt.exceptions import PyJWTError

from gateway.auth.principal import Principal

if TYPE_CHECKING:
    from gateway.config import OAuthSection

ALGORITHMS = ("RS256", "ES256")
#: Keys taken from one JWKS document at most (the rest are ignored, and that is logged).
MAX_KEYS = 32
#: Claims a token must carry besides the signature.
REQUIRED = ["exp", "iss", "aud"]
#: Claims that are times (NumericDate, RFC 7519 §2): a JSON number when present.
TIMES = ("exp", "nbf", "iat")
#: Bounds on what a token may hand the gateway: principal name length, groups, scopes.
MAX_NAME = 256
MAX_ITEMS = 256


class TokenRefused(Exception):
    """A JWT that does not authenticate: ``kind`` for logs and metrics, the message for the
    client (``error_description``; nothing from the token itself)."""

    def __init__(self, kind: str, description: str) -> None:
        super().__init__(description)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Key:
    kid: str
    algorithm: str
    key: Any  # the cryptography public key


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2


def parse_jwks(data: bytes, max_keys: int = MAX_KEYS) -> tuple[dict[str, Key], list[str]]:
    """The signing keys of a JWKS document by ``kid``, and what was skipped (in words).

    Raises:
        ValueError: not a JWKS document at all.
    """
    try:
        doc = json.loads(data)
    except ValueError:
        raise ValueError("not JSON") from None
    except RecursionError:  # nested deeper than the parser goes: a bad document, not a crash
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ValueError("not a JWKS document (no \"keys\" array)")
    keys: dict[str, Key] = {}
    skipped: list[str] = []
    for n, jwk in enumerate(doc["keys"]):
        if len(keys) >= max_keys:
            skipped.append(f"{len(doc['keys']) - n} keys beyond the first {max_keys}")
            break
        if not isinstance(jwk, dict):
            skipped.append(f"key {n}: not an object")
            continue
        kid = jwk.get("kid")
        if not isinstance(kid, str) or not kid or len(kid) > 256:
            skipped.append(f"key {n}: no kid")
            continue
        if jwk.get("use", "sig") != "sig" or "d" in jwk or "k" in jwk:
            skipped.append(f"key {kid!r}: not a public signing key")
            continue
        if jwk.get("kty") == "RSA":
            algorithm = "RS256"
        elif jwk.get("kty") == "EC" and jwk.get("crv") == "P-256":
            algorithm = "ES256"
        else:
            skipped.append(f"key {kid!r}: key type not RSA or EC P-256")
            continue
        if jwk.get("alg", algorithm) != algorithm:
            skipped.append(f"key {kid!r}: alg {str(jwk.get('alg'))[:16]!r} not accepted (RS256, "
                           "ES256 only)")
            continue
        try:
            keys[kid] = Key(kid, algorithm, pyjwt.PyJWK(jwk, algorithm).key)
        except PyJWTError as exc:
            skipped.append(f"key {kid!r}: {exc}")
    return keys, skipped


def header(token: str) -> tuple[str, str]:
    """The token's ``kid`` and ``alg`` (not verified: they only pick the key)."""
    try:
        head = pyjwt.get_unverified_header(token)
    except PyJWTError:
        raise TokenRefused("malformed", "the token is not a well-formed JWT") from None
    alg, kid = head.get("alg"), head.get("kid")
    if alg not in ALGORITHMS:
        raise TokenRefused("algorithm", "the token's algorithm is not accepted (RS256 or ES256)")
    if not isinstance(kid, str) or not kid:
        raise TokenRefused("no_kid", "the token names no key (kid)")
    return kid, alg


def verify(token: str, key: Key, alg: str, oauth: OAuthSection) -> dict[str, Any]:
    """The claims of ``token``, verified with ``key`` (see the module docstring)."""
    if alg != key.algorithm:
        raise TokenRefused("algorithm", "the token's algorithm is not its key's")
    try:
        claims: dict[str, Any] = pyjwt.decode(
            token, key.key, algorithms=[key.algorithm], audience=oauth.audience,
            issuer=oauth.issuer,
            leeway=oauth.leeway, options={"require": REQUIRED, "verify_signature": True})
    except pyjwt.ExpiredSignatureError:
        raise TokenRefused("expired", "the token has expired") from None
    except pyjwt.ImmatureSignatureError:
        raise TokenRefused("not_yet_valid", "the token is not valid yet (nbf/iat)") from None
    except pyjwt.InvalidAudienceError:
        raise TokenRefused("audience", "the token is not meant for this resource (aud)") from None
    except pyjwt.InvalidIssuerError:
        raise TokenRefused("issuer", "the token was not issued by this gateway's issuer") from None
    except pyjwt.MissingRequiredClaimError as exc:
        raise TokenRefused("claims", f"the token lacks the {exc.claim!r} claim") from None
    except pyjwt.InvalidSignatureError:
        raise TokenRefused("signature", "the token's signature does not verify") from None
    except PyJWTError:
        raise TokenRefused("invalid", "the token does not verify") from None
    check_times(claims)
    return claims


def check_times(claims: dict[str, Any]) -> None:
    """``exp``, ``nbf`` and ``iat``, when present, are finite JSON numbers (not strings, not
    booleans) that fit a float (an integer of 400 digits passes PyJWT, and ``math.isfinite``
    of it raises OverflowError)."""
    for claim in TIMES:
        value = claims.get(claim)
        if claim in claims and (isinstance(value, bool) or not isinstance(value, int | float)
                                or not _finite(value)):
            raise TokenRefused("claims",
                               f"the token's {claim!r} claim is not a number (NumericDate)")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _strings(value: object) -> frozenset[str]:
    """A claim holding names: a list of strings or one space-separated string (bounded)."""
    if isinstance(value, str):
        items = value.split()
    elif isinstance(value, list):
        items = [v for v in value if isinstance(v, str)]
    else:
        return frozenset()
    return frozenset(i for i in items[:MAX_ITEMS] if 0 < len(i) <= MAX_NAME)


def principal_of(claims: dict[str, Any], oauth: OAuthSection, labels: frozenset[str],
                 credential: str, token: str = "") -> Principal:
    """The caller a verified token names: ``principal_claim`` (``sub`` by default), groups
    from ``groups_claim``, scopes from ``scope`` (space separated) or ``scp`` (a list or a
    string).  ``labels``: the principal names an operator configured, the only ones metrics
    and logs may carry; ``token`` the verified token itself (kept for token exchange)."""
    name = claims.get(oauth.principal_claim)
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise TokenRefused("claims",
                           f"the token's {oauth.principal_claim!r} claim is not a usable name")
    groups = _strings(claims.get(oauth.groups_claim)) if oauth.groups_claim else frozenset()
    scopes = _strings(claims["scope"] if "scope" in claims else claims.get("scp"))
    exp = claims.get("exp")  # a number: verify() checked it
    return Principal(name, groups, scopes, "oauth", name if name in labels else "other",
                     credential=credential, token=token,
                     expires=float(exp) if isinstance(exp, int | float) else None)
