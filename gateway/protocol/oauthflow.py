"""The OAuth 2.1 authorization code flow's rules as the MCP authorization spec gives them, pure.

Where the protected-resource metadata (RFC 9728) and the authorization server's metadata
(RFC 8414, OpenID discovery) may be, the 2025-03-26 fallbacks (``/authorize``, ``/token``,
``/register`` at the server's origin), the ``WWW-Authenticate: Bearer`` parameters, the scope
asked for (the challenge's, else ``scopes_supported``, else none; a step-up adds to what was
asked; ``offline_access`` only when the server lists it), PKCE S256, the authorization URL, the
RFC 7591 registration body, the token endpoint's client authentication, the issuer checks
(metadata ``issuer`` and RFC 9207 ``iss``, compared as strings) and a token answer.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

OFFLINE_ACCESS = "offline_access"
_BEARER = re.compile(r"(?:^|,)\s*bearer(?:\s+|$)", re.IGNORECASE)
_PARAM = re.compile(r'([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.){0,4096})"|([^\s,]+))')


class FlowError(Exception):
    """A document or an answer the flow cannot go on with: ``detail`` says why."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def challenge(header: str | None) -> dict[str, str]:
    """The parameters of a ``WWW-Authenticate: Bearer`` challenge (``scope``, ``error``,
    ``resource_metadata``…), names lowercased; empty when there is none.  The header may hold
    other challenges before it (``DPoP …, Bearer …``); the first value of a name counts."""
    found = _BEARER.search(header or "")
    if found is None:
        return {}
    params: dict[str, str] = {}
    for m in _PARAM.finditer(header or "", found.end()):
        params.setdefault(m.group(1).lower(),
                          m.group(2) if m.group(2) is not None else m.group(3) or "")
    return params


def resource_metadata_urls(url: str, hint: str | None) -> list[str]:
    """Where the protected-resource metadata of the server at ``url`` may be, in order: the
    challenge's ``resource_metadata``, the path-based well-known URI, the root one."""
    parts = urlsplit(url)
    base = f"{parts.scheme}://{parts.netloc}/.well-known/oauth-protected-resource"
    path = parts.path.rstrip("/")
    found = [hint] if hint and urlsplit(hint).scheme in ("http", "https") else []
    return found + ([base + path] if path else []) + [base]


def metadata_urls(issuer: str) -> list[str]:
    """Where an authorization server's metadata may be (RFC 8414 §3.1, then OpenID)."""
    parts = urlsplit(issuer)
    origin = f"{parts.scheme}://{parts.netloc}"
    path = parts.path.rstrip("/")
    if not path:
        return [f"{origin}/.well-known/oauth-authorization-server",
                f"{origin}/.well-known/openid-configuration"]
    return [f"{origin}/.well-known/oauth-authorization-server{path}",
            f"{origin}/.well-known/openid-configuration{path}",
            f"{origin}{path}/.well-known/openid-configuration"]


def legacy_issuer(url: str) -> str:
    """A 2025-03-26 server without protected-resource metadata: its origin is its
    authorization server."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def legacy_metadata(issuer: str) -> dict[str, Any]:
    """The 2025-03-26 fallback endpoints of a server that has no metadata at all."""
    return {"issuer": issuer, "authorization_endpoint": f"{issuer}/authorize",
            "token_endpoint": f"{issuer}/token", "registration_endpoint": f"{issuer}/register"}


def resource_matches(resource: str, url: str) -> bool:
    """Whether protected-resource metadata's ``resource`` covers the server at ``url``: the
    same origin, and a path that is the url's or one of its parents."""
    a, b = urlsplit(resource), urlsplit(url)
    try:
        same = (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)
    except ValueError:
        return False
    base, path = a.path.rstrip("/"), b.path.rstrip("/")
    return same and (path == base or path.startswith(base + "/"))


