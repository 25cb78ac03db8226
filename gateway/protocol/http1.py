"""The common shape of an HTTP/1.1 exchange without h11, sans-IO: a request head parsed, a
response head and its chunks framed.

:func:`parse_head` accepts only a strict subset of what h11 accepts (``GET``, ``POST`` or
``DELETE``, HTTP/1.1, exactly one ``Host``, at most one ``Content-Length`` of digits, visible
ASCII field values, no ``Transfer-Encoding``, ``Expect``, ``Upgrade`` or ``Connection`` other
than ``keep-alive``); for anything else it returns None and the caller hands the bytes to h11,
which answers them as it always does.  The framing functions write the bytes h11 writes for the
same response (the same header order and case), so a client cannot tell the two apart.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_LINE = re.compile(rb"(GET|POST|DELETE) ([\x21-\x7e]+) HTTP/1\.1\r\n")
#: Header lines, each ``name:value`` of visible ASCII, spaces and tabs (one pass, no backtracking).
_FIELDS = re.compile(rb"(?:" + _TOKEN + rb":[\x20-\x7e\t]*\r\n)*")
_FIELD = re.compile(rb"(" + _TOKEN + rb"):([\x20-\x7e\t]*)\r\n")
_NAME = re.compile(_TOKEN)
#: What h11 accepts as a field value it sends (ASCII only: a str header is encoded as ASCII).
_SEND_VALUE = re.compile(rb"(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?")
#: Digits of a Content-Length at most (h11 refuses more than 20).
_MAX_DIGITS = 18
#: Headers whose presence sends the request to h11 (framing, 100-continue, protocol switch).
_UNUSUAL = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
#: Headers that may appear once only here.
_ONCE = frozenset({b"host", b"content-length", b"connection"})


class Head(NamedTuple):
    """A request head: method, target, header fields (lowercased names, values stripped of
    surrounding whitespace) in order, those values by name as text (repeated ones joined with
    ``", "``), the body's length."""

    method: str
    target: str
    fields: list[tuple[bytes, bytes]]
    by_name: dict[bytes, str]
    length: int


def parse_head(head: bytes) -> Head | None:
    """The request head ``head`` (the request line and the header lines, each with its CRLF,
    without the blank line that ends the head); None when it is not of the common shape (see
    the module docstring)."""
    line = _LINE.match(head)
    if line is None:
        return None
    block = head[line.end():]
    if _FIELDS.fullmatch(block) is None:
        return None
    fields: list[tuple[bytes, bytes]] = []
    by_name: dict[bytes, str] = {}
    length = 0
    for raw_name, raw_value in _FIELD.findall(block):
        name = raw_name.lower()
        value = raw_value.strip(b" \t")
        text = value.decode("ascii")
        if name in by_name:
            if name in _ONCE:
                return None
            by_name[name] = f"{by_name[name]}, {text}"
        else:
            by_name[name] = text
        if name == b"content-length":
            if not (value.isdigit() and len(value) <= _MAX_DIGITS):
                return None
            length = int(value)
        elif name in _UNUSUAL or (name == b"connection" and value.lower() != b"keep-alive"):
            return None
        fields.append((name, value))
    if b"host" not in by_name:
        return None
    return Head(line[1].decode("ascii"), line[2].decode("ascii"), fields, by_name, length)


_STATUS_LINES: dict[tuple[int, bytes], bytes] = {}


def response_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The bytes of a response head (status line, ``headers`` in order, the blank line); None
    when a header is not one h11 would send (the caller lets h11 refuse it)."""
    key = (status, reason)
    start = _STATUS_LINES.get(key)
    if start is None:
        if not 200 <= status <= 999 or _SEND_VALUE.fullmatch(reason) is None:
            return None
        start = _STATUS_LINES[key] = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    parts = [start]
    for name, value in headers:
        if _NAME.fullmatch(name) is None or _SEND_VALUE.fullmatch(value) is None:
            return None
        parts.append(b"%s: %s\r\n" % (name, value))
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (nothing for no data, as h11 does)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


#: The last chunk: the end of a chunked body without trailer fields.
LAST_CHUNK = b"0\r\n\r\n"
