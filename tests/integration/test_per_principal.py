"""Per-principal backends with real parts: bearer principals calling a stdio backend with
``sharing = "per-principal"`` (one child per principal, started with its ``env_files`` file,
its log lines to that principal alone, stopped when a reload removes the principal; a missing
or group-readable file refused -32005), and a remote with
``credentials = "per-principal"`` (each principal's ``token_files`` token on its own upstream
session, never another's; a changed file read again, a removed one refused, a 401 answered by
asking again)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from fixtures.remote_server import RemoteServer
from helpers import (
    backend_in,
    bearer_auth,
    connect,
    fixture_backend,
    make_config,
    private,
    run_gateway,
    text_of,
)

from gateway import config, events

pytestmark = pytest.mark.system

TOKENS = {"alice": "alice-inbound-1", "bob": "bob-inbound-2", "carol": "carol-inbound-3",
          "dave": "dave-inbound-4"}


async def test_each_principal_gets_its_own_child_and_environment(tmp_path: Path) -> None:
    private(tmp_path / "bearer-alice.env", "# alice's\nSECRET=alice-secret\nexport MODE='a'\n")
    private(tmp_path / "bearer-bob.env", "SECRET=bob-secret\n")
    private(tmp_path / "bearer-dave.env", "SECRET=dave-secret\n", 0o640)  # group-readable
    backend = fixture_backend("fx", sharing="per-principal", max_sessions=3,
                              env={"SECRET": "backend-default", "SHARED": "all"},
                              env_files=str(tmp_path / "{principal}.env"))
    head = '[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n[admin]\nlisten = "127.0.0.1:0"\n'
    path = tmp_path / "gw.toml"
    path.write_text(head + backend + bearer_auth(TOKENS))
    cfg = config.load(path.read_bytes(), base_dir=str(tmp_path))  # as a reload reads it
    with trio.fail_after(30):
        async with run_gateway(cfg, config_path=str(path)) as gw:
            async with (connect(gw.url, token=TOKENS["alice"]) as a1,
                        connect(gw.url, token=TOKENS["alice"]) as a2,
                        connect(gw.url, token=TOKENS["bob"]) as b):
                secret = {"name": "SECRET"}
                assert text_of(await a1.call("fx__getenv", secret)) == "alice-secret"
                assert text_of(await a1.call("fx__getenv", {"name": "MODE"})) == "a"
                assert text_of(await a1.call("fx__getenv", {"name": "SHARED"})) == "all"
                assert text_of(await b.call("fx__getenv", secret)) == "bob-secret"
                assert text_of(await b.call("fx__getenv", {"name": "MODE"})) == ""
                assert text_of(await a2.call("fx__getenv", secret)) == "alice-secret"
                pids = {name: json.loads(text_of(await c.call("fx__client_info")))["pid"]
                        for name, c in (("a1", a1), ("a2", a2), ("b", b))}
                assert pids["a1"] == pids["a2"] != pids["b"]  # one child per principal
                # a child's log line, sent with no call in flight, reaches its principal alone
                for c in (a1, b):
                    assert (await c.request("logging/setLevel", {"level": "debug"}))["result"] == {}
                assert text_of(await b.call("fx__log", {"level": "info", "data": "bob's",
                                                        "after": 0.05})) == "ok"

                def logged(c: Any) -> list[Any]:
                    return [n for n in c.notifications if n["method"] == "notifications/message"]

                await b.wait_for(lambda: logged(b))
                await a1.request("ping")  # (after anything queued for it before)
                assert logged(b)[0]["params"]["data"] == "bob's" and not logged(a1)
                st = await gw.status_until(lambda s: len(backend_in(s, "fx")["instances"]) == 3)
                names = sorted(i["name"] for i in backend_in(st, "fx")["instances"])
                assert names == ["fx/0", "fx/p1", "fx/p2"]
            async with connect(gw.url, token=TOKENS["carol"]) as c:
                r = await c.call("fx__getenv", secret)
                assert r["error"]["code"] == -32005, r
                assert "bearer-carol.env does not exist" in r["error"]["message"]
            async with connect(gw.url, token=TOKENS["dave"]) as d:
                r = await d.call("fx__getenv", secret)
                assert r["error"]["code"] == -32005, r
                assert "mode 0640" in r["error"]["message"]
            st = await gw.status_until(lambda s: len(backend_in(s, "fx")["instances"]) == 3)
            assert backend_in(st, "fx")["sharing"] == "per-principal"
            # a reload that removes bob stops his child; alice's goes on
            path.write_text(head + backend + bearer_auth({"alice": TOKENS["alice"]}))
            mark = gw.events.count
            gw.control.reload()
            await gw.events.wait(events.ReloadFinished, success=True, since=mark)
            st = await gw.status_until(lambda s: len(backend_in(s, "fx")["instances"]) == 2)
            assert sorted(i["name"] for i in backend_in(st, "fx")["instances"]) == ["fx/0", "fx/p1"]
            async with connect(gw.url, token=TOKENS["alice"]) as a:
                assert text_of(await a.call("fx__getenv", secret)) == "alice-secret"


def _sessions(server: RemoteServer) -> dict[str, set[str]]:
    """The Authorization values the remote got, by upstream session id."""
    out: dict[str, set[str]] = {}
    for seen in server.seen:
        sid = seen.headers.get("mcp-session-id")
        if sid is not None:
            out.setdefault(sid, set()).add(seen.headers.get("authorization", "-"))
    return out


def _session_of(server: RemoteServer, who: str) -> str:
    for seen in server.seen:
        body: Any = seen.body
        if (isinstance(body, dict) and body.get("method") == "tools/call"
                and body["params"]["arguments"].get("who") == who):
            return seen.headers["mcp-session-id"]
    raise AssertionError(f"no call of {who}")


async def test_a_per_principal_remote_gets_each_principals_token_and_never_anothers(
        tmp_path: Path) -> None:
    private(tmp_path / "bearer-alice.token", "tok-alice-1\n")
    private(tmp_path / "bearer-bob.token", "tok-bob-1\n")
    server = RemoteServer()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        backend = (f'[backends.ev]\nurl = "http://127.0.0.1:{server.port}/mcp"\n'
                   'credentials = "per-principal"\n'
                   f'token_files = "{tmp_path}/{{principal}}.token"\n'
                   'headers = { Authorization = "Bearer the-probe", X-Plain = "plain" }\n')
        cfg = make_config(backend, extra=bearer_auth(TOKENS))
        with trio.fail_after(30):
            async with (run_gateway(cfg) as gw,
                        connect(gw.url, token=TOKENS["alice"]) as a,
                        connect(gw.url, token=TOKENS["bob"]) as b):
                assert text_of(await a.call("ev__echo", {"who": "alice"})) == '{"who": "alice"}'
                assert text_of(await b.call("ev__echo", {"who": "bob"})) == '{"who": "bob"}'
                alice, bob = _session_of(server, "alice"), _session_of(server, "bob")
                assert alice != bob
                sessions = _sessions(server)
                assert sessions[alice] == {"Bearer tok-alice-1"}
                assert sessions[bob] == {"Bearer tok-bob-1"}
                # the probe (the catalog) used the backend's own headers, no principal's token
                probe = {sid for sid in sessions if sid not in (alice, bob)}
                assert probe and all(sessions[sid] == {"Bearer the-probe"} for sid in probe)
                # the caller's own inbound token never goes upstream
                assert not any(TOKENS[n] in v for s in sessions.values() for v in s
                               for n in TOKENS)
                assert all(seen.headers.get("x-plain") == "plain" for seen in server.seen)

                # a changed file is read again; a removed one refuses that principal only
                private(tmp_path / "bearer-alice.token", "tok-alice-2\n")
                os.utime(tmp_path / "bearer-alice.token", ns=(0, 10**18))
                assert "error" not in await a.call("ev__echo", {"who": "alice-2"})
                assert _session_of(server, "alice-2") == alice
                assert _sessions(server)[alice] == {"Bearer tok-alice-1", "Bearer tok-alice-2"}
                (tmp_path / "bearer-bob.token").unlink()
                r = await b.call("ev__echo", {"who": "bob-2"})
                assert r["error"]["code"] == -32005, r
                assert "bearer-bob.token does not exist" in r["error"]["message"]
                assert not r["error"]["data"].get("retryable")
                # a 401: the source is asked again and the POST sent once more (it did not run)
                server.refuse["tools/call"] = [401]
                assert text_of(await a.call("ev__echo", {"who": "alice-3"})) == '{"who": "alice-3"}'
                assert [seen.headers["authorization"] for seen in server.seen
                        if isinstance(seen.body, dict) and seen.body.get("params", {}).get(
                            "arguments", {}).get("who") == "alice-3"] == ["Bearer tok-alice-2"] * 2
        nursery.cancel_scope.cancel()
