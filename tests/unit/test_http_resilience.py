"""The ``http`` link's legacy-era robustness against an in-process h11 remote on trio memory
streams and the MockClock (the harness of the hostile-remote tests): an answer stream that ends
before its answer resumed with ``Last-Event-ID`` after the server's ``retry``; requests POSTed
by at most one worker task per request stream, none started per request; a call whose answer
never begins failed at ``max_call_duration``; a 400 saying the session is unknown, to the GET
stream, ends the session as expired."""

from __future__ import annotations

import json

import h11
import trio
import trio.testing
from regressions.test_remote_hostile import (
    Exchange,
    Hostile,
    note,
    open_link,
    plain,
    request,
    silent_calls,
)

from gateway.backend import http


def sse(*events: str) -> bytes:
    return "".join(event + "\n\n" for event in events).encode()


def answer(gid: int, text: str) -> str:
    return "data: " + json.dumps({"jsonrpc": "2.0", "id": gid, "result": {
        "content": [{"type": "text", "text": text}]}})


async def test_a_call_stream_ended_before_its_answer_is_resumed_after_the_servers_retry(
        autojump_clock: trio.testing.MockClock) -> None:
    ended: dict[int, float] = {}

    async def polling(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "tools/call":
            gid = ex.body["id"]
            await ex.head(200, [("content-type", "text/event-stream")])
            if gid == 2:  # a priming event, a progress, then the stream ends (SSE polling)
                progress = json.dumps({"jsonrpc": "2.0", "method": "notifications/progress",
                                       "params": {"progressToken": "t", "progress": 1}})
                await ex.data(sse("id: c1\nretry: 3000\ndata:", f"id: c2\ndata: {progress}"))
            else:  # gid 3: a priming event without retry, then nothing ever again
                await ex.data(sse("id: q1\ndata:"))
            await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))
            ended[gid] = trio.current_time()
            return
        if ex.method == "GET" and ex.headers.get("last-event-id") == "c2":
            await ex.head(200, [("content-type", "text/event-stream")])
            await ex.data(sse("id: c3\n" + answer(2, "resumed")))
            await trio.sleep_forever()  # a GET stream stays open: the link closes it
        if ex.method == "GET" and ex.headers.get("last-event-id") == "q1":
            await ex.head(200, [("content-type", "text/event-stream")])
            await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))  # at once, empty
            return
        await plain(server, ex)

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            server, link, receiver = await open_link(nursery, polling)
            link.send(request(2, "tools/call", {"name": "slow", "arguments": {}}), 2)
            await receiver.wait(lambda: receiver.answered(2))
            resumed = trio.current_time()
            gets = [ex for ex in server.seen if ex.headers.get("last-event-id") == "c2"]
            assert len(gets) == 1 and gets[0].headers["mcp-session-id"] == "s1"
            assert gets[0].headers["accept"] == "text/event-stream"
            assert 3.0 <= resumed - ended[2] < 3.5  # the server's retry (3000 ms) honoured
            mine = [(m, cause) for m, cause in receiver.messages if cause == 2]
            assert [m.get("method") for m, _ in mine] == ["notifications/progress", None]
            assert mine[-1][0]["result"]["content"][0]["text"] == "resumed"
            assert 2 not in receiver.failures and not receiver.ended_
            # A stream resumed again and again without ever a message: bounded, then it fails
            # (not retryable: the tool may have run).
            link.send(request(3, "tools/call", {"name": "lost", "arguments": {}}), 3)
            await receiver.wait(lambda: 3 in receiver.failures)
            assert len([ex for ex in server.seen if ex.headers.get("last-event-id") == "q1"]
                       ) == http.RESUME_ATTEMPTS
            assert receiver.failures[3].data["retryable"] is False
            took = trio.current_time() - ended[3]
            assert http.RESUME_ATTEMPTS * http.RESUME_WAIT <= took < http.RESUME_ATTEMPTS + 1
            assert len(server.posted("tools/call")) == 2  # never POSTed again
            nursery.cancel_scope.cancel()


