"""A modern child's ``InputRequiredResult`` for a legacy client: pushed requests, then a retry.

A legacy client (WebSocket, unix socket, legacy HTTP session) cannot read ``input_required``,
so :func:`resolve` asks it the legacy way: each input request is pushed to the call's owner as a
server→client request under an id minted for that connection (the reply correlates itself: no
attribution needed); once every answer is in, the call is re-issued to the backend with
``inputResponses`` and the child's ``requestState``, for at most :data:`MAX_ROUNDS` rounds.
Each input request is decided as a legacy child's would be
(:func:`gateway.core.ownership.decide`); one not asked, or answered with an error, is left out
of ``inputResponses`` for the child to decide.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio
from msgspec import Raw

from gateway import errors
from gateway.core import handlers
from gateway.core.handlers import HandlerPorts
from gateway.core.ownership import Answer, Ownership, decide
from gateway.core.request import Target
from gateway.events import ServerRequestFinished, ServerRequestOutcome, ServerRequestRouted
from gateway.protocol import era, jsonrpc

if TYPE_CHECKING:
    from gateway.core.request import Request
    from gateway.core.session import ClientSession, ServerRequest

LOGGER = logging.getLogger(__name__)


class InputPorts(HandlerPorts, Protocol):
    """What asking a legacy client a modern backend's input requests needs: the handlers' ports
    and the ownership of server→client requests (counted there)."""

    @property
    def ownership(self) -> Ownership: ...

#: Rounds of input requests one call may take before the gateway gives up (-32009).
MAX_ROUNDS = 16
#: Input requests in one round at most (each becomes a request pushed to the client).
MAX_INPUTS = 32
#: The methods a child may answer with ``input_required`` (2026-07-28 MRTR).
MRTR_METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})


def input_requests(result: Raw) -> tuple[dict[str, tuple[str, dict[str, Any]]], Raw | None]:
    """The ``inputRequests`` of an ``InputRequiredResult`` as ``{key: (method, params)}`` and its
    ``requestState`` as the child sent it (Raw: passed back byte for byte), pure.

    Raises:
        BackendProtocolError: not a well-formed ``InputRequiredResult``.
    """
    try:
        fields = jsonrpc.raw_dict(result)
        raw = fields.get("inputRequests")
        asks = jsonrpc.loads(raw) if raw is not None else {}
    except (msgspec.DecodeError, msgspec.ValidationError):
        asks = None
        fields = {}
    state = fields.get("requestState")
    if not isinstance(asks, dict) or (not asks and state is None) or len(asks) > MAX_INPUTS:
        raise errors.BackendProtocolError("the backend answered input_required without valid "
                                          f"inputRequests (at most {MAX_INPUTS})")
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for key, ask in asks.items():
        method = ask.get("method") if isinstance(ask, dict) else None
        params = ask.get("params", {}) if isinstance(ask, dict) else None
        if not isinstance(method, str) or not isinstance(params, dict):
            raise errors.BackendProtocolError(
                f"the backend's input request {key!r} has no method or params")
        out[key] = (method, params)
    return out, state


def retry_params(params: dict[str, Raw], responses: dict[str, Raw],
                 state: Raw | None) -> dict[str, Raw]:
    """The params of the re-issued call: the original ones plus ``inputResponses`` and the
    child's ``requestState`` (pure; an earlier round's keys are replaced)."""
    out = {k: v for k, v in params.items() if k not in ("inputResponses", "requestState")}
    out["inputResponses"] = jsonrpc.encode_dict(responses)
    if state is not None:
        out["requestState"] = state
    return out


async def resolve(ports: InputPorts, session: ClientSession, req: Request, target: Target,
                  result: Raw, started: float) -> Raw:
    """Answer a modern child's ``input_required`` ``result`` for the legacy ``session``; returns
    the complete result.  The whole flow ends at the backend's ``max_call_duration`` after the
    request; the client cancelling it cancels the flow, and the pushed requests still open are
    withdrawn with ``notifications/cancelled``.

    Raises:
        CallTimeout (max_call_duration), BackendProtocolError (too many rounds, a malformed
        result), and whatever the re-issued call raises.
    """
    backend_cfg = ports.cfg.backends[target.backend]
    deadline = started + backend_cfg.max_call_duration
    rounds = 0
    with trio.move_on_at(deadline) as scope:
        while era.is_input_required(result):
            rounds += 1
            req.rounds = rounds
            if rounds > MAX_ROUNDS:
                raise errors.BackendProtocolError(
                    f"backend {target.backend!r} asked for input more than {MAX_ROUNDS} times in "
                    f"one {req.method}", backend=target.backend)
            asks, state = input_requests(result)
            responses = await _ask(ports, session, target.backend, asks)
            retry = Target(target.backend, retry_params(target.params, responses, state),
                       progress=target.progress, meta=target.meta)
            result = await handlers.forward(ports, session, req, retry)
        return result
    assert scope.cancelled_caught
    raise errors.CallTimeout(f"{req.method} waited for input longer than max_call_duration "
                             f"({backend_cfg.max_call_duration:g}s)", backend=target.backend)


async def _ask(ports: InputPorts, session: ClientSession, backend: str,
               asks: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Raw]:
    """One round: push what the owner can answer, answer what the gateway answers itself, wait
    for every answer; returns ``inputResponses`` (keys without an answer left out)."""
    cfg = ports.cfg.backends[backend]
    responses: dict[str, Raw] = {}
    pushed: list[tuple[str, ServerRequest]] = []
    try:
        for key, (method, params) in asks.items():
            decision = decide(method, params, sharing=cfg.sharing, config_roots=cfg.roots,
                              owners={session}, declared=frozenset(cfg.declare))
            if isinstance(decision, Answer):
                if decision.result is not None:
                    responses[key] = decision.result
                else:  # left out: the child decides (it was told what the caller can answer)
                    LOGGER.info("backend %s: input request %r (%s) not asked: %s", backend, key,
                                method, decision.message, extra=session.log_fields)
                continue
            if method == "sampling/createMessage":
                params = {**params, "includeContext": "none"}  # one client's context must not leak
            ports.bus.emit(ServerRequestRouted(backend, method, session.conn_id))
            ports.ownership.open += 1
            sreq = session.open_request(method, params)
            sreq.on_end.append(_finished_event(ports, backend))
            if sreq.outcome is not None:  # the owner was already gone
                _finished_event(ports, backend)(sreq)
            pushed.append((key, sreq))
        for key, sreq in pushed:
            await sreq.done.wait()
            if sreq.outcome is ServerRequestOutcome.ANSWERED and sreq.result is not None:
                responses[key] = sreq.result
    finally:  # cancelled or timed out: withdraw what is still open
        for _key, sreq in pushed:
            if not sreq.done.is_set():
                session.cancel_request(sreq, ServerRequestOutcome.CALL_FINISHED,
                                       "the call that caused this request has ended")
    return responses


def _finished_event(ports: InputPorts, backend: str) -> Any:
    def ended(sreq: ServerRequest) -> None:
        ports.ownership.open -= 1
        outcome = sreq.outcome or ServerRequestOutcome.SHUTDOWN
        ports.bus.emit(ServerRequestFinished(backend, sreq.method, outcome,
                                             trio.current_time() - sreq.started))

    return ended
