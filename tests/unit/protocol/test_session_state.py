"""A client connection's lifecycle table (gateway.protocol.session), without trio."""

from __future__ import annotations

import pytest

from gateway.protocol.session import (
    TRANSITIONS,
    InvalidTransition,
    SessionEvent,
    SessionState,
    next_state,
)

S, E = SessionState, SessionEvent


def run(*events: SessionEvent) -> SessionState:
    state = S.AWAITING_INIT
    for event in events:
        state = next_state(state, event)
    return state


def test_a_legacy_connection_is_ready_once_initialized() -> None:
    assert run(E.LEGACY) is S.AWAITING_INIT  # e.g. a ping before initialize
    assert run(E.LEGACY, E.INITIALIZED) is S.READY_LEGACY


def test_a_modern_connection_is_ready_at_its_first_request() -> None:
    assert run(E.MODERN) is S.READY_MODERN
    assert run(E.MODERN, E.INITIALIZED) is S.READY_MODERN


@pytest.mark.parametrize("event", [E.LEGACY, E.MODERN, E.INITIALIZED])
def test_a_ready_legacy_connection_refuses_a_second_era_or_initialize(event: SessionEvent) -> None:
    with pytest.raises(InvalidTransition) as info:
        next_state(S.READY_LEGACY, event)
    assert info.value.state is S.READY_LEGACY and info.value.event is event


def test_every_open_state_drains_and_draining_keeps_what_was_admitted() -> None:
    for state in (S.AWAITING_INIT, S.READY_LEGACY, S.READY_MODERN, S.DRAINING):
        assert next_state(state, E.DRAIN) is S.DRAINING
    assert run(E.LEGACY, E.DRAIN, E.INITIALIZED) is S.DRAINING


def test_closed_is_terminal_and_absorbs_everything() -> None:
    for state in SessionState:
        assert next_state(state, E.CLOSE) is S.CLOSED
    for event in SessionEvent:
        assert next_state(S.CLOSED, event) is S.CLOSED


def test_the_table_names_only_states_and_events() -> None:
    for (state, event), to in TRANSITIONS.items():
        assert isinstance(state, SessionState) and isinstance(event, SessionEvent)
        assert isinstance(to, SessionState)