async def test_safe_requests_are_retried_on_5xx_and_resets_a_tool_call_never(
        autojump_clock: trio.testing.MockClock) -> None:
    refuse = {"tools/list": [503, 502], "prompts/list": [503, 503, 503],
              "tools/call": [503], "resources/read": ["reset", "reset"]}
    times: dict[str, list[float]] = {}

    async def failing(server: Hostile, ex: Exchange) -> None:
        if ex.rpc in refuse:
            times.setdefault(ex.rpc, []).append(trio.current_time())
            if refuse[ex.rpc]:
                status = refuse[ex.rpc].pop(0)
                if status == "reset":
                    await trio.aclose_forcefully(ex.stream)  # read, then gone
                    return
                out = b"upstream \x00overloaded " + b"x" * 5000
                await ex.head(int(status), [("content-type", "text/html"),
                                            ("content-length", str(len(out)))])
                await ex.data(out)
                await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))
                return
        await plain(server, ex)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _server, link, receiver = await open_link(nursery, failing)
            link.send(request(2, "tools/list"), 2)
            await receiver.wait(lambda: receiver.answered(2) or 2 in receiver.failures)
            assert receiver.answered(2) and len(times["tools/list"]) == 3
            first, second, third = times["tools/list"]
            assert 0.5 * http.RETRY_PAUSE <= second - first <= http.RETRY_PAUSE + 0.01
            assert http.RETRY_PAUSE <= third - second <= 2 * http.RETRY_PAUSE + 0.01
            link.send(request(3, "prompts/list"), 3)  # 5xx every time: bounded, then fails
            await receiver.wait(lambda: 3 in receiver.failures)
            assert len(times["prompts/list"]) == 1 + http.RETRIES
            error = receiver.failures[3]
            assert (error.code, error.data["status"], error.data["retryable"]) == (-32001, 503,
                                                                                   True)
            link.send(request(4, "tools/call", {"name": "charge", "arguments": {}}), 4)
            await receiver.wait(lambda: 4 in receiver.failures)
            error = receiver.failures[4]
            assert len(times["tools/call"]) == 1  # never POSTed again: it may have run
            assert (error.code, error.data["status"], error.data["retryable"]) == (-32001, 503,
                                                                                   False)
            assert error.data["body"].startswith("upstream ?overloaded xxx")
            assert len(error.data["body"]) <= http.SNIPPET
            link.send(request(5, "resources/read", {"uri": "r://a"}), 5)
            await receiver.wait(lambda: receiver.answered(5) or 5 in receiver.failures)
            assert receiver.answered(5) and len(times["resources/read"]) == 3
            assert not receiver.ended_  # none of it ended the session
            nursery.cancel_scope.cancel()


def test_a_400_body_says_the_session_is_unknown_only_when_it_names_it() -> None:
    def error(message: object) -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": 1,
                           "error": {"code": -32000, "message": message}}).encode()

    assert http.unknown_session(error("Bad Request: No valid session ID provided"))
    assert http.unknown_session(error("Session not found"))
    assert http.unknown_session(b"unknown session id")  # not JSON: the body as text
    assert not http.unknown_session(error("Bad Request: invalid params"))
    assert not http.unknown_session(error({"session": "unknown"}))  # not a message
    assert not http.unknown_session(b"Bad Request")
    assert not http.unknown_session(b"")


async def test_requests_wait_in_order_for_one_of_the_request_stream_workers_none_per_call(
        autojump_clock: trio.testing.MockClock) -> None:
    release = trio.Event()

    async def holding(server: Hostile, ex: Exchange) -> None:
        if ex.rpc == "tools/call":
            await release.wait()
        await plain(server, ex)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server, link, receiver = await open_link(nursery, holding)
            assert link._nursery is not None
            burst = list(range(10, 10 + http.REQUEST_STREAMS + 5))
            for gid in burst:
                link.send(request(gid, "tools/call", {"name": "mine", "arguments": {}}), gid)
            while len(server.posted("tools/call")) < http.REQUEST_STREAMS:
                await server.changed.wait()
            await trio.sleep(5)
            held = {ex.body["id"] for ex in server.posted("tools/call")}
            assert held == set(burst[:http.REQUEST_STREAMS])  # the first ones; the rest wait
            assert link._requests.workers == http.REQUEST_STREAMS
            tasks = len(link._nursery.child_tasks)
            release.set()
            await receiver.wait(lambda: all(receiver.answered(gid) for gid in burst))
            for gid in range(100, 120):  # one by one: each taken by a parked worker
                link.send(request(gid, "tools/list"), gid)
                await receiver.answer(gid)
            assert len(link._nursery.child_tasks) <= tasks
            assert link._requests.workers == http.REQUEST_STREAMS and not receiver.failures
            nursery.cancel_scope.cancel()


