"""The gateway's own consent prompt (policy "ask") reaches a modern (2026-07-28) caller as an
InputRequiredResult with a signed requestState; the retry carries the user's answer.

A modern connection's rounds run in-process on virtual time (tests/memharness.py: a memory
backend doing what the fixture server does, the client on a memory stream).  What proves a real
transport or a real peer stays real (``system``): stateless HTTP (status codes, each flow's
end, silence ending a flow and its connections), the Python SDK 2.x as the client, and a real
modern child asking for input itself.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import (
    DEPS,
    ROOT,
    connect,
    fixture_backend,
    make_config,
    metric,
    run_gateway,
    wait_status,
)
from memharness import backend, memory_config, running, sent

Clock = trio.testing.MockClock

V = "2026-07-28"
FORM = {"elicitation": {"form": {}}}
ASK = """
[policy]
elicitation_timeout = 30.0
rules = [{ match = "fx__echo", action = "ask" },
         { match = "fx__greet", kind = "prompt", action = "ask" }]
"""
ACCEPT = {"action": "accept", "content": {"approve": True}}
PY2 = os.path.join(DEPS, "venv-mcp2", "bin", "python")
PY2_CONSENT = os.path.join(ROOT, "tests", "interop", "py2_consent_client.py")


def meta(caps: dict[str, Any]) -> dict[str, Any]:
    return {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": caps}


async def post(c: httpx.AsyncClient, url: str, id: int, message: str, *,
               caps: dict[str, Any] = FORM, **extra: Any) -> httpx.Response:
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "fx__echo"}
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": "fx__echo", "arguments": {"message": message}, **extra,
                       "_meta": meta(caps)}}
    with trio.fail_after(10):
        return await c.post(url, headers=headers, json=body)


def consent_asked(r: httpx.Response, message: str) -> str:
    """The requestState of an InputRequiredResult asking for consent to echo ``message``."""
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert result["resultType"] == "input_required", result
    (key, ask), = result["inputRequests"].items()
    assert key == "consent" and ask["method"] == "elicitation/create"
    assert ask["params"]["mode"] == "form"
    assert "fx__echo" in ask["params"]["message"] and message in ask["params"]["message"]
    assert ask["params"]["requestedSchema"]["properties"]["approve"]["type"] == "boolean"
    return str(result["requestState"])


def invalid_state(r: httpx.Response, kind: str = "") -> bool:
    error = r.json().get("error") or {}
    return (r.status_code == 400 and error.get("code") == -32602
            and error["data"]["reason"] == "invalid_state" and kind in error["message"])


def expires_in(state: str) -> float:
    """Seconds until a gateway state's signed expiry (its payload is readable, only signed)."""
    payload = state.split(".")[1]
    return float(json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["x"]) - time.time()


def echoed(transcript: Path) -> list[str]:
    """The messages the child was asked to echo (every tools/call it ever read)."""
    calls = [json.loads(line) for line in transcript.read_text().splitlines()[1:]]
    return [m["params"]["arguments"]["message"] for m in calls if m.get("method") == "tools/call"]


