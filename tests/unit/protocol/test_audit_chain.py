"""The audit log's bytes: canonical JSON (RFC 8785 forms), redaction, and the MAC chain, whose
verifier must find any changed, removed, moved or inserted line at that line."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol import audit

KEY = b"k" * 32

keys = st.text(max_size=6) | st.sampled_from(["\uff21", "\U0001f600", "a", "\ue000"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12)


@pytest.mark.parametrize(("value", "expected"), [
    ({"b": 1, "a": [1.0, 0.5, -0.0]}, '{"a":[1,0.5,0],"b":1}'),
    (1e-7, "1e-7"), (1e21, "1e+21"), (1e20, "100000000000000000000"), (0.000001, "0.000001"),
    (123.456, "123.456"), (-1.5e-300, "-1.5e-300"), (2**64, "18446744073709551616"),
    ("é\u2028\x01\"\\\n", '"é\u2028\\u0001\\"\\\\\\n"'),
    # keys by UTF-16 code units: U+1F600 (D83D...) sorts before U+FF21
    ({"\uff21": 1, "\U0001f600": 2, "a": 3}, '{"a":3,"\U0001f600":2,"\uff21":1}'),
])
def test_canonical_forms(value: Any, expected: str) -> None:
    assert audit.canonical(value) == expected.encode()


@given(json_values)
@settings(max_examples=500)
def test_canonical_is_json_of_the_same_value_and_stable(value: Any) -> None:
    data = audit.canonical(value)
    assert as_floats(json.loads(data)) == as_floats(value)  # a number is an IEEE double
    assert audit.canonical(json.loads(data)) == data  # a fixed point
    out: list[str] = []
    audit._write(value, out, 0)  # the fast path (json.dumps) prints what the full writer does
    assert data == "".join(out).encode()
    if not isinstance(value, (str, dict, list)):
        assert b" " not in data


def as_floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: as_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_floats(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def test_canonical_refuses_what_json_cannot_say() -> None:
    for bad in (float("nan"), {1: 2}, "\ud800", {"a": object()}):
        with pytest.raises(ValueError):
            audit.canonical(bad)


def test_redaction_is_recursive_and_case_insensitive() -> None:
    args = {"Password": "x", "nested": [{"TOKEN": {"deep": 1}, "keep": "y"}], "user": "ada"}
    got = audit.redact(args, frozenset({"password", "token"}))
    assert got == {"Password": "[REDACTED]", "nested": [{"TOKEN": "[REDACTED]", "keep": "y"}],
                   "user": "ada"}
    assert args["Password"] == "x"  # the caller's value is untouched


def chain(records: list[dict[str, Any]], prev: bytes = audit.ZERO_MAC,
          key: bytes = KEY) -> tuple[list[bytes], bytes]:
    lines = []
    for i, record in enumerate(records):
        line, prev = audit.seal(key, prev, record, first=i == 0)
        lines.append(line)
    return lines, prev


def lines_of(data: list[bytes]) -> list[bytes]:
    return audit.split_lines(b"".join(data))[0]


records = st.lists(st.dictionaries(st.sampled_from("abcdef"), json_values, min_size=1,
                                   max_size=3), min_size=2, max_size=6)


@given(records)
@settings(max_examples=100)
def test_an_intact_chain_verifies(recs: list[dict[str, Any]]) -> None:
    lines, _ = chain(recs)
    assert all(line.endswith(b'"}\n') and b'"mac":"' in line.splitlines()[0][-75:]
               for line in lines)
    assert audit.verify(KEY, lines_of(lines)) is None
    wrong_key = audit.verify(b"other" * 8, lines_of(lines))
    assert wrong_key is not None and wrong_key.line == 1 and "MAC" in wrong_key.reason


@given(records, st.data())
@settings(max_examples=200)
def test_any_flipped_byte_is_found_at_its_line(recs: list[dict[str, Any]],
                                               data: st.DataObject) -> None:
    lines, _ = chain(recs)
    n = data.draw(st.integers(0, len(lines) - 1))
    line = bytearray(lines[n])
    i = data.draw(st.integers(0, len(line) - 2))  # not the newline
    line[i] ^= data.draw(st.integers(1, 255))
    if b"\n" in line:  # a newline made of a byte splits the line: the break is there
        return
    tampered = [*lines[:n], bytes(line), *lines[n + 1:]]
    broken = audit.verify(KEY, lines_of(tampered))
    assert broken is not None and broken.line == n + 1, broken


@given(records, st.data())
@settings(max_examples=100)
def test_removed_moved_inserted_lines_are_found(recs: list[dict[str, Any]],
                                                data: st.DataObject) -> None:
    lines, _ = chain(recs)
    n = data.draw(st.integers(0, len(lines) - 2))
    removed = [*lines[:n], *lines[n + 1:]]
    assert audit.verify(KEY, lines_of(removed)).line == n + 1  # type: ignore[union-attr]
    swapped = [*lines[:n], lines[n + 1], lines[n], *lines[n + 2:]]
    assert audit.verify(KEY, lines_of(swapped)).line == n + 1  # type: ignore[union-attr]
    # a line sealed elsewhere (with the right key, even after the right MAC) does not fit in
    forged, _ = audit.seal(KEY, audit.ZERO_MAC, {"a": "forged"})
    inserted = [*lines[:n + 1], forged, *lines[n + 1:]]
    assert audit.verify(KEY, lines_of(inserted)).line == n + 2  # type: ignore[union-attr]


def test_a_rotated_pair_verifies_across_files_and_only_in_order() -> None:
    one, last = chain([{"a": 1}, {"a": 2}])
    two, _ = chain([{"a": 3}, {"a": 4}], prev=last)
    c = audit.Chain(KEY)
    assert audit.verify(KEY, lines_of(one), c) is None
    assert audit.verify(KEY, lines_of(two), c) is None
    assert c.start == audit.ZERO_MAC and c.lines == 4
    # the newer file alone verifies from its prev; after a gap it does not
    assert audit.verify(KEY, lines_of(two)) is None
    c = audit.Chain(KEY)
    assert audit.verify(KEY, lines_of(one[:1]), c) is None
    broken = audit.verify(KEY, lines_of(two), c)
    assert broken is not None and broken.line == 1 and "previous file" in broken.reason
    # a file whose first line was removed
    broken = audit.verify(KEY, lines_of(two[1:]))
    assert broken is not None and broken.line == 1 and "prev" in broken.reason


def test_an_incomplete_last_line_is_told_apart() -> None:
    lines, _ = chain([{"a": 1}, {"a": 2}])
    got, complete = audit.split_lines(b"".join(lines)[:-5])
    assert not complete and len(got) == 2
