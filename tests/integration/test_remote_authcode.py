"""A remote backend with ``oauth.grant = "authorization_code"`` (one shared identity), the whole
daemon in-process on virtual time: it waits in AUTHORIZING until the operator's redirect comes
back with the right ``state`` (a wrong or reused one refused, nothing stored), keeps the refresh
token in the state directory (0600), fails calls -32001 retryable while the authorization
server is down at refresh (and at a restart: retried, never FATAL), goes back to AUTHORIZING
when the refresh token is revoked, and starts from the stored refresh token after a restart.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
import trio
from fixtures.token_server import CodeAuthServer, Net, ProtectedRemote
from memharness import elapse, memory_config, running

from gateway.backend import http
from gateway.hub import MAX_REDIRECT_QUERY
from gateway.limits import LOG_BURST

AS = "http://127.0.0.1:9000"
URL = "http://localhost:8080/mcp"


def code_config(tmp_path: Any) -> Any:
    return memory_config(f"""
[backends.r]
url = "{URL}"
prefix = ""
[backends.r.oauth]
grant = "authorization_code"
""", gateway=f'state_dir = "{tmp_path}"')


@asynccontextmanager
async def network(auth: CodeAuthServer, accepts: Callable[[str], bool]) -> AsyncIterator[Net]:
    """The authorization server and a remote taking the tokens ``accepts`` takes, in memory."""
    async with trio.open_nursery() as nursery:
        yield Net(nursery, {"127.0.0.1:9000": auth,
                            "localhost:8080": ProtectedRemote(URL, AS, accepts)})
        nursery.cancel_scope.cancel()


def daemon(cfg: Any, net: Net) -> AbstractAsyncContextManager[Any]:
    """The daemon on ``cfg``, its backend ``r`` a real HTTP connector over ``net``."""
    connector = http.HttpConnector(cfg.backends["r"], opener=net.open, name="r")
    return running(cfg, connectors={"r": connector})


def state_of(h: Any) -> str:
    state: str = h.instance("r")["state"]
    return state


async def authorize(h: Any, auth: CodeAuthServer) -> str:
    """The operator: the URL from the gateway, the user's consent, the redirect's query."""
    status, url = h.hub.begin_authorization("r")
    assert status == 200, url
    return auth.authorize(url)


@pytest.mark.trio
async def test_authorizing_until_the_redirect_with_its_state_wrong_and_reused_refused(
        autojump_clock: object, tmp_path: Any) -> None:
    auth = CodeAuthServer(AS)
    async with network(auth, lambda tok: tok in auth.issued) as net:
        cfg = code_config(tmp_path)
        async with daemon(cfg, net) as h:
            await h.until(lambda: state_of(h) == "AUTHORIZING")
            # not required: it does not hold /readyz back while it waits
            assert not [p for p in h.hub.status().not_ready_because() if "backend" in p]
            assert h.metric("mcp_gateway_backend_state", backend="r", state="AUTHORIZING") == 1.0
            oauth = h.status()["backends"][0]["oauth"]
            assert oauth["authorizing"] and oauth["grant"] == "authorization_code"
            async with h.connect() as c:
                query = await authorize(h, auth)
                wrong = query.replace("state=", "state=x")
                assert (await h.hub.complete_authorization(wrong))[0] == 400
                long = query + "&pad=" + "x" * MAX_REDIRECT_QUERY  # refused whole, not cut
                assert await h.hub.complete_authorization(long) == (
                    400, f"refused: a query longer than {MAX_REDIRECT_QUERY} characters")
                path = tmp_path / "oauth" / "r.json"  # the registration only: no token
                assert auth.grants == [] and json.loads(path.read_text())["refresh_token"] is None
                assert state_of(h) == "AUTHORIZING"
                assert (await h.hub.complete_authorization(query))[0] == 200
                await h.until(lambda: state_of(h) == "RUNNING")
                assert (await h.hub.complete_authorization(query))[0] == 400  # single use
                assert auth.grants == ["authorization_code"]
                assert h.instance("r")["restarts"] == 0
                answer = await c.call("echo", timeout=5)
                assert answer["result"]["content"][0]["text"] == "ok"
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
                assert json.loads(path.read_text())["refresh_token"].startswith("ref-")


@pytest.mark.trio
async def test_server_down_at_refresh_fails_calls_retryable_and_a_revoked_grant_authorizes_again(
        autojump_clock: object, tmp_path: Any) -> None:
    auth = CodeAuthServer(AS, lifetime=100)
    async with network(auth, lambda tok: tok == auth.issued[-1]) as net:
        cfg = code_config(tmp_path)
        async with daemon(cfg, net) as h:
            await h.until(lambda: state_of(h) == "AUTHORIZING")
            assert (await h.hub.complete_authorization(await authorize(h, auth)))[0] == 200
            await h.until(lambda: state_of(h) == "RUNNING")
            async with h.connect() as c:
                auth.down = True
                await elapse(120)  # the token has expired; its refresh cannot be had
                failed = await c.call("echo", timeout=5)
                assert failed["error"]["code"] == -32001, failed
                assert failed["error"]["data"]["retryable"] is True
                assert state_of(h) == "RUNNING"  # nothing else affected
                auth.down = False
                answer = await c.call("echo", timeout=5)  # refreshed now
                assert "result" in answer, answer
                assert auth.grants[0] == "authorization_code"
                assert auth.grants[-1] == "refresh_token"
                auth.revoked |= auth._refresh
                await elapse(120)
                await c.call("echo", timeout=5)
                await h.until(lambda: state_of(h) == "AUTHORIZING")
                assert h.instance("r")["restarts"] == 0
                assert h.status()["backends"][0]["oauth"]["has_refresh_token"] is False
                assert (await h.hub.complete_authorization(await authorize(h, auth)))[0] == 200
                await h.until(lambda: state_of(h) == "RUNNING")
        # a restart reads the refresh token again; the authorization server down meanwhile
        # holds the backend back (retried, never FATAL), and no operator is needed after
        auth.down = True
        authorized = auth.grants.count("authorization_code")
        async with daemon(cfg, net) as h:
            await elapse(60)
            assert state_of(h) in ("BACKOFF", "STARTING")
            auth.down = False
            await h.until(lambda: state_of(h) == "RUNNING")
            assert auth.grants.count("authorization_code") == authorized
            assert auth.grants[-1] == "refresh_token"


@pytest.mark.trio
async def test_a_registered_client_whose_secret_expired_registers_anew_and_authorizes_again(
        autojump_clock: object, tmp_path: Any) -> None:
    auth = CodeAuthServer(AS, secret_lifetime=3600)
    async with network(auth, lambda tok: tok in auth.issued) as net:
        cfg = code_config(tmp_path)
        async with daemon(cfg, net) as h:
            await h.until(lambda: state_of(h) == "AUTHORIZING")
            assert (await h.hub.complete_authorization(await authorize(h, auth)))[0] == 200
            await h.until(lambda: state_of(h) == "RUNNING")
        path = tmp_path / "oauth" / "r.json"
        doc = json.loads(path.read_text())
        assert doc["client_id"] == auth.registered[0] and doc["refresh_token"]
        assert doc["client_secret_expires_at"] > time.time() + 3000
        doc["client_secret_expires_at"] = time.time() - 1  # an hour later, as the restart reads
        path.write_text(json.dumps(doc))
        async with daemon(cfg, net) as h:
            await h.until(lambda: state_of(h) == "AUTHORIZING")
            assert auth.grants.count("refresh_token") == 0  # the expired client asked nothing
            assert len(auth.registered) == 2
            doc = json.loads(path.read_text())
            assert doc["client_id"] == auth.registered[1] and doc["refresh_token"] is None
            status, url = h.hub.begin_authorization("r")
            assert status == 200 and f"client_id={auth.registered[1]}" in url
            assert (await h.hub.complete_authorization(auth.authorize(url)))[0] == 200
            await h.until(lambda: state_of(h) == "RUNNING")


@pytest.mark.trio
async def test_refused_redirects_are_logged_at_most_ten_a_minute(
        autojump_clock: object, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    auth = CodeAuthServer(AS)
    async with network(auth, lambda tok: True) as net, daemon(code_config(tmp_path), net) as h:
        await h.until(lambda: state_of(h) == "AUTHORIZING")
        caplog.clear()
        for n in range(50):  # anyone who reaches the listener can send these
            assert (await h.hub.complete_authorization(f"state=s{n}&code=c"))[0] == 400
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == LOG_BURST, refused
        await elapse(61)
        assert (await h.hub.complete_authorization("state=late&code=c"))[0] == 400
        lines = [r.getMessage() for r in caplog.records][-2:]
        assert lines[0] == (f"{50 - LOG_BURST} more refused authorization redirects in the last "
                            "60s not logged")
        assert lines[1].endswith("unknown or used state: refused")
