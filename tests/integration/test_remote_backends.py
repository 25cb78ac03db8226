"""Remote backends (``url``) over Streamable HTTP with real parts: server-everything in its
Streamable HTTP mode behind the gateway (lists, calls, progress, each caller's own prompts,
the remote killed mid-call and back), a tiny recording server (configured headers, an expired
session), and a remote that cannot be reached at start."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from fixtures.remote_server import RemoteServer
from helpers import (
    EVERYTHING,
    ROOT,
    connect,
    free_port,
    http_json,
    listening_process,
    make_config,
    need_deps,
    poll,
    run_gateway,
    text_of,
    wait_instance,
)
from tlsutil import make_certs

from gateway import config
from gateway.events import BackendStateChanged, ReloadFinished
from gateway.service import StartupError

pytestmark = pytest.mark.system

PRELOAD = os.path.join(ROOT, "bench", "loopback-preload.cjs")  # binds 127.0.0.1 only
FAST_RESTART = "{ backoff_initial = 0.05, backoff_max = 0.2, max_restarts = 100, window = 60.0 }"


@asynccontextmanager
async def everything(port: int) -> AsyncIterator[trio.Process]:
    """server-everything's Streamable HTTP server on 127.0.0.1:``port``, until killed."""
    need_deps(EVERYTHING)
    async with listening_process(["node", "--require", PRELOAD, EVERYTHING, "streamableHttp"],
                                 port, env={"PORT": str(port)}) as proc:
        yield proc


def remote(port: int, scheme: str = "http", **extra: str) -> str:
    extra = {"start_timeout": "10.0", **extra}
    lines = ["[backends.ev]", f'url = "{scheme}://127.0.0.1:{port}/mcp"',
             *(f"{k} = {v}" for k, v in extra.items())]
    return "\n".join(lines) + "\n"


async def test_everything_remote_lists_calls_progress_and_own_prompts() -> None:
    port = free_port()
    elicit = {"elicitation": {"form": {}}}
    with trio.fail_after(60):
        cfg = make_config(remote(port, cancel_grace="0.5"))
        async with everything(port), run_gateway(cfg) as gw:
            async with connect(gw.url, capabilities=elicit) as c:
                wanted = {"ev__echo", "ev__trigger-long-running-operation",
                          "ev__trigger-elicitation-request"}
                async def listed() -> bool:  # some only after the remote's list_changed burst
                    tools = (await c.request("tools/list"))["result"]["tools"]
                    return wanted <= {t["name"] for t in tools}

                await poll(listed)
                assert text_of(await c.call("ev__echo", {"message": "hi"})) == "Echo: hi"
                r = await c.request("tools/call", {
                    "name": "ev__trigger-long-running-operation",
                    "arguments": {"duration": 0.3, "steps": 3},
                    "_meta": {"progressToken": "tok"}}, timeout=20)
                assert "result" in r, r
                progress = [n["params"] for n in c.notifications
                            if n["method"] == "notifications/progress"]
                assert [p["progressToken"] for p in progress] == ["tok"] * 3
                assert [p["progress"] for p in progress] == [1, 2, 3]

                # A cancelled call: the remote never answers it, so its answer stream is dropped
                # and the call leaves the attribution set (no recycle after cancel_grace).
                await c.send({"jsonrpc": "2.0", "id": "gone", "method": "tools/call", "params": {
                    "name": "ev__trigger-long-running-operation",
                    "arguments": {"duration": 30, "steps": 30},
                    "_meta": {"progressToken": "tok2"}}})
                await c.wait_for(lambda: any(n["params"].get("progressToken") == "tok2"
                                             for n in c.notifications), 10)
                await c.notify("notifications/cancelled", {"requestId": "gone"})
                await wait_instance(gw.bound.admin_port, lambda i: i["inflight"] == 0, 5)
                # real-clock: 3 × cancel_grace on a real remote; "no restart" is an absence
                await trio.sleep(1.5)
                inst = await wait_instance(gw.bound.admin_port, lambda i: True)
                assert (inst["state"], inst["restarts"], inst["recycles"]) == ("RUNNING", 0, 0)

            # Two callers at once on the shared remote: each prompt came on its caller's own
            # POST stream, so each goes to its caller (the attribution set holds both).
            results: dict[str, str] = {}

            async def one(i: int) -> None:
                nonce = f"user{i}-{secrets.token_hex(4)}"
                async with connect(gw.url, capabilities=elicit) as c:
                    async with trio.open_nursery() as nursery:
                        async def answer() -> None:
                            req = await c.wait_for(lambda: c.requests and c.requests[0], 20)
                            assert req["method"] == "elicitation/create"
                            await c.send({"jsonrpc": "2.0", "id": req["id"], "result": {
                                "action": "accept", "content": {"name": nonce}}})
                        nursery.start_soon(answer)
                        r = await c.call("ev__trigger-elicitation-request", {}, timeout=20)
                    assert len(c.requests) == 1
                    results[nonce] = json.dumps(r["result"])

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i)
            assert len(results) == 2
            for nonce, text in results.items():
                assert nonce in text
                assert not [n for n in results if n != nonce and n in text]
            st = await http_json(gw.bound.admin_port, "/status")
    (backend,) = st["backends"]
    assert backend["connector"] == "http"
    (inst,) = backend["instances"]
    assert inst["origin"] == f"http://127.0.0.1:{port}" and inst["pid"] is None
    assert inst["last_error"] is None, inst


