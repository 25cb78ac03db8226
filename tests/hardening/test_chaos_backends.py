"""Backends that misbehave (tests/fixtures/chaos_server.py) behind the real daemon: for every
chaos command the caller gets exactly one answer with the expected outcome, over the WebSocket
and the unix socket, and afterwards the invariants of tests/invariants.py hold."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
from helpers import Client, connect, poll, text_of
from invariants import Daemon, DaemonSlot, alive, baseline, chaos_backend, check

pytestmark = pytest.mark.system

REQUEST_TIMEOUT = 2.0
AT_ONCE = 1.5  # an answer "at once": well before REQUEST_TIMEOUT
MAX_MESSAGE = 1 << 20
FAST_RESTART = "{ backoff_initial = 0.05, backoff_max = 0.1, max_restarts = 200, window = 60.0 }"
CRASH_LOOP = "{ backoff_initial = 0.01, backoff_max = 0.02, max_restarts = 2, window = 60.0 }"
BACKENDS = (
    chaos_backend("fx", restart=FAST_RESTART)  # the bystanders' backend
    + chaos_backend("cx", request_timeout=REQUEST_TIMEOUT, cancel_grace=0.5, declare=[],
                    restart=FAST_RESTART)
    + chaos_backend("crashy", env={"CHAOS_CRASH_ON_START": "1"}, restart=CRASH_LOOP)
)
PROTOCOL_ERRORS = "mcp_gateway_backend_protocol_errors_total"


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("chaos"), BACKENDS,
                   gateway=f"max_message_bytes = {MAX_MESSAGE}")
    yield s
    s.close()


@dataclass(frozen=True)
class Case:
    do: str
    code: int | None = None  # None: a result whose text is the message
    reason: str | None = None
    restarts: bool = False  # the backend is restarted (it died)
    counted: bool = False  # backend_protocol_errors_total{backend="cx"} goes up
    at_once: bool = True
    args: dict[str, Any] = field(default_factory=dict)
    text_suffix: str = ""


CASES = [
    Case("sigkill", -32004, "backend_exited", restarts=True),
    Case("exit0", -32004, "backend_exited", restarts=True),
    Case("hang", -32003, "timeout", at_once=False),
    Case("not_json", counted=True),
    Case("unknown_id", counted=True),
    Case("duplicate", counted=True),
    Case("bad_utf8", -32009, "backend_protocol_error", counted=True),
    Case("lone_surrogate", text_suffix="\ud83d"),
    Case("big_line", counted=True),
    Case("big_id_first", -32008, "response_too_large", counted=True),
    Case("big_id_last", -32008, "response_too_large", counted=True),
    Case("deep_reply", -32009, "backend_protocol_error"),
    Case("deep_notification", counted=True),
    Case("id_first"),
    Case("id_last"),
    Case("stderr_flood", args={"size": 4 << 20}),
]


def answers_to(c: Client, rid: Any) -> list[dict[str, Any]]:
    return [m for m in c.received if "method" not in m and m.get("id") == rid]


async def first_success(c: Client, tool: str, args: dict[str, Any], bound: float) -> dict[str, Any]:
    """Call until it succeeds, within ``bound`` seconds (a restarting backend comes back);
    the calls' ids start with ``fence-``."""
    n = 0

    async def succeeded() -> dict[str, Any] | None:
        nonlocal n
        n += 1
        r = await c.call(tool, args, id=f"fence-{n}", timeout=bound)
        return r if "result" in r and not r["result"].get("isError") else None

    with trio.fail_after(bound):  # (the daemon is another process: its backend polled)
        return await poll(succeeded)


