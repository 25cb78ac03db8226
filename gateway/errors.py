"""The gateway's exception taxonomy and the one JSON-RPC error-code table.

Every condition the gateway reports to a client is a :class:`GatewayError` with a code defined
below and a machine-readable ``data.reason`` (the codes by condition are listed on
:class:`GatewayError` and in README).  ``gateway.core.connection`` is the only place that turns
exceptions into JSON-RPC error responses (:func:`gateway.core.serving.error_response`).  The
JSON-RPC 2.0 codes (-32700 … -32603) and the MCP spec's -32002 (resource not found) keep their
standard meaning.
"""

from __future__ import annotations

import enum
from typing import Any

# JSON-RPC 2.0
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# MCP (legacy revisions)
RESOURCE_NOT_FOUND = -32002
URL_ELICITATION_REQUIRED = -32042  # 2025-11-25 only
# Gateway conditions, implementation-defined range -32000..-32019
BACKEND_UNAVAILABLE = -32001
TIMEOUT = -32003
BACKEND_EXITED = -32004
DENIED = -32005
OVERLOADED = -32006
UNROUTABLE = -32007
RESPONSE_TOO_LARGE = -32008
BACKEND_PROTOCOL_ERROR = -32009
# MCP 2026-07-28, spec-defined range -32020..-32099
HEADER_MISMATCH = -32020
MISSING_CAPABILITY = -32021
UNSUPPORTED_VERSION = -32022

#: Every code the gateway itself emits, by name (a bounded metric label set).
CODE_NAMES: dict[int, str] = {
    PARSE_ERROR: "parse_error",
    INVALID_REQUEST: "invalid_request",
    METHOD_NOT_FOUND: "method_not_found",
    INVALID_PARAMS: "invalid_params",
    INTERNAL_ERROR: "internal_error",
    RESOURCE_NOT_FOUND: "resource_not_found",
    URL_ELICITATION_REQUIRED: "url_elicitation_required",
    BACKEND_UNAVAILABLE: "backend_unavailable",
    TIMEOUT: "timeout",
    BACKEND_EXITED: "backend_exited",
    DENIED: "denied",
    OVERLOADED: "overloaded",
    UNROUTABLE: "unroutable",
    RESPONSE_TOO_LARGE: "response_too_large",
    BACKEND_PROTOCOL_ERROR: "backend_protocol_error",
    HEADER_MISMATCH: "header_mismatch",
    MISSING_CAPABILITY: "missing_capability",
    UNSUPPORTED_VERSION: "unsupported_version",
}


def code_name(code: int) -> str:
    """The bounded label for a JSON-RPC error code (``other`` for codes nobody listed)."""
    return CODE_NAMES.get(code, "other")


