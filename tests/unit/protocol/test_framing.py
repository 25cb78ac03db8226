"""LineFramer: newline-delimited frames out of arbitrary chunks, with a hard size guard."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.framing import LineFramer, Oversize

# A frame: no newline, not blank, and no trailing "\r" (that one is stripped as part of CRLF).
frames_st = st.lists(
    st.binary(min_size=1, max_size=40).filter(
        lambda b: b"\n" not in b and b.strip() != b"" and not b.endswith(b"\r")
    ),
    max_size=8,
)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    chunks, prev = [], 0
    for p in [*points, len(data)]:
        chunks.append(data[prev:p])
        prev = p
    return chunks


def feed_all(framer: LineFramer, chunks: list[bytes], limit: int) -> list[bytes | Oversize]:
    out: list[bytes | Oversize] = []
    for chunk in chunks:
        out.extend(framer.feed(chunk))
        assert framer.buffered <= limit  # never holds more than the limit
    return out


@settings(max_examples=60, deadline=None)
@given(frames=frames_st, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_any_chunking_yields_exactly_the_frames(frames: list[bytes], cuts: list[int]) -> None:
    data = b"".join(f + b"\n" for f in frames)
    framer = LineFramer(max_frame=1024)
    assert feed_all(framer, split_at(data, cuts), 1024) == frames
    assert framer.buffered == 0


@settings(max_examples=60, deadline=None)
@given(frames=frames_st, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_crlf_line_endings(frames: list[bytes], cuts: list[int]) -> None:
    data = b"".join(f + b"\r\n" for f in frames)
    assert feed_all(LineFramer(1024), split_at(data, cuts), 1024) == frames


@settings(max_examples=30, deadline=None)
@given(frames=frames_st)
def test_byte_at_a_time(frames: list[bytes]) -> None:
    data = b"".join(f + b"\n" for f in frames)
    chunks = [data[i : i + 1] for i in range(len(data))]
    assert feed_all(LineFramer(1024), chunks, 1024) == frames


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from([b" ", b"\r", b"\t", b"\n", b"{", b"a", b"\x00", b"\xff"]),
                      max_size=12), limit=st.integers(min_value=1, max_value=8))
def test_a_whole_line_in_one_read_frames_as_in_pieces(parts: list[bytes], limit: int) -> None:
    data = b"".join(parts) + b"\n"
    pieces = [data[i : i + 1] for i in range(len(data))]
    if any(isinstance(f, Oversize) for f in feed_all(LineFramer(limit), pieces, limit)):
        limit = 64  # an oversize marker's size depends on the chunking: compare frames only
    assert LineFramer(limit).feed(data) == feed_all(LineFramer(limit), pieces, limit)


def test_incomplete_frame_is_held_until_its_newline() -> None:
    framer = LineFramer(100)
    assert framer.feed(b'{"a":') == []
    assert framer.buffered == 5
    assert framer.feed(b"1}") == []
    assert framer.feed(b"\n{") == [b'{"a":1}']
    assert framer.buffered == 1


def test_blank_lines_are_skipped() -> None:
    framer = LineFramer(100)
    assert framer.feed(b"\n\n   \n\t\r\n\r\nx\n \n") == [b"x"]
    assert framer.feed(b"") == []


def test_only_one_trailing_cr_is_stripped() -> None:
    assert LineFramer(100).feed(b"a\r\r\nb\rc\n") == [b"a\r", b"b\rc"]


def test_oversize_in_one_chunk_then_frames_continue() -> None:
    framer = LineFramer(10)
    out = framer.feed(b"0123456789\n" + b"x" * 11 + b"\nok\n")
    assert out[0] == b"0123456789"  # exactly the limit is fine
    assert isinstance(out[1], Oversize) and out[1].size == 11
    assert out[2:] == [b"ok"]
    assert framer.buffered == 0


def test_oversize_spanning_several_chunks_yields_one_marker() -> None:
    framer = LineFramer(10)
    assert framer.feed(b"first\n0123") == [b"first"]
    out = framer.feed(b"456789AB")  # crosses the limit: reported now, not buffered
    assert len(out) == 1 and isinstance(out[0], Oversize)
    assert out[0].size >= 11
    assert framer.buffered == 0
    assert framer.feed(b"C" * 1000) == []  # still the same line: discarded silently
    assert framer.buffered == 0
    assert framer.feed(b"D" * 50 + b"\nnext\nlast") == [b"next"]
    assert framer.feed(b"\n") == [b"last"]


def test_oversize_completed_by_its_newline_chunk() -> None:
    framer = LineFramer(10)
    assert framer.feed(b"01234567") == []
    out = framer.feed(b"89AB\nafter\n")
    assert isinstance(out[0], Oversize) and out[0].size == 12
    assert out[1:] == [b"after"]


@settings(max_examples=60, deadline=None)
@given(
    before=frames_st,
    big=st.integers(min_value=11, max_value=300),
    after=frames_st,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20),
)
def test_oversize_anywhere_in_any_chunking(
    before: list[bytes], big: int, after: list[bytes], cuts: list[int]
) -> None:
    limit = 40  # frames_st frames are at most 40 bytes
    before = [f for f in before if len(f) <= limit]
    after = [f for f in after if len(f) <= limit]
    data = b"".join(f + b"\n" for f in [*before, b"Z" * (limit + big), *after])
    framer = LineFramer(limit)
    out = feed_all(framer, split_at(data, cuts), limit)
    markers = [i for i, f in enumerate(out) if isinstance(f, Oversize)]
    assert markers == [len(before)]
    assert out[: len(before)] == before
    assert out[len(before) + 1 :] == after
    marker = out[len(before)]
    assert isinstance(marker, Oversize) and limit < marker.size <= limit + big
