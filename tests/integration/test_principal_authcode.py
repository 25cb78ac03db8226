"""A per-principal remote whose callers each authorize (``[oauth]`` grant =
"authorization_code" beside ``credentials = "per-principal"``), against the real Authlib
authorization server (``fixtures/auth_server.py``, users picked by ``login_hint``) and the
recording remote: each bearer principal gets the URL of the gateway's authorize page (as the
caller's protocol can read it), follows it in "its browser" (the consent page, the cookie, the
authorization server, the redirect back), and from then on its calls carry its own token, never
the other's.  A state completed without the consenting browser's cookie, or twice, is refused
and stores nothing; a revoked refresh token gives that principal alone a new URL.  Also the
shared-identity authorization code flow and client credentials against the same server."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import trio
from authserverutil import AuthServer, authorizing_remote
from fixtures.remote_server import RemoteServer
from helpers import bearer_auth, connect, free_port, run_gateway, text_of

from gateway import config, events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

TOKENS = {"alice": "alice-secret-token-1", "bob": "bob-secret-token-2",
          "carol": "carol-secret-token-3"}
MODERN = "2026-07-28"


def gateway_config(tmp_path: Path, port: int, url: str, oauth: str,
                   credentials: str = 'credentials = "per-principal"\n',
                   tokens: dict[str, str] = TOKENS,
                   backends: tuple[str, ...] = ("up",)) -> config.GatewayConfig:
    """The gateway's config (remotes named ``backends``, all at ``url``), also written to
    ``tmp_path/gw.toml`` (for a reload)."""
    text = f"""
[gateway]
state_dir = "{tmp_path}"
[listen]
websocket = "127.0.0.1:0"
http = "127.0.0.1:{port}"
[admin]
listen = "127.0.0.1:0"
{bearer_auth(tokens)}
""" + "".join(f"""
[backends.{name}]
url = "{url}"
{credentials}
[backends.{name}.oauth]
{oauth}
""" for name in backends)
    (tmp_path / "gw.toml").write_text(text)
    return config.load(text)


def client_oauth(tmp_path: Path, srv: AuthServer) -> str:
    """The gateway's client at ``srv`` (its secret written to a file)."""
    (tmp_path / "gw.secret").write_text("gw-secret\n")
    return (f'client_id = "gw"\nclient_secret = {{ file = "{tmp_path}/gw.secret" }}\n'
            f'token_url = "{srv.token_url}"\n')


def code_oauth(tmp_path: Path, srv: AuthServer) -> str:
    return 'grant = "authorization_code"\n' + client_oauth(tmp_path, srv)


def authorize_url(answer: dict[str, Any]) -> str:
    error = answer["error"]
    assert error["code"] == -32005 and error["data"]["reason"] == "authorization_required", error
    assert "authoriz" in error["message"] and error["message"].endswith(error["data"]["url"])
    return str(error["data"]["url"])


async def follow(http: httpx.AsyncClient, page: str, user: str, *, cookie: bool = True,
                 replay: bool = False) -> httpx.Response:
    """The user's browser: the consent page, continue (the cookie set), the authorization
    server as ``user``, the redirect back to the gateway (with the cookie unless not)."""
    with trio.fail_after(20):
        consent = await http.get(page)
        assert consent.status_code == 200 and "Continue" in consent.text, consent.text
        assert consent.headers["x-frame-options"] == "DENY"
        assert consent.headers["set-cookie"].startswith("__Host-")
        href = re.search(r'href="([^"]+)"', consent.text)
        assert href is not None
        go = await http.get(href.group(1).replace("&amp;", "&"),
                            headers={"cookie": consent.headers["set-cookie"].split(";", 1)[0]})
        assert go.status_code == 303, go.text
        set_cookie = go.headers["set-cookie"]
        assert set_cookie.startswith("__Host-") and "Secure" in set_cookie
        assert "HttpOnly" in set_cookie and "Path=/;" in set_cookie
        jar = set_cookie.split(";", 1)[0]
        at_server = await http.get(go.headers["location"] + "&" + urlencode({"login_hint": user}))
        assert at_server.status_code == 302, at_server.text
        back = at_server.headers["location"]
        assert "state=" in back and "code=" in back
        headers = {"cookie": jar} if cookie else {}
        done = await http.get(back, headers=headers)
        if replay:
            again = await http.get(back, headers=headers)
            assert again.status_code == 400 and "refused" in again.text, again.text
        return done


