"""The common shape of an HTTP/1.1 exchange without h11, sans-IO: a request head parsed, a
response head and its chunks framed.

:func:`parse_head` accepts only a strict subset of what h11 accepts (``GET``, ``POST`` or
``DELETE``, HTTP/1.1, exactly one ``Host``, at most one ``Content-Length`` of digits, visible
ASCII field values, no ``Transfer-Encoding``, ``Expect``, ``Upgrade`` or ``Connection`` other
than ``keep-alive``); for anything else it returns None and the caller hands the bytes to h11,
which answers them as it always does.  The framing functions write the bytes h11 writes for the
same response (the same header order and case), so a client cannot tell the two apart.
The client's side likewise: :func:`request_head` writes what h11 writes, and
:func:`parse_response_head` and :class:`BodyReader` read a common response (one
``Content-Length`` or chunked, HTTP/1.1, visible ASCII); anything else goes to h11.
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


#: Header lines seen before, each as (lowercased name, stripped value, value text): a client
#: sends the same ones on every request.  Bounded by count and by each value's length;
#: ``Content-Length`` lines (one per body size) are kept only while it is less than half full.
_KNOWN_FIELDS: dict[tuple[bytes, bytes], tuple[bytes, bytes, str]] = {}
_KNOWN_MAX = 1024
_KNOWN_VALUE_MAX = 256


def _field(raw: tuple[bytes, bytes]) -> tuple[bytes, bytes, str]:
    """A header line's (name, value) as (lowercased name, stripped value, value text), kept in
    :data:`_KNOWN_FIELDS` while there is room."""
    name, value = raw[0].lower(), raw[1].strip(b" \t")
    field = (name, value, value.decode("ascii"))
    kept = len(_KNOWN_FIELDS)
    if len(raw[1]) <= _KNOWN_VALUE_MAX and (
            kept < _KNOWN_MAX // 2 or (kept < _KNOWN_MAX and name != b"content-length")):
        _KNOWN_FIELDS[raw] = field
    return field


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
    for raw in _FIELD.findall(block):
        known = _KNOWN_FIELDS.get(raw)
        name, value, text = _field(raw) if known is None else known
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


# ---- the client's side: a request head written, a response head parsed, its body unframed ----

_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9])(?: [\x20-\x7e\t]*)?\r\n")
_TARGET = re.compile(r"[\x21-\x7e]+")
_CHUNK_SIZE = re.compile(rb"([0-9a-fA-F]{1,16})[ \t]*(?:;[\x20-\x7e\t]*)?")
#: A chunk-size line or a trailer line: its most bytes.
MAX_CHUNK_LINE = 4096


class ResponseHead(NamedTuple):
    """A response head: status, header values by lowercased name (a repeated one: the last),
    the body's length (None: chunked), and whether the server closes the connection after."""

    status: int
    headers: dict[str, str]
    length: int | None
    close: bool


def request_head(method: str, target: str, headers: list[tuple[str, str]]) -> bytes | None:
    """The bytes of a request head (request line, ``headers`` in order, the blank line), as h11
    writes them; None when the target or a header is not one h11 would send as it is (the
    caller lets h11 refuse it)."""
    if _TARGET.fullmatch(target) is None:
        return None
    lines = header_lines(headers)
    if lines is None:
        return None
    return f"{method} {target} HTTP/1.1\r\n".encode("ascii") + lines + b"\r\n"


def header_lines(headers: list[tuple[str, str]]) -> bytes | None:
    """``headers`` as h11 writes them, each line with its CRLF; None when one is not a header
    h11 would send as it is."""
    parts = []
    for name, value in headers:
        try:
            raw_name, raw_value = name.encode("ascii"), value.encode("ascii")
        except UnicodeError:
            return None
        if _NAME.fullmatch(raw_name) is None or _SEND_VALUE.fullmatch(raw_value) is None:
            return None
        parts.append(b"%s: %s\r\n" % (raw_name, raw_value))
    return b"".join(parts)


