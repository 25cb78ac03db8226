"""What the core tells a request's trace, and nothing of how it is recorded.

The core imports no tracing library: when ``[telemetry] enabled`` the service gives the hub a
:class:`Tracer` (``gateway.ops.telemetry``), else None, and every hook in the core is one
``is None`` test.  A request's :class:`RequestTrace` rides on its ``Request.trace``: the
server span, its children (policy, consent, the wait for an instance) and one client span per
backend call, whose W3C trace context goes into the forwarded request's ``_meta``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

from msgspec import Raw

#: The ``_meta`` keys of a W3C trace context: the gateway's replace the caller's.
TRACE_KEYS = frozenset({"traceparent", "tracestate"})

#: The ``traceparent`` and ``tracestate`` headers of the /mcp POST served in this task (set by
#: the endpoint only while tracing is on); a request's own ``_meta`` comes first.
http_context: ContextVar[tuple[str, str | None] | None] = ContextVar("http_trace_context",
                                                                     default=None)


class RequestTrace(Protocol):
    """One client request's trace.  Times are ``time.time_ns()``."""

    def span(self, name: str, start_ns: int, outcome: str) -> None:
        """A child span from ``start_ns`` to now (``policy``, ``consent``, ``wait``)."""

    def call(self, backend: str, instance: str) -> dict[str, Raw]:
        """A backend call starts: its client span; returns the ``_meta`` keys it carries."""

    def call_done(self, code: int | None) -> None:
        """The backend call ended (``code``: its JSON-RPC error, if any)."""

    def end(self, outcome: str, code: int | None, backend: str, tool: str | None) -> None:
        """The request was answered (or not: ``cancelled``)."""


class Tracer(Protocol):
    def request(self, method: str, params: Raw | None, transport: str,
                principal: str | None) -> RequestTrace:
        """A request arrives (``params``: as received, its ``_meta`` may carry a parent;
        ``principal``: who authenticated, None: nobody)."""
