"""Hostile checks of what session 7 changed, with real sockets and processes: a remote's 4xx
(429 retryable), a registration's odd ``client_secret_expires_at``, a slow-loris WebSocket
upgrade (plain and TLS), raw unix lines on the framing and tool-name fast paths, a flood of
refused redirects, per-principal step-ups (bounded, not used up by retries),
``notifications/elicitation/complete`` to the asked connection only, answers across the frame
header sizes, a JWT expiring mid-call, a tool coming and going while called."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from authserverutil import AuthServer, authorizing_remote
from fixtures.remote_server import RemoteServer
from fixtures.token_server import CodeAuthServer
from helpers import (
    ROOT,
    UPGRADE,
    Running,
    connect,
    fixture_backend,
    free_port,
    http_request,
    make_config,
    run_gateway,
    text_of,
    unix_connect,
    wait_status,
)
from integration import test_principal_authcode as pc
from integration import test_remote_authcode as rc
from integration.test_authentication import Issuer, oauth_toml
from tlsutil import make_certs

from gateway import config, limits
from gateway.backend.authcode import MAX_STEP_UPS

pytestmark = pytest.mark.system

FAST_RESTART = "{ backoff_initial = 0.05, backoff_max = 0.2, max_restarts = 100, window = 60.0 }"


def remote(port: int) -> str:
    return (f'[backends.ev]\nurl = "http://127.0.0.1:{port}/mcp"\nstart_timeout = 10.0\n'
            f"restart = {FAST_RESTART}\n")


@asynccontextmanager
async def authorizing_gateway(tmp_path: Path) -> AsyncIterator[
        tuple[AuthServer, RemoteServer, Running, httpx.AsyncClient]]:
    """The gateway before a per-principal authorization code remote, and a browser; 120 s."""
    async with authorizing_remote("--client", "gw:gw-secret") as (srv, remote, url):
        cfg = pc.gateway_config(tmp_path, free_port(), url, pc.code_oauth(tmp_path, srv))
        with trio.fail_after(120):
            async with run_gateway(cfg) as gw, httpx.AsyncClient() as web:
                yield srv, remote, gw, web


async def test_each_4xx_to_a_call_fails_it_with_its_status_429_retryable() -> None:
    # A remote's 4xx without a JSON-RPC error fails that call -32001 with the status, not
    # retryable, except 429 (the remote says it did not run it: retryable even for tools/call);
    # a 404 to a request carrying the session ends that session (-32004, retryable).
    server = RemoteServer()
    got: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        cfg = make_config(remote(server.port))
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                for status in (401, 403, 404, 405, 413, 429):
                    assert text_of(await c.call("ev__echo", {"n": 1})) == '{"n": 1}'
                    server.refuse["tools/call"] = [status]
                    got[status] = (await c.call("ev__echo", {"n": status}))["error"]
        nursery.cancel_scope.cancel()
    for status in (401, 403, 405, 413, 429):
        error = got[status]
        assert error["code"] == -32001 and error["data"]["status"] == status, error
        assert error["data"]["retryable"] is (status == 429), error
    assert got[404]["code"] == -32004 and got[404]["data"]["retryable"] is True, got[404]


class _OddSecretExpiry(CodeAuthServer):
    """Registers clients with a secret whose ``client_secret_expires_at`` is ``raw`` (JSON)."""

    raw = b"0"

    def __call__(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Any:
        if method == "POST" and target == "/register":
            self.registered.append(f"client-{len(self.registered) + 1}")
            return 201, [("content-type", "application/json")], (
                b'{"client_id": "%s", "client_secret": "s", "client_secret_expires_at": %s}'
                % (self.registered[-1].encode(), self.raw))
        return super().__call__(method, target, headers, body)


@pytest.mark.trio
@pytest.mark.parametrize("raw", [b'"4102444800"', b"-5", b"1" + b"0" * 400, b"1e400", b"NaN",
                                 b"true", b"null", b"[1]"])
async def test_a_registration_with_an_odd_secret_expiry_is_taken_as_never_expiring(
        autojump_clock: object, tmp_path: Any, raw: bytes) -> None:
    # RFC 7591's client_secret_expires_at as a string, negative, beyond a float, infinite, NaN,
    # a bool, null or an array: the client is kept (never expiring), the backend authorizes.
    auth = _OddSecretExpiry(rc.AS)
    auth.raw = raw
    async with (rc.network(auth, lambda t: t in auth.issued) as net,
                rc.daemon(rc.code_config(tmp_path), net) as h):
        await h.until(lambda: rc.state_of(h) == "AUTHORIZING")
        assert (await h.hub.complete_authorization(await rc.authorize(h, auth)))[0] == 200
        await h.until(lambda: rc.state_of(h) == "RUNNING")
        assert auth.registered == ["client-1"]
        async with h.connect() as c:
            assert (await c.call("echo", timeout=5))["result"]["content"][0]["text"] == "ok"


async def _trickle(stream: trio.abc.Stream, head: bytes, every: float) -> bytes:
    """Send ``head`` a byte at a time, waiting up to ``every`` seconds for the server's answer
    after each, until it answers; its answer (read to the close)."""
    got = b""
    for i in range(len(head) + 1):
        if i < len(head):
            await stream.send_all(head[i:i + 1])
        with trio.move_on_after(every):  # the answer, if it comes before the next byte
            got = await stream.receive_some(65536)
        if got:
            break
    try:
        while chunk := await stream.receive_some(65536):
            got += chunk
    except trio.BrokenResourceError:
        pass
    return got


@pytest.mark.parametrize("secure", [False, True])
async def test_a_slow_loris_upgrade_gets_408_at_the_head_timeout_and_its_slot_back(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, secure: bool) -> None:
    # An upgrade head sent a byte at a time (plain and over TLS), still coming when the head
    # timeout passes: 408 then the close, the slot given back; others are served meanwhile.
    monkeypatch.setattr(limits, "HEAD_TIMEOUT", 1.0, raising=False)
    listen = ""
    ctx = None
    if secure:
        certs = make_certs(tmp_path)
        listen = f'tls_cert = "{certs.cert}"\ntls_key = "{certs.key}"\n'
        ctx = certs.client_context()
    cfg = config.load(f"""[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n{listen}
[admin]\nlisten = "127.0.0.1:0"\n""" + fixture_backend("fx"), base_dir=ROOT)
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            port = gw.bound.websocket_port
            assert port is not None
            tcp = await trio.open_tcp_stream("127.0.0.1", port)
            stream: trio.abc.Stream = tcp
            if ctx is not None:
                stream = trio.SSLStream(tcp, ctx, server_hostname="localhost")
                await stream.do_handshake()
            start = trio.current_time()
            async with stream:
                got = await _trickle(stream, UPGRADE, 0.05)
            took = trio.current_time() - start
            assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got[:80]
            assert got.endswith(b"upgrade request not completed in time\n"), got
            assert 0.5 < took < 4.0, took
            await wait_status(gw.bound.admin_port, lambda st: st["connection_slots"] == 0)
            scheme = "wss" if secure else "ws"
            if not secure:  # the listener serves the next client as before
                async with connect(f"{scheme}://127.0.0.1:{port}/") as c:
                    assert text_of(await c.call("fx__echo", {"message": "hi"})) == "hi"


MAX = 65536  # max_message_bytes of the unix test


def _call_line(id: int, name: bytes, message: str = "hi") -> bytes:
    return (b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":%s,'
            b'"arguments":{"message":"%s"}}}' % (id, name, message.encode()))


async def test_unix_lines_and_tool_names_as_written_on_the_fast_paths(tmp_path: Path) -> None:
    # Over the unix socket, raw lines: a call before initialize is refused and after it served;
    # a tool name found by its bytes or decoded (escapes), never by a prefix, trailing spaces,
    # a non-string; duplicate keys answered by the last (what the backend is sent too); CRLF,
    # blank and space-led lines, a line split over reads, one held while more bytes come; a
    # line at max_message_bytes taken and one over refused, then the connection closed.
    sock = str(tmp_path / "gw.sock")
    cfg = make_config(fixture_backend("fx"), unix=sock, gateway=f"max_message_bytes = {MAX}")
    with trio.fail_after(30):
        async with run_gateway(cfg):
            stream = await trio.open_unix_socket(sock)
            async with stream:
                got = b""

                async def ask(data: bytes, answers: int = 1) -> list[dict[str, Any]]:
                    nonlocal got
                    await stream.send_all(data)
                    while got.count(b"\n") < answers:
                        got += await stream.receive_some(65536)
                    *lines, got = got.split(b"\n", answers)
                    return [json.loads(line) for line in lines]

                (r,) = await ask(_call_line(1, b'"fx__echo"') + b"\n")
                assert r["error"]["code"] == -32600, r  # not initialized
                (r,) = await ask(b'{"jsonrpc":"2.0","id":2,"method":"initialize","params":{'
                                 b'"protocolVersion":"2025-11-25","capabilities":{},'
                                 b'"clientInfo":{"name":"t","version":"0"}}}\r\n')
                assert r["result"]["protocolVersion"] == "2025-11-25", r
                await stream.send_all(b'\n\r\n  \t\n{"jsonrpc":"2.0","method":'
                                      b'"notifications/initialized"}\n')
                cases: list[tuple[bytes, str | int]] = [
                    (b'"fx__echo"', "hi"), (b'"fx__ech\\u006f"', "hi"),
                    (b'"fx__ech"', -32602), (b'"fx__echo "', -32602), (b'" fx__echo"', -32602),
                    (b'5', -32602), (b'null', -32602), (b'["fx__echo"]', -32602),
                    (b'"fx__\xc3\xa9cho"', -32602)]
                for n, (name, want) in enumerate(cases, 10):
                    (r,) = await ask(_call_line(n, name) + b"\n")
                    if isinstance(want, str):
                        assert text_of(r) == want, (name, r)
                    else:
                        assert r["error"]["code"] == want, (name, r)
                dup = (b'{"jsonrpc":"2.0","id":30,"method":"tools/call","params":{"name":'
                       b'"fx__nope","name":"fx__echo","arguments":{"message":"dup"}}}\n')
                (r,) = await ask(dup)
                assert text_of(r) == "dup", r
                (r,) = await ask(b" \t" + _call_line(31, b'"fx__echo"', "lead") + b"\r\n")
                assert text_of(r) == "lead", r
                line = _call_line(32, b'"fx__echo"', "")
                exact = line.replace(b'"message":""', b'"message":"' + b"m" * (MAX - len(line))
                                     + b'"')
                assert len(exact) == MAX
                (r,) = await ask(exact + b"\n")
                # taken and forwarded (the echo of it, twice its text, is the backend's too big)
                assert r["error"]["data"]["reason"] == "response_too_large", r
                split = _call_line(35, b'"fx__echo"', "split") + b"\n"
                await stream.send_all(split[:7])
                await trio.testing.wait_all_tasks_blocked()  # the gateway read the first part
                (r,) = await ask(split[7:])
                assert text_of(r) == "split", r
                both = split.replace(b'"id":35', b'"id":36') + split[:9]
                (r,) = await ask(both)
                assert r["id"] == 36, r
                (r,) = await ask(split[9:])
                assert r["id"] == 35 and text_of(r) == "split", r
                over = exact.replace(b'"id":32', b'"id":33').replace(b'"m', b'"mm', 1)
                assert len(over) == MAX + 1
                (r,) = await ask(over + b"\n")
                assert r["error"]["code"] == -32600 and r["id"] in (33, None), r
                with trio.fail_after(5):  # then the connection is closed (as before)
                    while chunk := await stream.receive_some(65536):
                        got += chunk
                assert got == b"", got


async def test_a_flood_of_refused_redirects_logs_a_bounded_number_of_lines(
        caplog: pytest.LogCaptureFixture) -> None:
    # 400 refused requests to listen.redirect_path over real sockets (an unknown state, a
    # parameter twice, an unknown start link, an over-long query, a code and iss with an unknown
    # state): all refused, at most LOG_BURST warning lines in the minute.
    cfg = make_config(fixture_backend("fx"))
    queries = ["state=nope", "a=1&a=2", "start=zzz", "state=" + "x" * 9000,
               "code=c&state=s&iss=http%3A%2F%2Fevil"]
    caplog.set_level("INFO")
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw:
            for n in range(400):
                status, _ = await http_request(gw.bound.http_port,
                                               f"/oauth/callback?{queries[n % len(queries)]}")
                assert 400 <= status < 500, status
    lines = [r for r in caplog.records if r.levelno >= 30 and r.name.startswith("gateway")]
    assert 1 <= len(lines) <= limits.LOG_BURST, [r.getMessage()[:80] for r in lines]


@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_remote_wanting_a_new_scope_at_every_call_gets_a_bounded_number_of_step_ups(
        tmp_path: Path) -> None:
    # Every call of bob answered 403 insufficient_scope naming a scope never asked before: he
    # is given a URL to authorize it at most MAX_STEP_UPS times; after that each 403 goes to
    # him (not retryable) and no further authorization is asked; alice is never affected.
    async with (authorizing_gateway(tmp_path) as (_srv, remote, gw, web),
                connect(gw.url, token=pc.TOKENS["bob"]) as b,
                connect(gw.url, token=pc.TOKENS["alice"]) as a):
        for who, c in (("bob", b), ("alice", a)):
            page = pc.authorize_url(await c.call("up__echo", {"who": who}))
            assert (await pc.follow(web, page, who)).status_code == 200
            assert text_of(await c.call("up__echo", {"who": who})) == f'{{"who": "{who}"}}'
        step_ups = refused = 0
        for n in range(6):
            remote.refuse["tools/call"] = [403]
            remote.refusal_challenge = f'Bearer error="insufficient_scope", scope="extra:{n}"'
            r = await b.call("up__echo", {"who": "bob"})
            if r["error"]["code"] == -32005:
                step_ups += 1
                assert (await pc.follow(web, pc.authorize_url(r), "bob")).status_code == 200
            else:
                refused += 1
                assert r["error"]["code"] == -32001, r
                assert r["error"]["data"]["status"] == 403, r
                assert r["error"]["data"]["retryable"] is False, r
            remote.refuse.pop("tools/call", None)
            assert text_of(await a.call("up__echo", {"who": "a"})) == '{"who": "a"}'
        assert step_ups == MAX_STEP_UPS and refused == 6 - MAX_STEP_UPS, (step_ups, refused)


def _elicitation(answer: dict[str, Any]) -> dict[str, Any]:
    error = answer["error"]
    assert error["code"] == -32042, error
    (ask,) = error["data"]["elicitations"]
    return dict(ask)


def _completions(c: Any) -> list[str]:
    return [m["params"]["elicitationId"] for m in c.notifications
            if m["method"] == "notifications/elicitation/complete"]


@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_elicitation_complete_goes_to_the_connections_asked_only(tmp_path: Path) -> None:
    # bob's and alice's 2025-11-25 connections (URL elicitation declared) are sent -32042 with
    # their own authorize URLs; bob authorizing tells bob's asked connection alone (not his
    # other one, never alice's); alice authorizing after her connection closed tells nobody, and
    # the daemon goes on.
    caps = {"elicitation": {"url": {}}}
    async with (authorizing_gateway(tmp_path) as (_srv, _remote, gw, web),
                connect(gw.url, token=pc.TOKENS["bob"], capabilities=caps) as b1,
                connect(gw.url, token=pc.TOKENS["bob"], capabilities=caps) as b2):
        bob = _elicitation(await b1.call("up__echo", {"who": "bob"}))
        async with connect(gw.url, token=pc.TOKENS["alice"], capabilities=caps) as a:
            alice = _elicitation(await a.call("up__echo", {"who": "alice"}))
            assert alice["elicitationId"] != bob["elicitationId"]
            assert (await pc.follow(web, bob["url"], "bob")).status_code == 200
            await b1.wait_for(lambda: _completions(b1))
            assert text_of(await b2.call("up__echo", {"who": "b2"})) == '{"who": "b2"}'
            assert _completions(b1) == [bob["elicitationId"]]
            assert _completions(b2) == [] and _completions(a) == []
        async with connect(gw.url, token=pc.TOKENS["alice"], capabilities=caps) as a2:
            assert (await pc.follow(web, alice["url"], "alice")).status_code == 200
            assert text_of(await a2.call("up__echo", {"who": "a2"})) == '{"who": "a2"}'
            assert _completions(a2) == []
        assert _completions(b1) == [bob["elicitationId"]] and _completions(b2) == []


@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_calls_retried_before_a_step_up_is_authorized_do_not_use_up_the_step_ups(
        tmp_path: Path) -> None:
    # bob's call answered 403 insufficient_scope for a scope, retried three times before he
    # authorizes: each retry gets the same URL without reaching the remote (one step-up pending,
    # not four); after he authorized, a second scope wanted later still gets its step-up.
    async with (authorizing_gateway(tmp_path) as (srv, remote, gw, web),
                connect(gw.url, token=pc.TOKENS["bob"]) as b):
        page = pc.authorize_url(await b.call("up__echo", {"who": "bob"}))
        assert (await pc.follow(web, page, "bob")).status_code == 200
        remote.refusal_challenge = 'Bearer error="insufficient_scope", scope="files:write"'
        remote.refuse["tools/call"] = [403, 403, 403, 403]
        pages = [pc.authorize_url(await b.call("up__echo", {"who": "bob"}))
                 for _ in range(4)]
        assert len(set(pages)) == 1, pages
        # the retries waited for the authorization: not sent again
        assert remote.refuse["tools/call"] == [403, 403, 403], remote.refuse
        remote.refuse.pop("tools/call")
        assert (await pc.follow(web, pages[0], "bob")).status_code == 200
        assert text_of(await b.call("up__echo", {"who": "b"})) == '{"who": "b"}'
        remote.refusal_challenge = 'Bearer error="insufficient_scope", scope="admin"'
        remote.refuse["tools/call"] = [403]
        page = pc.authorize_url(await b.call("up__echo", {"who": "bob"}))
        assert (await pc.follow(web, page, "bob")).status_code == 200
        assert text_of(await b.call("up__echo", {"who": "c"})) == '{"who": "c"}'
        stepped = [r for r in await srv.issued() if r["sub"] == "bob"][-1]
        assert {"files:write", "admin"} <= set(stepped["scope"].split()), stepped


async def test_answers_of_every_size_around_the_frame_header_limits_arrive_whole(
        tmp_path: Path) -> None:
    # One-call writes (a frame header and its message, a line and its newline): answers whose
    # size crosses 125/126 and 65535/65536 bytes arrive whole and in order, over WebSocket and
    # the unix socket.
    sock = str(tmp_path / "gw.sock")
    cfg = make_config(fixture_backend("fx"), unix=sock)
    sizes: set[int] = set()
    with trio.fail_after(120):
        async with run_gateway(cfg) as gw:
            for opened in (connect(gw.url), unix_connect(sock)):
                async with opened as c:
                    for n in [*range(0, 160), *range(65380, 65560)]:
                        r = await c.call("x" * n)
                        assert r["error"]["code"] == -32602 and "x" * n in r["error"]["message"]
                        sizes.add(len(json.dumps(r, separators=(",", ":"))))
                    assert text_of(await c.call("fx__echo", {"message": "end"})) == "end"
    assert {125, 126, 65535, 65536} <= sizes, sorted(sizes)[:3]


async def test_a_websocket_whose_jwt_expires_mid_call_gives_its_principals_slot_back() -> None:
    # dana (max_inflight = 1) calls sleep on a WebSocket whose JWT expires 2 s later: the
    # connection ends with 1008 mid-call, and the call's slot is dana's again at once (a new
    # connection of hers is served, not -32006), the gateway's counts back to nothing.
    limit = '[[auth.limits]]\nprincipal = "dana"\nmax_inflight = 1\n'
    with Issuer().running() as issuer:
        cfg = make_config(fixture_backend(), extra=oauth_toml(issuer) + limit)
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw:
                async with connect(gw.url, token=issuer.token(exp=int(time.time()) + 2)) as ws:
                    await ws.send({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
                        "name": "fx__sleep", "arguments": {"seconds": 20}}})
                    with trio.fail_after(8):
                        while not ws.closed:
                            await ws._changed.wait()
                    assert ws.ws.closed is not None and ws.ws.closed.code == 1008
                    assert 7 not in ws.responses
                async with connect(gw.url, token=issuer.token()) as again:
                    r = await again.call("fx__echo", {"message": "again"})
                    assert text_of(r) == "again", r
                st = await wait_status(gw.bound.admin_port,
                                       lambda st: not any(st["connections"].values()))
                assert st["connection_slots"] == 0, st
                assert st["client_requests_in_flight"] == 0, st


async def test_calls_to_a_tool_coming_and_going_by_list_changed_each_get_one_answer() -> None:
    # One connection calls fx__extra_tool in a tight loop while another toggles it in and out
    # of the backend's list (tools/list_changed, the catalog rebuilt): every call gets exactly
    # one answer, "extra" or -32602 unknown tool (or the backend's own refusal), never a hang.
    # Each state lasts at least PER_STATE answered calls, so both answers are seen.
    cfg = make_config(fixture_backend("fx"))
    answers: list[dict[str, Any]] = []
    per_state = 10
    progress = trio.Event()
    toggled = trio.Event()
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw, connect(gw.url) as caller, connect(gw.url) as toggler:

            async def call_loop() -> None:
                nonlocal progress
                while not toggled.is_set() or len(answers) < 150:
                    answers.append(await caller.call("fx__extra_tool", timeout=10))
                    progress.set()
                    progress = trio.Event()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call_loop)
                for _ in range(20):
                    seen = len(answers)
                    r = await toggler.call("fx__notify_list_changed", {"kind": "tools"})
                    assert text_of(r) == "ok", r
                    while len(answers) < seen + per_state:
                        await progress.wait()
                toggled.set()
    kinds = set()
    for r in answers:
        if "result" in r:
            assert text_of(r) == "extra", r
            kinds.add("ok")
        else:
            assert r["error"]["code"] == -32602, r
            kinds.add("unknown" if r["error"]["message"].startswith("unknown tool") else "backend")
    assert len(answers) >= 150 and "ok" in kinds and "unknown" in kinds, kinds
