"""The child-stderr helpers on their own: line splitting with a bound, and the log rate limit."""

from __future__ import annotations

import random

from gateway.protocol.stderr import TRUNCATED, LineSplitter, LineThrottle


def test_throttle_admits_the_burst_then_the_rate_and_counts_the_rest() -> None:
    t = LineThrottle(rate=10, burst=5, window=5.0, now=100.0)
    assert t.admit(100.0, 3) == 3
    assert t.admit(100.0, 4) == 2  # burst of 5 spent
    assert t.suppressed == 2 and t.due() == 105.0
    assert t.admit(100.5, 10) == 5  # 0.5 s at 10/s refilled 5
    assert t.suppressed == 7
    assert t.admit(100.5, 1) == 0


def test_throttle_summary_once_the_window_has_passed_then_a_fresh_window() -> None:
    t = LineThrottle(rate=1, burst=1, window=5.0, now=0.0)
    assert t.due() is None and t.summary(0.0) is None
    t.admit(1.0, 101)  # 1 logged, 100 held back; the window opens at 1.0
    assert t.summary(5.9) is None  # not due yet
    t.admit(3.0, 50)  # 2 s refilled 1 token... capped at the burst of 1
    assert t.suppressed == 149
    assert t.summary(6.0) == (149, 5.0)
    assert t.suppressed == 0 and t.due() is None and t.summary(7.0) is None
    t.admit(100.0, 3)  # long quiet: the bucket is full again (1), 2 held back, new window
    assert t.due() == 105.0
    assert t.summary(101.0, final=True) == (2, 1.0)  # end of stream: at once


def test_throttle_never_refills_past_the_burst() -> None:
    t = LineThrottle(rate=1000, burst=10, window=1.0, now=0.0)
    assert t.admit(3600.0, 1000) == 10


def test_throttle_rate_zero_is_no_limit() -> None:
    t = LineThrottle(rate=0, burst=1, window=1.0, now=0.0)
    assert t.admit(0.0, 10**6) == 10**6 and t.due() is None


def test_splitter_keeps_partial_lines_and_cuts_long_ones() -> None:
    s = LineSplitter(5)
    assert s.feed(b"ab\ncdefghij\nk") == [b"ab", b"cdefg" + TRUNCATED]
    assert s.feed(b"lmnopq") == [b"klmno" + TRUNCATED]  # cut while still incomplete
    assert s.feed(b"rs\nxy") == []  # the rest of the cut line is dropped
    assert s.close() == [b"xy"]
    assert s.close() == []


def test_feed_counted_agrees_with_feed_in_any_chunking() -> None:
    for trial in range(2000):
        rnd = random.Random(trial)
        data = b"".join(rnd.choice([b"a", b"bb", b"\n", b"cccccccc", b"\n\n"])
                        for _ in range(rnd.randint(0, 60)))
        cuts = sorted(rnd.sample(range(len(data) + 1), min(len(data) + 1, 4)))
        chunks = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        whole, counted = LineSplitter(5), LineSplitter(5)
        for chunk in filter(None, chunks):
            lines = whole.feed(chunk)
            assert counted.feed_counted(chunk, 2) == (len(lines), lines[-2:]), (trial, chunks)
        assert whole.close() == counted.close()


def test_printable_replaces_control_characters_and_invalid_utf8() -> None:
    from gateway.protocol.stderr import printable

    assert (printable(b"\x1b[31mred\x1b[0m\tok\x00 caf\xc3\xa9 \xff  \r")
            == "\ufffd[31mred\ufffd[0m\tok\ufffd café \ufffd")