class GatewayError(Exception):
    """A condition reported to a client as a JSON-RPC error.

    ===========================  =======  =========================================
    condition                    code     ``data.reason``
    ===========================  =======  =========================================
    backend not running          -32001   ``backend_unavailable`` (+backend, retryable)
    call timed out at gateway    -32003   ``timeout``
    child died with call open    -32004   ``backend_exited``
    policy / consent             -32005   ``denied`` ``declined`` ``timeout``
                                          ``authorization_required`` ``shutdown``
                                          ``insufficient_scope`` (+scopes)
    per-connection limit         -32006   ``overloaded``
    per-principal limit          -32006   ``rate_limited`` (+limit, value, retryAfter)
    unroutable server request    -32007   ``unattributable`` ``no_capability``
    backend reply too large      -32008   ``response_too_large`` (+backend, limit)
    backend broke the protocol   -32009   ``backend_protocol_error`` (+backend, detail)
    caller lacks a capability    -32021   ``authorization_required`` (+requiredCapabilities)
    caller must open a URL       -32042   (2025-11-25 callers) ``elicitations``
    ===========================  =======  =========================================
    """

    code: int = INTERNAL_ERROR
    reason: str | None = None

    def __init__(self, message: str, *, reason: str | None = None, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.data = data

    def error_data(self) -> dict[str, Any] | None:
        data = dict(self.data)
        if self.reason is not None:
            data["reason"] = self.reason
        return data or None


# ---- errors in what a peer sent (JSON-RPC standard codes) -------------------------------


class ParseError(GatewayError):
    code = PARSE_ERROR


class InvalidRequest(GatewayError):
    code = INVALID_REQUEST


class MethodNotFound(GatewayError):
    code = METHOD_NOT_FOUND


class InvalidParams(GatewayError):
    code = INVALID_PARAMS


class ResourceNotFound(GatewayError):
    code = RESOURCE_NOT_FOUND


class HeaderMismatch(GatewayError):
    """A 2026-07-28 HTTP request whose routing headers do not match its body."""

    code = HEADER_MISMATCH


class MissingCapability(GatewayError):
    """A 2026-07-28 request needs a client capability its ``_meta`` did not declare
    (``data.requiredCapabilities``)."""

    code = MISSING_CAPABILITY


class URLElicitationRequired(GatewayError):
    """2025-11-25 ``URLElicitationRequiredError``: the caller must open a URL first
    (``data.elicitations``: URL-mode elicitation params) and then call again."""

    code = URL_ELICITATION_REQUIRED
    reason = "authorization_required"


class UnsupportedVersion(GatewayError):
    """A modern request names a protocol version the gateway does not speak (2026-07-28)."""

    code = UNSUPPORTED_VERSION


class InternalError(GatewayError):
    code = INTERNAL_ERROR


# ---- gateway conditions ------------------------------------------------------------------


class BackendUnavailable(GatewayError):
    code = BACKEND_UNAVAILABLE
    reason = "backend_unavailable"


class CallTimeout(GatewayError):
    code = TIMEOUT
    reason = "timeout"


class BackendExited(GatewayError):
    code = BACKEND_EXITED
    reason = "backend_exited"


class NotDelivered(BackendExited):
    """The request could not even be written to the child (it never saw it): safe to retry."""


class Denied(GatewayError):
    code = DENIED
    reason = "denied"


class Overloaded(GatewayError):
    code = OVERLOADED
    reason = "overloaded"


class ResponseTooLarge(GatewayError):
    code = RESPONSE_TOO_LARGE
    reason = "response_too_large"


class BackendProtocolError(GatewayError):
    """The backend's reply to the call could not be passed on (invalid UTF-8, nested too deep)."""

    code = BACKEND_PROTOCOL_ERROR
    reason = "backend_protocol_error"


class RemoteError(GatewayError):
    """A JSON-RPC error a backend answered; passed to the client with its own code."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.remote_data = data

    def error_data(self) -> Any:
        return self.remote_data


# ---- transport-level conditions (never reach the wire as JSON-RPC) ------------------------


class TransportClosed(Exception):
    """The peer went away (EOF, reset, WebSocket close).  Raised by transports only."""


class CloseReason(enum.StrEnum):
    """Why a client connection ended (the ``reason`` label of the closed-connections counter).

    A ``StrEnum``: code that still passes the plain string compares and hashes equal.
    """

    CLIENT_CLOSED = "client_closed"
    OVERFLOW = "overflow"  # the client did not read its outbound queue
    OVERSIZE = "oversize"  # a message over max_message_bytes
    UNSUPPORTED_DATA = "unsupported_data"  # a WebSocket binary frame
    INVALID_DATA = "invalid_data"  # a WebSocket text frame that is not UTF-8
    INCOMPLETE = "incomplete_message"  # a message not completed within INCOMPLETE_MESSAGE_TIMEOUT
    SHUTDOWN = "shutdown"
    ERROR = "error"
    IDLE = "idle"
    UNAUTHORIZED = "unauthorized"  # its credential was removed by a reload (WebSocket 1008)


class MessageRefused(Exception):
    """A peer sent a message the transport will not pass on: the connection answers -32600 with
    ``data.reason = reason`` (no answer when ``reason`` is None) and closes for ``close_reason``."""

    close_reason: CloseReason = CloseReason.ERROR
    reason: str | None = None

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.data = data


class MessageTooLarge(MessageRefused):
    """A peer sent a message over ``max_message_bytes``."""

    close_reason = CloseReason.OVERSIZE
    reason = "message_too_large"

    def __init__(self, size: int | None, limit: int) -> None:
        what = f"message of {size} bytes" if size is not None else "message"
        super().__init__(f"{what} exceeds the limit of {limit} bytes", limit=limit)
        self.size = size
        self.limit = limit


class IncompleteMessage(MessageRefused):
    """A peer started a message and did not complete it within
    :data:`gateway.limits.INCOMPLETE_MESSAGE_TIMEOUT` seconds."""

    close_reason = CloseReason.INCOMPLETE
    reason = "incomplete_message"


class UnsupportedMessage(MessageRefused):
    """A WebSocket binary frame: MCP over WebSocket is one JSON-RPC message per text frame."""

    close_reason = CloseReason.UNSUPPORTED_DATA
    reason = "binary_frame"


class InvalidFramePayload(MessageRefused):
    """A WebSocket text frame that is not valid UTF-8 (RFC 6455 §8.1: fail the connection, no
    answer)."""

    close_reason = CloseReason.INVALID_DATA


class ConfigError(Exception):
    """The configuration is invalid; ``errors`` lists each problem with its key path."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors
