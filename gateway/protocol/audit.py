"""The audit log's bytes: canonical JSON, redaction, and the HMAC-SHA256 chain of its lines.

Canonical JSON follows RFC 8785: keys sorted by UTF-16 code units, no insignificant whitespace,
UTF-8, strings escaped only where JSON requires it, floats as ECMAScript prints them. Python's
float repr differs there (``1e-07``, ``1e+16``, ``1.0`` where ECMAScript prints ``1e-7``,
``10000000000000000``, ``1``): :func:`canonical` prints the ECMAScript form. Integers print
exactly, also beyond 2**53 where RFC 8785 (IEEE doubles) would round them.

A line is one JSON object whose last member is ``"mac"``; its *body* is the line with the suffix
``,"mac":"<64 hex>"}`` replaced by ``}``. ``mac = HMAC-SHA256(key, prev || body)``, ``prev``
the previous line's MAC (32 raw bytes). The first line of a file carries ``"prev"`` (hex): the
last MAC of the previous file, all zeros for the very first. A verifier works on the bytes as
written and never re-canonicalizes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

#: The MAC before the very first line.
ZERO_MAC = bytes(32)
#: What replaces a redacted value.
REDACTED = "[REDACTED]"
#: Nesting deeper than this is refused (canonical JSON and redaction recurse).
MAX_DEPTH = 256

#: A line's ``,"mac":"<64 hex>"}`` suffix (group 1: the MAC in hex).
MAC_SUFFIX = re.compile(rb',"mac":"([0-9a-f]{64})"\}\Z')


def _number(x: float) -> str:
    """``x`` as ECMAScript's Number.prototype.toString prints it (RFC 8785, section 3.2.2.3)."""
    if not math.isfinite(x):
        raise ValueError("NaN and infinities have no JSON form")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    t = Decimal(repr(abs(x))).normalize().as_tuple()
    digits = "".join(map(str, t.digits))
    assert isinstance(t.exponent, int)
    k = len(digits)
    n = k + t.exponent  # value = 0.digits × 10**n
    if k <= n <= 21:
        out = digits + "0" * (n - k)
    elif 0 < n <= 21:
        out = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * -n + digits
    else:
        e = n - 1
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        out = f"{mantissa}e{'+' if e > 0 else '-'}{abs(e)}"
    return sign + out


def _utf16(key: str) -> bytes:
    return key.encode("utf-16-be", "surrogatepass")


