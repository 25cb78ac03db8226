"""The modern protocol era (2026-07-28) on a client connection: what a request must carry, and
what a result must say (pure).

A modern request has no handshake: it carries its protocol version and the client's
capabilities in ``params._meta``.  A WebSocket or unix-socket connection is pinned to an era by
its first request (:func:`era_of`) and refuses requests of the other era afterwards.  Every
modern result carries ``resultType``, the cacheable ones ``ttlMs`` and ``cacheScope``.  The
gateway as the client of a modern child uses :func:`envelope`, :func:`refuses_legacy`,
:func:`speaks_modern` and :func:`is_input_required`.  Era bridging lives in
:mod:`gateway.core.bridge` and :mod:`gateway.core.inputs`.
"""

from __future__ import annotations

import base64
import enum
from typing import Any, NamedTuple

import msgspec
from msgspec import Raw

from gateway import errors
from gateway.protocol import jsonrpc, mcp

MODERN_VERSIONS = ("2026-07-28",)
LATEST_MODERN = MODERN_VERSIONS[-1]
#: Every revision the gateway speaks to clients, newest first (``server/discover``).
SUPPORTED_VERSIONS = (*reversed(MODERN_VERSIONS), *reversed(mcp.LEGACY_VERSIONS))

VERSION_KEY = "io.modelcontextprotocol/protocolVersion"
CAPABILITIES_KEY = "io.modelcontextprotocol/clientCapabilities"
CLIENT_INFO_KEY = "io.modelcontextprotocol/clientInfo"
LOG_LEVEL_KEY = "io.modelcontextprotocol/logLevel"
SERVER_INFO_KEY = "io.modelcontextprotocol/serverInfo"

#: Methods of the legacy era only: a modern request for them is "method not found".
LEGACY_ONLY = frozenset({"initialize", "ping", "logging/setLevel", "resources/subscribe",
                         "resources/unsubscribe"})
#: Requests a modern client may send the gateway (others: -32601, on HTTP with status 404).
MODERN_METHODS = frozenset({"server/discover", "tools/list", "tools/call", "prompts/list",
                            "prompts/get", "resources/list", "resources/templates/list",
                            "resources/read", "completion/complete", "subscriptions/listen"})
#: Requests whose ``Mcp-Name`` header carries a param (2026-07-28 Streamable HTTP).
NAMED = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
#: Results that carry caching hints, by method.
CACHEABLE = frozenset({"tools/list", "prompts/list", "resources/list", "resources/templates/list",
                       "resources/read", "server/discover"})
#: Results computed by the gateway from its merged catalog: ``cacheScope`` ``"public"``, except
#: the lists (:data:`LISTS`) while policy filters them per caller (``"private"``).
CATALOG = frozenset({"tools/list", "prompts/list", "resources/list", "resources/templates/list",
                     "server/discover"})
LISTS = CATALOG - {"server/discover"}


class Era(enum.Enum):
    LEGACY = "legacy"
    MODERN = "modern"


