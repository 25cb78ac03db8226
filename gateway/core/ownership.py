"""Server→client requests from backends reach only their owner.

Legacy stdio carries no field saying which call caused a child's ``elicitation/create``,
``sampling/createMessage`` or ``roots/list``.  The gateway attributes such a request only when
every call in the child's attribution set belongs to one connection; otherwise it fails closed:
it answers the child itself, logs and counts it.  :func:`decide` is pure and returns what to do;
:meth:`Ownership.route` forwards the request to its owner under an id minted for that
connection, pausing the owner's call timeouts, and ends it exactly once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgspec
import trio
from msgspec import UNSET, Raw, UnsetType

from gateway import errors
from gateway.core.request import asker_key
from gateway.events import (
    EventBus,
    ServerRequestFinished,
    ServerRequestOutcome,
    ServerRequestRefused,
    ServerRequestRouted,
)
from gateway.protocol import jsonrpc
from gateway.protocol.era import Era

if TYPE_CHECKING:
    from gateway.backend.child import ChildConnection, Owner
    from gateway.backend.instance import Instance, Pool
    from gateway.core.session import ClientSession, ServerRequest

LOGGER = logging.getLogger(__name__)

DECLINE = Raw(b'{"action":"decline"}')


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the child directly: a result or an error."""

    result: Raw | None = None
    code: int = 0
    message: str = ""
    reason: str = ""  # why the gateway answered itself (for the refusal event), "" if not refused
    data: dict[str, Any] | None = None  # the error's ``data``, beyond ``reason``


@dataclass(frozen=True, slots=True)
class Forward:
    owner: ClientSession


def refusal(method: str, reason: str, message: str) -> Answer:
    if method == "elicitation/create":
        return Answer(result=DECLINE, reason=reason, message=message)
    return Answer(code=errors.UNROUTABLE, message=message, reason=reason)


def decide(
    method: str,
    params: dict[str, Any],
    *,
    sharing: str,
    config_roots: list[str],
    owners: set[ClientSession],
    declared: frozenset[str],
    cancelled: int = 0,
    cancel_grace: float = 0.0,
) -> Answer | Forward:
    """What to do with a child's server→client request (pure).  A modern owner (a bridged
    flow, ``owner.mrtr``) that lacks the capability gets nothing asked: the child is answered
    -32021 with ``data.requiredCapabilities`` (2026-07-28), and the flow goes on.  ``cancelled``:
    how many of ``owners`` are there only for calls they cancelled that the child has not
    answered (the refusal says so: those end at ``cancel_grace`` with a recycle)."""
    if method == "roots/list" and sharing != "per-session":
        return Answer(result=jsonrpc.encode_dict({"roots": [{"uri": r} for r in config_roots]}))
    capability = {"elicitation/create": "elicitation", "sampling/createMessage": "sampling",
                  "roots/list": "roots"}.get(method)
    if capability is None:
        return Answer(code=errors.METHOD_NOT_FOUND,
                      message=f"method {method!r} is not supported by the gateway")
    if capability not in declared:
        return Answer(code=errors.METHOD_NOT_FOUND,
                      message=f"the gateway did not declare the {capability} capability to "
                              "this backend")
    if not owners:
        if method == "roots/list":
            return Answer(result=jsonrpc.encode_dict({"roots": [{"uri": r} for r in config_roots]}))
        return refusal(method, "no_call_in_flight",
                       f"{method} refused: no client call is in flight on this backend")
    if len(owners) > 1:
        hint = "use sharing = \"affine\" or \"per-session\""
        if cancelled:  # the child may still be working on it: recycled, not guessed done
            hint = (f"{cancelled} of them only for a cancelled call the child has not answered: "
                    f"it is recycled if that lasts cancel_grace ({cancel_grace:g}s); {hint}")
        return refusal(method, "unattributable",
                       f"{method} refused: calls of {len(owners)} connections are in flight, "
                       f"the requesting one cannot be proven ({hint})")
    (owner,) = owners
    if owner.mrtr is not None:  # a modern caller: asked in an InputRequiredResult (core.bridge)
        if owner.mrtr.full:
            return refusal(method, "overloaded", f"{method} refused: too many calls wait for their "
                           "clients' input (gateway.max_parked_flows)")
        calls = owner.calls()  # an open listen is at no child: it cannot be the one asking
        if len(calls) != 1:
            return refusal(method, "unattributable",
                           f"{method} refused: {len(calls)} requests of the calling modern "
                           "connection are in flight, the asking one cannot be proven")
        caps = calls[0].caps
        if caps is None or not caps.allows(method, params):
            return Answer(code=errors.MISSING_CAPABILITY, reason="no_capability",
                          message=f"the calling client did not declare the {capability} capability",
                          data={"requiredCapabilities": {capability: {}}})
        return Forward(owner)
    if not owner.caps.allows(method, params):
        if owner.era is Era.MODERN:  # 2026-07-28: missing capability
            return Answer(code=errors.MISSING_CAPABILITY, reason="no_capability",
                          message=f"the calling client did not declare the {capability} capability",
                          data={"requiredCapabilities": {capability: {}}})
        if method == "elicitation/create" and owner.caps.has_capability(method):
            mode = params.get("mode", "form")
            return Answer(code=errors.INVALID_PARAMS, reason="no_capability",
                          message=f"the client did not declare elicitation mode {mode!r}")
        return Answer(code=errors.UNROUTABLE, reason="no_capability",
                      message=f"the calling client did not declare the {capability} capability")
    return Forward(owner)


