"""A client connection's lifecycle as a table (pure: no I/O, no clock).

A connection starts ``AWAITING_INIT``.  Its first request pins its era: a modern (2026-07-28)
one makes it ``READY_MODERN`` at once (no ``initialize`` in that era); a legacy one leaves it
waiting for ``initialize``, whose success makes it ``READY_LEGACY``.  The daemon's drain makes it
``DRAINING`` when it first refuses one of its requests (new requests refused; answers and a
parked call's retry still taken; its close waits for it to settle), and ``close`` ends it in
``CLOSED``, which absorbs everything after.  An event with no entry in
:data:`TRANSITIONS` is refused (:class:`InvalidTransition`); the core turns the ones a client can
cause into JSON-RPC errors.
"""

from __future__ import annotations

import enum


class SessionState(enum.Enum):
    __hash__ = object.__hash__  # a member is its only instance (no Python call per lookup)

    AWAITING_INIT = "awaiting_initialize"  # no era yet, or legacy before initialize succeeded
    READY_LEGACY = "ready_legacy"  # initialized (2025-03-26 … 2025-11-25)
    READY_MODERN = "ready_modern"  # 2026-07-28: every request describes its caller
    DRAINING = "draining"  # the daemon drains: new requests refused, answers still taken
    CLOSED = "closed"  # over: nothing more is sent or served


class SessionEvent(enum.Enum):
    __hash__ = object.__hash__

    LEGACY = "legacy"  # the first request pins the legacy era
    MODERN = "modern"  # the first request pins the modern era
    INITIALIZED = "initialized"  # an initialize was answered
    DRAIN = "drain"  # the daemon's drain reached the connection
    CLOSE = "close"


S, E = SessionState, SessionEvent

#: (state, event) -> the next state.  An initialize served while draining (it was admitted
#: before) or on a modern connection records its revision and leaves the state as it is; a
#: closed connection stays closed whatever a task still running does.
TRANSITIONS: dict[tuple[SessionState, SessionEvent], SessionState] = {
    (S.AWAITING_INIT, E.LEGACY): S.AWAITING_INIT,
    (S.AWAITING_INIT, E.MODERN): S.READY_MODERN,
    (S.AWAITING_INIT, E.INITIALIZED): S.READY_LEGACY,
    (S.READY_MODERN, E.INITIALIZED): S.READY_MODERN,
    (S.DRAINING, E.LEGACY): S.DRAINING,
    (S.DRAINING, E.MODERN): S.DRAINING,
    (S.DRAINING, E.INITIALIZED): S.DRAINING,
    **{(s, E.DRAIN): S.DRAINING for s in (S.AWAITING_INIT, S.READY_LEGACY, S.READY_MODERN,
                                           S.DRAINING)},
    **{(s, E.CLOSE): S.CLOSED for s in SessionState},
    **{(S.CLOSED, e): S.CLOSED for e in SessionEvent},
}


class InvalidTransition(Exception):
    """``event`` is not allowed in ``state``."""

    def __init__(self, state: SessionState, event: SessionEvent) -> None:
        super().__init__(f"{event.value} is not allowed in state {state.value}")
        self.state = state
        self.event = event


def next_state(state: SessionState, event: SessionEvent) -> SessionState:
    """The state ``event`` leads to from ``state`` (raises InvalidTransition)."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise InvalidTransition(state, event) from None