def modern_version(params: dict[str, Raw]) -> str | None:
    """The protocol version a request's ``_meta`` names (None: none, a legacy request)."""
    raw = params.get("_meta")
    if raw is None or VERSION_KEY.encode() not in bytes(raw):
        return None
    try:
        meta = jsonrpc.raw_dict(raw)
        value = jsonrpc.loads(meta[VERSION_KEY])
    except (KeyError, errors.GatewayError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return value if isinstance(value, str) else None


def era_of(method: str, params: dict[str, Raw]) -> Era:
    """The era a connection's first request pins it to."""
    if method == "server/discover" or modern_version(params) is not None:
        return Era.MODERN
    return Era.LEGACY


class Modern(NamedTuple):
    """What a valid modern request's ``_meta`` says about its caller."""

    caps: dict[str, Any]  # the client's capabilities
    log_level: str | None  # the level it wants log messages at (None: none at all)


def modern_meta(method: str, params: dict[str, Raw]) -> Modern:
    """Validate a modern request's ``_meta`` (one decode); returns what it says.

    Raises:
        InvalidParams: the protocol version or the client capabilities are missing.
        errors.UnsupportedVersion: a version the gateway does not speak (``data.supported``).
        MethodNotFound: a method the 2026-07-28 revision removed.
    """
    if method in LEGACY_ONLY:
        raise errors.MethodNotFound(f"{method} does not exist in protocol version {LATEST_MODERN}, "
                                    "which this connection speaks (its first request chose it)")
    try:
        meta = jsonrpc.raw_dict(params["_meta"]) if "_meta" in params else {}
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise errors.InvalidParams(f"{method}: _meta must be an object") from None
    return _judged(method, meta)[0]


def _judged(method: str, meta: dict[str, Raw], version: Any = None) -> tuple[Modern, str]:
    """:func:`modern_meta` on ``_meta`` decoded one level; the version it names too
    (``version``: that one, decoded already; None: decoded here)."""
    if VERSION_KEY not in meta:
        raise errors.InvalidParams(f"{method}: _meta[{VERSION_KEY!r}] is required (2026-07-28), "
                                   "or open the connection with initialize")
    if version is None:
        version = jsonrpc.loads(meta[VERSION_KEY])
    if version not in MODERN_VERSIONS:
        raise errors.UnsupportedVersion(f"protocol version {version!r} is not supported on a "
                                        "modern request",
                                 supported=list(SUPPORTED_VERSIONS), requested=version)
    if CAPABILITIES_KEY not in meta:
        raise errors.InvalidParams(
            f"{method}: _meta[{CAPABILITIES_KEY!r}] is required (2026-07-28)")
    caps = jsonrpc.loads(meta[CAPABILITIES_KEY])
    if not isinstance(caps, dict):
        raise errors.InvalidParams(f"{method}: _meta[{CAPABILITIES_KEY!r}] must be an object")
    level = jsonrpc.loads(meta[LOG_LEVEL_KEY]) if LOG_LEVEL_KEY in meta else None
    if level is not None and not _is_level(level):
        raise errors.InvalidParams(f"{method}: _meta[{LOG_LEVEL_KEY!r}] must be one of "
                                   f"{', '.join(mcp.LOG_RANK)}")
    return Modern(caps, level), version


class HttpModern(NamedTuple):
    """What the edge reads of a valid modern HTTP request."""

    judged: Modern  # what modern_meta says of the same request (the core takes it as is)
    progress: int | str | None  # its progress token (None: none, or not a string or integer)


def check_http(method: str, params: dict[str, Raw],
               headers: dict[str, str | None]) -> HttpModern:
    """A modern (2026-07-28) HTTP request's ``_meta`` and routing headers, with ``_meta`` decoded
    once: -32020 when the ``MCP-Protocol-Version`` header and ``_meta`` name different versions
    (checked before either is judged), then :func:`modern_meta`'s checks, then
    the routing headers against the body.

    Raises:
        errors.HeaderMismatch: a header does not match the body.
        InvalidParams, errors.UnsupportedVersion, MethodNotFound: as :func:`modern_meta`.
    """
    raw = params.get("_meta")
    meta: dict[str, Raw] | None = None
    if raw is not None:
        try:
            meta = jsonrpc.raw_dict(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            meta = None
    body_version = (jsonrpc.loads(meta[VERSION_KEY]) if meta is not None and VERSION_KEY in meta
                    else None)
    got = _header_value(headers.get("mcp-protocol-version"))
    if got is not None and isinstance(body_version, str) and got != body_version:
        raise errors.HeaderMismatch(f"the mcp-protocol-version header ({got!r}) does not match "
                                    f"the request's _meta ({body_version!r})",
                                    header="mcp-protocol-version")
    if method in LEGACY_ONLY:
        raise errors.MethodNotFound(f"{method} does not exist in protocol version {LATEST_MODERN}, "
                                    "which this connection speaks (its first request chose it)")
    if raw is not None and meta is None:
        raise errors.InvalidParams(f"{method}: _meta must be an object")
    modern, version = _judged(method, meta or {}, body_version)
    mismatch = _headers_against(method, version, params, headers, got)
    if mismatch is not None:
        raise mismatch
    return HttpModern(modern, progress_of(meta or {}))


def progress_of(meta: dict[str, Raw]) -> int | str | None:
    """The progress token of a request's ``_meta`` decoded one level (None: none, or not a
    string or integer)."""
    raw = meta.get("progressToken")
    token = None if raw is None else jsonrpc.loads(raw)
    return token if isinstance(token, int | str) and not isinstance(token, bool) else None


def _is_level(value: object) -> bool:
    return isinstance(value, str) and value in mcp.LOG_RANK


def _headers_against(method: str, version: Any, params: dict[str, Raw],
                     headers: dict[str, str | None], got_version: str | None
                     ) -> errors.GatewayError | None:
    """The -32020 error for a modern HTTP request whose routing headers do not match its body
    (``MCP-Protocol-Version``, whose value is ``got_version``, ``Mcp-Method``, ``Mcp-Name``),
    or None.  A header value may be ``=?base64?…?=``-encoded."""
    if got_version is None or got_version != version:
        return _mismatch("mcp-protocol-version", got_version, version)
    got = _header_value(headers.get("mcp-method"))
    if got is None or got != method:
        return _mismatch("mcp-method", got, method)
    if method in NAMED:
        raw = params.get(NAMED[method])
        want = jsonrpc.loads(raw) if raw is not None else None
        got = _header_value(headers.get("mcp-name"))
        if got is None or got != want:
            return _mismatch("mcp-name", got, want)
    return None


def _mismatch(name: str, got: str | None, want: Any) -> errors.GatewayError:
    return errors.HeaderMismatch(
        f"the {name} header ({got!r}) does not match the request body ({want!r})", header=name)


def header_value(value: str) -> str:
    """A value for a 2026-07-28 routing header: as is when it is visible ASCII (spaces inside
    only) and does not look like the sentinel, else ``=?base64?…?=`` (the inverse of
    :func:`_header_value`)."""
    if (value.isascii() and value.isprintable() and value == value.strip()
            and not (value.startswith("=?base64?") and value.endswith("?="))):
        return value
    return f"=?base64?{base64.b64encode(value.encode('utf-8')).decode('ascii')}?="


def _header_value(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if value[:9] == "=?base64?" and value[-2:] == "?=":
        try:
            return base64.b64decode(value[9:-2], validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
    return value


#: The 2026-07-28 ``_meta`` keys that describe the client's request to the gateway: never passed
#: to a legacy child (a dual-era child refuses a modern envelope on its initialized session).
ENVELOPE_KEYS = frozenset({VERSION_KEY, CAPABILITIES_KEY, CLIENT_INFO_KEY, LOG_LEVEL_KEY})


def strip_envelope(params: dict[str, Raw], meta: dict[str, Raw]
                   ) -> tuple[dict[str, Raw] | None, dict[str, Raw] | None]:
    """Remove the modern envelope from a request's ``_meta`` (``meta``: it, decoded one level;
    ``params`` changes in place: the rest passes as is, ``_meta`` goes when nothing is left).
    Returns the envelope's keys that were there (for a modern child, which gets them back), or
    None, and what is left of ``meta`` (None: nothing)."""
    envelope: dict[str, Raw] = {}
    kept: dict[str, Raw] = {}
    for k, v in meta.items():
        if k in ENVELOPE_KEYS:
            envelope[k] = v
        else:
            kept[k] = v
    if not envelope:
        return None, meta
    if kept:
        params["_meta"] = jsonrpc.encode_dict(kept)
    else:
        del params["_meta"]
    return envelope, kept or None


# ---- the gateway as the client of a modern child ----------------------------------------------

#: The client capabilities a child may ask input for (``inputRequests`` methods), by name.
INPUT_CAPABILITIES = ("roots", "sampling", "elicitation")


def envelope(capabilities: dict[str, Any], *, log_level: str | None = None,
             client_info: dict[str, Any] | None = None) -> dict[str, Raw]:
    """The ``_meta`` keys the gateway sends a modern child with a request of its own or of a
    legacy client (whose ``logLevel``, set with ``logging/setLevel``, goes along)."""
    env = {VERSION_KEY: Raw(b'"' + LATEST_MODERN.encode() + b'"'),
           CAPABILITIES_KEY: Raw(msgspec.json.encode(capabilities))}
    if client_info is not None:
        env[CLIENT_INFO_KEY] = Raw(msgspec.json.encode(client_info))
    if log_level is not None:
        env[LOG_LEVEL_KEY] = Raw(msgspec.json.encode(log_level))
    return env


def restrict_envelope(env: dict[str, Raw], declare: frozenset[str]) -> dict[str, Raw]:
    """A modern client's envelope for a modern child: its capabilities without the input kinds
    the operator does not let this backend ask for (``declare``); the rest as the client sent it."""
    raw = env.get(CAPABILITIES_KEY)
    if raw is None or all(kind in declare for kind in INPUT_CAPABILITIES):
        return env
    try:
        caps = jsonrpc.loads(raw)
    except msgspec.DecodeError:
        return env
    if not isinstance(caps, dict):
        return env
    kept = {k: v for k, v in caps.items() if k not in INPUT_CAPABILITIES or k in declare}
    return {**env, CAPABILITIES_KEY: Raw(msgspec.json.encode(kept))}


def add_envelope(params: dict[str, Raw], env: dict[str, Raw]) -> None:
    """Put a modern envelope into a request's ``_meta`` (in place; its other keys stay)."""
    raw = params.get("_meta")
    meta: dict[str, Raw] = {}
    if raw is not None:
        try:
            meta = jsonrpc.raw_dict(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            meta = {}
    params["_meta"] = jsonrpc.encode_dict({**meta, **env})


def speaks_modern(supported: Any) -> bool:
    """Whether a ``supportedVersions`` / ``data.supported`` list names a revision the gateway
    speaks as a modern client."""
    return isinstance(supported, list) and any(v in MODERN_VERSIONS for v in supported)


def refuses_legacy(code: int, data: Any) -> bool:
    """Whether a child's error to ``initialize`` says it speaks only the modern era: -32601
    (``initialize`` does not exist for it), -32022, or an error whose ``data.supported`` names
    a modern revision only (mcp-spec-digest §3.2: a modern-only server SHOULD list them)."""
    supported = data.get("supported") if isinstance(data, dict) else None
    if isinstance(supported, list) and supported:
        return speaks_modern(supported) and not any(v in mcp.LEGACY_VERSIONS for v in supported)
    return code in (errors.METHOD_NOT_FOUND, errors.UNSUPPORTED_VERSION)


def is_input_required(result: Raw) -> bool:
    """Whether a result is an ``InputRequiredResult`` (checked on the bytes first: cheap)."""
    data = bytes(result)
    if b'"input_required"' not in data:
        return False
    try:
        value: object = jsonrpc.loads(jsonrpc.raw_dict(result).get("resultType", Raw(b"null")))
    except (msgspec.DecodeError, msgspec.ValidationError, errors.GatewayError):
        return False
    return value == "input_required"


_RESULT_TYPE = b'"resultType"'
_COMPLETE_OPEN = b'{"resultType":"complete"'


def complete(method: str, result: Raw, *, per_caller: bool = False) -> Raw:
    """A result for a modern client: ``resultType`` (``"complete"`` unless the result has one)
    and, where the revision requires them, ``ttlMs`` and ``cacheScope`` (a legacy child gives
    none: ``0`` and ``"private"``, the safe reading; the gateway's own catalog is the same for
    every caller, ``"public"``, unless ``per_caller``: policy filters the lists per caller, so
    a list result is ``"private"``)."""
    if method not in CACHEABLE:  # the common case, a call's result: ``resultType`` put first
        raw = bytes(result)
        # an object without the name at any depth, nor an escape that could spell it
        if raw[:1] == b"{" and _RESULT_TYPE not in raw and b"\\u" not in raw:
            rest = raw[1:].lstrip()
            return Raw(_COMPLETE_OPEN + (b"}" if rest[:1] == b"}" else b"," + rest))
    try:
        fields = jsonrpc.raw_dict(result)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return result  # not an object: passed on as the child sent it
    fields.setdefault("resultType", Raw(b'"complete"'))
    if method in CACHEABLE:
        fields.setdefault("ttlMs", Raw(b"0"))
        public = method in CATALOG and not (per_caller and method in LISTS)
        fields.setdefault("cacheScope", Raw(b'"public"' if public else b'"private"'))
    return jsonrpc.encode_dict(fields)


def modern_error(exc: errors.GatewayError) -> errors.GatewayError:
    """Errors whose code changed in 2026-07-28: resource not found is -32602 there."""
    if exc.code == errors.RESOURCE_NOT_FOUND:
        return errors.InvalidParams(exc.message, **exc.data)
    return exc


def discover(capabilities: dict[str, Any], server_name: str, version: str) -> Raw:
    """The gateway's ``server/discover`` result."""
    return complete("server/discover", jsonrpc.encode_dict({
        "supportedVersions": list(SUPPORTED_VERSIONS),
        "capabilities": capabilities,
        "_meta": {SERVER_INFO_KEY: {"name": server_name, "version": version}},
    }))