def _learn_asker(backend: Pool, owner: ClientSession) -> None:
    """``owner``'s call at ``backend`` (when it has just one) may ask for input."""
    calls = [s for s in owner.inflight.values() if s.req.backend == backend.name]
    if len(calls) == 1:
        backend.learn_asker(asker_key(calls[0].req))


class Ownership:
    """Routes children's server→client requests; remembers the owners of URL-mode elicitations.

    Everything here is synchronous: a forwarded request is state in the child's router and in
    the owner's session, ended by whichever event comes first:

    ===================  ======================================  ==========================
    path                 toward the child                         toward the owner
    ===================  ======================================  ==========================
    answered / error     the owner's result / error               —
    owner gone, drain    elicitation ``cancel``; others -32007     —
    child cancelled it   nothing                                   ``notifications/cancelled``
    call finished first  nothing                                   ``notifications/cancelled``
    child restarted      nothing (the child is gone)               ``notifications/cancelled``
    ===================  ======================================  ==========================
    """

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self.open = 0  # forwarded requests not ended yet (``/status``)
        # (backend, per-principal instance's principal key or "", URL-mode elicitationId) ->
        # owner; ids are chosen by each backend (each principal's child its own)
        self.elicitations: dict[tuple[str, str, str], ClientSession] = {}

    def route(self, inst: Instance, child: ChildConnection, child_id: int | str,
              method: str, params: Raw | UnsetType, owners: set[Owner]) -> None:
        """``owners``: the attribution set as it was when the request arrived (the sessions whose
        calls the child has: owners are the core's sessions)."""
        sessions = cast("set[ClientSession]", owners)
        backend = inst.backend
        try:
            fields: dict[str, Any] = jsonrpc.loads(params) if params is not UNSET else {}
            if not isinstance(fields, dict):
                raise ValueError
        except (msgspec.DecodeError, ValueError):
            child.respond_error(child_id, errors.INVALID_PARAMS, "params must be an object")
            return
        decision = decide(method, fields, sharing=backend.cfg.sharing,
                          config_roots=backend.cfg.roots, owners=sessions,
                          declared=backend.declared,
                          cancelled=(len(owners & child.router.cancelled_owners())
                                     if len(owners) > 1 else 0),  # only said when refused
                          cancel_grace=backend.cfg.cancel_grace)
        if method != "roots/list" and (isinstance(decision, Forward)
                                       or decision.reason == "unattributable"):
            # Remember which calls ask for input: on a shared backend such a call waits for a
            # parked flow of another caller to go first (gateway.backend.pool._acquire_unparked).
            # A hint for scheduling only (a refused request's asker is one of the owners).
            for owner in (decision.owner,) if isinstance(decision, Forward) else sessions:
                if owner.flow is None or not owner.flow.parked:
                    _learn_asker(backend, owner)
        if isinstance(decision, Answer):
            if decision.reason:
                LOGGER.warning("backend %s: %s", inst.name, decision.message,
                               extra={"MCP_BACKEND": backend.name})
                self._bus.emit(ServerRequestRefused(backend.name, method, decision.reason))
            if decision.result is not None:
                child.respond(child_id, decision.result)
            else:
                data = {"reason": decision.reason} if decision.reason else {}
                child.respond_error(child_id, decision.code, decision.message,
                                    {**data, **(decision.data or {})} or None)
            return
        self._forward(inst, child, child_id, method, fields, decision.owner)

    def _forward(self, inst: Instance, child: ChildConnection, child_id: int | str,
                 method: str, fields: dict[str, Any], owner: ClientSession) -> None:
        backend = inst.backend.name
        if method == "sampling/createMessage":
            fields = {**fields, "includeContext": "none"}  # one client's context must not leak
        router = child.router
        if router.has_server_request(child_id):
            child.respond_error(child_id, errors.INVALID_REQUEST,
                                f"request id {child_id!r} is already in use by an open request")
            return
        bridge = owner.mrtr
        req = owner.open_request(method, fields, send=bridge is None)
        elicitation_id = fields.get("elicitationId") if method == "elicitation/create" else None
        if isinstance(elicitation_id, str):
            self.elicitations[(backend, inst.principal_key or "", elicitation_id)] = owner
        self._bus.emit(ServerRequestRouted(backend, method, owner.conn_id))
        self.open += 1

        def ended(req: ServerRequest) -> None:
            self.open -= 1
            outcome = req.outcome or ServerRequestOutcome.SHUTDOWN
            self._bus.emit(ServerRequestFinished(backend, method, outcome,
                                                 trio.current_time() - req.started))
            child.perform(router.server_request_done(child_id, outcome, trio.current_time(),
                                                     req.result, req.error))

        req.on_end.append(ended)
        child.perform(router.server_request(child_id, owner, method, req, trio.current_time()))
        if req.outcome is not None:  # the owner was already gone: it ended before anyone listened
            ended(req)
        elif bridge is not None:  # asked in the flow's InputRequiredResult, under the child's id
            bridge.requested(owner, str(child_id), req)

    def child_cancelled(self, child: ChildConnection, child_id: int | str) -> None:
        child.perform(child.router.child_cancelled(child_id))

    def elicitation_owner(self, backend: str, elicitation_id: str,
                          principal_key: str | None = None) -> ClientSession | None:
        """The owner of a URL-mode elicitation, once: its completion is the last word on it
        (``principal_key``: the per-principal instance's that completes it)."""
        return self.elicitations.pop((backend, principal_key or "", elicitation_id), None)

    def forget_session(self, session: ClientSession) -> None:
        if not self.elicitations:  # (most connections end with none open)
            return
        for eid in [e for e, s in self.elicitations.items() if s is session]:
            del self.elicitations[eid]
