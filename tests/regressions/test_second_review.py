"""Regressions found in the second review (one test per bug)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from helpers import connect, fixture_backend, make_config, poll, run_gateway, text_of

from gateway import config, events
from gateway.backend.memory import MemoryConnector, Script
from gateway.hub import Hub

pytestmark = pytest.mark.system


def call_msg(id: Any, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments or {}}}


async def test_per_session_first_call_cancelled_at_once_does_not_wedge_the_session() -> None:
    # The first call of a connection starts its per-session child; when that call is cancelled
    # while the child is being started, the instance must still be supervised and reaped (it
    # used to stay in the backend's table, stopped, so every later call waited restart_wait
    # and failed with backend_unavailable, and the slot counted against max_sessions forever).
    cfg = make_config(fixture_backend("fx", sharing="per-session", max_sessions=1),
                      gateway="restart_wait = 3.0")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url, version="2025-03-26") as c:
                await c.send([call_msg(1, "fx__echo", {"message": "x"}),
                              {"jsonrpc": "2.0", "method": "notifications/cancelled",
                               "params": {"requestId": 1}}])
                await gw.events.wait(events.RequestFinished, tool="fx__echo",
                                     outcome=events.RequestOutcome.CANCELLED)
                r = await c.call("fx__echo", {"message": "after"}, timeout=10)
                assert text_of(r) == "after", r
                mark = gw.events.count
            # the connection closed: its child is reaped and the slot is free for another one
            await gw.events.wait(events.BackendExited, backend="fx", since=mark)
            async with connect(gw.url) as d:
                r = await d.call("fx__echo", {"message": "next"}, timeout=10)
                assert text_of(r) == "next", r


# A minimal stdio backend: `hold` never answers; `trick` sends an elicitation/create and then
# its own result in ONE write, so both lines reach the gateway in the same read.
TRICK_SERVER = r'''
import json, sys
out = sys.stdout.buffer
def send(*msgs):
    out.write(b"".join(json.dumps(m).encode() + b"\n" for m in msgs)); out.flush()
for line in sys.stdin.buffer:
    m = json.loads(line)
    method, mid = m.get("method"), m.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": "2025-11-25",
              "capabilities": {"tools": {}}, "serverInfo": {"name": "trick", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [
            {"name": n, "inputSchema": {"type": "object"}} for n in ("hold", "trick")]}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
    elif method == "tools/call" and m["params"]["name"] == "trick":
        send({"jsonrpc": "2.0", "id": "srv-1", "method": "elicitation/create",
              "params": {"message": "asked by trick",
                         "requestedSchema": {"type": "object", "properties": {}}}},
             {"jsonrpc": "2.0", "id": mid,
              "result": {"content": [{"type": "text", "text": "tricked"}]}})
    elif mid is not None and method is not None and method != "tools/call":
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no"}})
'''


def script_backend(tmp_path: Any, name: str, source: str, **extra: Any) -> str:
    import sys
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    lines = [f"[backends.{name}]", f"command = {json.dumps(sys.executable)}",
             f"args = [{json.dumps(str(path))}]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


async def test_server_request_is_attributed_on_arrival_not_when_its_task_runs(
    tmp_path: Any) -> None:
    # When the child's elicitation arrived, calls of two connections were in flight: it must be
    # refused.  It used to be attributed later, after the caller's reply (same read) had already
    # left the set, and so reached the *other* connection, which never made the call.
    cfg = make_config(script_backend(tmp_path, "tk", TRICK_SERVER))
    caps = {"elicitation": {"form": {}}}
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities=caps) as x, \
                connect(gw.url, capabilities=caps) as y:
            await y.send(call_msg(1, "tk__hold"))
            # y's call is in the child's attribution set (it is sent in the step that counts it)
            await gw.events.wait(events.RequestStarted, backend="tk")
            r = await x.call("tk__trick", timeout=10)
            assert text_of(r) == "tricked"
            refused = await gw.events.wait(events.ServerRequestRefused, backend="tk")
            assert (refused.method, refused.reason) == ("elicitation/create", "unattributable")
            await x.request("ping")  # read after anything sent to them before
            await y.request("ping")
            assert [q for q in y.requests if q["method"] == "elicitation/create"] == []
            assert [q for q in x.requests if q["method"] == "elicitation/create"] == []


# `late` waits a little, then asks its caller (elicitation/create) and writes the answer it got
# to the file named by $ANSWERS; it ignores notifications/cancelled.
LATE_SERVER = r'''
import json, os, sys, threading, time
out = sys.stdout.buffer
lock = threading.Lock()
def send(m):
    with lock:
        out.write(json.dumps(m).encode() + b"\n"); out.flush()
def late(mid):
    time.sleep(0.5)
    send({"jsonrpc": "2.0", "id": "srv-1", "method": "elicitation/create",
          "params": {"message": "late question",
                     "requestedSchema": {"type": "object", "properties": {}}}})
for line in sys.stdin.buffer:
    m = json.loads(line)
    method, mid = m.get("method"), m.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": "2025-11-25",
              "capabilities": {"tools": {}}, "serverInfo": {"name": "late", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid,
              "result": {"tools": [{"name": "late", "inputSchema": {"type": "object"}}]}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
    elif method == "tools/call":
        threading.Thread(target=late, args=(mid,), daemon=True).start()
    elif method is None and mid == "srv-1":
        with open(os.environ["ANSWERS"], "a") as f:
            f.write(json.dumps(m) + "\n")
    elif mid is not None and method is not None:
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no"}})
'''


async def test_request_attributed_to_a_closed_connection_is_answered_at_once(tmp_path: Any) -> None:
    # The caller disconnected, its call is still in the attribution set (the child has not
    # answered the cancel yet), and the child asks it something: the child must get an
    # answer (elicitation → cancel), not wait forever on a connection that is gone.
    answers = tmp_path / "answers.jsonl"
    cfg = make_config(script_backend(
        tmp_path, "lt", LATE_SERVER) + f"env = {{ ANSWERS = {json.dumps(str(answers))} }}\n")
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url, capabilities={"elicitation": {"form": {}}}) as x:
                await x.send(call_msg(1, "lt__late"))
                await gw.events.wait(events.RequestStarted, backend="lt")  # at the child
            # answered at once by the gateway, then written down by the child (polled: a file)
            await gw.events.wait(events.ServerRequestFinished, backend="lt",
                                 method="elicitation/create", timeout=3)

            async def written() -> bool:
                return answers.exists() and answers.read_text().endswith("\n")

            with trio.move_on_after(3):
                await poll(written)
            assert answers.exists(), "the child's elicitation/create was never answered"
            got = json.loads(answers.read_text().splitlines()[0])
            assert got["result"] == {"action": "cancel"}, got


def gateway_toml(backends: str, extra: str = "") -> str:
    return (f'[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n[admin]\nlisten = ""\n{extra}\n'
            f'{backends}')


async def test_backend_removed_by_reload_during_a_consent_prompt_is_backend_unavailable(
    tmp_path: Any) -> None:
    # The tool's backend was removed while its call waited for consent: the approved call gets
    # -32001 backend_unavailable, not an internal error (KeyError on hub.backends).
    from helpers import ROOT

    policy = '[[policy.rules]]\nmatch = "fx__echo"\naction = "ask"\n'
    path = tmp_path / "gateway.toml"
    path.write_text(gateway_toml(fixture_backend("fx") + fixture_backend("keep"), policy))
    cfg = config.load(path.read_text(), base_dir=ROOT)
    with trio.fail_after(30):
        async with run_gateway(cfg, str(path)) as gw, \
                connect(gw.url, capabilities={"elicitation": {"form": {}}}) as c:
            await c.send(call_msg("call", "fx__echo", {"message": "hi"}))
            prompt = await c.wait_for(lambda: [q for q in c.requests
                                               if q["method"] == "elicitation/create"])
            path.write_text(gateway_toml(fixture_backend("keep"), policy))
            gw.control.reload()
            await c.wait_for(lambda: any(n["method"] == "notifications/tools/list_changed"
                                         for n in c.notifications))
            await c.send({"jsonrpc": "2.0", "id": prompt[0]["id"],
                          "result": {"action": "accept", "content": {"approve": True}}})
            r = await c.response("call")
            assert r["error"]["code"] == -32001, r
            assert r["error"]["data"]["reason"] == "backend_unavailable"


async def test_affine_call_queued_when_reload_removes_the_backend_is_backend_unavailable(
    tmp_path: Any) -> None:
    # A call waiting in the affine queue of a backend that reload removes is told the backend
    # is unavailable (-32001), not that the gateway is overloaded (-32006).
    from helpers import ROOT

    path = tmp_path / "gateway.toml"
    path.write_text(gateway_toml(fixture_backend("fx", sharing="affine") + fixture_backend("keep")))
    cfg = config.load(path.read_text(), base_dir=ROOT)
    with trio.fail_after(30):
        async with run_gateway(cfg, str(path)) as gw, connect(gw.url) as a, connect(gw.url) as b:
            await a.send(call_msg("hold", "fx__sleep", {"seconds": 5}))
            await gw.events.wait(events.RequestStarted, backend="fx")
            # counted as started before it waits in the affine queue
            await b.send(call_msg("queued", "fx__echo", {"message": "x"}))
            await gw.events.wait(events.RequestStarted, backend="fx", count=2)
            path.write_text(gateway_toml(fixture_backend("keep")))
            gw.control.reload()
            r = await b.response("queued")
            assert r["error"]["code"] == -32001, r
            assert r["error"]["data"]["reason"] == "backend_unavailable"


# Answers everything at once except resources/unsubscribe, which it never answers (wedged).
WEDGED_UNSUBSCRIBE_SERVER = r'''
import json, sys
out = sys.stdout.buffer
def send(m):
    out.write(json.dumps(m).encode() + b"\n"); out.flush()
for line in sys.stdin.buffer:
    m = json.loads(line)
    method, mid = m.get("method"), m.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": "2025-11-25",
              "capabilities": {"resources": {"subscribe": True}},
              "serverInfo": {"name": "w", "version": "0"}}})
    elif method == "resources/list":
        send({"jsonrpc": "2.0", "id": mid,
              "result": {"resources": [{"uri": "w://a", "name": "a"}]}})
    elif method == "resources/templates/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"resourceTemplates": []}})
    elif method == "resources/unsubscribe":
        pass
    elif mid is not None and method is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
'''


async def test_closing_a_subscribed_connection_does_not_wait_for_a_wedged_backend(
    tmp_path: Any) -> None:
    # The upstream unsubscribe of a closing connection ran inside its shielded cleanup, bounded
    # only by request_timeout: a backend that never answers held the connection task (and so
    # the whole drain on SIGTERM) for that long.
    cfg = make_config(script_backend(tmp_path, "w", WEDGED_UNSUBSCRIBE_SERVER,
                                     request_timeout=30.0),
                      gateway="drain_grace = 1.0")
    with trio.fail_after(12):
        async with run_gateway(cfg) as gw:
            async with connect(gw.url) as c:
                r = await c.request("resources/subscribe", {"uri": "w://a"})
                assert r["result"] == {}, r
                mark = gw.events.count
            # closed without waiting for the backend's unsubscribe answer
            await gw.events.wait(events.ConnectionClosed, since=mark, timeout=5)
        # leaving run_gateway stops it: drain (1 s) + close must not wait 30 s for the backend


async def test_unanswered_internal_request_does_not_restart_the_child(
        autojump_clock: trio.testing.MockClock) -> None:
    # A server that (as the spec asks) never answers a request the gateway cancelled, here a
    # timed-out health ping: internal requests never count for attribution, so they must not
    # trigger the cancel_grace restart meant for clients' calls (it killed everyone's calls).
    # The upstream is the memory connector's fake, on virtual time.
    cfg = config.load('[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n[backends.fake]\n'
                      'command = "never-spawned"\ncancel_grace = 0.5\n'
                      "health = { interval = 0.2, timeout = 0.2, failures = 1000 }\n")
    connector = MemoryConnector(Script(answer_pings=False))
    bus = events.EventBus()
    exited: list[events.BackendExited] = []
    bus.subscribe(exited.append, events.BackendExited)
    hub = Hub(cfg, bus, connectors=lambda name, cfg: connector)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            await hub.wait_started()
            await trio.sleep(2.5)  # ten pings timed out, each long past cancel_grace
            pings = [m for m in connector.links[0].received if m.get("method") == "ping"]
            assert len(pings) >= 5, pings
            assert exited == [] and len(connector.links) == 1
            nursery.cancel_scope.cancel()


# `url` asks a URL-mode elicitation with the fixed elicitationId "e1"; once answered it sends
# notifications/elicitation/complete for "e1" and then its result.
URL_ELICIT_SERVER = r'''
import json, sys
out = sys.stdout.buffer
def send(m):
    out.write(json.dumps(m).encode() + b"\n"); out.flush()
waiting = {}
n = 0
for line in sys.stdin.buffer:
    m = json.loads(line)
    method, mid = m.get("method"), m.get("id")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": "2025-11-25",
              "capabilities": {"tools": {}}, "serverInfo": {"name": "u", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid,
              "result": {"tools": [{"name": "url", "inputSchema": {"type": "object"}}]}})
    elif method == "tools/call":
        n += 1
        waiting[f"srv-{n}"] = mid
        send({"jsonrpc": "2.0", "id": f"srv-{n}", "method": "elicitation/create",
              "params": {"mode": "url", "message": "open it", "url": "https://example.com/x",
                         "elicitationId": "e1"}})
    elif method is None and mid in waiting:
        send({"jsonrpc": "2.0", "method": "notifications/elicitation/complete",
              "params": {"elicitationId": "e1"}})
        send({"jsonrpc": "2.0", "id": waiting.pop(mid),
              "result": {"content": [{"type": "text", "text": "done"}]}})
    elif mid is not None and method is not None:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
'''


async def test_elicitation_complete_goes_to_the_owner_even_when_two_backends_reuse_an_id(
    tmp_path: Any) -> None:
    # elicitationIds are chosen by each backend: the same id from two backends must not make
    # one backend's completion reach the other backend's prompt owner.
    cfg = make_config(script_backend(tmp_path, "ua", URL_ELICIT_SERVER) + script_backend(
        tmp_path, "ub", URL_ELICIT_SERVER))
    caps = {"elicitation": {"url": {}}}
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url, capabilities=caps) as x, \
                connect(gw.url, capabilities=caps) as y:
            await x.send(call_msg("cx", "ua__url"))
            px = await x.wait_for(lambda: x.requests)
            await y.send(call_msg("cy", "ub__url"))
            await y.wait_for(lambda: y.requests)
            await x.send({"jsonrpc": "2.0", "id": px[0]["id"], "result": {"action": "accept"}})
            assert text_of(await x.response("cx")) == "done"
            await x.request("ping")  # read after anything sent to them before
            await y.request("ping")
            done = "notifications/elicitation/complete"
            assert [n for n in x.notifications
                    if n["method"] == done], "the owner did not get its completion"
            assert [n for n in y.notifications if n["method"] == done] == []


def crash_marker_backend(name: str, marker: Any, restart: str, **extra: Any) -> str:
    """The fixture behind /bin/sh: while ``marker`` exists, every start crashes (exit 3)."""
    import sys

    from helpers import FIXTURE
    script = 'if [ -e "$MARKER" ]; then exit 3; fi; exec "$PY" "$FIXTURE"'
    lines = [f"[backends.{name}]", 'command = "/bin/sh"', f"args = [\"-c\", {json.dumps(script)}]",
             f"env = {{ MARKER = {json.dumps(str(marker))}, PY = {json.dumps(sys.executable)}, "
             f"FIXTURE = {json.dumps(FIXTURE)} }}", f"restart = {restart}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("restart, retryable", [
    # FATAL
    ("{ backoff_initial = 0.01, backoff_max = 0.02, max_restarts = 2, window = 60.0 }", False),
    # BACKOFF
    ("{ backoff_initial = 30.0, backoff_max = 30.0, max_restarts = 5, window = 60.0 }", True),
])
async def test_affine_backend_not_running_is_backend_unavailable_within_the_wait_bound(
        tmp_path: Any, restart: str, retryable: bool) -> None:
    # §10: a backend that is not running gives -32001 — FATAL at once, restarting after
    # restart_wait.  In affine mode the call used to sit in the instance queue for queue_timeout
    # (30 s) and then got -32006 overloaded.
    marker = tmp_path / "crash"
    cfg = make_config(crash_marker_backend("af", marker, restart, sharing="affine"),
                      gateway="restart_wait = 1.0")
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            assert text_of(await c.call("af__echo", {"message": "up"})) == "up"
            marker.touch()
            assert (await c.call("af__crash", {}))["error"]["code"] == -32004
            # FATAL, or waiting out a long backoff
            await gw.events.wait(events.BackendStateChanged, backend="af",
                                 new="BACKOFF" if retryable else "FATAL")
            start = trio.current_time()
            r = await c.call("af__echo", {"message": "x"}, timeout=20)
            took = trio.current_time() - start
            assert r["error"]["code"] == -32001, r
            assert r["error"]["data"]["retryable"] is retryable
            assert took < (0.5 if not retryable else 2.5), took