def _write(value: Any, out: list[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(str(value))
    elif isinstance(value, float):
        out.append(_number(value))
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise ValueError("object keys must be strings")
        out.append("{")
        for i, key in enumerate(sorted(value, key=_utf16)):
            if i:
                out.append(",")
            out.append(json.dumps(key, ensure_ascii=False))
            out.append(":")
            _write(value[key], out, depth + 1)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out, depth + 1)
        out.append("]")
    else:
        raise ValueError(f"{type(value).__name__} has no JSON form")


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``json.dumps`` (sorted keys) prints ``value`` as :func:`_write` does: every float
    printed alike by Python and ECMAScript, no key outside the BMP (where code point order and
    UTF-16 order may differ), string keys, JSON types only, not too deep."""
    if depth > MAX_DEPTH:
        return False
    if isinstance(value, str) or value is None or isinstance(value, int):
        return True
    if isinstance(value, float):
        r = repr(value)
        return "e" not in r and not r.endswith(".0") and math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and (k.isascii() or max(k) < "\U00010000")
                   and _plain(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    return False


def canonical(value: Any) -> bytes:
    """``value`` (JSON data: dict, list, str, int, float, bool, None) as canonical JSON bytes.

    Raises:
        ValueError: not JSON data (NaN, a non-string key, a lone surrogate, too deep).
    """
    if _plain(value):  # json.dumps (C) prints it the same, faster
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    else:
        out: list[str] = []
        _write(value, out, 0)
        text = "".join(out)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone surrogate") from None


def sha256_hex(value: Any) -> str:
    """The SHA-256 (hex) of ``value``'s canonical JSON."""
    return hashlib.sha256(canonical(value)).hexdigest()


def redact(value: Any, keys: frozenset[str], depth: int = 0) -> Any:
    """``value`` with the value of every object member whose name is in ``keys`` (lower case;
    matched case-insensitively, at any depth) replaced by :data:`REDACTED`."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and k.lower() in keys
                else redact(v, keys, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, keys, depth + 1) for v in value]
    return value


def timestamp(t: float) -> str:
    """``t`` (seconds since the epoch) as RFC 3339 UTC with milliseconds."""
    ms = round(t * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def mac_of(key: bytes, prev: bytes, body: bytes) -> bytes:
    """The MAC of a line whose body is ``body``, after the line whose MAC is ``prev``."""
    return hmac.new(key, prev + body, hashlib.sha256).digest()


def seal(key: bytes, prev: bytes, record: dict[str, Any], *,
         first: bool = False) -> tuple[bytes, bytes]:
    """The line (with its newline) for ``record`` after the MAC ``prev``, and its MAC.
    ``first``: the line starts a file (it carries ``prev``).

    Raises:
        ValueError: ``record`` is not JSON data, or names ``mac``.
    """
    if "mac" in record or not record:
        raise ValueError("a record must have members, and no 'mac' member")
    if first:
        record = {**record, "prev": prev.hex()}
    body = canonical(record)
    mac = mac_of(key, prev, body)
    return body[:-1] + b',"mac":"' + mac.hex().encode() + b'"}\n', mac


@dataclass(frozen=True, slots=True)
class Broken:
    """Where a chain breaks: the line (1-based, within its file) and why."""

    line: int
    reason: str


class Chain:
    """Verifies lines in order, across files (call :meth:`file` before each file's lines)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.mac: bytes | None = None  # the last line's MAC (None: no line yet)
        self.start: bytes | None = None  # the first file's ``prev``
        self.lines = 0
        self._first = True

    def file(self) -> None:
        """The next line starts a file."""
        self._first = True

    def line(self, data: bytes) -> str | None:
        """Check one line (without its newline); why it breaks the chain, or None."""
        m = MAC_SUFFIX.search(data)
        if not data.startswith(b"{") or m is None:
            return "not a line of the audit log (no \"mac\" member at its end)"
        body = data[:m.start()] + b"}"
        try:
            record = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to decode
            return "not valid JSON"
        if not isinstance(record, dict):
            return "not a JSON object"
        prev_hex = record.get("prev")
        if self._first:
            if not isinstance(prev_hex, str) or not re.fullmatch("[0-9a-f]{64}", prev_hex):
                return "the first line of a file has no \"prev\" (its first lines were removed?)"
            prev = bytes.fromhex(prev_hex)
            if self.mac is None:
                self.start = prev
            elif prev != self.mac:
                return ("\"prev\" is not the last MAC of the previous file (a file or its last "
                        "lines are missing, or the files are out of order)")
        elif prev_hex is not None:
            return "\"prev\" on a line that does not start a file"
        else:
            assert self.mac is not None
            prev = self.mac
        mac = bytes.fromhex(m.group(1).decode())
        if not hmac.compare_digest(mac, mac_of(self.key, prev, body)):
            return ("MAC mismatch (the line was changed, or a line before it was removed, "
                    "inserted or moved; or the key is not this log's)")
        self.mac = mac
        self._first = False
        self.lines += 1
        return None


def split_lines(data: bytes) -> tuple[list[bytes], bool]:
    """A file's lines (without their newlines), and whether it ends in a complete line."""
    if not data:
        return [], True
    lines = data.split(b"\n")
    if lines[-1] == b"":
        return lines[:-1], True
    return lines, False


def verify(key: bytes, lines: Iterable[bytes], chain: Chain | None = None) -> Broken | None:
    """The first line of one file (its lines without newlines) that breaks the chain, or None.
    ``chain``: continue one across files (the previous file's)."""
    chain = chain if chain is not None else Chain(key)
    chain.file()
    for n, data in enumerate(lines, 1):
        why = chain.line(data)
        if why is not None:
            return Broken(n, why)
    return None
