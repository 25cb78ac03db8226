"""A hostile remote on real loopback TCP against the request worker that watches the connection
it kept and reads the answer to a request written on it from the sender's task: answers cut
at odd places, bytes after the body, the connection closed right after an answer, answers
over the size limit, many calls at once."""

from __future__ import annotations

import gc
import json
from typing import Any

import h11
import pytest
import trio
import trio.testing
from fixtures.link_recorder import request
from helpers import fixture_backend, make_config, run_gateway
from test_remote_hostile import Exchange, Hostile, close_tcp, open_tcp_link, plain

from gateway.core.session import ClientSession
from gateway.protocol import http1
from gateway.protocol.sse import EventTooLarge, SseDecoder


def call(gid: int, name: str = "mine") -> bytes:
    return request(gid, "tools/call", {"name": name, "arguments": {}})


async def test_sse_answers_cut_at_crlf_with_crlf_lines_and_a_nul_id_keep_the_connection() -> None:
    # A chunked SSE answer, each TCP write ending exactly at a chunk's CRLF or inside it, the
    # event's lines ending in CRLF and its id holding a NUL: the answer comes whole, the
    # connection is kept (watched) and carries the next calls, each POSTed once.
    async def cut(server: Hostile, ex: Exchange) -> None:
        if ex.rpc != "tools/call":
            return await plain(server, ex)
        answer = json.dumps({"jsonrpc": "2.0", "id": ex.body["id"], "result": {}}).encode()
        event = b"event: message\r\nid: a\0b\r\ndata: " + answer + b"\r\n\r\n"
        raw = ex.conn.send(h11.Response(status_code=200, headers=[
            ("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]))
        raw += ex.conn.send(h11.Data(data=event[:7])) + ex.conn.send(h11.Data(data=event[7:]))
        raw += ex.conn.send(h11.EndOfMessage())
        cuts = sorted({i + 1 for i in range(len(raw) - 1) if raw[i:i + 2] == b"\r\n"}
                      | {i + 2 for i in range(len(raw) - 1) if raw[i:i + 2] == b"\r\n"})
        at = 0
        for stop in [*cuts[::3], len(raw)]:
            if stop > at:
                await ex.stream.send_all(raw[at:stop])
                at = stop
                await trio.testing.wait_all_tasks_blocked()  # each piece read alone

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, cut)
            for gid in range(3, 8):
                await trio.testing.wait_all_tasks_blocked()
                link.send(call(gid), gid)
                await receiver.answer(gid)
                assert receiver.answered(gid), receiver.failures
            assert len(server.posted("tools/call")) == 5 and server.connections <= 3
            assert not receiver.failures and not receiver.ended_
            await close_tcp(nursery, link, ends)


async def test_bytes_after_an_answer_or_a_close_right_after_it_do_not_repeat_a_call() -> None:
    # A tools/call answered, then junk after its body in the same write, or the connection
    # closed right after the answer, or junk coming later while the worker watches: each call
    # delivered once, POSTed once, and the next calls go on a sound connection.
    junk_sent = {gid: trio.Event() for gid in range(3, 15)}

    async def odd(server: Hostile, ex: Exchange) -> None:
        if ex.rpc != "tools/call":
            return await plain(server, ex)
        gid = ex.body["id"]
        out = json.dumps({"jsonrpc": "2.0", "id": gid, "result": {"n": gid}}).encode()
        raw = ex.conn.send(h11.Response(status_code=200, headers=[
            ("content-type", "application/json"), ("content-length", str(len(out)))]))
        raw += ex.conn.send(h11.Data(data=out)) + ex.conn.send(h11.EndOfMessage())
        if gid % 3 == 0:  # junk after the body, in the same write
            await ex.stream.send_all(raw + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        elif gid % 3 == 1:  # closed right after the answer
            await ex.stream.send_all(raw)
            await trio.aclose_forcefully(ex.stream)
        else:  # junk later, while the worker watches
            await ex.stream.send_all(raw)
            await trio.testing.wait_all_tasks_blocked()  # the answer read, watched
            await ex.stream.send_all(b"\r\n\r\nxx")
        junk_sent[gid].set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, odd)
            for gid in range(3, 15):
                link.send(call(gid), gid)
                await receiver.answer(gid)
                assert receiver.answered(gid), receiver.failures
                await junk_sent[gid].wait()
                await trio.testing.wait_all_tasks_blocked()  # what came after it read
            ids = [ex.body["id"] for ex in server.posted("tools/call")]
            assert ids == list(range(3, 15))
            answers = [m["id"] for m, _ in receiver.messages if "n" in m.get("result", {})]
            assert answers == list(range(3, 15))
            assert not receiver.failures and not receiver.ended_
            await close_tcp(nursery, link, ends)


async def test_an_answer_just_over_the_limit_in_one_read_fails_that_call_only() -> None:
    # An answer one byte over max_message_bytes, its whole body in one write (plain and SSE):
    # that call fails as too large, POSTed once; the worker's next calls are answered.
    async def big(server: Hostile, ex: Exchange) -> None:
        if ex.rpc != "tools/call" or ex.body["params"]["name"] != "big":
            return await plain(server, ex)
        gid = ex.body["id"]
        head = json.dumps({"jsonrpc": "2.0", "id": gid, "result": {"x": ""}}).encode()
        pad = b"y" * (65536 + 1 - len(head))
        out = head[:-3] + pad + head[-3:]
        assert len(out) == 65537
        if gid % 2:
            out = b"event: message\ndata: " + out + b"\n\n"
            headers = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]
        else:
            headers = [("content-type", "application/json"), ("content-length", str(len(out)))]
        raw = ex.conn.send(h11.Response(status_code=200, headers=headers))
        raw += ex.conn.send(h11.Data(data=out)) + ex.conn.send(h11.EndOfMessage())
        await ex.stream.send_all(raw)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, big)
            for gid in range(3, 9):
                await trio.testing.wait_all_tasks_blocked()
                link.send(call(gid, "big" if gid < 5 or gid == 7 else "mine"), gid)
                await receiver.answer(gid)
            assert set(receiver.failures) == {3, 4, 7}
            assert all("max_message_bytes" in receiver.failures[g].message for g in (3, 4, 7))
            assert all(receiver.answered(g) for g in (5, 6, 8))
            assert len(server.posted("tools/call")) == 6 and not receiver.ended_
            await close_tcp(nursery, link, ends)
    decoder = SseDecoder(30)  # an event over the decoder's limit, whole in one chunk
    assert decoder.feed(b"data: 1\n\n") == [b"1"]
    with pytest.raises(EventTooLarge):
        decoder.feed(b"data: " + b"x" * 30 + b"\n\n")


async def test_many_calls_at_once_each_posted_and_answered_once() -> None:
    # Far more calls than request workers, some answers saying the connection closes after
    # them (then it closes): each call POSTed once and answered once.
    async def some_close(server: Hostile, ex: Exchange) -> None:
        if ex.rpc != "tools/call":
            return await plain(server, ex)
        gid = ex.body["id"]
        for _ in range(gid % 5):  # answers out of order
            await trio.lowlevel.checkpoint()
        await ex.json({"jsonrpc": "2.0", "id": gid, "result": {}},
                      headers=(("connection", "close"),) if gid % 7 == 0 else ())

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server, link, receiver, ends = await open_tcp_link(nursery, some_close)
            for round_ in range(3):
                gids = range(100 * (round_ + 1), 100 * (round_ + 1) + 60)
                for gid in gids:
                    link.send(call(gid), gid)
                for gid in gids:
                    await receiver.answer(gid)
                await trio.testing.wait_all_tasks_blocked()
            ids = sorted(ex.body["id"] for ex in server.posted("tools/call"))
            want = [g for r in range(3) for g in range(100 * (r + 1), 100 * (r + 1) + 60)]
            assert ids == want
            got = sorted(m["id"] for m, _ in receiver.messages
                         if isinstance(m.get("id"), int) and m["id"] >= 100)
            assert got == want and not receiver.failures and not receiver.ended_
            await close_tcp(nursery, link, ends)


V = "2026-07-28"


def _post(gid: int, method: str, params: dict[str, Any], caps: Any = None) -> bytes:
    body = json.dumps({"jsonrpc": "2.0", "id": gid, "method": method, "params": {
        **params, "_meta": {"io.modelcontextprotocol/protocolVersion": V,
                            "io.modelcontextprotocol/clientCapabilities": caps or {}}}}).encode()
    name = f"mcp-name: {params['name']}\r\n" if method == "tools/call" else ""
    return (f"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"accept: application/json, text/event-stream\r\nmcp-protocol-version: {V}\r\n"
            f"mcp-method: {method}\r\n{name}content-length: {len(body)}\r\n\r\n"
            ).encode() + body


async def _answers(stream: trio.SocketStream, n: int, slow: bool) -> list[Any]:
    """``n`` answers read off ``stream`` in order (each whole: its JSON, or its SSE data)."""
    buf = bytearray()
    out: list[Any] = []
    while len(out) < n:
        while (end := buf.find(b"\r\n\r\n")) < 0:
            got = await stream.receive_some(1 << 14)
            assert got, f"closed after {len(out)} answers"
            buf += got
        head = http1.parse_response_head(bytes(buf[:end + 2]))
        assert head is not None and head.status == 200, bytes(buf[:end + 2])
        del buf[:end + 4]
        body, reader = bytearray(), http1.BodyReader(head.length)
        while True:
            body += reader.take(buf)
            if reader.done:
                break
            got = await stream.receive_some(1 << 14)
            assert got, f"closed within answer {len(out)}"
            buf += got
            if slow:
                await trio.testing.wait_all_tasks_blocked()  # its sender blocks
        if head.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in bytes(body).split(b"\n") if line.startswith(b"data: ")]
            out.append(json.loads(events[-1]))
        else:
            out.append(json.loads(body))
    return out


