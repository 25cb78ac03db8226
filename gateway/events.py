"""Typed events the core emits; metrics, logs and ``/status`` subscribe to them.

Business logic never increments a counter: it calls ``bus.emit(SomeEvent(...))`` and the
subscribers (``gateway.ops.metrics`` among them) do the rest.  Subscribers run synchronously in
the emitting task and must not block or raise; an exception in one is logged and swallowed so an
observer can never break routing.

Label discipline: every field that a metric uses as a label holds a value from a bounded set
(method names from :data:`gateway.protocol.mcp.KNOWN_METHODS` or ``other``, outcome names,
transport names, backend names from config).  Free-form values (conn ids, tool names) are
carried for logs and for capped label sets only.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import msgspec

LOGGER = logging.getLogger(__name__)


# The bounded value sets of event fields.  ``StrEnum``s: metric labels and log lines carry their
# plain string values, and a member compares and hashes equal to its value.


class RequestOutcome(enum.StrEnum):
    """How a client request ended (:class:`RequestFinished`)."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"  # the client cancelled it: no response was sent


class ServerRequestOutcome(enum.StrEnum):
    """How a server→client request ended (:class:`ServerRequestFinished`)."""

    ANSWERED = "answered"  # the owner answered with a result
    ERROR = "error"  # the owner answered with an error
    CANCELLED = "cancelled"  # the child cancelled it
    OWNER_GONE = "owner_gone"  # the owner disconnected
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"  # the gateway is draining
    CALL_FINISHED = "call_finished"  # the call that caused it ended first
    CHILD_RESTARTED = "child_restarted"  # the child that sent it exited


class ExitKind(enum.StrEnum):
    """Why a backend process ended (:class:`BackendExited`)."""

    EXITED = "exited"  # on its own, exit code 0
    CRASHED = "crashed"  # on its own, non-zero exit code or a signal
    STOPPED = "stopped"  # the gateway stopped it
    UNHEALTHY = "unhealthy"  # restarted by the gateway for health (pings missed)
    # restarted by the gateway after a drain (a cancelled call unanswered): not a failure
    RECYCLED = "recycled"
    EXPIRED = "expired"  # the remote ended the session: a new one opened at once, not a failure
    START_FAILED = "start_failed"  # the hand-shake failed or timed out
    UNAUTHORIZED = "unauthorized"  # the remote wants an authorization: AUTHORIZING, no failure


class ConnectionOpened(msgspec.Struct, frozen=True):
    conn_id: str
    transport: str  # "websocket" | "unix"


class ConnectionClosed(msgspec.Struct, frozen=True):
    conn_id: str
    transport: str
    reason: str  # a gateway.errors.CloseReason value
    duration: float


class ConnectionRefused(msgspec.Struct, frozen=True):
    """A client connection turned away before it was served."""

    transport: str  # "websocket" | "unix" | "http"
    reason: str  # "max_connections" | "unauthorized" (a 401 on the upgrade or an HTTP request)


class RequestStarted(msgspec.Struct, frozen=True):
    """A client request accepted for processing (the in-flight gauge rises)."""

    conn_id: str
    method: str  # bounded: a known MCP method or "other"
    backend: str  # "" when the gateway answers itself


class QueueWaited(msgspec.Struct, frozen=True):
    """A call waited for an instance (affine hand-over, restart wait) before it was sent."""

    backend: str
    seconds: float


class RequestFinished(msgspec.Struct, frozen=True):
    """A client request answered (or dropped, for ``cancelled``)."""

    conn_id: str
    method: str  # bounded: a known MCP method or "other"
    backend: str  # backend name, or "" for requests the gateway answers itself
    outcome: RequestOutcome
    error_code: int | None
    duration: float  # seconds, receipt to answer
    backend_time: float | None  # seconds spent waiting on the child (None: no child involved)
    tool: str | None = None  # the namespaced tool for tools/call
    principal: str = "_none"  # the caller's bounded label (gateway.auth.labels)


class BackendStateChanged(msgspec.Struct, frozen=True):
    backend: str
    instance: str  # e.g. "time/0"
    old: str
    new: str
    pid: int | None
    reason: str


class BackendStarted(msgspec.Struct, frozen=True):
    backend: str
    instance: str
    pid: int | None  # None: no process (a remote or in-process upstream)
    start_duration: float  # link opened (spawn) to handshake complete


class BackendExited(msgspec.Struct, frozen=True):
    backend: str
    instance: str
    pid: int | None
    reason: ExitKind
    returncode: int | None


class BackendProtocolError(msgspec.Struct, frozen=True):
    """A child printed a line that is not JSON-RPC (logged, counted, the child keeps serving)."""

    backend: str
    instance: str
    kind: str  # "not_json" | "invalid_message" | "oversize" | "unknown_response"