async def test_a_small_pool_holds_at_most_max_connections_at_the_remote_and_loses_no_call(
        autojump_clock: trio.testing.MockClock) -> None:
    size, more = 6, 5  # max_connections, and calls beyond it
    release = trio.Event()

    async def holding(server: Hostile, ex: Exchange) -> None:
        if ex.method == "GET":  # the GET stream stays open, as a real server's does
            await ex.head(200, [("content-type", "text/event-stream")])
            await trio.sleep_forever()
        if ex.rpc == "tools/call" or ex.rpc == "notifications/roots/list_changed":
            await release.wait()
        await plain(server, ex)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server, link, receiver = await open_link(nursery, holding,
                                                     f"max_connections = {size}\n")
            streams = http.request_streams(size)
            calls = list(range(10, 10 + size + more))
            for gid in calls:
                link.send(request(gid, "tools/call", {"name": "mine", "arguments": {}}), gid)
            for _ in range(3):  # after the calls: they do not wait for these
                link.send(note("notifications/roots/list_changed"))
            await trio.sleep(5)
            # every connection but the DELETE's in use: the GET stream, the calls' streams
            # and the notifications'; the rest of the calls wait, in order
            assert server.live == size - 1 and server.most == size - 1
            assert {ex.body["id"] for ex in server.posted("tools/call")} == set(calls[:streams])
            assert len(server.posted("notifications/roots/list_changed")) == http.OTHER_STREAMS
            release.set()
            await receiver.wait(lambda: all(receiver.answered(gid) for gid in calls))
            assert not receiver.failures and not receiver.ended_
            assert sorted(ex.body["id"] for ex in server.posted("tools/call")) == calls  # once
            assert len(server.posted("notifications/roots/list_changed")) == 3
            await link.close()
            assert [ex.method for ex in server.seen].count("DELETE") == 1
            assert server.most <= size
            nursery.cancel_scope.cancel()


async def test_a_call_whose_answer_never_begins_fails_at_max_call_duration_the_session_goes_on(
        autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(10**5):
        async with trio.open_nursery() as nursery:
            _, link, receiver = await open_link(nursery, silent_calls)
            start = trio.current_time()
            link.send(request(2, "tools/call", {"name": "mine", "arguments": {}}), 2)
            await receiver.answer(2)
            assert trio.current_time() - start == link._cfg.max_call_duration
            assert "within max_call_duration" in receiver.failures[2].message
            assert not receiver.ended_  # the link lives on
            link.send(request(3, "tools/list"), 3)
            await receiver.answer(3)
            assert receiver.answered(3)
            nursery.cancel_scope.cancel()


async def test_the_get_stream_reopened_to_a_400_saying_the_session_is_unknown_ends_it_expired(
        autojump_clock: trio.testing.MockClock) -> None:
    # server-everything answers a GET carrying a session it ended with a 400 and a JSON-RPC
    # error: the GET stream is not "refused", the session expired (renewed at once).
    async def forgetting(server: Hostile, ex: Exchange) -> None:
        if ex.method == "GET" and sum(e.method == "GET" for e in server.seen) == 1:
            await ex.head(200, [("content-type", "text/event-stream")])
            await ex.data(b": open\n\n")
            await ex.stream.send_all(ex.conn.send(h11.EndOfMessage()))  # it ends
        elif ex.method == "GET":
            await ex.json({"jsonrpc": "2.0", "id": None, "error": {
                "code": -32000, "message": "Bad Request: No valid session ID provided"}},
                status=400)
        else:
            await plain(server, ex)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server, link, receiver = await open_link(nursery, forgetting)
            await receiver.wait(lambda: receiver.ended_)
            assert sum(e.method == "GET" for e in server.seen) == 2
            end = await link.close()
            assert end.expired and "no longer knows the session (HTTP 400)" in end.detail, end
            nursery.cancel_scope.cancel()
