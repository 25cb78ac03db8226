"""What the gateway checks of JSON bytes before it decodes them, and what it can still read of a
line it will not decode.

Payloads cross the gateway as bytes (``msgspec.Raw``), yet the next hop needs them to be UTF-8
and bounded in nesting depth (a recursive decoder must not exhaust its stack): :func:`check`
tests both with fast passes over the bytes, exact only when the cheap bound fails.
:func:`reply_id_hint` reads the gateway id of a reply that will not be decoded (too large, too
deep, not UTF-8) from the line's ends, so its caller fails at once instead of timing out.
"""

from __future__ import annotations

import re
from itertools import accumulate

#: Every byte but quotes and brackets is deleted to get a message's skeleton.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
#: A string in the skeleton (escaped quotes are gone by then, so: quote to quote).
_SKELETON_STRING = re.compile(rb'"[^"]*"')
_SQUARE = bytes.maketrans(b"{}", b"[]")
#: Openers as +1, closers as -1 (signed bytes).
_STEPS = bytes.maketrans(b"[]", b"\x01\xff")
#: Innermost levels peeled off before the depth is measured exactly (most JSON is shallow).
_PEEL_PASSES = 8

#: The start of a reply: ``{``, scalar ``jsonrpc``/``id`` members, then ``result`` or ``error``.
_REPLY_HEAD = re.compile(
    rb'^\s*\{((?:\s*"(?:jsonrpc|id)"\s*:\s*(?:"[^"\\]*"|-?\d+)\s*,)*)\s*"(?:result|error)"\s*:')
_ID_MEMBER = re.compile(rb'"id"\s*:\s*(\d+)')
#: ``id`` as the last member of a line.
_ID_LAST = re.compile(rb',\s*"id"\s*:\s*(\d+)\s*\}\s*$')


class NotUtf8(ValueError):
    """The bytes are not valid UTF-8."""


class TooDeep(ValueError):
    """The JSON nests arrays/objects deeper than allowed."""


def check(data: bytes | bytearray | memoryview, max_depth: int) -> None:
    """Raise unless ``data`` is UTF-8 and nests at most ``max_depth`` levels.

    Bytes that are not JSON at all pass here (the decoder reports them); only what would make a
    decoder misbehave or a peer receive invalid text is refused before decoding.

    Raises:
        NotUtf8: an invalid UTF-8 sequence (position in the message).
        TooDeep: more than ``max_depth`` levels of ``[``/``{``.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    if not data.isascii():
        try:
            data.decode()
        except UnicodeDecodeError as exc:
            raise NotUtf8(f"invalid UTF-8 at byte {exc.start}") from None
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return
    brackets = _brackets(data)
    peeled = brackets
    for _ in range(min(max_depth, _PEEL_PASSES)):  # a pass removes one level: cheap when shallow
        if not peeled:
            return
        shorter = peeled.replace(b"[]", b"")
        if len(shorter) * 4 > len(peeled) * 3:
            break  # a pass that removes little (deep, or unbalanced): measure exactly instead
        peeled = shorter
    if peeled and _prefix_depth(brackets) > max_depth:
        raise TooDeep(f"JSON nested deeper than {max_depth} levels")


def depth(data: bytes) -> int:
    """The deepest nesting of arrays/objects in ``data``, brackets inside strings not counted."""
    return _prefix_depth(_brackets(data))


def _brackets(data: bytes) -> bytes:
    """The brackets of ``data`` outside JSON strings, as ``[`` and ``]``.

    Escaped backslashes go first, then escaped quotes (left to right, as JSON pairs them); of
    what remains only quotes and brackets are kept, and every quoted run is a string's content.
    Each step is a pass in C that makes one new bytes object (no object per string).
    """
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Quotes alternate open/close, so dropping two adjacent ones removes an empty string or
    # joins two strings into one: either way no bracket changes sides, and most strings go.
    skeleton = unescaped.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    return _SKELETON_STRING.sub(b"", skeleton).translate(_SQUARE)


def _prefix_depth(brackets: bytes) -> int:
    """The highest running total of +1 per ``[`` and -1 per ``]`` (linear, in C)."""
    if not brackets:
        return 0
    return max(0, max(accumulate(memoryview(brackets.translate(_STEPS)).cast("b"))))


def reply_id_hint(head: bytes, tail: bytes = b"") -> int | None:
    """The integer ``id`` of a reply, read from the line's first bytes (``id`` before ``result``
    or ``error``) or, when the first bytes show a reply, from its last bytes (``id`` the last
    member).  None when the line is not shown to be a reply (a request from the backend also
    carries an ``id``), or its id is not visible there."""
    m = _REPLY_HEAD.match(head)
    if m is None:
        return None
    found = _ID_MEMBER.search(m.group(1)) or _ID_LAST.search(tail)
    return int(found.group(1)) if found else None
