"""JSON-RPC 2.0 envelopes, decoded once at the edge.

Theory of operation: a message is decoded into an :class:`Envelope` whose ``params``,
``result`` and ``error`` stay :class:`msgspec.Raw` (the bytes as received), so payloads pass
through the gateway byte for byte.  ``id`` distinguishes *absent* (``UNSET``: a notification)
from ``null``.  :func:`classify` turns an envelope into one of four kinds or raises
:class:`~gateway.errors.InvalidRequest`.  Only the few methods the gateway inspects decode their
params further (``gateway.protocol.mcp``).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Raw, UnsetType

from gateway.errors import GatewayError, InvalidRequest, ParseError
from gateway.protocol import wire

#: Default of ``gateway.max_json_depth``.
MAX_DEPTH = 128
#: A ``\uD800``–``\uDFFF`` escape: valid JSON that msgspec refuses when it is unpaired.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

RequestId = int | str


class ErrorObject(msgspec.Struct, omit_defaults=True):
    code: int
    message: str
    data: Any = UNSET


class Envelope(msgspec.Struct, omit_defaults=True):
    """Any JSON-RPC 2.0 message. Unknown top-level keys are ignored."""

    jsonrpc: str = ""
    id: int | str | UnsetType | None = UNSET
    method: str | UnsetType = UNSET
    params: Raw | UnsetType = UNSET
    result: Raw | UnsetType = UNSET
    error: ErrorObject | UnsetType = UNSET


class _Request(msgspec.Struct, omit_defaults=True):
    jsonrpc: str
    id: int | str
    method: str
    params: Raw | UnsetType = UNSET


class _RequestFields(msgspec.Struct):
    jsonrpc: str
    id: int | str
    method: str
    params: dict[str, Raw]


class _Notification(msgspec.Struct, omit_defaults=True):
    jsonrpc: str
    method: str
    params: Raw | UnsetType = UNSET


class _Result(msgspec.Struct):
    jsonrpc: str
    id: int | str
    result: Raw


class _Error(msgspec.Struct):
    jsonrpc: str
    id: int | str | None
    error: ErrorObject


_decoder = msgspec.json.Decoder(Envelope)
_raw_list_decoder = msgspec.json.Decoder(list[Raw])
_encoder = msgspec.json.Encoder()
_dict_decoder = msgspec.json.Decoder(dict[str, Raw])

Kind = Literal["request", "notification", "response", "error"]


class Goes(enum.Enum):
    """What an outgoing message relates to, as its sender knows (it is never parsed for it)."""

    ANSWER = "answer"  # the response to request ``key`` (None: to an unreadable message)
    PROGRESS = "progress"  # ``notifications/progress`` under the caller's progress token ``key``
    UNRELATED = "unrelated"  # relates to no request (a list change, a resource update)
    OTHER = "other"  # caused by a call of its receiver (a log message, a server request)


#: A routing hint sent with an outgoing message: a transport of several streams (HTTP)
#: picks one by it.
Route = tuple[Goes, int | str | None]


def is_batch(data: bytes) -> bool:
    """True when ``data`` is a JSON array (a batch), judged by its first non-blank byte."""
    if data[:1] == b"{":  # a message (the usual case): nothing to strip
        return False
    return data.lstrip()[:1] == b"["


def decode(data: bytes, max_depth: int = MAX_DEPTH) -> Envelope:
    """Decode one JSON-RPC message, after checking that it is UTF-8 and nests at most
    ``max_depth`` levels (:func:`gateway.protocol.wire.check`).

    Raises:
        ParseError: ``data`` is not JSON, or not UTF-8 (``reason = "invalid_utf8"``).
        InvalidRequest: JSON, but not a JSON-RPC 2.0 message (wrong types, bool ids, …), or
            nested too deep (``reason = "too_deep"``).
    """
    try:
        if (type(data) is not bytes or not data.isascii()
                or data.count(b"[") + data.count(b"{") > max_depth):  # wire.check's cheap test
            wire.check(data, max_depth)
        env = _decoder.decode(data)
    except wire.NotUtf8 as exc:
        raise ParseError(f"parse error: {exc}", reason="invalid_utf8") from None
    except wire.TooDeep as exc:
        raise InvalidRequest(str(exc), reason="too_deep", limit=max_depth) from None
    except msgspec.ValidationError as exc:
        salvaged = _salvage_id(data)
        message = f"invalid JSON-RPC message: {exc}"
        if salvaged is None:
            raise InvalidRequest(message) from None
        raise InvalidRequest(message, id=salvaged) from None
    except msgspec.DecodeError as exc:
        if not _SURROGATE_ESCAPE.search(data):
            raise ParseError(f"parse error: {exc}") from None
        env = _decode_unpaired_surrogates(data)
    except RecursionError:  # unreachable while max_depth stays far below the stack's depth
        raise InvalidRequest("JSON nested too deep", reason="too_deep", limit=max_depth) from None
    if env.jsonrpc != "2.0":
        raise InvalidRequest('invalid JSON-RPC message: "jsonrpc" must be "2.0"', id=_safe_id(env))
    return env


class _IdOnly(msgspec.Struct):
    id: int | str | None = None


_id_decoder = msgspec.json.Decoder(_IdOnly)


def _salvage_id(data: bytes) -> int | str | None:
    """The id of a message that is JSON but not a valid envelope, when it is an id the envelope
    accepts (so the error answer reaches the caller's request); None otherwise."""
    try:
        return _id_decoder.decode(data).id
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _check(data: bytes, max_depth: int) -> None:
    try:
        wire.check(data, max_depth)
    except wire.NotUtf8 as exc:
        raise ParseError(f"parse error: {exc}", reason="invalid_utf8") from None
    except wire.TooDeep as exc:
        raise InvalidRequest(str(exc), reason="too_deep", limit=max_depth) from None


def _decode_unpaired_surrogates(data: bytes) -> Envelope:
    """The slow path for a message with an unpaired ``\\uD8xx`` escape (valid JSON, which
    JavaScript and Python emit, and which msgspec refuses): decoded by the standard library,
    payloads re-encoded with ASCII escapes, so the unpaired surrogate passes on as an escape."""
    try:
        obj = _stdlib_loads(data)
    except msgspec.DecodeError as exc:
        raise ParseError(f"parse error: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("invalid JSON-RPC message: expected an object")
    typed = {k: obj[k] for k in ("jsonrpc", "id", "method") if k in obj}
    for key, value in typed.items():
        if isinstance(value, str) and not _encodable(value):
            rid = typed.get("id")
            usable = isinstance(rid, int | str) and not isinstance(rid, bool) and key != "id"
            raise InvalidRequest(f"invalid JSON-RPC message: {key!r} holds an unpaired surrogate",
                                 **({"id": rid} if usable else {}))
    error = obj.get("error")
    if isinstance(error, dict):
        message = error.get("message")
        typed["error"] = {
            "code": error.get("code"),
            "message": message if not isinstance(message, str) or _encodable(message)
            else message.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),
        }
    elif error is not None:
        typed["error"] = error
    try:
        env = msgspec.convert(typed, Envelope)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid JSON-RPC message: {exc}") from None
    for key in ("params", "result"):
        if key in obj:
            setattr(env, key, _stdlib_raw(obj[key]))
    if isinstance(error, dict) and "data" in error and env.error is not UNSET:
        env.error.data = _stdlib_raw(error["data"])
    return env


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def split_batch(data: bytes, max_depth: int = MAX_DEPTH) -> list[Raw]:
    """Split a JSON array into its elements (each decoded later by :func:`decode`).

    Raises:
        ParseError: not JSON, not UTF-8.
        InvalidRequest: nested deeper than ``max_depth``.
    """
    _check(data, max_depth)
    try:
        return _raw_list_decoder.decode(data)
    except msgspec.DecodeError as exc:
        if not _SURROGATE_ESCAPE.search(data):
            raise ParseError(f"parse error: {exc}") from None
        try:
            items = _stdlib_loads(data)
        except msgspec.DecodeError as exc:
            raise ParseError(f"parse error: {exc}") from None
        if not isinstance(items, list):
            raise ParseError("parse error: expected an array") from None
        return [_stdlib_raw(item) for item in items]


#: The one protocol revision with JSON-RPC batches (added in 2025-03-26, removed in 2025-06-18).
BATCH_VERSION = "2025-03-26"


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One entry of a batch: a message (``env`` and its ``kind``) or, when it is not a valid
    JSON-RPC message, the ``error`` to answer it with (``id: null``)."""

    size: int
    env: Envelope | None = None
    kind: Kind | None = None
    error: GatewayError | None = None


def decode_batch(data: bytes, version: str | None, max_items: int,
                 max_depth: int = MAX_DEPTH) -> list[BatchEntry]:
    """The batch rule, the same on every transport: a JSON array from a client that negotiated
    :data:`BATCH_VERSION`, of 1 to ``max_items`` entries (its answers must fit one bounded
    array), decoded entry by entry.  An invalid entry does not spoil the others (JSON-RPC 2.0
    §6): it is answered, in the batch's array, by its own -32600 with ``id: null``.

    Raises:
        InvalidRequest: the client did not negotiate 2025-03-26, the array is empty, has more
            than ``max_items`` entries, or nests deeper than ``max_depth``.
        ParseError: not JSON, not UTF-8.
    """
    if version != BATCH_VERSION:
        raise InvalidRequest("JSON-RPC batches are only accepted from clients that negotiated "
                             f"{BATCH_VERSION}")
    items = split_batch(data, max_depth)
    if not items:
        raise InvalidRequest("empty batch")
    if len(items) > max_items:
        raise InvalidRequest(f"a batch of {len(items)} messages; at most {max_items} "
                             "(max_inflight_per_connection)", reason="batch_too_large",
                             limit=max_items)
    entries = []
    for item in items:
        try:
            env = decode(bytes(item), max_depth)
            entries.append(BatchEntry(len(item), env, classify(env)))
        except GatewayError as exc:
            exc.data.pop("id", None)  # JSON-RPC 2.0: an invalid request's error has id null
            entries.append(BatchEntry(len(item), error=exc))
    return entries


def _safe_id(env: Envelope) -> int | str | None:
    return env.id if isinstance(env.id, int | str) else None


def classify(env: Envelope) -> Kind:
    """The kind of a decoded message.

    Raises:
        InvalidRequest: an ``id: null`` request, a message with both method and result, etc.
    """
    if env.method is not UNSET:
        if env.result is not UNSET or env.error is not UNSET:
            raise InvalidRequest("a message cannot carry both a method and a result or error")
        if env.id is UNSET:
            return "notification"
        if env.id is None:
            raise InvalidRequest("request id must be a string or an integer, not null")
        return "request"
    if env.id is UNSET:
        raise InvalidRequest("message has neither a method nor an id")
    if env.result is not UNSET and env.error is UNSET:
        if env.id is None:
            raise InvalidRequest("a result must carry the id of its request")
        return "response"
    if env.error is not UNSET and env.result is UNSET:
        return "error"
    raise InvalidRequest("a response must carry exactly one of result and error")


# ---- encoding -----------------------------------------------------------------------------


def encode_request(id: RequestId, method: str, params: Raw | bytes | UnsetType = UNSET) -> bytes:
    if isinstance(params, bytes):
        params = Raw(params)
    return _encoder.encode(_Request("2.0", id, method, params))


def encode_request_fields(id: RequestId, method: str, params: dict[str, Raw]) -> bytes:
    """A request whose params are given decoded one level (encoded in the same pass)."""
    return _encoder.encode(_RequestFields("2.0", id, method, params))


def encode_notification(method: str, params: Raw | bytes | UnsetType = UNSET) -> bytes:
    if isinstance(params, bytes):
        params = Raw(params)
    return _encoder.encode(_Notification("2.0", method, params))


def encode_result(id: RequestId, result: Raw | bytes) -> bytes:
    if isinstance(result, bytes):
        result = Raw(result)
    return _encoder.encode(_Result("2.0", id, result))


def encode_error(id: RequestId | None, code: int, message: str, data: Any = UNSET) -> bytes:
    if data is None:
        data = UNSET
    return _encoder.encode(_Error("2.0", id, ErrorObject(code, message, data)))


def encode(obj: Any) -> bytes:
    """Encode any msgspec-encodable value as JSON."""
    return _encoder.encode(obj)


def params_dict(params: Raw | UnsetType) -> dict[str, Raw]:
    """Decode the top level of ``params`` (values stay Raw).  Absent params → ``{}``.

    Raises:
        InvalidRequest: ``params`` is not a JSON object.
    """
    if params is UNSET or not params:
        return {}
    try:
        return _dict_decoder.decode(params)
    except msgspec.ValidationError:
        raise InvalidRequest("params must be a JSON object") from None
    except msgspec.DecodeError:  # maybe an unpaired surrogate escape: raw_dict's slow path
        pass
    try:
        return raw_dict(params)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise InvalidRequest("params must be a JSON object") from None


def raw_dict(raw: Raw | bytes) -> dict[str, Raw]:
    """Decode the top level of a JSON object held as Raw; values stay Raw (an unpaired
    surrogate escape in a value passes on as an escape).

    Raises:
        msgspec.DecodeError, msgspec.ValidationError: not a JSON object.
    """
    try:
        return _dict_decoder.decode(raw)
    except msgspec.DecodeError:
        if not _SURROGATE_ESCAPE.search(raw):
            raise
    obj = _stdlib_loads(raw)
    if not isinstance(obj, dict):
        raise msgspec.ValidationError("expected an object")
    return {key: _stdlib_raw(value) for key, value in obj.items()}


def loads(raw: Raw | bytes) -> Any:
    """Decode JSON the gateway reads for itself (a tool name, a progress token, a client's
    answer).  Unpaired surrogate escapes become U+FFFD there; payloads that pass through are
    never decoded by this.

    Raises:
        msgspec.DecodeError: not JSON.
    """
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        if not _SURROGATE_ESCAPE.search(raw):
            raise
        return msgspec.json.decode(replace_unpaired_surrogates(raw))


#: An unpaired surrogate escape: a high one not followed by a low one, a low one not preceded
#: by a high one.
_UNPAIRED = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def replace_unpaired_surrogates(raw: Raw | bytes) -> bytes:
    """``raw`` with every unpaired surrogate escape replaced by ``\\ufffd`` (same length), for
    data the gateway must decode with msgspec, which refuses them."""
    return _UNPAIRED.sub(rb"\\ufffd", bytes(raw))


def _strict_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _stdlib_loads(raw: Raw | bytes) -> Any:
    """The standard library's decoder, held to what msgspec accepts (it is the slow path for
    unpaired surrogates only): the bytes are UTF-8 (no encoding is guessed), ``NaN`` and
    ``Infinity`` are refused, and so are numbers that overflow a float.

    Raises:
        msgspec.DecodeError: not JSON by those rules, or too deep for the standard library.
    """
    try:
        return json.loads(bytes(raw).decode("utf-8"), parse_float=_strict_float,
                          parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise msgspec.DecodeError(f"{type(exc).__name__}: {exc}") from None


def _stdlib_raw(value: Any) -> Raw:
    """A value the standard library decoded, as compact JSON with ASCII escapes."""
    return Raw(json.dumps(value, separators=(",", ":")).encode())


def encode_dict(d: dict[str, Raw | Any]) -> Raw:
    return Raw(_encoder.encode(d))


EMPTY_RESULT = Raw(b"{}")
