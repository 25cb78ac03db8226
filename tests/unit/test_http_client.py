"""The remote backends' HTTP/1.1 client and SSE reader, bounded: on trio memory streams and the
MockClock (no socket, no real time)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from gateway.backend import httpclient
from gateway.protocol.sse import EventTooLarge, SseDecoder


async def serve_once(stream: trio.abc.Stream, answer: list[bytes], pause: float = 0.0) -> None:
    """Read one request head, then send the ``answer`` pieces, ``pause`` seconds apart."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    for piece in answer:
        await trio.sleep(pause)  # virtual-time: the tests run on autojump_clock
        await stream.send_all(piece)


@pytest.mark.parametrize("case", ["oversize_body", "slow_head", "slow_body", "ok_kept_alive"])
async def test_client_bounds(case: str, autojump_clock: trio.testing.MockClock) -> None:
    client, server = trio.testing.memory_stream_pair()
    conn = httpclient.Connection(client, "remote:1")
    body = b'{"jsonrpc":"2.0","id":1,"result":{}}'
    answers = {
        "oversize_body": ([b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                           b"content-length: 5000\r\n\r\n", b"x" * 5000], 0.0),
        "slow_head": ([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"], 30.0),
        "slow_body": ([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n", b"12345", b"67890"],
                      30.0),
        "ok_kept_alive": ([b"HTTP/1.1 200 OK\r\ncontent-type: application/json; charset=utf-8"
                           b"\r\ncontent-length: %d\r\n\r\n" % len(body), body], 0.0),
    }
    pieces, pause = answers[case]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_once, server, pieces, pause)
        start = trio.current_time()
        if case == "slow_head":
            with pytest.raises(httpclient.HttpTimeout):
                await conn.request("POST", "/mcp", [], b"{}", head_timeout=10.0)
            assert trio.current_time() - start == pytest.approx(10.0)
        else:
            response = await conn.request("POST", "/mcp", [], b"{}", head_timeout=60.0)
            assert response.status == 200
            if case == "oversize_body":
                with pytest.raises(httpclient.BodyTooLarge, match="more than 1024 bytes"):
                    await conn.body(1024)
            elif case == "slow_body":
                assert await conn.chunk(idle_timeout=31.0) == b"12345"
                with pytest.raises(httpclient.HttpTimeout):
                    await conn.body(1024, idle_timeout=5.0)
            else:
                assert response.content_type == "application/json"
                assert await conn.body(1024) == body
                assert conn.reusable()  # keep-alive: ready for the next exchange
        if case != "ok_kept_alive":
            assert conn.broken and not conn.reusable()  # never reused after a failure
        nursery.cancel_scope.cancel()


def test_sse_decoder_cut_anywhere_and_bounded() -> None:
    stream = (b": comment\r\nid: 1\r\ndata:\r\n\r\n"  # a priming event: no data, skipped
              b"event: message\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n"
              b"data: {\"b\":2}\n\n"
              b"data: {\"c\":3}\r\r")
    for cut in range(1, len(stream)):  # cut in two anywhere, a CRLF split included
        decoder = SseDecoder(1000)
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert got == [b'{"a":\n1}', b'{"b":2}', b'{"c":3}'], cut
        for cut2 in range(cut, len(stream)):  # and in three: held bytes, then a chunk's tail
            decoder = SseDecoder(1000)
            got = (decoder.feed(stream[:cut]) + decoder.feed(stream[cut:cut2])
                   + decoder.feed(stream[cut2:]))
            assert got == [b'{"a":\n1}', b'{"b":2}', b'{"c":3}'], (cut, cut2)
    decoder = SseDecoder(1000)  # a CRLF cut apart, its LF alone: one line end, not two
    assert decoder.feed(b"data: 1\r") + decoder.feed(b"\n") + decoder.feed(b"\ndata: 2\n\n") == [
        b"1", b"2"]
    decoder = SseDecoder(30)  # a chunk's whole events taken, its unfinished tail still bounded
    with pytest.raises(EventTooLarge):
        decoder.feed(b"data: 1\n\ndata: " + b"x" * 30)
    decoder = SseDecoder(100)
    assert decoder.feed(b"data: " + b"x" * 90) == []
    with pytest.raises(EventTooLarge):
        decoder.feed(b"x" * 20)  # still no end of event, over 100 bytes: refused
    # What resuming needs: the last id (a priming event's too), the retry; an id that cannot
    # be sent back as a header makes the stream not resumable; a NUL one is ignored.
    decoder = SseDecoder(1000, "old")
    assert decoder.feed(b"id: p1\nretry: 2500\ndata:\n\n") == [] and decoder.last_id == "p1"
    assert decoder.retry == 2500
    decoder.feed(b"id: a\0b\ndata: 1\n\nretry: soon\ndata: 2\n\n")
    assert (decoder.last_id, decoder.retry) == ("p1", 2500)
    decoder.feed(b"id: " + b"x" * 300 + b"\ndata: 3\n\n")
    assert decoder.last_id is None
    decoder.feed("id: caf\u00e9\ndata: 4\n\n".encode())
    assert decoder.last_id is None
    decoder.feed(b"id: p2\ndata: 5\n\n")
    assert decoder.last_id == "p2"


def test_sse_common_events_read_as_line_by_line() -> None:
    """Events of the common shape (event, id, one data line) read in one match give what the
    same fields in another order, read line by line, give: the data, the last id."""
    common = (b"id: p\ndata: \n\nevent: message\nid: 7\ndata: {\"a\":1}\n\n"
              b"event:m\nid:8\ndata:  two spaces\n\nid: a\0b\ndata: nul\n\ndata: 3\n\n")
    other = (b"data: \nid: p\n\ndata: {\"a\":1}\nid: 7\nevent: message\n\n"
             b"data:  two spaces\nid:8\nevent:m\n\ndata: nul\nid: a\0b\n\n: c\ndata: 3\n\n")
    for cut in range(1, len(common)):
        decoders = SseDecoder(1000), SseDecoder(1000)
        seen = [d.feed(s[:cut]) + d.feed(s[cut:]) for d, s in zip(decoders, (common, other),
                                                                   strict=True)]
        assert seen[0] == seen[1] == [b'{"a":1}', b" two spaces", b"nul", b"3"], cut
        assert decoders[0].last_id == decoders[1].last_id == "8"