async def test_remote_killed_mid_call_fails_the_call_and_comes_back() -> None:
    port = free_port()
    cfg = make_config(remote(port, restart=FAST_RESTART))
    with trio.fail_after(90):
        async with everything(port) as proc, run_gateway(cfg) as gw:
            admin = gw.bound.admin_port
            async with connect(gw.url) as c:
                await c.send({"jsonrpc": "2.0", "id": "long", "method": "tools/call", "params": {
                    "name": "ev__trigger-long-running-operation",
                    "arguments": {"duration": 30, "steps": 30},
                    "_meta": {"progressToken": "tok"}}})
                await c.wait_for(lambda: c.notifications, 10)  # the call is at the remote
                proc.send_signal(signal.SIGKILL)
                killed = trio.current_time()
                r = await c.response("long", timeout=10)
                took = trio.current_time() - killed
                assert r["error"]["code"] == -32004, r
                assert r["error"]["data"]["retryable"] is False  # it was running: not again
                inst = await wait_instance(admin, lambda i: i["state"] == "BACKOFF")
                assert f"cannot reach http://127.0.0.1:{port}" in (inst["last_exit"] or ""), inst
                async with everything(port):  # the remote is back on the same port
                    await wait_instance(admin, lambda i: i["state"] == "RUNNING", timeout=20)
                    r = await c.call("ev__echo", {"message": "again"})
                    assert text_of(r) == "Echo: again"
    print(f"call failed {took * 1000:.0f} ms after the remote was killed")
    assert took < 5