class BackendStderr(msgspec.Struct, frozen=True):
    """Lines a child wrote to stderr (one event per chunk read): logged, or held back by the
    rate limit (those are summarised in one log line per window)."""

    backend: str
    instance: str
    logged: int
    suppressed: int


class CatalogChanged(msgspec.Struct, frozen=True):
    kinds: tuple[str, ...]  # subset of ("tools", "prompts", "resources")


class ServerRequestRouted(msgspec.Struct, frozen=True):
    backend: str
    method: str
    conn_id: str


class ServerRequestRefused(msgspec.Struct, frozen=True):
    """A child's server→client request the gateway could not attribute or deliver."""

    backend: str
    method: str
    reason: str  # "unattributable" | "no_capability" | "no_call_in_flight"


class ServerRequestFinished(msgspec.Struct, frozen=True):
    backend: str  # "" for the gateway's own consent prompts
    method: str
    outcome: ServerRequestOutcome
    duration: float


class AnswerRefused(msgspec.Struct, frozen=True):
    """A client answered a server→client request it does not own (or that does not exist)."""

    conn_id: str
    reason: str  # "unknown_id"


class InputRequired(msgspec.Struct, frozen=True):
    """A modern caller's call was answered ``input_required`` for a legacy child's requests
    (era bridging, one per round) or for the gateway's consent prompt (backend "")."""

    backend: str


class RequestStateRefused(msgspec.Struct, frozen=True):
    """A retry's ``requestState`` was refused (``invalid_state``)."""

    # "tampered" | "foreign" | "expired" | "used" | "gone" | "other_params" | "malformed" |
    # "principal" | "preempted"
    reason: str


class AuditRecordsDropped(msgspec.Struct, frozen=True):
    """Audit records lost: the queue was full (``on_full = "drop"``) or a write failed."""

    count: int


class ReloadFinished(msgspec.Struct, frozen=True):
    success: bool
    error: str | None
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()


class ListsChanged(msgspec.Struct, frozen=True):
    """A backend's lists changed (its first instance listed them anew): the catalog is rebuilt."""

    backend: str


class News:
    """Base of the news a layer below the core reports on the bus with that layer's own objects
    (``gateway.backend.instance.ChildNotified``); the hub subscribes and hands it to the core."""

    __slots__ = ()


Event = (
    ConnectionOpened
    | ConnectionClosed
    | ConnectionRefused
    | RequestStarted
    | QueueWaited
    | RequestFinished
    | BackendStateChanged
    | BackendStarted
    | BackendExited
    | BackendProtocolError
    | BackendStderr
    | CatalogChanged
    | ServerRequestRouted
    | ServerRequestRefused
    | ServerRequestFinished
    | AnswerRefused
    | InputRequired
    | RequestStateRefused
    | AuditRecordsDropped
    | ReloadFinished
    | ListsChanged
    | News
)


class EventBus:
    """Synchronous fan-out of events to subscribers, in subscription order.

    ``emit`` costs one dict lookup plus the calls: the callbacks for each event type are resolved
    once, on the first emit of that type, into a tuple kept in a table that every (un)subscribe
    clears.  Emitting iterates that tuple, so a callback that (un)subscribes while an event is
    being delivered changes who sees the next event, not this one.
    """

    def __init__(self) -> None:
        self._subscriptions: list[tuple[Callable[[Any], None], tuple[type, ...]]] = []
        self._table: dict[type, tuple[Callable[[Any], None], ...]] = {}

    def subscribe(self, callback: Callable[[Any], None], *types: type) -> Callable[[], None]:
        """Add ``callback`` for events that are instances of ``types`` (of every event if none).

        Returns:
            A function that removes this subscription again.
        """
        entry = (callback, types)
        self._subscriptions.append(entry)
        self._table.clear()

        def unsubscribe() -> None:
            self._subscriptions.remove(entry)
            self._table.clear()

        return unsubscribe

    def emit(self, event: Event) -> None:
        """Call every callback subscribed to ``event``'s type.

        Error handling: an exception from a callback is logged and swallowed, and the remaining
        callbacks still run.
        """
        callbacks = self._table.get(type(event))
        if callbacks is None:
            callbacks = self._resolve(type(event))
        for callback in callbacks:
            try:
                callback(event)
            except Exception:
                LOGGER.exception("event subscriber %r failed on %r", callback, event)

    def _resolve(self, kind: type) -> tuple[Callable[[Any], None], ...]:
        callbacks = self._table[kind] = tuple(
            callback
            for callback, types in self._subscriptions
            if not types or issubclass(kind, types)
        )
        return callbacks