def seen_tokens(remote: RemoteServer, who: str) -> set[str | None]:
    return {s.headers.get("authorization") for s in remote.seen
            if isinstance(s.body, dict) and s.body.get("method") == "tools/call"
            and s.body["params"].get("arguments", {}).get("who") == who}


async def test_each_principal_authorizes_and_calls_with_its_own_token(tmp_path: Path) -> None:
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, remote, url):
        port = free_port()
        cfg = gateway_config(tmp_path, port, url, code_oauth(tmp_path, srv))
        async with (run_gateway(cfg, str(tmp_path / "gw.toml")) as gw, httpx.AsyncClient() as http,
                    connect(gw.url, token=TOKENS["alice"]) as a,
                    connect(gw.url, token=TOKENS["bob"]) as b):
            pages = {"alice": authorize_url(await a.call("up__echo", {"who": "alice"})),
                     "bob": authorize_url(await b.call("up__echo", {"who": "bob"}))}
            assert pages["alice"] != pages["bob"]
            assert pages["alice"].startswith(f"http://127.0.0.1:{port}/oauth/callback?start=")
            for who in ("alice", "bob"):
                done = await follow(http, pages[who], who, replay=True)
                assert done.status_code == 200, done.text
            assert text_of(await a.call("up__echo", {"who": "alice"})) == '{"who": "alice"}'
            assert text_of(await b.call("up__echo", {"who": "bob"})) == '{"who": "bob"}'
            issued = {r["sub"]: r for r in await srv.issued()
                      if r["grant_type"] == "authorization_code"}
            assert sorted(issued) == ["alice", "bob"] and {r["aud"] for r in issued.values()} \
                == {url}
            for who, other in (("alice", "bob"), ("bob", "alice")):
                assert seen_tokens(remote, who) == {f"Bearer {issued[who]['access_token']}"}
                assert f"Bearer {issued[other]['access_token']}" not in seen_tokens(remote, who)
            for who in ("alice", "bob"):
                path = tmp_path / "oauth" / "up" / f"bearer-{who}.json"
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
                assert json.loads(path.read_text())["refresh_token"]
            assert not (tmp_path / "oauth" / "up" / "bearer-carol.json").exists()
            # alice's refresh token revoked: a new URL for alice alone
            refresh = json.loads((tmp_path / "oauth" / "up" / "bearer-alice.json").read_text())[
                "refresh_token"]
            await srv.revoke(refresh)
            remote.refuse["tools/call"] = [401]  # her access token refused: a refresh is tried
            again = await a.call("up__echo", {"who": "alice-2"})
            assert authorize_url(again).startswith(f"http://127.0.0.1:{port}/oauth/callback?")
            assert text_of(await b.call("up__echo", {"who": "bob"})) == '{"who": "bob"}'
            done = await follow(http, authorize_url(again), "alice")
            assert done.status_code == 200, done.text
            assert text_of(await a.call("up__echo", {"who": "alice-3"})) == '{"who": "alice-3"}'
            # a reload rotates bob's token: his connection ends, his grant stays (no new URL)
            rotated = {**TOKENS, "bob": "bob-rotated-token-9"}
            gateway_config(tmp_path, port, url, code_oauth(tmp_path, srv), tokens=rotated)
            mark = gw.events.count
            gw.control.reload()
            await gw.events.wait(events.ReloadFinished, success=True, since=mark)
            assert (tmp_path / "oauth" / "up" / "bearer-bob.json").exists()
            async with connect(gw.url, token=rotated["bob"]) as b2:
                assert text_of(await b2.call("up__echo", {"who": "bob-2"})) == '{"who": "bob-2"}'
                # the remote wants more scope of bob: he authorizes again, asking for it
                remote.refuse["tools/call"] = [403]
                remote.refusal_challenge = 'Bearer error="insufficient_scope", scope="files:write"'
                page = authorize_url(await b2.call("up__echo", {"who": "bob-3"}))
                assert text_of(await a.call("up__echo", {"who": "alice-4"})) \
                    == '{"who": "alice-4"}'  # alice unaffected
                assert authorize_url(await b2.call("up__echo", {"who": "bob-3"})) == page
                assert (await follow(http, page, "bob")).status_code == 200
                assert text_of(await b2.call("up__echo", {"who": "bob-4"})) == '{"who": "bob-4"}'
                stepped = [r for r in await srv.issued() if r["sub"] == "bob"][-1]
                assert "files:write" in stepped["scope"].split(), stepped