async def test_configured_headers_reach_an_https_remote_and_are_never_shown(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    secret, env_secret, rotated = (secrets.token_hex(16) for _ in range(3))
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    os.environ["REMOTE_TEST_KEY"] = env_secret
    certs = make_certs(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certs.cert, certs.key)
    server = RemoteServer(tls=tls)
    caplog.set_level(logging.DEBUG)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            headers = (f'{{ Authorization = {{ file = "{token_file}", prefix = "Bearer " }}, '
                       'X-Api-Key = { env = "REMOTE_TEST_KEY" }, X-Plain = "plain" }')
            path = tmp_path / "gw.toml"
            path.write_text('[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n[admin]\n'
                            'listen = "127.0.0.1:0"\n' + remote(
                                server.port, "https", headers=headers,
                                ca_file=json.dumps(str(certs.ca))))
            cfg = config.load(path.read_bytes(), base_dir=str(tmp_path))  # as a reload reads it
            with trio.fail_after(20):
                async with run_gateway(cfg, config_path=str(path)) as gw:
                    async with connect(gw.url) as c:
                        r = await c.call("ev__echo", {"x": 1})
                        assert text_of(r) == '{"x": 1}'
                        first = len(server.seen)
                        token_file.write_text(rotated)  # a rotated token: read on reload
                        mark = gw.events.count
                        gw.control.reload()
                        await gw.events.wait(ReloadFinished, since=mark)
                        assert text_of(await c.call("ev__echo", {"x": 2})) == '{"x": 2}'
                        assert server.seen[-1].headers.get("authorization") == f"Bearer {rotated}"
                    status_text = json.dumps(await http_json(gw.bound.admin_port, "/status"))
            nursery.cancel_scope.cancel()
    finally:
        del os.environ["REMOTE_TEST_KEY"]
    posts = [s for s in server.seen[:first] if s.method == "POST"]
    assert posts and all(s.headers["authorization"] == f"Bearer {secret}" for s in posts)
    assert all(s.headers["x-api-key"] == env_secret and s.headers["x-plain"] == "plain"
               for s in posts)
    assert all(s.headers["accept"] == "application/json, text/event-stream" for s in posts)
    after_init = [s for s in server.seen if s.method == "POST"
                  and s.body.get("method") != "initialize"]
    assert after_init and all(s.headers["mcp-session-id"] == "s1"  # the same session throughout
                              and s.headers["mcp-protocol-version"] == "2025-11-25"
                              for s in after_init)
    assert [s.method for s in server.seen].count("DELETE") == 1  # the session ended on stop
    assert f"https://127.0.0.1:{server.port}" in status_text
    for text in (status_text, caplog.text):
        assert secret not in text and env_secret not in text and rotated not in text


async def test_an_expired_session_is_renewed_at_once_with_the_subscriptions_replayed() -> None:
    # The remote forgets the session (a 404): a new session at once (no BACKOFF), the held
    # subscription made again on it, no list_changed (the lists are the same), the call
    # refused with the 404 retryable, the tool call in flight then not (it may have run).
    server = RemoteServer()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        cfg = make_config(remote(server.port, restart=FAST_RESTART))
        with trio.fail_after(20):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                assert text_of(await c.call("ev__echo", {"n": 1})) == '{"n": 1}'
                r = await c.request("resources/subscribe", {"uri": "rec://a"})
                assert r["result"] == {}, r
                await c.send({"jsonrpc": "2.0", "id": "held", "method": "tools/call",
                              "params": {"name": "ev__hold", "arguments": {}}})

                async def held_at_remote() -> bool:
                    return any(s.method == "POST" and s.body.get("params", {}).get("name")
                               == "hold" for s in server.seen)

                await poll(held_at_remote)
                mark = gw.events.count
                server.expire()
                r = await c.call("ev__echo", {"n": 2})
                assert r["error"]["code"] == -32004 and r["error"]["data"]["retryable"], r
                held = await c.response("held")
                assert held["error"]["code"] == -32004, held
                assert held["error"]["data"]["retryable"] is False, held
                inst = await wait_instance(
                    gw.bound.admin_port, lambda i: i["state"] == "RUNNING" and i["restarts"] == 1)
                assert text_of(await c.call("ev__echo", {"n": 3})) == '{"n": 3}'
                states = [(e.old, e.new) for e in gw.events.of(BackendStateChanged, mark)]
                server.release.set()
                assert not [m for m in c.notifications if m["method"].endswith("list_changed")]
                first = len(server.seen)
                server.more_tools.append("later")  # the next session lists one more tool
                server.expire()
                r = await c.call("ev__echo", {"n": 4})
                assert r["error"]["code"] == -32004 and r["error"]["data"]["retryable"], r
                await c.wait_for(lambda: [m for m in c.notifications
                                          if m["method"] == "notifications/tools/list_changed"])
                assert "ev__later" in [t["name"] for t in
                                       (await c.request("tools/list"))["result"]["tools"]]
        nursery.cancel_scope.cancel()
    assert states == [("RUNNING", "STARTING"), ("STARTING", "RUNNING")], states
    assert inst["last_exit"].startswith("session expired"), inst
    seen = server.seen[:first]
    inits = [s for s in seen if s.method == "POST" and s.body.get("method") == "initialize"]
    assert len(inits) == 2 and "mcp-session-id" not in inits[1].headers
    subscribes = [s.headers.get("mcp-session-id") for s in server.seen if s.method == "POST"
                  and s.body.get("method") == "resources/subscribe"]
    assert subscribes == ["s1", "s2", "s3"]  # made again on each new session
    assert seen[-1].headers.get("mcp-session-id") == "s2"


async def test_a_400_saying_the_session_is_unknown_renews_it_at_once_as_a_404_does() -> None:
    # server-everything answers a request carrying a session it ended with a 400 whose JSON-RPC
    # error names the request: as a 404, a new session at once (no BACKOFF), the call refused
    # retryable; a 400 saying something else is that call's failure and the session goes on.
    server = RemoteServer(forget_with_400=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        cfg = make_config(remote(server.port, restart=FAST_RESTART))
        with trio.fail_after(20):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                assert text_of(await c.call("ev__echo", {"n": 1})) == '{"n": 1}'
                server.refuse["tools/call"] = [400]
                r = await c.call("ev__echo", {"n": 2})
                assert "HTTP 400" in r["error"]["message"], r
                assert r["error"]["code"] == -32001 and r["error"]["data"]["status"] == 400, r
                assert r["error"]["data"]["retryable"] is False, r  # the remote refused it
                assert text_of(await c.call("ev__echo", {"n": 3})) == '{"n": 3}'
                inst = await wait_instance(gw.bound.admin_port, lambda i: True)
                assert inst["restarts"] == 0, inst
                mark = gw.events.count
                server.expire()
                r = await c.call("ev__echo", {"n": 4})
                assert r["error"]["code"] == -32004 and r["error"]["data"]["retryable"], r
                inst = await wait_instance(
                    gw.bound.admin_port, lambda i: i["state"] == "RUNNING" and i["restarts"] == 1)
                assert text_of(await c.call("ev__echo", {"n": 5})) == '{"n": 5}'
                states = [(e.old, e.new) for e in gw.events.of(BackendStateChanged, mark)]
        nursery.cancel_scope.cancel()
    assert states == [("RUNNING", "STARTING"), ("STARTING", "RUNNING")], states
    assert inst["last_exit"].startswith("session expired"), inst
    assert "no longer knows the session (HTTP 400)" in inst["last_exit"], inst
    inits = [s for s in server.seen if s.method == "POST" and s.body.get("method") == "initialize"]
    assert len(inits) == 2 and "mcp-session-id" not in inits[1].headers


async def test_a_remote_answering_503_or_ending_a_stream_early_as_the_client_sees_it() -> None:
    # A 503 to tools/list at the handshake: repeated, the start goes on; a 503 to a tool call:
    # a -32001 naming the status, not retryable, the call POSTed once; a call whose event stream
    # ends before its answer: resumed with Last-Event-ID after the server's retry (300 ms).
    server = RemoteServer(refuse={"tools/list": [503]})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        cfg = make_config(remote(server.port, restart=FAST_RESTART))
        with trio.fail_after(20):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                assert text_of(await c.call("ev__echo", {"n": 1})) == '{"n": 1}'
                server.refuse["tools/call"] = [503]
                r = await c.call("ev__echo", {"n": 2})
                assert r["error"]["code"] == -32001, r
                assert r["error"]["data"]["status"] == 503 and not r["error"]["data"]["retryable"]
                assert len(r["error"]["data"]["body"]) <= 200
                assert text_of(await c.call("ev__poll", {})) == "polled"
                inst = await wait_instance(gw.bound.admin_port, lambda i: True)
            nursery.cancel_scope.cancel()
    assert inst["state"] == "RUNNING" and inst["restarts"] == 0, inst
    lists = [s for s in server.seen if s.method == "POST" and s.body.get("method") == "tools/list"]
    assert len(lists) == 2  # the 503, then the list
    calls = [s.body["params"]["arguments"] for s in server.seen if s.method == "POST"
             and s.body.get("method") == "tools/call"]
    assert calls == [{"n": 1}, {"n": 2}, {}]  # the refused call was not sent again
    (resumed,) = [s for s in server.seen if s.method == "GET"
                  and s.headers.get("last-event-id") == "p1"]
    assert resumed.headers["mcp-session-id"] == "s1"
    (polled,) = [s for s in server.seen if s.method == "POST"
                 and s.body.get("params", {}).get("name") == "poll"]
    assert resumed.at - polled.at >= 0.3  # the server's retry honoured


async def test_unreachable_remote_backs_off_and_a_required_one_fails_the_start() -> None:
    port = free_port()  # nothing listens there
    with trio.fail_after(30):
        async with run_gateway(make_config(remote(port, start_timeout="1.0"))) as gw:
            inst = await wait_instance(gw.bound.admin_port, lambda i: i["state"] == "BACKOFF")
            assert inst["last_exit"].startswith(f"spawn failed: cannot reach http://127.0.0.1:"
                                                f"{port}: "), inst
            assert inst["origin"] == f"http://127.0.0.1:{port}"
        started = trio.current_time()
        expected = (f"required backend 'ev' \\(http://127.0.0.1:{port}/mcp\\) did not start "
                    "within start_timeout \\(1s\\): spawn failed: cannot reach")
        with pytest.RaisesGroup(pytest.RaisesExc(StartupError, match=expected),
                                flatten_subgroups=True):
            async with run_gateway(make_config(remote(port, start_timeout="1.0",
                                                      required="true"))):
                pass
        waited = trio.current_time() - started
    assert 1.0 <= waited < 10
