"""What an HTTP client is told about authentication (pure): the ``WWW-Authenticate`` challenge
of a 401 or a 403 ``insufficient_scope`` (RFC 6750 §3), and the Protected Resource Metadata
document (RFC 9728) it points to.

The metadata exists only when ``[auth.oauth]`` names an authorization server, where an
OAuth-capable client goes for a token.  With bearer tokens only, the challenge is
``Bearer realm="<gateway.name>"`` and the metadata paths answer 404, so a client reports a
missing token instead of trying to register with the gateway.  The resource is
``[auth.oauth] audience`` (RFC 8707); its metadata is served at the RFC 9728 §3.1 well-known URL
and at the bare well-known path, on the HTTP listener only (:func:`metadata_location`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from gateway.config import AuthSection, OAuthSection

WELL_KNOWN = "/.well-known/oauth-protected-resource"
#: The paths the metadata is served at on the client listener.
METADATA_PATHS = (WELL_KNOWN, WELL_KNOWN + "/mcp")


def metadata_location(auth: AuthSection, public_url: str | None, scheme: str,
                      http_host: str | None) -> str | None:
    """Where a challenge points (``resource_metadata``): None without an authorization server
    (no metadata is served).  The well-known URL of the audience when it is an http(s) URL,
    else of ``public_url``, else of the HTTP listener as ``http_host`` names it (None: no HTTP
    listener, nowhere to point)."""
    if auth.oauth is None:
        return None
    for uri in (auth.oauth.audience, public_url):
        if uri and urlsplit(uri).scheme in ("http", "https"):
            return metadata_url(uri)
    return None if http_host is None else metadata_url(f"{scheme}://{http_host}/mcp")


def metadata_url(resource_uri: str) -> str:
    """Where the metadata of ``resource_uri`` is (RFC 9728 §3.1)."""
    parts = urlsplit(resource_uri)
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{WELL_KNOWN}{path}"


def _quoted(value: str) -> str:
    """An auth-param value as a quoted-string (no quote, backslash or control in it)."""
    return '"' + "".join(c for c in value if c.isprintable() and c not in '"\\') + '"'


def www_authenticate(metadata: str | None, *, realm: str = "", error: str | None = None,
                     description: str | None = None, scope: list[str] | None = None) -> str:
    """``Bearer resource_metadata="…"`` (or ``realm="…"`` when there is no metadata to point
    at) plus ``error``, ``error_description`` and ``scope`` when given."""
    params = [f"resource_metadata={_quoted(metadata)}" if metadata else f"realm={_quoted(realm)}"]
    if error:
        params.append(f"error={_quoted(error)}")
    if description:
        params.append(f"error_description={_quoted(description)}")
    if scope:
        params.append(f"scope={_quoted(' '.join(scope))}")
    return "Bearer " + ", ".join(params)


def metadata_document(resource_uri: str, oauth: OAuthSection, name: str) -> dict[str, Any]:
    """The Protected Resource Metadata (served only with an authorization server)."""
    return {
        "resource": resource_uri,
        "authorization_servers": [oauth.issuer],
        "bearer_methods_supported": ["header"],
        "scopes_supported": list(oauth.scopes_supported),
        "resource_name": name,
    }