def parse_response_head(head: bytes) -> ResponseHead | None:
    """The response head ``head`` (status line and header lines, each with its CRLF, without
    the blank line) to a GET, POST or DELETE; None when it is not of the common shape: not
    HTTP/1.1, a status outside 200–599, a header line that is not visible ASCII, a body framed
    other than by one ``Content-Length`` or ``Transfer-Encoding: chunked`` alone, or a
    ``Connection`` other than ``keep-alive`` or ``close`` (the caller hands it to h11)."""
    line = _STATUS_LINE.match(head)
    if line is None:
        return None
    block = head[line.end():]
    if _FIELDS.fullmatch(block) is None:
        return None
    headers: dict[str, str] = {}
    length: int | None = None
    chunked = close = False
    # checked above: lines of ``name:value`` in visible ASCII (and tabs), each ending in CRLF
    for field in block.decode("ascii").split("\r\n")[:-1]:
        raw_name, _, raw_value = field.partition(":")
        name = raw_name.lower()
        value = raw_value.strip(" \t")
        if name == "content-length":
            if length is not None or not (value.isdigit() and len(value) <= _MAX_DIGITS):
                return None
            length = int(value)
        elif name == "transfer-encoding":
            if chunked or value.lower() != "chunked":
                return None
            chunked = True
        elif name == "connection":
            tokens = {t.strip(" \t") for t in value.lower().split(",")}
            if not tokens <= {"keep-alive", "close"}:
                return None
            close = close or "close" in tokens
        headers[name] = value
    status = int(line[1])
    if status in (204, 304):
        if chunked or length:
            return None
        length = 0
    elif chunked == (length is not None):  # both, or neither (a body up to the close)
        return None
    return ResponseHead(status, headers, length, close)


class BodyReader:
    """A response body's framing undone (``length`` bytes, or chunked when None), sans-IO:
    :meth:`take` consumes what it can from the front of a buffer."""

    __slots__ = ("chunked", "done", "left", "state")

    def __init__(self, length: int | None) -> None:
        self.chunked = length is None
        self.left = length or 0  # bytes left of the body, or of the current chunk
        self.state = "size" if self.chunked else "data"  # chunked: size, data, crlf, trailer
        self.done = length == 0

    def take(self, buf: bytearray) -> bytes:
        """The body's data at the front of ``buf`` (consumed from it); :attr:`done` once the
        body ended.

        Raises:
            ValueError: a chunk's framing is broken or a line of it over MAX_CHUNK_LINE bytes.
        """
        if not self.chunked:
            n = min(self.left, len(buf))
            data = bytes(buf[:n])
            del buf[:n]
            self.left -= n
            self.done = self.left == 0
            return data
        out: list[bytes] = []
        if self.state == "size":  # whole chunks in ``buf`` taken in one pass, cut off once
            pos, length, n = 0, 1, len(buf)
            while length and (end := buf.find(b"\r\n", pos)) >= 0:
                line = _CHUNK_SIZE.fullmatch(buf, pos, end)
                if line is None or end - pos > MAX_CHUNK_LINE:
                    break  # the state machine below says what is wrong with it
                length = int(line[1], 16)
                stop = end + 2 + length
                if length and (stop + 2 > n or buf[stop:stop + 2] != b"\r\n"):
                    break  # not all here, or broken: the state machine below
                if length:
                    out.append(bytes(buf[end + 2:stop]))
                    pos = stop + 2
                else:
                    pos = end + 2
                    self.state = "trailer"
            del buf[:pos]
        while not self.done:
            if self.state == "data":
                if not buf:
                    break
                n = min(self.left, len(buf))
                out.append(bytes(buf[:n]))
                del buf[:n]
                self.left -= n
                if not self.left:
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise ValueError("no CRLF after a chunk's data")
                del buf[:2]
                self.state = "size"
            else:  # "size" or "trailer": a line
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_CHUNK_LINE:
                        raise ValueError(f"a chunk line of more than {MAX_CHUNK_LINE} bytes")
                    break
                if self.state == "trailer":
                    del buf[:end + 2]
                    self.done = end == 0
                    continue
                size = _CHUNK_SIZE.fullmatch(buf, 0, end)
                if size is None:
                    raise ValueError("a malformed chunk size")
                self.left = int(size[1], 16)
                del buf[:end + 2]
                self.state = "data" if self.left else "trailer"
        return b"".join(out)