@pytest.mark.system
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_consent_on_stateless_http(tmp_path: Path) -> None:
    transcript = tmp_path / "fx.jsonl"
    cfg = make_config(fixture_backend("fx", env={"FIXTURE_TRANSCRIPT": str(transcript)}), extra=ASK,
                      gateway='replica_id = "r1"')
    async with run_gateway(cfg) as gw, httpx.AsyncClient() as c:
        url, port = gw.http_url, gw.bound.admin_port
        # accept: the tool runs once, the retry's id gets its result; the state is spent
        state = consent_asked(await post(c, url, 1, "yes-1"), "yes-1")
        assert state.startswith("r1.")
        r = await post(c, url, 2, "yes-1", inputResponses={"consent": ACCEPT}, requestState=state)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == 2 and r.json()["result"]["resultType"] == "complete"
        assert r.json()["result"]["content"][0]["text"] == "yes-1"
        r = await post(c, url, 3, "yes-1", inputResponses={"consent": ACCEPT}, requestState=state)
        assert invalid_state(r, "call is over"), r.text  # replayed: refused, nothing runs again
        # decline / cancel / accept without yes: -32005 declined, nothing runs
        for i, answer in enumerate([{"action": "decline"}, {"action": "cancel"},
                                    {"action": "accept", "content": {"approve": False}}]):
            state = consent_asked(await post(c, url, 10 + i, f"no-{i}"), f"no-{i}")
            r = await post(c, url, 20 + i, f"no-{i}", inputResponses={"consent": answer},
                           requestState=state)
            error = r.json()["error"]
            assert r.json()["id"] == 20 + i and error["code"] == -32005, r.text
            assert error["data"] == {"reason": "declined", "tool": "fx__echo"}
        # a retry without the answer is asked again (a fresh state), the old one is spent
        state = consent_asked(await post(c, url, 30, "again"), "again")
        again = consent_asked(await post(c, url, 31, "again", inputResponses={},
                                         requestState=state), "again")
        assert again != state
        r = await post(c, url, 32, "again", inputResponses={"consent": ACCEPT}, requestState=state)
        assert invalid_state(r, "already used"), r.text
        r = await post(c, url, 33, "again", inputResponses={"consent": ACCEPT}, requestState=again)
        assert r.json()["result"]["content"][0]["text"] == "again"
        # tampered: refused, nothing runs (the call it names may end at once: then its genuine
        # state is refused too; else that state's decline ends it)
        state = consent_asked(await post(c, url, 40, "tampered"), "tampered")
        r = await post(c, url, 41, "tampered", inputResponses={"consent": ACCEPT},
                       requestState=state + "x")
        assert invalid_state(r, "signature"), r.text
        r = await post(c, url, 42, "tampered", inputResponses={"consent": {"action": "decline"}},
                       requestState=state)
        assert invalid_state(r, "call is over") or r.json()["error"]["data"][
            "reason"] == "declined", r.text
        # the state is bound to the call's params
        state = consent_asked(await post(c, url, 50, "mine"), "mine")
        r = await post(c, url, 51, "other", inputResponses={"consent": ACCEPT}, requestState=state)
        assert invalid_state(r, "params differ"), r.text
        # a caller that did not declare elicitation: -32021 (HTTP 400), never asked
        r = await post(c, url, 60, "nocap", caps={})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == -32021
        assert error["data"] == {"reason": "authorization_required", "tool": "fx__echo",
                                 "requiredCapabilities": {"elicitation": {"form": {}}}}
        r = await post(c, url, 61, "urlonly", caps={"elicitation": {"url": {}}})
        assert r.json()["error"]["code"] == -32021, r.text
        with trio.fail_after(5):
            await wait_status(port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
        assert await metric(port, "mcp_gateway_request_states_refused_total",
                            reason="tampered") == 1
        assert await metric(port, "mcp_gateway_input_required_results_total",
                            backend="_gateway") == 8
    assert echoed(transcript) == ["yes-1", "again"]  # each approved call ran exactly once


async def test_silence_ends_the_call_at_the_consent_timeout(autojump_clock: Clock) -> None:
    async with (running(memory_config(backend("fx"), extra=ASK.replace("30.0", "0.5"))) as gw,
                gw.connect(initialize=False) as c):
        args = {"name": "fx__echo", "arguments": {"message": "silent"}, "_meta": meta(FORM)}
        start = trio.current_time()
        first = (await c.request("tools/call", args))["result"]
        assert list(first["inputRequests"]) == ["consent"]
        timeout = {"backend": "_gateway", "method": "elicitation/create", "outcome": "timeout"}
        await gw.until(lambda: gw.metric("mcp_gateway_server_requests_total", **timeout) == 1)
        assert trio.current_time() - start == pytest.approx(0.5)  # the parked call ended
        await gw.until(lambda: gw.status()["client_requests_in_flight"] == 0)
        r = await c.request("tools/call", {**args, "inputResponses": {"consent": ACCEPT},
                                           "requestState": first["requestState"]})
        assert r["error"]["data"]["reason"] == "invalid_state", r  # too late: nothing runs
        assert sent(gw.link("fx"), "tools/call") == []


async def test_after_consent_the_backends_own_elicitation_is_the_next_round(
        autojump_clock: Clock) -> None:
    """The same flow goes on: consent (round 1), then the legacy child's elicitation (round 2,
    under the child's request id, at state_ttl), then the result."""
    extra = ASK.replace('match = "fx__echo"', 'match = "fx__elicit"')
    async with (running(memory_config(backend("fx"), extra=extra)) as gw,
                gw.connect(initialize=False) as c):

        async def call(**extra: Any) -> dict[str, Any]:
            params = {"name": "fx__elicit", "arguments": {"message": "name?"}, **extra,
                      "_meta": meta(FORM)}
            return await c.request("tools/call", params)

        first = (await call())["result"]
        assert list(first["inputRequests"]) == ["consent"]
        assert sent(gw.link("fx"), "tools/call") == []  # nothing runs before consent
        second = (await call(inputResponses={"consent": ACCEPT},
                             requestState=first["requestState"]))["result"]
        assert (second["resultType"] == "input_required"
                and list(second["inputRequests"]) == ["s1"])  # the child's own request id
        assert 25 <= expires_in(first["requestState"]) <= 32  # elicitation_timeout = 30
        assert 295 <= expires_in(second["requestState"]) <= 302  # state_ttl = 300
        answer = {"s1": {"action": "accept", "content": {"answer": "Ada"}}}
        done = await call(inputResponses=answer, requestState=second["requestState"])
        assert json.loads(done["result"]["content"][0]["text"])["content"] == {"answer": "Ada"}
        assert len(sent(gw.link("fx"), "tools/call")) == 1  # the tool ran once
        assert not c.requests  # a modern connection is never sent a request


async def test_consent_on_a_modern_connection(autojump_clock: Clock) -> None:
    """On a byte stream the retry comes on the same connection; a prompt under ask goes the same
    way; a declined call ends that call only."""
    async with (running(memory_config(backend("fx"), extra=ASK)) as gw,
                gw.connect(initialize=False) as c):
        args = {"name": "fx__echo", "arguments": {"message": "ws-yes"}, "_meta": meta(FORM)}
        first = (await c.request("tools/call", args))["result"]
        assert (first["resultType"] == "input_required"
                and list(first["inputRequests"]) == ["consent"])
        done = await c.request("tools/call", {**args, "inputResponses": {"consent": ACCEPT},
                                              "requestState": first["requestState"]})
        assert done["result"]["content"][0]["text"] == "ws-yes"
        replay = await c.request("tools/call", {**args, "inputResponses": {"consent": ACCEPT},
                                                "requestState": first["requestState"]})
        assert replay["error"]["data"]["reason"] == "invalid_state"
        prompt = {"name": "fx__greet", "arguments": {"name": "Ada"}, "_meta": meta(FORM)}
        asked = (await c.request("prompts/get", prompt))["result"]
        (ask,) = asked["inputRequests"].values()
        assert "Allow the prompt fx__greet" in ask["params"]["message"]
        no = await c.request("prompts/get",
                             {**prompt, "inputResponses": {"consent": {"action": "decline"}},
                                             "requestState": asked["requestState"]})
        assert no["error"]["code"] == -32005 and no["error"]["data"]["reason"] == "declined"
        got = await c.request("prompts/get", prompt)
        (ask,) = got["result"]["inputRequests"].values()
        got = await c.request("prompts/get", {**prompt, "inputResponses": {"consent": ACCEPT},
                                              "requestState": got["result"]["requestState"]})
        assert got["result"]["messages"][0]["content"]["text"] == "Hello, Ada!"
        nocap = await c.request("tools/call", {**args, "_meta": meta({})})
        assert nocap["error"]["code"] == -32021
        assert nocap["error"]["data"]["reason"] == "authorization_required"
        # every request got exactly one answer: no second response to an input_required id
        answered = [m["id"] for m in c.received if "id" in m and "method" not in m]
        assert len(answered) == len(set(answered)) == 8
        assert not c.requests  # a modern connection is never sent a request
        calls = sent(gw.link("fx"), "tools/call")
        assert [m["params"]["arguments"]["message"] for m in calls] == ["ws-yes"]


@pytest.mark.system
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize(("answer", "expected"),
                         [("accept", "ran: sdk"), ("decline", "error -32005 declined")])
async def test_python_sdk_2_answers_the_consent_prompt(answer: str, expected: str) -> None:
    """``mcp.Client(url)`` of the Python SDK 2.x (2026-07-28 over /mcp) with an elicitation
    callback calls an ``ask`` tool: its callback sees the gateway's prompt, its answer decides."""
    missing = [p for p in (PY2, PY2_CONSENT) if not os.path.exists(p)]  # noqa: ASYNC240 - a skip check on a local path
    assert not missing, f"missing {missing}: run scripts/setup --test"
    async with run_gateway(make_config(fixture_backend("fx"), extra=ASK)) as gw:
        with trio.fail_after(60):
            proc = await trio.run_process([PY2, PY2_CONSENT, gw.http_url, "fx__echo",
                                           '{"message": "sdk"}', answer],
                                          capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    got = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert got["protocolVersion"] == V
    assert len(got["prompts"]) == 1 and "Allow the tool fx__echo" in got["prompts"][0]
    assert got["outcome"] == expected


@pytest.mark.system
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_consent_for_a_modern_backend_that_asks_for_input_itself() -> None:
    """The consent round's state is the gateway's, recognised as such although the backend is
    modern (whose own states pass through to it); each call to the backend is consented to,
    so its own round (a new call carrying its state) is asked consent again."""
    import sys

    modern = os.path.join(ROOT, "tests", "fixtures", "modern_server.py")
    backend = (f"[backends.mo]\ncommand = {json.dumps(sys.executable)}\n"
               f"args = [{json.dumps(modern)}]\nprotocol_mode = \"modern_only\"\n")
    extra = '[policy]\nrules = [{ match = "mo__ask_name", action = "ask" }]\n'
    with trio.fail_after(30):
        async with run_gateway(make_config(backend, extra=extra)) as gw, \
                connect(gw.url, initialize=False) as c:
            args = {"name": "mo__ask_name", "arguments": {}, "_meta": meta(FORM)}

            async def consented(params: dict[str, Any]) -> dict[str, Any]:
                asked = (await c.request("tools/call", params))["result"]
                assert list(asked["inputRequests"]) == ["consent"]
                return await c.request("tools/call",
                                       {**params, "inputResponses": {"consent": ACCEPT},
                                                      "requestState": asked["requestState"]})

            child = (await consented(args))["result"]  # the backend's own round, passed through
            assert (child["resultType"] == "input_required"
                    and list(child["inputRequests"]) == ["user_name"])
            name = {"user_name": {"action": "accept", "content": {"name": "Ada"}}}
            done = await consented({**args, "inputResponses": name,
                                    "requestState": child["requestState"]})
            assert done["result"]["content"][0]["text"] == "Hello, Ada"


@pytest.mark.system
async def test_silence_on_real_stateless_http_ends_the_flow_and_its_connections(
        tmp_path: Path) -> None:
    transcript = tmp_path / "fx.jsonl"
    cfg = make_config(fixture_backend("fx", env={"FIXTURE_TRANSCRIPT": str(transcript)}),
                      extra=ASK.replace("30.0", "0.5"))
    async with run_gateway(cfg) as gw, httpx.AsyncClient() as c:
        port = gw.bound.admin_port
        state = consent_asked(await post(c, gw.http_url, 1, "silent"), "silent")
        with trio.fail_after(5):  # the parked call and its flow end by themselves
            await wait_status(port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
        assert await metric(port, "mcp_gateway_server_requests_total", backend="_gateway",
                            method="elicitation/create", outcome="timeout") == 1
        r = await post(c, gw.http_url, 2, "silent", inputResponses={"consent": ACCEPT},
                       requestState=state)
        assert invalid_state(r), r.text  # too late: nothing runs
    assert echoed(transcript) == []
