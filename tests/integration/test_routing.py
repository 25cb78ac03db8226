"""Routing through the gateway: colliding client ids and progress tokens across many
connections, cancellation, byte-exact payloads, local ping, and the gateway's own pagination.

Every connection uses a nonce of its own in every argument, and every payload is checked.  The
gateway runs in-process on virtual time (tests/memharness.py: memory backends, clients on memory
streams); one test stays on a real child and a real WebSocket (``system``): Unicode and a 1 MB
result byte-exact from the child's pipe to the client's frame.
"""

from __future__ import annotations

import json
import secrets
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio
import trio.testing
import trio_websocket
from helpers import Client, fixture_backend, make_config, run_gateway, text_of
from memharness import (
    TOOLS,
    backend,
    elapse,
    fixture_script,
    memory_config,
    running,
    sent,
    settle,
)

#: Tools the memory fixture lists by default (extra_tool only on demand).
FIXTURE_TOOLS = set(TOOLS) - {"extra_tool"}
Clock = trio.testing.MockClock


def nonce() -> str:
    return secrets.token_hex(6)


def call_msg(
    id: Any, tool: str, arguments: dict[str, Any], meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    params: dict[str, Any] = {"name": tool, "arguments": arguments}
    if meta is not None:
        params["_meta"] = meta
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}


def responses_in(c: Client) -> list[dict[str, Any]]:
    """Every response (result or error) the connection received, in order."""
    return [m for m in c.received if "method" not in m]


# ---- colliding request ids ------------------------------------------------------------------


@pytest.mark.parametrize("n_conns", [2, 16])
async def test_colliding_request_ids_each_connection_gets_only_its_own_responses(
    n_conns: int, autojump_clock: Clock
) -> None:
    cfg = memory_config(backend("fx"))
    ids: list[Any] = [
        *range(1, 21),
        *(f"r{i}" for i in range(1, 6)),
    ]  # same ids on every connection
    with trio.fail_after(60):
        async with running(cfg) as gw, AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(gw.connect()) for _ in range(n_conns)]
            nonces = [nonce() for _ in clients]
            for c in clients:
                c.responses.clear()
                c.received.clear()

            async def burst(c: Client, tag: str) -> None:
                for i in ids:
                    await c.send(call_msg(i, "fx__echo", {"message": f"{tag}/{i}"}))

            async with trio.open_nursery() as nursery:
                for c, tag in zip(clients, nonces, strict=True):
                    nursery.start_soon(burst, c, tag)
            for c in clients:
                await c.wait_for(lambda c=c: len(c.responses) >= len(ids), timeout=30)
            await settle()  # anything extra (or misrouted) would have arrived
            for c, tag in zip(clients, nonces, strict=True):
                got = responses_in(c)
                assert len(got) == len(ids), f"{len(got)} responses for {len(ids)} requests"
                assert sorted(map(str, (m["id"] for m in got))) == sorted(map(str, ids))
                assert [m for m in c.received if "method" in m] == []
                for i in ids:
                    r = c.responses[i]
                    assert "error" not in r, r
                    assert text_of(r) == f"{tag}/{i}"
                    assert r["result"]["structuredContent"] == {"message": f"{tag}/{i}"}


@pytest.mark.parametrize("n_conns", [2, 16])
async def test_colliding_progress_tokens_reach_only_their_connection_in_order(
        n_conns: int, autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    tokens: list[Any] = ["tok-a", "tok-b", 7]  # the same tokens (and request ids) everywhere
    with trio.fail_after(60):
        async with running(cfg) as gw, AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(gw.connect()) for _ in range(n_conns)]
            tags = [nonce() for _ in clients]
            steps = [3 + k for k in range(n_conns)]  # distinct per connection: misrouting shows
            for c in clients:
                c.responses.clear()
                c.received.clear()

            async def run(c: Client, tag: str, n: int) -> None:
                for rid, token in enumerate(tokens, start=1):
                    await c.send(
                        call_msg(
                            rid,
                            "fx__progress",
                            {"steps": n, "delay": 0.01, "message": f"{tag}/{rid}"},
                            meta={"progressToken": token},
                        )
                    )

            async with trio.open_nursery() as nursery:
                for c, tag, n in zip(clients, tags, steps, strict=True):
                    nursery.start_soon(run, c, tag, n)
            for c in clients:
                await c.wait_for(lambda c=c: len(c.responses) >= len(tokens), timeout=30)
            await settle()
            for c, tag, n in zip(clients, tags, steps, strict=True):
                assert len(responses_in(c)) == len(tokens)
                notes = [m for m in c.received if "method" in m]
                assert all(m["method"] == "notifications/progress" for m in notes), notes
                assert len(notes) == n * len(tokens), (
                    f"expected {n * len(tokens)} progress, got {len(notes)}"
                )
                for rid, token in enumerate(tokens, start=1):
                    resp = c.responses[rid]
                    assert text_of(resp) == f"{tag}/{rid}"
                    mine = [
                        (i, m["params"])
                        for i, m in enumerate(c.received)
                        if m.get("method") == "notifications/progress"
                        and m["params"]["progressToken"] == token
                    ]
                    assert [p["progress"] for _, p in mine] == list(range(1, n + 1))
                    assert all(p["total"] == n for _, p in mine)
                    assert all(type(p["progressToken"]) is type(token) for _, p in mine)
                    result_at = c.received.index(resp)
                    assert all(i < result_at for i, _ in mine), "progress after the result"