def authorization_server(prm: dict[str, Any], url: str) -> tuple[str, str]:
    """The ``resource`` and the (first) authorization server that protected-resource metadata
    names for the server at ``url``.

    Raises:
        FlowError: a resource that does not cover ``url``, no authorization server, or one
            that is not an http(s) URL.
    """
    resource, servers = prm.get("resource"), prm.get("authorization_servers")
    if not isinstance(resource, str) or not resource_matches(resource, url):
        raise FlowError(f"the protected-resource metadata names resource {resource!r:.200}, "
                        "not this backend's url: refused")
    if not isinstance(servers, list) or not servers or not isinstance(servers[0], str):
        raise FlowError("the protected-resource metadata names no authorization server")
    issuer = servers[0]
    if urlsplit(issuer).scheme not in ("http", "https"):
        raise FlowError(f"authorization server {issuer!r:.200} is not an http(s) URL")
    return resource, issuer


def check_metadata(meta: dict[str, Any], issuer: str) -> None:
    """Authorization server metadata fetched for ``issuer``: its ``issuer`` must be that very
    string, and it must name the endpoints the flow uses.

    Raises:
        FlowError: another issuer, or no authorization or token endpoint (an http or https URL
            of printable ASCII without spaces: the browser is sent there by a header).
    """
    check_issuer(meta, issuer)
    for key in ("authorization_endpoint", "token_endpoint"):
        url = meta.get(key)
        if not isinstance(url, str) or not _header_safe(url) \
                or urlsplit(url).scheme not in ("http", "https"):
            raise FlowError(f"the metadata of {issuer:.200} has no usable {key}")


def check_issuer(meta: dict[str, Any], issuer: str) -> None:
    """RFC 8414 §3.3: the ``issuer`` of metadata fetched for ``issuer`` is that very string (no
    trailing-slash or case folding: a client that normalises can be pointed at another server).

    Raises:
        FlowError: another issuer.
    """
    if meta.get("issuer") != issuer:
        raise FlowError(f"the metadata of {issuer:.200} names issuer "
                        f"{str(meta.get('issuer'))!r:.200}: refused")


def _header_safe(url: str) -> bool:
    return url.isascii() and url.isprintable() and " " not in url


def scope_to_ask(challenged: str | None, resource_scopes: list[str] | None,
                 server_scopes: list[str] | None, asked_before: str | None = None,
                 offline: bool = True) -> str | None:
    """The ``scope`` of an authorization request: the challenge's, else every one of the
    protected resource's ``scopes_supported``, else none; joined with what was asked before
    (a step-up keeps it); ``offline_access`` added when ``offline`` and the authorization
    server lists it.  None: the parameter is left out."""
    if challenged:
        words = challenged.split()
    elif resource_scopes:
        words = [s for s in resource_scopes if isinstance(s, str)]
    else:
        words = []
    if asked_before:
        words = asked_before.split() + words
    if offline and server_scopes and OFFLINE_ACCESS in server_scopes and words:
        words.append(OFFLINE_ACCESS)
    unique = list(dict.fromkeys(w for w in words if w))
    return " ".join(unique) or None


def covers(asked: str | None, challenged: str | None) -> bool:
    """Whether every scope of a 403's challenge was asked for already (a step-up would ask
    for nothing new)."""
    return set((challenged or "").split()) <= set((asked or "").split())


def pkce() -> tuple[str, str]:
    """A PKCE code verifier and its S256 challenge."""
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def new_state() -> str:
    return secrets.token_urlsafe(32)


def authorization_url(endpoint: str, client_id: str, redirect_uri: str, challenge_s256: str,
                      state: str, resource: str, scope: str | None) -> str:
    """The authorization request (response type ``code``, PKCE S256, RFC 8707 resource)."""
    query = {"response_type": "code", "client_id": client_id, "redirect_uri": redirect_uri,
             "code_challenge": challenge_s256, "code_challenge_method": "S256", "state": state,
             "resource": resource}
    if scope:
        query["scope"] = scope
    sep = "&" if urlsplit(endpoint).query else "?"
    return endpoint + sep + urlencode(query)


