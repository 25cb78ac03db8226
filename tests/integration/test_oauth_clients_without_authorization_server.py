"""Bearer tokens only (no ``[auth.oauth]``): OAuth-capable clients are not sent into a dead end.

The 401 carries ``Bearer realm="<gateway.name>"`` and no ``resource_metadata``; the Protected
Resource Metadata answers 404 (it would have to name an authorization server).  An OAuth client
that then takes the gateway's origin for its authorization server (the 2025-03-26 fallback:
``/.well-known/oauth-authorization-server``, ``/register``) gets 401 there too, with an OAuth
error body saying a bearer token is wanted.  Three real clients, each in its own process (pinned
by ``scripts/setup --test``), report a missing token, not "404 … the MCP endpoint is /mcp":
the MCP Inspector CLI (interactive OAuth allowed), the TypeScript SDK with an ``authProvider``,
and FastMCP with ``auth="oauth"``.  No browser is ever opened: ``BROWSER`` and ``xdg-open`` are a
stub that records, and none of the clients gets as far as calling it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import trio
from helpers import (
    DEPS,
    HTTP_HEADERS,
    HTTP_INIT,
    INSPECTOR,
    INTEROP,
    NODE22,
    ROOT,
    bearer_auth,
    fixture_backend,
    make_config,
    need_deps,
    run_gateway,
)

pytestmark = pytest.mark.system

TS_CLIENT = os.path.join(ROOT, "tests", "interop", "ts_oauth_client.mjs")
FASTMCP = os.path.join(DEPS, "venv-fastmcp", "bin", "python")
FASTMCP_CLIENT = os.path.join(ROOT, "tests", "interop", "fastmcp_oauth_client.py")
TOKEN = "team-token-0123456789"
AUTH = bearer_auth({"alice": TOKEN})
MISSING = "authentication required: send Authorization: Bearer <token>"
DEAD_END = "the MCP endpoint is /mcp"


@pytest.fixture
def quiet_env(tmp_path: Path) -> dict[str, str]:
    """A scratch HOME (no stored credentials), and a browser opener that only records."""
    stub = tmp_path / "bin"
    stub.mkdir()
    opener = stub / "xdg-open"
    opener.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "opened"}\n')
    opener.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    return dict(os.environ, HOME=str(home), BROWSER=str(opener),
                PATH=f"{stub}:{os.environ['PATH']}",
                NO_COLOR="1", MCP_AUTO_OPEN_ENABLED="true", MCP_INSPECTOR_SECRET_STORE="memory")


async def _run(argv: list[str], env: dict[str, str]) -> tuple[int, dict[str, object]]:
    """Run a client (60 s at most): its exit status and the JSON line it printed last (the
    Inspector prints its error on stderr)."""
    with trio.fail_after(60):
        proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False,
                                      env=env)
    lines = [line for line in (proc.stdout + proc.stderr).decode().splitlines()
             if line.startswith("{")]
    assert lines, (argv, proc.returncode, proc.stderr.decode()[-4000:])
    return proc.returncode, json.loads(lines[-1])


async def test_the_401_names_a_realm_and_no_metadata_and_other_paths_want_the_token() -> None:
    cfg = make_config(fixture_backend(), gateway='name = "team-gw"', extra=AUTH)
    async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
        base = gw.http_url.removesuffix("/mcp")
        r = await c.post(gw.http_url, headers=HTTP_HEADERS, json=HTTP_INIT)
        assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="team-gw"'
        for path in ("/.well-known/oauth-protected-resource",
                     "/.well-known/oauth-protected-resource/mcp"):
            assert (await c.get(base + path)).status_code == 404
        for path in ("/.well-known/oauth-authorization-server", "/register", "/token"):
            r = await c.post(base + path,
                             json={}) if path != "/.well-known/oauth-authorization-server" \
                else await c.get(base + path)
            assert (r.status_code == 401
                    and r.headers["www-authenticate"] == 'Bearer realm="team-gw"'), path
            assert r.json() == {"error": "invalid_request", "error_description": MISSING}
        r = await c.get(base + "/register", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"] == "invalid_token"
        r = await c.get(base + "/register", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 404 and DEAD_END in r.text  # a caller with a token: not found
        for probe in ("/healthz", "/readyz"):  # a load balancer's checks need no token
            assert (await c.get(base + probe)).status_code == 200


async def test_real_oauth_clients_report_a_missing_token(quiet_env: dict[str, str],
                                                         tmp_path: Path) -> None:
    need_deps(NODE22, INSPECTOR, TS_CLIENT, FASTMCP, FASTMCP_CLIENT)
    cfg = make_config(fixture_backend(), gateway='name = "team-gw"', extra=AUTH)
    reports: dict[str, str] = {}
    async with run_gateway(cfg) as gw:
        url = gw.http_url
        rc, got = await _run([NODE22, INSPECTOR, "--cli", url, "--transport", "http",
                              "--method", "tools/list"], quiet_env)
        assert rc != 0 and isinstance(got["error"], dict), got
        reports["inspector"] = str(got["error"]["message"])
        for token in (None, "wrong"):
            rc, got = await _run(["node", TS_CLIENT, INTEROP, url, *([token] if token else [])],
                                 quiet_env)
            assert not got["connected"] and not got["registered"] and got["redirect"] is None, got
            reports[f"typescript token={token}"] = str(got["error"])
        rc, got = await _run([FASTMCP, FASTMCP_CLIENT, url], quiet_env)
        assert not got["connected"], got
        reports["fastmcp"] = str(got["error"])
    for client, error in reports.items():
        assert MISSING in error and DEAD_END not in error, (client, error)
    assert not (tmp_path / "opened").exists()  # no client got as far as a browser