# ---- cancellation ---------------------------------------------------------------------------


async def test_client_cancel_suppresses_the_response_and_the_connection_keeps_working(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw, gw.connect() as c:
            tag = nonce()
            # 0.8 s: if the gateway failed to cancel, the child's reply would arrive in time.
            await c.send(call_msg(50, "fx__sleep", {"seconds": 0.8, "message": tag}))
            await settle()
            (call,) = sent(gw.link("fx"), "tools/call")
            await c.notify("notifications/cancelled", {"requestId": 50, "reason": "test"})
            r = await c.call("fx__echo", {"message": f"{tag}-after"}, id=51)
            assert text_of(r) == f"{tag}-after"
            r = await c.call("fx__sleep", {"seconds": 0.05, "message": f"{tag}-sleep"}, id=52)
            assert text_of(r) == f"{tag}-sleep"
            await elapse(1.2)
            assert 50 not in c.responses, c.responses.get(50)
            assert [m["params"]["requestId"] for m in sent(gw.link("fx"), "notifications/cancelled")
                    ] == [call["id"]]
            assert not any(m.get("id") == 50 for m in c.received)
            # the id is free again on this connection
            r = await c.call("fx__echo", {"message": f"{tag}-reuse"}, id=50)
            assert text_of(r) == f"{tag}-reuse"


async def test_cancel_reaches_the_child(autojump_clock: Clock) -> None:
    """The child sees the cancellation: it withdraws its pending elicitation, which the gateway
    relays to the owner as notifications/cancelled for the gateway's own request id."""
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw, gw.connect(capabilities={"elicitation": {}}) as c:
            tag = nonce()
            await c.send(call_msg(9, "fx__elicit", {"message": f"q-{tag}", "nonce": tag}))
            req = await c.wait_for(
                lambda: next((m for m in c.requests if m["method"] == "elicitation/create"), None)
            )
            assert req["params"]["message"] == f"q-{tag}"
            assert req["params"]["_meta"]["fixture/nonce"] == tag
            await c.notify("notifications/cancelled", {"requestId": 9})
            note = await c.wait_for(
                lambda: next(
                    (m for m in c.notifications if m["method"] == "notifications/cancelled"), None
                ),
                timeout=5,
            )
            assert note["params"]["requestId"] == req["id"]
            await settle()
            assert 9 not in c.responses
            r = await c.call("fx__echo", {"message": tag})
            assert text_of(r) == tag


async def test_closed_connection_cancels_its_calls(autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw:
            a_tag = nonce()
            async with gw.connect() as b:
                async with gw.connect() as a:
                    for i in range(3):
                        await a.send(
                            call_msg(i + 1, "fx__sleep", {"seconds": 30, "message": f"{a_tag}-{i}"})
                        )
                    await settle()
                # a is closed with three calls in flight
                tag = nonce()
                start = trio.current_time()
                r = await b.call("fx__echo", {"message": tag})
                assert text_of(r) == tag
                assert trio.current_time() == start
                await settle()
                assert gw.metric("mcp_gateway_requests_total", method="tools/call", backend="fx",
                                 outcome="cancelled", principal="_none") == 3
                # the child was told to cancel exactly those three calls
                lines = gw.link("fx").received
                a_gids = {
                    m["id"]
                    for m in lines
                    if m.get("method") == "tools/call"
                    and m["params"]["arguments"].get("message", "").startswith(a_tag)
                }
                assert len(a_gids) == 3
                cancelled = [
                    m["params"]["requestId"]
                    for m in lines
                    if m.get("method") == "notifications/cancelled"
                ]
                assert sorted(cancelled) == sorted(a_gids)
                r = await b.call("fx__echo", {"message": tag + "2"})
                assert text_of(r) == tag + "2"


async def test_client_ids_and_progress_tokens_never_reach_the_child(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"))
    with trio.fail_after(30):
        async with running(cfg) as gw, gw.connect() as a, gw.connect() as b:
            secret = nonce()  # only ever in ids and tokens, never in arguments
            args_tag = nonce()
            for who, c in (("a", a), ("b", b)):
                for i in range(3):
                    await c.send(
                        call_msg(
                            f"id-{secret}-{i}",
                            "fx__progress",
                            {"steps": 2, "delay": 0.01, "message": f"{args_tag}-{i}"},
                            meta={"progressToken": f"tok-{secret}-{i}"},
                        )
                    )
                await c.send(
                    call_msg(
                        f"id-{secret}-sleep",
                        "fx__sleep",
                        {"seconds": 30, "message": f"{args_tag}-{who}"},
                    )
                )
            for c in (a, b):
                await c.wait_for(
                    lambda c=c: (
                        len(c.responses) >= 4
                        and len(
                            [m for m in c.notifications if m["method"] == "notifications/progress"]
                        )
                        == 6
                    )
                )
            for c in (a, b):
                assert {m["params"]["progressToken"] for m in c.notifications} == {
                    f"tok-{secret}-{i}" for i in range(3)
                }
            await a.notify("notifications/cancelled", {"requestId": f"id-{secret}-sleep"})
            await settle()
            lines = gw.link("fx").received
            assert secret not in json.dumps(lines)
            calls = [m for m in lines if m.get("method") == "tools/call"]
            assert len(calls) == 8
            gids = [m["id"] for m in calls]
            assert all(isinstance(g, int) for g in gids) and len(set(gids)) == 8
            tokens = [
                m["params"]["_meta"]["progressToken"]
                for m in calls
                if m["params"]["name"] == "progress"
            ]
            assert len(set(tokens)) == 6  # the colliding client tokens became six distinct ones
            (a_sleep,) = [
                m["id"] for m in calls if m["params"]["arguments"].get("message") == f"{args_tag}-a"
            ]
            cancels = [
                m["params"]["requestId"]
                for m in lines
                if m.get("method") == "notifications/cancelled"
            ]
            assert cancels == [a_sleep]  # a's sleep only, under its gateway id
            assert f"id-{secret}-sleep" not in a.responses
            assert text_of(await b.call("fx__echo", {"message": args_tag})) == args_tag


# ---- payloads -------------------------------------------------------------------------------

UNICODE = (
    "héllo wörld ✓ 日本語 عربى 𝄞 🎉👩‍👩‍👧 e\u0301 \u2028\u2029 "
    '"quoted" \\back\\slash\n\ttab \u0000 end'
)


@pytest.mark.system
async def test_unicode_and_a_1mb_result_pass_through_byte_exact() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with (
            run_gateway(cfg) as gw,
            trio_websocket.open_websocket_url(
                gw.url, subprotocols=["mcp"], max_message_size=16 * 2**20
            ) as ws,
        ):
            await ws.send_message(
                json.dumps(
                    {
                        "jsonrpc": "2.0",
                        "id": 1,
                        "method": "initialize",
                        "params": {
                            "protocolVersion": "2025-11-25",
                            "capabilities": {},
                            "clientInfo": {"name": "t", "version": "0"},
                        },
                    }
                )
            )
            assert json.loads(await ws.get_message())["id"] == 1
            await ws.send_message(
                json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
            )

            async def exchange(id: int, tool: str, arguments: dict[str, Any]) -> str:
                # ensure_ascii=False: raw UTF-8 on the wire toward the gateway
                await ws.send_message(json.dumps(call_msg(id, tool, arguments), ensure_ascii=False))
                while True:
                    raw = await ws.get_message()
                    assert isinstance(raw, str)
                    if json.loads(raw).get("id") == id:
                        return raw

            tag = nonce()
            message = f"{tag} {UNICODE} " * 200
            raw = await exchange(2, "fx__echo", {"message": message})
            # the fixture writes json.dumps(result, separators=(",", ":")): it must arrive as is
            expected = json.dumps(
                {
                    "content": [{"type": "text", "text": message}],
                    "structuredContent": {"message": message},
                },
                separators=(",", ":"),
            )
            assert raw.endswith(',"result":' + expected + "}"), raw[:300]
            assert json.loads(raw)["result"]["content"][0]["text"] == message

            size = 1_000_000
            raw = await exchange(3, "fx__big", {"size": size})
            expected = json.dumps(
                {"content": [{"type": "text", "text": "x" * size}]}, separators=(",", ":")
            )
            assert raw.endswith(',"result":' + expected + "}")
            assert json.loads(raw) == {"jsonrpc": "2.0", "id": 3, "result": json.loads(expected)}


async def test_ping_is_answered_by_the_gateway_itself(autojump_clock: Clock) -> None:
    # The backend never answers ping: a ping that reached it would hang.
    cfg = memory_config(backend("fx"))
    with trio.fail_after(20):
        async with running(cfg, {"fx": fixture_script(answer_pings=False)}) as gw:
            async with gw.connect(initialize=False) as c:
                r = await c.request("ping", id="p-before-init", timeout=2)
                assert r == {"jsonrpc": "2.0", "id": "p-before-init", "result": {}}
                await c.initialize()
                r = await c.request("ping", id=77, timeout=2)
                assert r == {"jsonrpc": "2.0", "id": 77, "result": {}}
                tag = nonce()
                assert text_of(await c.call("fx__echo", {"message": tag})) == tag
                assert sent(gw.link("fx"), "ping") == []  # neither ping reached it


async def test_a_tool_name_is_routed_however_its_json_is_written(autojump_clock: Clock) -> None:
    # The catalog finds a plainly written name by its JSON bytes; written with escapes, the name
    # is decoded and found the same; an unknown or non-string name is refused by name.
    cfg = memory_config(backend("fx"))
    with trio.fail_after(20):
        async with running(cfg, {"fx": fixture_script()}) as gw:
            async with gw.connect() as c:
                tag = nonce()
                await c.send('{"jsonrpc":"2.0","id":"esc","method":"tools/call","params":'
                             '{"name":"fx__\\u0065cho","arguments":{"message":"' + tag + '"}}}')
                assert text_of(await c.response("esc")) == tag
                assert text_of(await c.call("fx__echo", {"message": tag})) == tag
                r = await c.call("fx__nope", {})
                assert r["error"]["code"] == -32602
                assert r["error"]["message"] == "unknown tool 'fx__nope'"
                r = await c.request("tools/call", {"name": 7})
                assert r["error"]["code"] == -32602
                assert r["error"]["message"] == "tools/call: 'name' must be a string"
                r = await c.request("tools/call", {"arguments": {}})
                assert r["error"]["message"] == "tools/call: missing required parameter 'name'"


# ---- pagination -----------------------------------------------------------------------------


async def test_tools_list_pagination_follows_next_cursor_to_the_full_list(
        autojump_clock: Clock) -> None:
    cfg = memory_config(backend("fx"), gateway="page_size = 3")
    with trio.fail_after(20):
        async with running(cfg) as gw, gw.connect() as c:
            names: list[str] = []
            cursor = None
            pages = 0
            while True:
                r = await c.request("tools/list", {"cursor": cursor} if cursor is not None else {})
                assert "error" not in r, r
                tools = r["result"]["tools"]
                assert 1 <= len(tools) <= 3
                for t in tools:
                    assert isinstance(t["inputSchema"], dict)
                names += [t["name"] for t in tools]
                pages += 1
                cursor = r["result"].get("nextCursor")
                if cursor is None:
                    break
                assert isinstance(cursor, str) and cursor
                assert pages < 50
            assert len(names) == len(set(names))
            assert set(names) == {f"fx__{n}" for n in FIXTURE_TOOLS}
            assert pages == -(-len(FIXTURE_TOOLS) // 3)

            for bogus in (
                "bogus-cursor",
                "",
                "!!!",
                "dG9vbHM6OTk5",
            ):  # the last: base64 "tools:999"
                r = await c.request("tools/list", {"cursor": bogus})
                assert r["error"]["code"] == -32602, (bogus, r)
            r = await c.request("tools/list", {"cursor": 3})
            assert r["error"]["code"] == -32602
            # still serving
            tag = nonce()
            assert text_of(await c.call("fx__echo", {"message": tag})) == tag
