"""What an HTTP client is told about authentication (pure): the ``WWW-Authenticate`` challenge
of a 401 or a 403 ``insufficient_scope`` (RFC 6750 §3), and the Protected Resource Metadata
document (RFC 9728) it points to.

The resource is this gateway's ``/mcp`` as clients name it: ``[auth.oauth] audience`` when
OAuth is configured (the RFC 8707 resource its tokens are issued for), else
``listen.public_url``, else ``<scheme>://<Host of the request>/mcp`` (the Host was checked
against the allow-list before).  Its metadata lives at the RFC 9728 §3.1 well-known URL: the
path ``/.well-known/oauth-protected-resource`` inserted between the resource's authority and
its path; the gateway serves it there and at the bare well-known path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from gateway.config import AuthSection

WELL_KNOWN = "/.well-known/oauth-protected-resource"
#: The paths the metadata is served at on the client listener.
METADATA_PATHS = (WELL_KNOWN, WELL_KNOWN + "/mcp")


def resource(auth: AuthSection, public_url: str | None, scheme: str, host: str | None) -> str:
    """This gateway's resource URI (see the module docstring)."""
    if auth.oauth is not None:
        return auth.oauth.audience
    if public_url:
        return public_url
    return f"{scheme}://{host or 'localhost'}/mcp"


def metadata_url(resource_uri: str) -> str:
    """Where the metadata of ``resource_uri`` is (RFC 9728 §3.1)."""
    parts = urlsplit(resource_uri)
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{WELL_KNOWN}{path}"


def _quoted(value: str) -> str:
    """An auth-param value as a quoted-string (no quote, backslash or control in it)."""
    return '"' + "".join(c for c in value if c.isprintable() and c not in '"\\') + '"'


def www_authenticate(metadata: str, *, error: str | None = None, description: str | None = None,
                     scope: list[str] | None = None) -> str:
    """``Bearer resource_metadata="…"`` plus ``error``, ``error_description`` and ``scope``
    when given."""
    params = [f"resource_metadata={_quoted(metadata)}"]
    if error:
        params.append(f"error={_quoted(error)}")
    if description:
        params.append(f"error_description={_quoted(description)}")
    if scope:
        params.append(f"scope={_quoted(' '.join(scope))}")
    return "Bearer " + ", ".join(params)


def metadata_document(resource_uri: str, auth: AuthSection) -> dict[str, Any]:
    oauth = auth.oauth
    doc: dict[str, Any] = {
        "resource": resource_uri,
        "authorization_servers": [oauth.issuer] if oauth is not None else [],
        "bearer_methods_supported": ["header"],
    }
    if oauth is not None:
        doc["scopes_supported"] = list(oauth.scopes_supported)
    doc["resource_name"] = "mcp-gateway"
    return doc