@pytest.mark.parametrize("transport", ["websocket", "unix"])
@pytest.mark.parametrize("case", CASES, ids=[c.do for c in CASES])
async def test_chaos_command_gets_one_answer_then_invariants_hold(
    daemon: Daemon, case: Case, transport: str
) -> None:
    with trio.fail_after(60):
        base = await baseline(daemon)
        before = await daemon.instance("cx")
        errors_before = await daemon.metric(PROTOCOL_ERRORS, backend="cx")
        tag = secrets.token_hex(6)
        async with daemon.client(transport) as c:
            rid = f"chaos-{tag}"
            started = trio.current_time()
            r = await c.call("cx__chaos", {"do": case.do, "message": tag, **case.args}, id=rid,
                             timeout=REQUEST_TIMEOUT + 8)
            took = trio.current_time() - started
            if case.code is None:
                assert "result" in r, r
                assert text_of(r) == tag + case.text_suffix
            else:
                assert "result" not in r, str(r)[:300]
                assert r["error"]["code"] == case.code, r["error"]
                assert r["error"]["data"]["reason"] == case.reason, r["error"]
                assert r["error"]["data"]["backend"] == "cx", r["error"]
            if case.at_once:
                assert took < AT_ONCE, f"{case.do}: answered after {took:.2f}s"
            else:
                assert REQUEST_TIMEOUT * 0.9 <= took < REQUEST_TIMEOUT + AT_ONCE, took
            # a call behind it on the same child pipe fences off any second answer
            fence = await first_success(c, "cx__echo", {"message": tag}, bound=10)
            assert text_of(fence) == tag
            assert len(answers_to(c, rid)) == 1, answers_to(c, rid)
            foreign = [m for m in c.received if "method" not in m and m.get("id") != 1
                       and m.get("id") != rid and not str(m.get("id")).startswith("fence-")]
            assert not foreign, foreign  # only answers to ids this client sent
        after = await daemon.instance("cx")
        if case.restarts:
            assert after["restarts"] > before["restarts"]
        else:
            assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"]), \
                f"{case.do} restarted the backend: {after['last_exit']}"
        errors_after = await daemon.metric(PROTOCOL_ERRORS, backend="cx")
        if case.counted:
            assert errors_after > errors_before, f"{case.do} was not counted"
        await check(daemon, base)
        if not case.restarts:  # not later either (an abandoned call's grace, a health check)
            late = await daemon.instance("cx")
            assert (late["pid"], late["restarts"]) == (before["pid"], before["restarts"]), late


async def test_invalid_utf8_reply_never_reaches_a_websocket_client_as_text(daemon: Daemon) -> None:
    """Byte-level check: every frame the gateway sends after a bad reply is valid UTF-8 JSON
    (the Client's reader decodes strictly; trio-websocket closes 1007 on invalid text)."""
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with connect(daemon.url) as c:
            for i in range(3):
                r = await c.call("cx__chaos", {"do": "bad_utf8", "message": f"m{i}"})
                assert r["error"]["code"] == -32009, r
            assert not c.closed
            for m in c.received:
                json.dumps(m, ensure_ascii=False).encode("utf-8")  # no lone surrogates smuggled
        await check(daemon, base)


async def test_grandchild_left_behind_is_reaped_when_its_parent_dies(daemon: Daemon) -> None:
    with trio.fail_after(30):
        base = await baseline(daemon)
        async with connect(daemon.url) as c:
            r = await c.call("cx__chaos", {"do": "grandchild"})
            grandchild = json.loads(text_of(r))["pid"]
            assert alive(grandchild)
            r = await c.call("cx__chaos", {"do": "sigkill"})
            assert r["error"]["code"] == -32004, r
            await first_success(c, "cx__echo", {"message": "back"}, bound=10)
        # the daemon is a subreaper: the orphan is killed and reaped, not even a zombie left
        async def gone() -> bool:  # seen in /proc
            return not alive(grandchild)

        with trio.fail_after(10):
            await poll(gone)
        await check(daemon, base)


async def test_crash_at_start_goes_fatal_and_calls_fail_at_once(daemon: Daemon) -> None:
    """A backend that never started never listed its tools: a call naming one is answered at
    once as an unknown tool (-32602; names are routed by the catalog, never by their prefix),
    and the backend shows FATAL in /status."""
    with trio.fail_after(30):
        base = await baseline(daemon)
        inst = await daemon.instance("crashy")
        assert inst["state"] == "FATAL" and inst["pid"] is None, inst
        assert inst["restarts"] == 2
        async with connect(daemon.url) as c:
            for i in range(3):
                started = trio.current_time()
                r = await c.call("crashy__echo", {"message": str(i)}, id=f"crashy-{i}")
                assert trio.current_time() - started < 0.5
                assert r["error"]["code"] == -32602, r
                assert len(answers_to(c, f"crashy-{i}")) == 1
        await check(daemon, base)