async def test_a_state_completed_in_another_browser_or_twice_is_refused(tmp_path: Path) -> None:
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, _remote, url):
        port = free_port()
        cfg = gateway_config(tmp_path, port, url, code_oauth(tmp_path, srv))
        async with (run_gateway(cfg) as gw, httpx.AsyncClient() as http,
                    connect(gw.url, token=TOKENS["alice"]) as a):
            page = authorize_url(await a.call("up__echo", {"who": "alice"}))
            # alice's state completed in bob's browser (no cookie of the consent): refused
            done = await follow(http, page, "bob", cookie=False)
            assert done.status_code == 400 and "another browser" in done.text, done.text
            assert not (tmp_path / "oauth" / "up" / "bearer-alice.json").exists() or not \
                json.loads((tmp_path / "oauth" / "up" / "bearer-alice.json").read_text())[
                    "refresh_token"]
            assert [r for r in await srv.issued() if r["grant_type"] ==
                    "authorization_code"] == []
            # a wrong state and a used start link: refused
            bad = await http.get(f"http://127.0.0.1:{port}/oauth/callback?state=nope&code=x")
            assert bad.status_code == 400
            used = await http.get(page + "&consent=yes")
            assert used.status_code == 400 and "refused" in used.text
            page = authorize_url(await a.call("up__echo", {"who": "alice"}))  # a new link
            done = await follow(http, page, "alice")
            assert done.status_code == 200, done.text
            assert text_of(await a.call("up__echo", {"who": "alice"})) == '{"who": "alice"}'


async def modern_call(http: httpx.AsyncClient, url: str, caps: dict[str, Any]) -> Any:
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": caps}
    headers = {"accept": "application/json, text/event-stream",
               "content-type": "application/json", "mcp-protocol-version": MODERN,
               "mcp-method": "tools/call", "mcp-name": "up__echo",
               "authorization": f"Bearer {TOKENS['carol']}"}
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "up__echo", "arguments": {"who": "carol"}, "_meta": meta}}
    with trio.fail_after(20):
        return (await http.post(url, headers=headers, json=body)).json()