def check_iss(iss: str | None, issuer: str, advertised: bool) -> None:
    """RFC 9207: an ``iss`` in the authorization response must be the issuer, as a string
    (no normalization); a server that advertises it must send it.

    Raises:
        FlowError: a different or missing ``iss``.
    """
    if iss is not None:
        if iss != issuer:
            raise FlowError(f"the authorization response came from issuer {iss!r:.200}, "
                            f"not {issuer!r:.200}: refused")
    elif advertised:
        raise FlowError(f"{issuer:.200} advertises the iss parameter but the authorization "
                        "response has none: refused")


#: A ``client_secret_expires_at`` from here on means never (beyond any clock: 1e18 s).
_NEVER = 10**18


def secret_expires_at(value: object) -> float:
    """An RFC 7591 registration's ``client_secret_expires_at`` (seconds since the epoch; 0 or
    absent: never), 0 when it is not a usable number (one past :data:`_NEVER` is never too: an
    integer beyond a float's range cannot be one)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < _NEVER:
        return 0.0
    return float(value)


def secret_expired(expires_at: float, now: float) -> bool:
    """Whether a registered client whose secret expires at ``expires_at`` (0: never) must
    register again at wall-clock time ``now``."""
    return expires_at > 0 and now >= expires_at


def registration_body(redirect_uri: str, name: str, scope: str | None) -> dict[str, Any]:
    """An RFC 7591 registration request for this gateway as a confidential client."""
    host = urlsplit(redirect_uri).hostname or ""
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    body: dict[str, Any] = {
        "client_name": name, "redirect_uris": [redirect_uri],
        "grant_types": ["authorization_code", "refresh_token"], "response_types": ["code"],
        "token_endpoint_auth_method": "client_secret_basic",
        "application_type": "native" if loopback else "web"}
    if scope:
        body["scope"] = scope
    return body


def client_auth_method(registered: str | None, has_secret: bool,
                       supported: list[str] | None) -> str:
    """How the token endpoint is told who the client is: what registration said, else by what
    the server supports (``client_secret_basic`` when it lists nothing)."""
    if registered in ("client_secret_basic", "client_secret_post", "none"):
        return registered if has_secret or registered == "none" else "none"
    if not has_secret:
        return "none"
    offered = supported or ["client_secret_basic"]
    for method in ("client_secret_basic", "client_secret_post", "none"):
        if method in offered:
            return method
    return "client_secret_basic"


@dataclass(frozen=True, slots=True)
class TokenAnswer:
    access_token: str
    lifetime: float | None  # seconds; None: no expires_in
    refresh_token: str | None
    scope: str | None


def token_answer(status: int, doc: Any, where: str, max_token: int = 8192,
                 max_lifetime: float = 365 * 86400.0) -> TokenAnswer:
    """A token endpoint's answer.

    Raises:
        FlowError: an error answer (with its ``error`` code: ``invalid_grant`` means the grant
            is no longer good) or an unusable one.
    """
    if not isinstance(doc, dict):
        doc = {}
    if status != 200:
        code = str(doc.get("error", ""))[:64]
        text = str(doc.get("error_description", ""))[:200]
        said = "".join(c for c in f"{code}: {text}" if " " <= c <= "~").strip(": ")
        raise FlowError(f"{where} refused the token request (HTTP {status}"
                        f"{': ' + said if said else ''})")
    token = doc.get("access_token")
    if not isinstance(token, str) or not token or len(token) > max_token \
            or not all(" " <= c <= "~" for c in token):
        raise FlowError(f"{where} answered without a usable access_token")
    if str(doc.get("token_type", "")).lower() != "bearer":
        raise FlowError(f"{where} answered a token_type other than Bearer")
    lifetime = doc.get("expires_in")
    if lifetime is not None and (isinstance(lifetime, bool)
                                 or not isinstance(lifetime, int | float)
                                 or not 0 < lifetime < math.inf):
        raise FlowError(f"{where} answered an expires_in that is not a positive number")
    refresh = doc.get("refresh_token")
    if refresh is not None and (not isinstance(refresh, str) or not refresh
                                or len(refresh) > max_token):
        raise FlowError(f"{where} answered an unusable refresh_token")
    scope = doc.get("scope")
    return TokenAnswer(token, None if lifetime is None else float(min(lifetime, max_lifetime)),
                       refresh, scope if isinstance(scope, str) else None)
