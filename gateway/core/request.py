"""A client request as the handlers see it, and where a forwarded one goes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from msgspec import Raw

from gateway.protocol.policy import Kind

if TYPE_CHECKING:
    from gateway.core.tracing import RequestTrace


class Request:
    """A client request as the handlers see it: the base of the request being served
    (:class:`gateway.core.serving.Served`, which sets every field but the three the slow paths
    set)."""

    __slots__ = ("at", "backend", "backend_time", "consent", "counted", "id", "instance",
                 "label", "method", "params", "rounds", "tool", "trace")  # fmt: skip

    id: int | str
    method: str
    label: str  # the method's metrics label (gateway.protocol.mcp.METHOD_LABELS)
    params: dict[str, Raw]
    backend: str  # the backend's name, once one was chosen
    backend_time: float | None
    tool: str | None
    counted: bool  # RequestStarted was emitted (a backend was chosen)
    # For the audit log, set on the slow paths only (read with getattr): forwarded by a task,
    # the instance that took it; how a consent prompt for it ended (gateway.core.policy); a
    # modern child's input_required rounds pushed to a legacy caller.
    instance: str
    consent: str
    rounds: int
    # forwarded by a task (:func:`gateway.core.handlers.forward`): its child and its call there
    at: tuple[Any, Any] | None
    trace: RequestTrace | None  # tracing is on (see gateway.core.tracing)


@dataclass(slots=True)
class Target:
    """Where a forwarded request goes, decided synchronously from the request alone."""

    backend: str
    params: dict[str, Raw]  # the params for the backend (names mapped back)
    # (name, arguments, kind): policy asks the user first
    consent: tuple[str, Any, Kind] | None = None
    progress: Any = None  # the caller's progress token, if any (see :func:`progress_token`)
    meta: dict[str, Raw] | None = None  # the request's ``_meta``, decoded one level, if any
    envelope: dict[str, Raw] | None = None  # a modern caller's envelope (for a modern child)


def asker_key(req: Request) -> str:
    """What a backend remembers of a call that asked its caller for input: the tool's name,
    else the method."""
    return req.tool or req.method
