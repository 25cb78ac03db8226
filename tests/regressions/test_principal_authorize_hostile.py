"""Hostile tests of the gateway's authorize page for a per-principal remote (the confused
deputy of a proxy with one client id at the authorization server): a consent that did not come
from the page itself (a cross-site link straight to ``consent``, or the continue link of a page
another browser fetched) is refused, sends no browser to the authorization server and uses up
nothing; the consent of the page in the same browser still works (other cookies of the host
beside it); one browser authorizing two
backends at once completes both (a cookie per flow); a redirect back with a query too long
is refused whole (not cut, so nothing used up).  An authorization endpoint
that cannot be a ``Location`` header (CR LF, non-ASCII, a space) is refused in the metadata."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
import trio
from authserverutil import AuthServer, authorizing_remote
from helpers import connect, free_port, run_gateway, text_of
from integration import test_principal_authcode as pc

from gateway import config
from gateway.protocol import oauthflow

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

TOKENS = {"alice": "alice-secret-token-1", "mallory": "mallory-secret-token-2"}


def gateway_config(tmp_path: Path, srv: AuthServer, url: str,
                   backends: tuple[str, ...] = ("up",)) -> config.GatewayConfig:
    """Per-principal authorization code backends named ``backends``, all at ``url``."""
    return pc.gateway_config(tmp_path, free_port(), url, pc.code_oauth(tmp_path, srv),
                             tokens=TOKENS, backends=backends)


async def test_a_consent_not_given_on_the_page_in_that_browser_is_refused(
        tmp_path: Path) -> None:
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, _remote, url):
        cfg = gateway_config(tmp_path, srv, url)
        async with (run_gateway(cfg) as gw, httpx.AsyncClient() as http,
                    connect(gw.url, token=TOKENS["mallory"]) as m):
            with trio.fail_after(20):
                answer = await m.call("up__echo", {"who": "mallory"})
                page = str(answer["error"]["data"]["url"])
                # mallory's own link sent to alice's browser straight at the consent (a cross-site
                # link or image): no cookie of the page, so no trip to the authorization server
                for forged in (page + "&consent=yes", page + "&consent="):
                    csrf = await http.get(forged)
                    assert csrf.status_code == 403 and "location" not in csrf.headers, csrf.text
                    assert "set-cookie" not in csrf.headers
                # mallory fetches the page himself and gives alice its continue link: alice's
                # browser lacks that page's cookie (SameSite=Strict, set in mallory's browser)
                shown = await http.get(page)
                assert shown.status_code == 200
                assert "default-src 'none'" in shown.headers["content-security-policy"]
                href = re.search(r'href="([^"]+)"', shown.text)
                assert href is not None
                go = href.group(1).replace("&amp;", "&")
                stolen = await http.get(go)
                assert stolen.status_code == 403 and "location" not in stolen.headers
                # in mallory's own browser (the page's cookie, beside cookies of other sites of
                # the host that a strict parser chokes on), the same link works, once
                jar = 'prefs={"theme": "dark"}; seen; ' + \
                    shown.headers["set-cookie"].split(";", 1)[0]
                assert "SameSite=Strict" in shown.headers["set-cookie"]
                ok = await http.get(go, headers={"cookie": jar})
                assert ok.status_code == 303 and ok.headers["location"].startswith(srv.issuer)
                again = await http.get(go, headers={"cookie": jar})
                assert again.status_code == 400
            assert [r for r in await srv.issued() if r["grant_type"] == "authorization_code"] == []


@pytest.mark.parametrize("endpoint", ["https://as.example/authorize\r\nset-cookie: x=1",
                                      "https://as.example/authorize?\u00e9",
                                      "https://as.example/a b"])
def test_an_authorization_endpoint_that_cannot_be_a_location_header_is_refused(
        endpoint: str) -> None:
    # the browser is sent there by a Location header: a CR LF, a non-ASCII character or a space
    # would drop the connection after the link was used up (or split the header)
    meta = {"issuer": "https://as.example", "authorization_endpoint": endpoint,
            "token_endpoint": "https://as.example/token"}
    with pytest.raises(oauthflow.FlowError, match="no usable authorization_endpoint"):
        oauthflow.check_metadata(meta, "https://as.example")
    oauthflow.check_metadata({**meta, "authorization_endpoint": "https://as.example/authorize"},
                             "https://as.example")


async def test_one_browser_authorizing_two_backends_at_once_completes_both(
        tmp_path: Path) -> None:
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, _remote, url):
        cfg = gateway_config(tmp_path, srv, url, ("up", "two"))
        jar: dict[str, str] = {}  # alice's browser

        async def get(target: str) -> httpx.Response:
            cookie = "; ".join(f"{k}={v}" for k, v in jar.items())
            answer = await http.get(target, headers={"cookie": cookie} if cookie else {})
            for line in answer.headers.get_list("set-cookie"):
                name, _, rest = line.partition("=")
                value = rest.split(";", 1)[0]
                if "Max-Age=0" in line:
                    jar.pop(name, None)
                else:
                    jar[name] = value
            return answer

        async with (run_gateway(cfg) as gw, httpx.AsyncClient() as http,
                    connect(gw.url, token=TOKENS["alice"]) as a):
            with trio.fail_after(20):
                backs = []
                for tool in ("up__echo", "two__echo"):
                    page = str((await a.call(tool, {"who": "alice"}))["error"]["data"]["url"])
                    shown = await get(page)
                    href = re.search(r'href="([^"]+)"', shown.text)
                    assert href is not None
                    go = await get(href.group(1).replace("&amp;", "&"))
                    assert go.status_code == 303, go.text
                    at = await http.get(go.headers["location"] + "&"
                                        + urlencode({"login_hint": "alice"}))
                    backs.append(at.headers["location"])
                for back in backs:  # the first flow's redirect comes back after the second began
                    done = await get(back)
                    assert done.status_code == 200, done.text
                for tool in ("up__echo", "two__echo"):
                    assert text_of(await a.call(tool, {"who": "alice"})) == '{"who": "alice"}'
            assert len([r for r in await srv.issued()
                        if r["grant_type"] == "authorization_code"]) == 2


async def test_a_redirect_back_too_long_is_refused_whole_and_uses_nothing_up(
        tmp_path: Path) -> None:
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, _remote, url):
        cfg = gateway_config(tmp_path, srv, url)
        async with (run_gateway(cfg) as gw, httpx.AsyncClient() as http,
                    connect(gw.url, token=TOKENS["alice"]) as a):
            with trio.fail_after(20):
                page = str((await a.call("up__echo", {"who": "alice"}))["error"]["data"]["url"])
                shown = await http.get(page)
                href = re.search(r'href="([^"]+)"', shown.text)
                assert href is not None
                jar = shown.headers["set-cookie"].split(";", 1)[0]
                go = await http.get(href.group(1).replace("&amp;", "&"),
                                    headers={"cookie": jar})
                jar = go.headers["set-cookie"].split(";", 1)[0]
                at = await http.get(go.headers["location"] + "&"
                                    + urlencode({"login_hint": "alice"}))
                back = at.headers["location"]
                # a query past the limit was read cut at it: what followed, silently dropped
                long = await http.get(back + "&error_description=" + "x" * 9000,
                                      headers={"cookie": jar})
                assert long.status_code == 414 and "8192" in long.text, long.text
                done = await http.get(back, headers={"cookie": jar})
                assert done.status_code == 200, done.text
                assert text_of(await a.call("up__echo", {"who": "alice"})) == '{"who": "alice"}'