@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_stateless_posts_pipelined_read_slowly_closed_mid_answer_leave_nothing() -> None:
    # Many stateless POSTs pipelined on one keep-alive connection, large answers among them,
    # read slowly: each answered whole, in order; POSTs whose client closes while the call runs
    # or mid-answer cancel or end it; after hundreds of such calls no flow, session or call
    # is left (but the last one's: its connection waits for the next request).
    gc.collect()  # what earlier tests left is not counted in here
    cfg = make_config(fixture_backend("fx"))
    async with run_gateway(cfg) as gw:
        port = gw.bound.http_port
        calls = [("tools/call", {"name": "fx__big", "arguments": {"size": 400_000}}),
                 ("tools/call", {"name": "fx__echo", "arguments": {"message": "m"}}),
                 ("tools/list", {})]
        with trio.fail_after(60):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"".join(_post(gid, *calls[gid % 3]) for gid in range(12)))
            got = await _answers(stream, 12, slow=True)
            assert [a["id"] for a in got] == list(range(12))
            for a in got:
                result = a["result"]
                if a["id"] % 3 == 0:
                    assert len(result["content"][0]["text"]) == 400_000
                elif a["id"] % 3 == 1:
                    assert result["content"][0]["text"] == "m"
                else:
                    assert result["tools"]
            for _ in range(3):  # closed while the call runs, then mid-answer
                sleeper = await trio.open_tcp_stream("127.0.0.1", port)
                await sleeper.send_all(_post(1, "tools/call", {
                    "name": "fx__sleep", "arguments": {"seconds": 30}}))
                await gw.status_until(lambda st: st["client_requests_in_flight"] == 1)
                await trio.aclose_forcefully(sleeper)
                big = await trio.open_tcp_stream("127.0.0.1", port)
                await big.send_all(_post(2, *calls[0]))
                assert await big.receive_some(100)
                await trio.aclose_forcefully(big)
            await gw.status_until(lambda st: st["client_requests_in_flight"] == 0
                                  and st["connections"].get("http", 0) == 0)
            before = {id(o) for o in gc.get_objects() if isinstance(o, ClientSession)}
            for _ in range(10):
                await stream.send_all(b"".join(_post(gid, *calls[1]) for gid in range(40)))
                assert len(await _answers(stream, 40, slow=False)) == 40
            await gw.status_until(lambda st: st["client_requests_in_flight"] == 0
                                  and st["connections"].get("http", 0) == 0)
            gc.collect()
            alive = [o for o in gc.get_objects()
                     if isinstance(o, ClientSession) and id(o) not in before]
            assert len(alive) <= 1, alive  # the last call's: its connection waits for the next
            await trio.aclose_forcefully(stream)