async def test_each_caller_shape_gets_the_url_as_it_can_read_it(tmp_path: Path) -> None:
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, _remote, url):
        port = free_port()
        cfg = gateway_config(tmp_path, port, url, code_oauth(tmp_path, srv))
        url_caps = {"elicitation": {"url": {}}}
        async with run_gateway(cfg) as gw, httpx.AsyncClient() as http:
            # 2026-07-28 with URL elicitation: an InputRequiredResult
            got = await modern_call(http, gw.http_url, url_caps)
            result = got["result"]
            assert result["resultType"] == "input_required", got
            ask = result["inputRequests"]["authorize"]
            assert ask["method"] == "elicitation/create" and ask["params"]["mode"] == "url"
            page = ask["params"]["url"]
            assert page.startswith(f"http://127.0.0.1:{port}/oauth/callback?start=")
            # 2025-11-25 with URL elicitation: -32042, then the completion once she authorized
            async with connect(gw.url, token=TOKENS["carol"], capabilities=url_caps) as told, \
                    connect(gw.url, token=TOKENS["carol"], capabilities=url_caps) as other:
                error = (await told.call("up__echo", {"who": "carol"}))["error"]
                assert error["code"] == -32042, error
                [elicitation] = error["data"]["elicitations"]
                assert elicitation["mode"] == "url" and elicitation["url"] == page
                assert elicitation["elicitationId"] and elicitation["message"]
                # 2025-06-18, and 2025-11-25 without URL elicitation: -32005 with data.url
                for version, caps in (("2025-06-18", url_caps), ("2025-11-25", {})):
                    async with connect(gw.url, token=TOKENS["carol"], version=version,
                                       capabilities=caps) as c:
                        assert authorize_url(await c.call("up__echo", {"who": "carol"})) == page
                # a modern caller without URL elicitation: -32005 too
                got = await modern_call(http, gw.http_url, {})
                assert got["error"]["code"] == -32005 and got["error"]["data"]["url"] == page
                done = await follow(http, page, "carol")
                assert done.status_code == 200, done.text
                complete = {"method": "notifications/elicitation/complete",
                            "params": {"elicitationId": elicitation["elicitationId"]}}
                await told.wait_for(lambda: [n for n in told.notifications
                                             if n["method"] == complete["method"]])
                assert [{k: n[k] for k in ("method", "params")} for n in told.notifications
                        if n["method"].startswith("notifications/elicitation")] == [complete]
                await other.request("ping")  # (anything for it came before this answer)
                assert not [n for n in other.notifications if "elicitation" in n["method"]]
            # the retry of the round (a new call) works now
            got = await modern_call(http, gw.http_url, url_caps)
            assert got["result"]["content"][0]["text"] == '{"who": "carol"}', got


async def test_shared_authorization_code_and_client_credentials_with_the_real_server(
        tmp_path: Path) -> None:
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, remote, url):
        secret = client_oauth(tmp_path, srv)
        port = free_port()
        remote.require_bearer = True
        # one shared identity, authorized by an operator
        cfg = gateway_config(tmp_path, port, url, 'grant = "authorization_code"\n' + secret,
                             credentials="")
        async with run_gateway(cfg) as gw, httpx.AsyncClient() as http:
            await gw.status_until(lambda s: s["backends"][0]["instances"][0]["state"]
                                  == "AUTHORIZING", timeout=20)
            page = await http.post(f"http://127.0.0.1:{gw.bound.admin_port}/authorize/up",
                                   headers={"host": "localhost"})  # `mcp-gateway authorize`
            assert page.status_code == 200, page.text
            at_server = await http.get(page.text.strip() + "&login_hint=operator")
            assert at_server.status_code == 302
            back = await http.get(at_server.headers["location"])
            assert back.status_code == 200, back.text
            await gw.status_until(lambda s: s["backends"][0]["instances"][0]["state"]
                                  == "RUNNING", timeout=20)
            async with connect(gw.url, token=TOKENS["alice"]) as a:
                assert text_of(await a.call("up__echo", {"who": "op"})) == '{"who": "op"}'
        # client credentials
        cfg = gateway_config(tmp_path, port, url, secret, credentials="")
        async with run_gateway(cfg) as gw, connect(gw.url, token=TOKENS["bob"]) as b:
            assert text_of(await b.call("up__echo", {"who": "svc"})) == '{"who": "svc"}'
        grants = [(r["grant_type"], r["sub"], r["client_id"]) for r in await srv.issued()]
        assert ("authorization_code", "operator", "gw") in grants
        assert any(g == "client_credentials" and c == "gw" for g, _s, c in grants), grants
        assert {s.headers.get("authorization") for s in remote.seen
                if isinstance(s.body, dict) and s.body.get("method") == "tools/call"} == {
            f"Bearer {r['access_token']}" for r in await srv.issued()}
