"""Hostile clients of era bridging (gateway.core.bridge, gateway.protocol.mrtr) on an in-process
gateway with real sockets and children: forged ``requestState`` values, and what a flow leaves
behind.  Each hostile request gets a specific answer, no traceback is logged, and the gateway goes
on serving."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio
from helpers import fixture_backend, make_config, run_gateway, wait_status

from gateway import events

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

V = "2026-07-28"
CAPS = {"elicitation": {}, "sampling": {}, "roots": {}}
ANSWER = {"srv-1": {"action": "accept", "content": {"answer": "A"}}}


def _headers(name: str) -> dict[str, str]:
    return {"accept": "application/json, text/event-stream", "content-type": "application/json",
            "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": name}


def _body(name: str, args: dict[str, Any], id: int = 1, **extra: Any) -> bytes:
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": CAPS}
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                       "params": {"name": name, "arguments": args, **extra,
                                  "_meta": meta}}).encode()


def _invalid_state(r: httpx.Response) -> bool:
    error = r.json().get("error") or {}
    return (r.status_code == 400 and error.get("code") == -32602
            and error["data"]["reason"] == "invalid_state")


async def test_a_non_ascii_request_state_is_invalid_state_not_a_dropped_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    """A state with non-ASCII characters after this replica's id reached the HMAC code, which
    raised (UnicodeEncodeError / TypeError): a traceback, and the connection dropped unanswered."""
    caplog.set_level(logging.ERROR)
    async with run_gateway(make_config(fixture_backend("fx", sharing="per-session"),
                                       gateway='replica_id = "r7"')) as gw, \
            httpx.AsyncClient(timeout=10) as c:
        r = await c.post(gw.http_url, headers=_headers("fx__elicit"),
                         content=_body("fx__elicit", {"message": "m"}))
        state = r.json()["result"]["requestState"]
        _, payload, mac = state.split(".")
        forged_states = (f"r7.\u00e9{payload}.{mac}", f"r7.{payload}.\u00e9{mac[1:]}",
                         "r7.\u00e9.\u00e9")
        for forged in forged_states:
            r = await c.post(gw.http_url, headers=_headers("fx__elicit"),
                             content=_body("fx__elicit", {"message": "m"}, id=2, inputResponses={},
                                           requestState=forged))
            assert _invalid_state(r), r.text
        # the genuine state still completes its call
        r = await c.post(gw.http_url, headers=_headers("fx__elicit"),
                         content=_body("fx__elicit", {"message": "m"}, id=3, requestState=state,
                                       inputResponses=ANSWER))
        assert r.json()["result"]["resultType"] == "complete", r.text
        with trio.fail_after(5):
            await wait_status(gw.bound.admin_port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]


async def test_a_caller_queued_behind_a_parked_flow_on_an_affine_backend_may_hang_up(
        caplog: pytest.LogCaptureFixture) -> None:
    """A parked flow holds its affine child; a modern call queued for that child whose client
    hangs up had its waiter removed twice (the session's drop, then the waiting task's own
    cleanup): ValueError, logged as a failed call with a traceback."""
    caplog.set_level(logging.ERROR)
    async with run_gateway(make_config(fixture_backend("fx", sharing="affine"))) as gw, \
            httpx.AsyncClient(timeout=10) as c:
        r = await c.post(gw.http_url, headers=_headers("fx__elicit"),
                         content=_body("fx__elicit", {"message": "m"}))
        state = r.json()["result"]["requestState"]  # parked: fx/0 is this flow's
        mark = gw.events.count
        for i in range(3):
            body = _body("fx__echo", {"text": "queued"})
            head = "".join(f"{k}: {v}\r\n" for k, v in _headers("fx__echo").items())
            stream = await trio.open_tcp_stream("127.0.0.1", gw.bound.http_port)
            await stream.send_all(f"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\n{head}content-length: "
                                  f"{len(body)}\r\n\r\n".encode() + body)
            # queued for fx/0 (counted as started before it waits for an instance)
            await gw.events.wait(events.RequestStarted, backend="fx", since=mark, count=i + 1)
            await stream.aclose()
        await gw.events.wait(events.RequestFinished, tool="fx__echo", since=mark, count=3)
        r = await c.post(gw.http_url, headers=_headers("fx__elicit"),
                         content=_body("fx__elicit", {"message": "m"}, id=2, requestState=state,
                                       inputResponses=ANSWER))
        assert r.json()["result"]["resultType"] == "complete", r.text
        with trio.fail_after(5):
            await wait_status(gw.bound.admin_port, lambda st: st["client_requests_in_flight"] == 0
                              and st["connections"].get("http", 0) == 0)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR or rec.exc_info]


class _Abort(Exception):
    pass


async def test_a_gateway_cancelled_with_a_parked_flow_unwinds_cleanly() -> None:
    """Cancelled from outside (an error elsewhere unwinding the service), the child of a parked
    flow exits and ends its call; the flow's session then closed its connection from a task
    started in the listener's nursery, already closed: RuntimeError joined the unwinding."""
    with pytest.raises(BaseExceptionGroup) as caught:
        async with run_gateway(make_config(fixture_backend("fx"))) as gw, \
                httpx.AsyncClient(timeout=10) as c:
            r = await c.post(gw.http_url, headers=_headers("fx__elicit"),
                             content=_body("fx__elicit", {"message": "m"}))
            assert r.json()["result"]["resultType"] == "input_required"
            raise _Abort
    leaves: list[BaseException] = []
    stack: list[BaseException] = [caught.value]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        elif not isinstance(exc, trio.Cancelled):
            leaves.append(exc)
    assert [type(e) for e in leaves] == [_Abort], leaves
