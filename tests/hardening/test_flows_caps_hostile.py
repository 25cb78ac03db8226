"""Hostile review of parked flows, log routing and per-principal caps (review2)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import (
    HTTP_HEADERS,
    HTTP_INIT,
    ROOT,
    bearer_auth,
    connect,
    fixture_backend,
    make_config,
    run_gateway,
    wait_status,
)

from gateway import config as gconfig
from gateway import events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

TOKENS = {"alice": "alice-review2-token-1", "bob": "bob-review2-token-2"}
AUTH = bearer_auth(TOKENS)
V = "2026-07-28"


def alice_caps(**caps: int) -> str:
    return ('[[auth.limits]]\nprincipal = "alice"\n'
            + "".join(f"{k} = {v}\n" for k, v in caps.items()))


def bearer(name: str) -> dict[str, str]:
    return dict(HTTP_HEADERS, authorization=f"Bearer {TOKENS[name]}")


async def not_refused(send: Any) -> httpx.Response:
    """``send()`` once the in-process gateway is idle (any place a task gives back is back): not
    refused 503."""
    await trio.testing.wait_all_tasks_blocked()
    r = await send()
    assert r.status_code != 503, r.text
    return r


def inflight(st: dict[str, Any]) -> int:
    return sum(i["inflight"] for i in st["backends"][0]["instances"])


async def test_a_failed_initialize_holds_no_session_place() -> None:
    # before: an initialize answered with an error still made a session (its id in the
    # Mcp-Session-Id header) that held one of the principal's max_sessions (and of
    # http_max_sessions) for http_session_idle_timeout (600 s): two typos locked Alice out
    cfg = make_config(fixture_backend("fx"), extra=AUTH + alice_caps(max_sessions=2))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            bad = dict(HTTP_INIT, params={"protocolVersion": 5})
            sids = []
            for _ in range(3):
                r = await not_refused(
                    lambda: c.post(gw.http_url, headers=bearer("alice"), json=bad))
                assert r.json()["error"]["code"] == -32602, r.text
                sids.append(r.headers.get("mcp-session-id"))
            r = await not_refused(
                lambda: c.post(gw.http_url, headers=bearer("alice"), json=HTTP_INIT))
            assert r.status_code == 200 and "result" in r.json(), r.text
            for sid in sids:  # no session was made: its id is unknown
                if sid is not None:
                    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
                    r = await c.post(gw.http_url, json=ping,
                                     headers=dict(bearer("alice"), **{"mcp-session-id": sid}))
                    assert r.status_code == 404, r.text


META = {"io.modelcontextprotocol/protocolVersion": V,
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}


async def modern(c: httpx.AsyncClient, url: str, who: str, id: int, tool: str,
                 arguments: dict[str, Any], **extra: Any) -> dict[str, Any]:
    headers = dict(bearer(who), **{"mcp-protocol-version": V, "mcp-method": "tools/call",
                                   "mcp-name": tool})
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments, **extra, "_meta": META}}
    r = await c.post(url, headers=headers, json=body)
    return r.json()


def asked(r: dict[str, Any]) -> tuple[str, str]:
    result = r["result"]
    assert result["resultType"] == "input_required", r
    (key, _ask), = result["inputRequests"].items()
    return key, result["requestState"]


async def test_several_callers_waiting_behind_a_parked_flow_go_one_at_a_time() -> None:
    # before: at the preemption every waiter went to the child at once: each one's elicitation
    # was refused (declined) as unattributable, the preempted flow ended for nothing
    limit = 0.5
    cfg = make_config(fixture_backend("fx", sharing="shared"), extra=AUTH,
                      gateway=f"shared_park_limit = {limit}\ndrain_grace = 0.5")
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            asked(await modern(c, gw.http_url, "alice", 1, "fx__elicit", {"message": "a?"}))
            t0 = trio.current_time()
            got: dict[str, tuple[float, dict[str, Any]]] = {}
            async with trio.open_nursery() as nursery:
                async def waiter(who: str, id: int) -> None:
                    r = await modern(c, gw.http_url, who, id, "fx__elicit", {"message": f"{who}?"})
                    got[who] = (trio.current_time() - t0, r)
                nursery.start_soon(waiter, "bob", 2)
                nursery.start_soon(waiter, "alice", 3)
            (_first, (t1, r1)), (second, (t2, r2)) = sorted(got.items(), key=lambda kv: kv[1][0])
            asked(r1)  # the first prompt after the limit, the other after the first one's limit
            key, state = asked(r2)
            assert limit - 0.1 <= t1 and t1 + limit - 0.1 <= t2 < 3 * limit + 1, (t1, t2)
            r = await modern(c, gw.http_url, second, 4, "fx__elicit", {"message": f"{second}?"},
                             requestState=state,
                             inputResponses={key: {"action": "accept", "content": {"answer": "x"}}})
            assert json.loads(r["result"]["content"][0]["text"])["action"] == "accept", r


async def test_a_reload_applies_shared_park_limit_and_max_parked_flows(tmp_path: Any) -> None:
    # before: the bridge kept the values it was started with (no warning either): a reload
    # lowering shared_park_limit left callers waiting 30 s, one lowering max_parked_flows
    # bounded nothing
    ASK_ECHO = '[policy]\nrules = [{ match = "fx__echo", action = "ask" }]\n'

    def text(gateway: str) -> str:
        return (f"[gateway]\ndrain_grace = 0.5\n{gateway}\n[listen]\nhttp = \"127.0.0.1:0\"\n"
                f"[admin]\nlisten = \"127.0.0.1:0\"\n{AUTH}{ASK_ECHO}"
                + fixture_backend("fx", sharing="shared"))
    path = tmp_path / "gw.toml"
    path.write_text(text(""))
    with trio.fail_after(20):
        async with (run_gateway(gconfig.load(path.read_bytes(), base_dir=ROOT),
                                config_path=str(path)) as gw,
                    httpx.AsyncClient(timeout=10) as c):
            path.write_text(text("shared_park_limit = 0.3\nmax_parked_flows = 1"))
            gw.control.reload()
            await gw.events.wait(events.ReloadFinished, success=True)
            asked(await modern(c, gw.http_url, "alice", 1, "fx__elicit", {"message": "a?"}))
            t0 = trio.current_time()
            asked(await modern(c, gw.http_url, "bob", 2, "fx__elicit", {"message": "b?"}))
            assert trio.current_time() - t0 < 2  # preempted at 0.3 s, not 30 s
            # bob's flow is parked: max_parked_flows = 1 refuses a consent prompt
            r = await modern(c, gw.http_url, "alice", 3, "fx__echo", {"message": "x"})
            assert r["error"]["code"] == -32006 and r["error"]["data"]["limit"] == 1, r


async def test_calls_asking_at_once_do_not_park_beyond_max_parked_flows() -> None:
    # before: gateway.max_parked_flows was checked before the prompt only, and a flow parks
    # 20 ms later (the gather): four calls asking at once all parked with max_parked_flows = 1
    cfg = make_config(fixture_backend("fx"), gateway="max_parked_flows = 1\ndrain_grace = 0.3",
                      extra=AUTH + '[policy]\nrules = [{ match = "fx__echo", action = "ask" }]\n')
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            out: list[dict[str, Any]] = []

            async def ask(id: int) -> None:
                who = ("alice", "bob")[id % 2]
                out.append(await modern(c, gw.http_url, who, id, "fx__echo", {"message": "x"}))

            async with trio.open_nursery() as nursery:
                for id in range(4):
                    nursery.start_soon(ask, id)
            parked = [r for r in out if r.get("result", {}).get("resultType") == "input_required"]
            refused = [r for r in out if r.get("error", {}).get("code") == -32006]
            assert len(parked) == 1 and len(refused) == 3, out
            assert all(r["error"]["data"] == {"limit": 1, "reason": "overloaded"} for r in refused)


async def test_an_expired_flow_on_a_shared_child_frees_it_without_a_recycle(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # before: the flow ended by state_ttl had its call cancelled (notifications/cancelled), which
    # a spec-following child never answers: for cancel_grace every other caller's prompt there
    # was declined as unattributable, then the healthy shared child was recycled.  (The fixture
    # answers when its tool sees the elicitation's cancel before the notification: a race.)
    told = tmp_path / "transcript"
    cfg = make_config(fixture_backend("fx", sharing="shared", cancel_grace=0.5,
                                      env={"FIXTURE_TRANSCRIPT": str(told)}),
                      extra=AUTH, gateway="state_ttl = 0.3\ndrain_grace = 0.3")
    caplog.set_level("INFO", "gateway.core.bridge")
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            asked(await modern(c, gw.http_url, "alice", 1, "fx__elicit", {"message": "a?"}))
            # alice never retries: her flow expires
            await gw.events.wait(events.RequestFinished, tool="fx__elicit", principal="alice",
                                 outcome=events.RequestOutcome.CANCELLED)
            key, state = asked(await modern(c, gw.http_url, "bob", 2, "fx__elicit",
                                            {"message": "b?"}))
            r = await modern(c, gw.http_url, "bob", 3, "fx__elicit", {"message": "b?"},
                             requestState=state,
                             inputResponses={key: {"action": "accept", "content": {"answer": "B"}}})
            assert json.loads(r["result"]["content"][0]["text"])["content"] == {"answer": "B"}, r
            # nothing left at the child (a call abandoned unanswered would stay until the
            # recycle at cancel_grace)
            st = await wait_status(gw.bound.admin_port, lambda st: inflight(st) == 0)
            (inst,) = st["backends"][0]["instances"]
            assert inst["recycles"] == 0 and inst["restarts"] == 0, inst
            assert b"notifications/cancelled" not in told.read_bytes()
            ended = [r.getMessage() for r in caplog.records if " ended: " in r.getMessage()]
            assert len(ended) == 1 and "state_ttl" in ended[0], ended  # once


async def test_a_flow_refused_at_its_principals_cap_frees_a_shared_child(tmp_path: Any) -> None:
    # before: the refused flow's call was cancelled (notifications/cancelled) after its
    # elicitation was answered cancel: the child never answered, and after cancel_grace the
    # shared child, which other principals' calls use, was recycled
    told = tmp_path / "transcript"
    cfg = make_config(fixture_backend("fx", sharing="shared", instances=2, cancel_grace=0.5,
                                      env={"FIXTURE_TRANSCRIPT": str(told)}),
                      extra=AUTH + alice_caps(max_parked_flows=1), gateway="drain_grace = 0.3")
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, httpx.AsyncClient(timeout=10) as c:
            asked(await modern(c, gw.http_url, "alice", 1, "fx__elicit", {"message": "a?"}))
            r = await modern(c, gw.http_url, "alice", 2, "fx__elicit", {"message": "a2?"})
            assert r["error"]["data"]["limit"] == "max_parked_flows", r
            # only alice's parked call left at the children (as above)
            st = await wait_status(gw.bound.admin_port, lambda st: inflight(st) == 1)
            assert [i["recycles"] for i in st["backends"][0]["instances"]] == [0, 0], st
            assert b"notifications/cancelled" not in told.read_bytes()
            asked(await modern(c, gw.http_url, "bob", 3, "fx__elicit", {"message": "b?"}))


async def test_a_websocket_flow_forwarded_by_a_task_is_given_up_when_it_expires(
        tmp_path: Any) -> None:
    # before: a WebSocket call forwarded by a task (here: after its consent round) that parked
    # on the child's elicitation and expired was cancelled with notifications/cancelled (the
    # gateway did not know its call at the child): the shared child was recycled
    told = tmp_path / "transcript"
    cfg = make_config(fixture_backend("fx", sharing="shared", cancel_grace=0.5,
                                      env={"FIXTURE_TRANSCRIPT": str(told)}),
                      extra=AUTH + '[policy]\nrules = [{ match = "fx__elicit", action = "ask" }]\n',
                      gateway="drain_grace = 0.3\nstate_ttl = 0.3")
    with trio.fail_after(20):
        async with (run_gateway(cfg) as gw,
                    connect(gw.url, token=TOKENS["alice"], initialize=False) as ws):
            args = {"name": "fx__elicit", "arguments": {"message": "a?"}, "_meta": META}
            consent = (await ws.request("tools/call", args))["result"]
            r = await ws.request("tools/call", {
                **args, "requestState": consent["requestState"],
                "inputResponses": {"consent": {"action": "accept", "content": {"approve": True}}}})
            assert list(r["result"]["inputRequests"]) == ["srv-1"], r  # the child asks: parked
            # alice never retries: expired (the child's request ends with the flow), and nothing
            # left at the child (as above)
            await gw.events.wait(events.ServerRequestFinished, method="elicitation/create",
                                 outcome=events.ServerRequestOutcome.OWNER_GONE)
            st = await wait_status(gw.bound.admin_port, lambda st: inflight(st) == 0)
            assert [i["recycles"] for i in st["backends"][0]["instances"]] == [0], st
            assert b"notifications/cancelled" not in told.read_bytes()
            echo = await ws.request("tools/call", {"name": "fx__echo", "_meta": META,
                                                   "arguments": {"message": "on"}})
            assert echo["result"]["content"][0]["text"] == "on"  # the connection goes on
