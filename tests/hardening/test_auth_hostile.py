"""Hostile tests of authentication and authorization (issue 10): what an attacker, or a broken
issuer, sends to break the daemon or get around its checks."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import trio
from helpers import HTTP_HEADERS, HTTP_INIT, connect, fixture_backend, make_config, run_gateway

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore::ResourceWarning",
                                         "ignore::pytest.PytestUnraisableExceptionWarning")]

H, INIT = HTTP_HEADERS, HTTP_INIT


@contextmanager
def serving(body: bytes) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering every GET with ``body``; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_jwks_nested_too_deeply_does_not_end_the_daemon() -> None:
    """A JWKS document nested deeper than the JSON parser's recursion limit (well under the
    256 KiB bound) is a failed fetch like any other: the daemon starts and stays up, a JWT is
    answered 401, a bearer token still works."""
    nested = b'{"keys": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with serving(nested) as url:
        oauth = (f'[auth.oauth]\nissuer = "{url}/"\njwks_uri = "{url}/jwks.json"\n'
                 'audience = "https://gateway.test/mcp"\njwks_refresh_min_interval = 0.01\n')
        bearer = ('[[auth.bearer]]\nprincipal = "alice"\n'
                  'token_sha256 = '
                  '"2bd806c97f0e00af1a1fc3328fa763a9269723c8db8fac4f93af71db186d6e90"\n')  # "alice"
        cfg = make_config(fixture_backend(), extra=bearer + oauth)
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            # {"alg":"RS256","kid":"new"}
            jwt_like = "eyJhbGciOiJSUzI1NiIsImtpZCI6Im5ldyJ9.e30.c2ln"
            r = await c.post(gw.http_url, headers=dict(H, authorization=f"Bearer {jwt_like}"),
                             json=INIT)
            assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
            r = await c.post(gw.http_url, headers=dict(H, authorization="Bearer alice"), json=INIT)
            assert r.status_code == 200, r.text


async def test_resource_read_rule_not_escaped_by_dot_segments() -> None:
    """A read rule ``fixture://static/*`` (then ``*`` denied) must not let a URI climb out of
    it with dot segments, plain or percent-encoded: those are refused -32005 before they reach
    the backend, on read, subscribe and completion alike."""
    rules = ('[[policy.rules]]\nkind = "resource"\nmatch = "fixture://static/*"\naction = "allow"\n'
             '[[policy.rules]]\nkind = "resource"\nmatch = "*"\naction = "deny"\n')
    cfg = make_config(fixture_backend(), extra=rules)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            r = await c.request("resources/read", {"uri": "fixture://static/a"})
            assert r["result"]["contents"][0]["uri"] == "fixture://static/a"
            for uri in ("fixture://static/../item/1", "fixture://static/%2E%2e/item/1",
                        "fixture://static/a/../../item/1", "fixture://static/./../item/1"):
                for method in ("resources/read", "resources/subscribe"):
                    r = await c.request(method, {"uri": uri})
                    assert r.get("error", {}).get("code") == -32005, (method, uri, r)
    # the same climb out of a backend's include filter: the resource is absent (-32002)
    cfg = make_config(fixture_backend(resources='{ include = ["fixture://static/*"] }'))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            assert "result" in await c.request("resources/read", {"uri": "fixture://static/a"})
            for uri in ("fixture://static/../item/1", "fixture://static/%2e%2E/item/1"):
                r = await c.request("resources/read", {"uri": uri})
                assert r.get("error", {}).get("code") == -32002, (uri, r)