async def test_an_input_required_flow_survives_its_posts_connections_closing_abruptly() -> None:
    # A bridged elicitation: the first POST's connection reset right after its input_required
    # answer, the retry on a new connection completes the call (each round); a POST reset
    # before the child asks ends its flow.  Nothing is left after.
    caps = {"elicitation": {}, "sampling": {}, "roots": {}}
    ask = {"name": "fx__elicit", "arguments": {"message": "name?"}}
    async with run_gateway(make_config(fixture_backend("fx"))) as gw:
        port = gw.bound.http_port
        with trio.fail_after(60):
            for round_ in range(3):
                first = await trio.open_tcp_stream("127.0.0.1", port)
                await first.send_all(_post(1, "tools/call", ask, caps))
                got, = await _answers(first, 1, slow=False)
                await trio.aclose_forcefully(first)
                result = got["result"]
                assert result["resultType"] == "input_required", got
                (key, _), = result["inputRequests"].items()
                retry = {**ask, "requestState": result["requestState"], "inputResponses": {
                    key: {"action": "accept", "content": {"answer": f"a{round_}"}}}}
                second = await trio.open_tcp_stream("127.0.0.1", port)
                await second.send_all(_post(2, "tools/call", retry, caps))
                done, = await _answers(second, 1, slow=True)
                assert done["result"]["resultType"] == "complete", done
                assert json.loads(done["result"]["content"][0]["text"])["content"] == {
                    "answer": f"a{round_}"}
                await trio.aclose_forcefully(second)
                await gw.status_until(lambda st: st["client_requests_in_flight"] == 0
                                      and st["connections"].get("http", 0) == 0)
            late = await trio.open_tcp_stream("127.0.0.1", port)  # reset before the ask
            await late.send_all(_post(3, "tools/call", {
                "name": "fx__elicit", "arguments": {"message": "m", "delay": 30}}, caps))
            await gw.status_until(lambda st: st["client_requests_in_flight"] == 1)
            await trio.aclose_forcefully(late)
            await gw.status_until(lambda st: st["client_requests_in_flight"] == 0
                                  and st["connections"].get("http", 0) == 0)
