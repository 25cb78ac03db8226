"""Where a 401 sends a client: with an authorization server ([auth.oauth]) to the Protected
Resource Metadata on the HTTP listener (never the WebSocket port), naming that server; with
bearer tokens only to nothing (``realm``, no metadata): an OAuth-capable client must not be sent
to register with a gateway that is no authorization server."""

from __future__ import annotations

from gateway.auth.authenticator import Authenticator, Unauthorized
from gateway.config import load

BEARER = ('[gateway]\nname = "team-gw"\n[listen]\nhttp = "127.0.0.1:8766"\n'
          '[[auth.bearer]]\nprincipal = "a"\ntoken_sha256 = "' + "0" * 64 + '"\n')
OAUTH = ('[gateway]\nname = "team-gw"\n[listen]\nhttp = "127.0.0.1:8766"\n'
         '[auth.oauth]\nissuer = "https://id.example/"\njwks_uri = "https://id.example/jwks"\n'
         'audience = "{audience}"\nscopes_supported = ["tools:read"]\n')


def test_bearer_only_has_a_realm_and_no_metadata() -> None:
    authn = Authenticator(load(BEARER))
    authn.http_port = 8766
    assert authn.challenge("127.0.0.1:8766") == 'Bearer realm="team-gw"'
    assert authn.challenge("127.0.0.1:8765", websocket=True) == 'Bearer realm="team-gw"'
    bad = Unauthorized("the token is not valid here")
    assert authn.challenge("h", bad) == \
        ('Bearer realm="team-gw", error="invalid_token", error_description="the token is not valid '
         'here"')
    assert authn.metadata() is None


def test_with_an_authorization_server_the_metadata_names_it_and_follows_gateway_name() -> None:
    authn = Authenticator(load(OAUTH.format(audience="https://gw.example/mcp")))
    meta = 'Bearer resource_metadata="https://gw.example/.well-known/oauth-protected-resource/mcp"'
    assert authn.challenge("127.0.0.1:8766") == meta
    assert authn.challenge("127.0.0.1:8765", websocket=True) == meta
    assert authn.metadata() == {"resource": "https://gw.example/mcp", "authorization_servers": ["https://id.example/"],
                                "bearer_methods_supported": ["header"],
                                "scopes_supported": ["tools:read"], "resource_name": "team-gw"}


def test_a_websocket_401_points_at_the_http_listener() -> None:
    # an audience that is not a URL: the metadata is located on the HTTP listener, by the Host
    # the client used with the HTTP listener's port (the WebSocket port answers no metadata)
    authn = Authenticator(load(OAUTH.format(audience="api://mcp-gateway")))
    authn.http_port = 8766
    well_known = "/.well-known/oauth-protected-resource/mcp"
    assert authn.challenge("gw.local:8766") == f'Bearer resource_metadata="http://gw.local:8766{well_known}"'
    assert authn.challenge("gw.local:8765", websocket=True) == \
        f'Bearer resource_metadata="http://gw.local:8766{well_known}"'
    assert authn.challenge("[::1]:8765", websocket=True) == f'Bearer resource_metadata="http://[::1]:8766{well_known}"'
    authn.http_port = None  # no HTTP listener: nowhere to point
    assert authn.challenge("gw.local:8765", websocket=True) == 'Bearer realm="team-gw"'
