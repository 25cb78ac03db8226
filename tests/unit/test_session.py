"""ClientSession: the bounded outbound queue and server→client requests owned by one connection."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
import trio
import trio.testing
from msgspec import Raw

from gateway import errors
from gateway.core import session as session_module
from gateway.core.session import ClientSession, ServerRequest
from gateway.errors import CloseReason
from gateway.limits import ByteBudget
from gateway.protocol import jsonrpc, mcp
from gateway.protocol.era import Era
from gateway.protocol.session import SessionState


def session(capacity: int = 16, max_inflight: int = 4) -> ClientSession:
    return ClientSession("memory", outbound_capacity=capacity, max_inflight=max_inflight)


def drain(s: ClientSession) -> list[dict[str, Any]]:
    out = []
    while True:
        try:
            out.append(json.loads(s.outbound.receive_nowait()))
        except trio.WouldBlock:
            return out


def answer(rid: object, result: object = None, error: object = None) -> jsonrpc.Envelope:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid}
    if error is not None:
        msg["error"] = error
    else:
        msg["result"] = result if result is not None else {}
    return jsonrpc.decode(json.dumps(msg).encode())


# ---- outbound queue -----------------------------------------------------------------------


async def test_outbound_overflow_closes_the_connection() -> None:
    s = session(capacity=3)
    for i in range(3):
        assert s.send(b'{"n":%d}' % i)
    assert not s.closed.is_set()
    assert s.send(b'{"n":3}') is False  # never blocks: the slow client is cut off
    assert s.closed.is_set()
    assert s.close_reason == "overflow"
    assert s.send(b"{}") is False  # nothing more is queued after the close
    assert s.notify("notifications/message") is False
    assert [m["n"] for m in drain(s)] == [0, 1, 2]


async def test_queue_drained_in_time_never_overflows() -> None:
    s = session(capacity=2)
    for i in range(20):
        assert s.send(b'{"n":%d}' % i)
        assert json.loads(s.outbound.receive_nowait()) == {"n": i}
    assert not s.closed.is_set()


async def test_close_is_idempotent_and_keeps_the_first_reason() -> None:
    s = session()
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            s.run_in(nursery, cancel_scope=scope)
            s.close("shutdown")
            s.close("overflow")
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert s.close_reason == "shutdown"


async def test_conn_ids_are_minted_and_unique() -> None:
    ids = {session().conn_id for _ in range(100)}
    assert len(ids) == 100


# ---- server→client requests ---------------------------------------------------------------


async def test_open_request_sends_the_request_with_a_fresh_id() -> None:
    s = session(capacity=100)
    reqs = [s.open_request("elicitation/create", {"message": f"q{i}"}) for i in range(50)]
    sent = drain(s)
    assert len({r.id for r in reqs}) == 50
    assert [m["id"] for m in sent] == [r.id for r in reqs]
    assert all(m["method"] == "elicitation/create" for m in sent)
    assert [m["params"]["message"] for m in sent] == [f"q{i}" for i in range(50)]
    assert set(s.server_requests) == {r.id for r in reqs}


async def test_raw_params_pass_through() -> None:
    s = session()
    s.open_request("sampling/createMessage", Raw(b'{"maxTokens":12345678901234567890}'))
    raw = s.outbound.receive_nowait()
    assert b'"params":{"maxTokens":12345678901234567890}' in raw


async def test_request_ids_differ_between_sessions_and_are_refused_elsewhere() -> None:
    a, b = session(), session()
    ra, rb = a.open_request("roots/list", {}), b.open_request("roots/list", {})
    assert ra.id != rb.id  # same position in each counter, still different
    # b cannot answer a's request, even knowing a's id.
    assert b.on_answer(answer(ra.id)) == "refused"
    assert not ra.done.is_set()
    assert a.on_answer(answer(ra.id, {"roots": []})) == "accepted"
    assert ra.outcome == "answered"


async def test_on_answer_accepted_with_result_passes_raw_through() -> None:
    s = session()
    req = s.open_request("elicitation/create", {"message": "?"})
    env = jsonrpc.decode(
        b'{"jsonrpc":"2.0","id":"%s","result":{"action":"accept","content":{"n":1.0e10}}}'
        % req.id.encode()
    )
    assert s.on_answer(env) == "accepted"
    assert req.done.is_set() and req.outcome == "answered"
    assert req.result is not None
    assert bytes(req.result) == b'{"action":"accept","content":{"n":1.0e10}}'
    assert req.id not in s.server_requests


async def test_on_answer_accepted_with_error() -> None:
    s = session()
    req = s.open_request("sampling/createMessage", {})
    assert s.on_answer(answer(req.id, error={"code": -1, "message": "user said no"})) == "accepted"
    assert req.outcome == "error"
    assert req.error is not None and (req.error.code, req.error.message) == (-1, "user said no")


async def test_on_answer_late_after_finish() -> None:
    s = session()
    req = s.open_request("elicitation/create", {})
    s.cancel_request(req, "timeout", "the prompt timed out")
    assert s.on_answer(answer(req.id)) == "late"
    assert req.outcome == "timeout"  # the late answer changed nothing
    # A second answer to an answered request is late too.
    req2 = s.open_request("elicitation/create", {})
    assert s.on_answer(answer(req2.id)) == "accepted"
    assert s.on_answer(answer(req2.id)) == "late"


@pytest.mark.parametrize("rid", ["gw-000000-1", "nope", 1, 0, None])
async def test_on_answer_refused_for_unknown_ids(rid: object) -> None:
    s = session()
    req = s.open_request("elicitation/create", {})
    env = (
        answer(rid)
        if rid is not None
        else jsonrpc.decode(b'{"jsonrpc":"2.0","id":null,"error":{"code":-1,"message":"x"}}')
    )
    assert s.on_answer(env) == "refused"
    assert not req.done.is_set()


async def test_cancel_request_notifies_the_client_once() -> None:
    s = session()
    req = s.open_request("elicitation/create", {})
    drain(s)
    s.cancel_request(req, "owner_gone", "bye")
    s.cancel_request(req, "shutdown", "again")
    sent = drain(s)
    assert sent == [{"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": req.id, "reason": "bye"}}]
    assert req.outcome == "owner_gone"


async def test_end_all_requests() -> None:
    s = session()
    reqs = [s.open_request("roots/list", {}) for _ in range(3)]
    s.end_all_requests("owner_gone")
    assert all(r.outcome == "owner_gone" and r.done.is_set() for r in reqs)
    assert s.server_requests == {}
    assert all(s.on_answer(answer(r.id)) == "late" for r in reqs)


async def test_server_request_finish_is_exactly_once() -> None:
    req = ServerRequest("gw-1", "elicitation/create", {})
    calls: list[str | None] = []
    req.on_end.append(lambda r: calls.append(r.outcome))
    req.on_end.append(lambda r: calls.append("second callback"))
    assert req.finish("answered", result=Raw(b"{}")) is True
    assert req.finish("timeout") is False
    assert req.finish("answered", result=Raw(b'{"x":1}')) is False
    assert calls == ["answered", "second callback"]
    assert req.outcome == "answered" and req.result is not None and bytes(req.result) == b"{}"
    assert req.done.is_set()


async def test_waiters_wake_on_finish() -> None:
    s = session()
    req = s.open_request("elicitation/create", {})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(req.done.wait)
        await trio.testing.wait_all_tasks_blocked()
        s.on_answer(answer(req.id))
    assert req.outcome == "answered"


# ---- calls and progress -------------------------------------------------------------------


async def test_check_new_call_limits() -> None:
    s = session(max_inflight=2)
    s.check_new_call(1)
    s.inflight[1] = trio.CancelScope()
    with pytest.raises(errors.InvalidRequest):
        s.check_new_call(1)  # duplicate id in flight
    s.check_new_call("1")  # a string id is another id
    s.inflight["1"] = trio.CancelScope()
    with pytest.raises(errors.Overloaded) as info:
        s.check_new_call(3)
    assert info.value.code == errors.OVERLOADED


async def test_session_caps_default_to_nothing() -> None:
    s = session()
    assert not s.caps.allows("elicitation/create", {})
    assert not s.caps.allows("sampling/createMessage")
    assert msgspec.json.encode(s.caps.raw) == b"{}"


# ---- byte bounds --------------------------------------------------------------------------


async def test_outbound_bytes_bound_closes_the_connection() -> None:
    s = ClientSession("memory", outbound_capacity=512, max_inflight=4, outbound_bytes=1000)
    assert s.send(b"x" * 600)
    assert s.send(b"x" * 400)  # exactly at the bound
    assert s.queued_bytes == 1000 and not s.closed.is_set()
    s.sent(600)  # the writer wrote the first one: room again
    assert s.send(b"x" * 600)
    assert s.send(b"x") is False
    assert s.close_reason == "overflow"


async def test_sessions_charge_the_shared_budget_and_release_on_drop() -> None:
    budget = ByteBudget(10_000)
    a = ClientSession("memory", outbound_capacity=512, max_inflight=4, budget=budget)
    b = ClientSession("memory", outbound_capacity=512, max_inflight=4, budget=budget)
    a.send(b"x" * 3000)
    b.send(b"y" * 1000)
    assert budget.total == 4000
    b.sent(1000)
    assert budget.total == 3000
    a.check_new_call(1, 7000)  # fits exactly
    with pytest.raises(errors.Overloaded) as info:
        b.check_new_call(1, 7001)
    assert info.value.error_data() == {"reason": "overloaded", "limit": 10_000}
    a.send(b"x" * 7001)  # a reply cannot be refused: the biggest holder is cut off
    assert a.close_reason == "overflow" and not b.closed.is_set()
    a.drop_outbound()
    b.drop_outbound()
    assert budget.total == 0


async def test_an_open_listen_is_not_a_call_that_may_ask_for_input() -> None:
    """``calls()``: what a child's server request may come from (ownership, bridge) — every
    request in flight but an open ``subscriptions/listen``, which no child ever sees."""
    s = session()
    listen, call = (SimpleNamespace(req=SimpleNamespace(method=m))
                    for m in ("subscriptions/listen", "tools/call"))
    s.inflight.update({"l": listen, 1: call})
    assert s.calls() == [call]


async def test_the_session_state_moves_only_through_its_transitions() -> None:
    """The negotiated fields change through the session's own methods; a second initialize is
    refused with ``already_initialized`` and the first revision stays."""
    s = session()
    assert s.state is SessionState.AWAITING_INIT and s.era is None and not s.initialized
    s.choose_era(Era.LEGACY)
    assert s.state is SessionState.AWAITING_INIT and s.era is Era.LEGACY
    with pytest.raises(RuntimeError):
        s.choose_era(Era.MODERN)  # pinned once
    s.initialize("2025-06-18", mcp.ClientCaps({"sampling": {}}))
    assert s.state is SessionState.READY_LEGACY and s.initialized
    assert s.protocol_version == "2025-06-18" and s.caps.sampling
    with pytest.raises(errors.InvalidRequest) as info:
        s.initialize("2025-11-25", mcp.ClientCaps({}))
    assert info.value.reason == "already_initialized" and s.protocol_version == "2025-06-18"
    assert s.set_log_level("info") and not s.set_log_level("info") and s.log_level == "info"
    s.drain(5.0)
    assert s.state is SessionState.DRAINING and s.refused_at == 5.0
    s.close(CloseReason.SHUTDOWN)
    assert s.state is SessionState.CLOSED and s.closed.is_set()
    s.close(CloseReason.OVERFLOW)
    assert s.close_reason is CloseReason.SHUTDOWN


async def test_a_modern_session_is_ready_at_once_and_bridged_once() -> None:
    s = session()
    s.choose_era(Era.MODERN)
    assert s.state is SessionState.READY_MODERN and not s.initialized
    first, second = cast(Any, SimpleNamespace()), cast(Any, SimpleNamespace())  # identities
    s.bridge_with(first)
    s.bridge_with(second)
    assert s.mrtr is first


def test_connection_ids_stay_random_and_distinct_across_entropy_refills() -> None:
    ids = [session_module.mint_conn_id() for _ in range(3 * session_module.ENTROPY_CHUNK // 4)]
    tails = [i.partition("-")[2] for i in ids]
    assert all(len(t) == 8 and int(t, 16) >= 0 for t in tails)
    assert len(set(tails)) > len(tails) * 0.99  # 32 random bits each: collisions are rare
