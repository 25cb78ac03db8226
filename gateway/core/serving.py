"""Serving one client request: answered by the gateway at once, forwarded without a task, or
run in a task when it must wait — and the one place where exceptions become JSON-RPC errors.

Theory of operation: :func:`serve_request` is called by a connection's reader for each admitted
request (see :mod:`gateway.core.connection`).  It makes a :class:`Served`, the request's entry in
``session.inflight``: the gateway's own methods are answered synchronously; a forwarded request
(:data:`gateway.core.handlers.FORWARDED`) goes to the routing core of the child that takes it right
now (:meth:`Served.forward_now`; the answer comes back through :meth:`Served.finished`, in the
child's reader); only a request that must wait (consent, an instance starting or busy, a
resource subscription) runs in a task of the connection's nursery (:func:`_run_slow`).  A modern
(2026-07-28) request is checked first (:mod:`gateway.protocol.era`) and its result completed.

:meth:`Served.end` is the only place where an answer is made: exceptions become JSON-RPC error
responses there (unexpected ones are logged with their traceback and answered -32603; they never
take the connection down).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio
from msgspec import UNSET, Raw

from gateway import __version__, errors
from gateway.auth.labels import NO_PRINCIPAL
from gateway.core import audit, handlers, inputs
from gateway.core.handlers import HANDLERS, PRE_INIT
from gateway.core.inputs import InputPorts
from gateway.core.ports import Lifecycle
from gateway.core.request import Request, Target, asker_key
from gateway.core.session import BridgedCall, Bridging, ClientSession, Transport
from gateway.core.tracing import RequestTrace, Tracer
from gateway.events import RequestFinished, RequestOutcome, RequestStarted
from gateway.protocol import era, jsonrpc, mcp
from gateway.protocol.routing import CallState
from gateway.protocol.session import SessionState

if TYPE_CHECKING:
    from gateway.auth.principal import Principal
    from gateway.backend.child import ChildConnection
    from gateway.backend.instance import Instance
    from gateway.backend.pool import Backend
    from gateway.limits import PrincipalLimits
    from gateway.protocol.routing import Call

LOGGER = logging.getLogger(__name__)


class ServingPorts(InputPorts, Lifecycle, Protocol):
    """What serving a request needs: the handlers' ports, the lifecycle, the principals'
    ``[[auth.limits]]`` and era bridging."""

    @property
    def limits(self) -> PrincipalLimits: ...
    @property
    def bridge(self) -> Bridging: ...
    @property
    def audit(self) -> audit.AuditSink | None:
        """Where the audit log's records go (None: audit is off)."""
        ...
    @property
    def tracer(self) -> Tracer | None: ...


def error_response(id: int | str | None, exc: errors.GatewayError) -> bytes:
    """The JSON-RPC error response for ``exc``: every error the gateway answers goes through
    here."""
    return jsonrpc.encode_error(id, exc.code, exc.message, exc.error_data())


class Mode(enum.Enum):
    """How a :class:`Served` is being served (the fields each way uses)."""

    INLINE = "inline"  # in the reader's call: answered at once, or about to be forwarded
    FORWARDED = "forwarded"  # at a child, no task: ``backend``, ``inst``, ``child``, ``call``
    TASK = "task"  # in a task of the connection's nursery (:func:`_run_slow`): ``scope``


# Module names for the members read on every request (a member looked up on its enum class is
# a descriptor call on CPython 3.11).
_INLINE, _FORWARDED, _TASK = Mode.INLINE, Mode.FORWARDED, Mode.TASK
_MODERN, _LEGACY = era.Era.MODERN, era.Era.LEGACY
_READY_LEGACY = SessionState.READY_LEGACY
_OK, _ERROR, _CANCELLED = RequestOutcome.OK, RequestOutcome.ERROR, RequestOutcome.CANCELLED
_LABELS = mcp.METHOD_LABELS


class Served(Request):
    """One client request being served: ``session.inflight``'s entry for its id, and the one
    place where its answer is made (:meth:`end`, exceptions become JSON-RPC errors there).

    Served three ways (its :class:`Mode`): answered by the gateway at once; *forwarded* without
    a task (it is then the handle of its call at the child, told by :meth:`finished`); or in a
    task of the connection's nursery (:func:`_run_slow`) when it must wait for something.
    """

    __slots__ = (
        "call",
        "caps",
        "child",
        "ended",
        "flow",
        "forwarded_at",
        "held",
        "inst",
        "mode",
        "modern",
        "pool",
        "ports",
        "principal",
        "reply",
        "retried",
        "scope",
        "session",
        "size",
        "started",
        "target",
    )

    def __init__(self, ports: ServingPorts, session: ClientSession, id: int | str, method: str,
                 size: int, reply: Callable[[bytes | None, int | str | None], None],
                 principal: Principal | None) -> None:
        self.ports = ports
        self.session = session
        self.principal = principal  # the caller, as its request was admitted
        self.id = id  # the Request's fields
        self.method = method
        self.params = {}
        self.backend = ""
        self.backend_time = None
        self.tool = None
        self.counted = False
        self.at = None
        self.trace = None
        self.label = _LABELS.get(method, "other")
        self.size = size
        self.reply = reply
        self.started = session.now()
        self.mode = _INLINE
        self.ended = False  # answered, or dropped unanswered (a retry took its id over)
        self.scope: trio.CancelScope | None = None  # served in a task
        self.target: Target | None = None
        self.pool: Backend | None = None  # forwarded without a task: where to
        self.inst: Instance | None = None
        self.child: ChildConnection | None = None
        self.call: Call | None = None
        self.forwarded_at = 0.0
        self.retried = False
        # a 2026-07-28 request: its result says resultType (see gateway.protocol.era)
        self.modern = False
        self.caps: mcp.ClientCaps | None = None  # a modern request's declared capabilities
        self.held: str | None = None  # the principal whose [[auth.limits]] slot it holds
        self.flow: BridgedCall | None = None  # a modern call asked for input (gateway.core.bridge)

    @property
    def req(self) -> Request:
        """The request, as the handlers see it (this object)."""
        return self

    def cancel(self) -> None:
        """The client cancelled it, its connection closed, or the drain grace is over (then it
        is answered -32005 ``shutdown``, ``retryable: false``: it may have had effects)."""
        mode, call, child = self.mode, self.call, self.child
        if mode is _FORWARDED and call is not None and child is not None:
            error = None
            if self.ports.calls_cut_off:  # a call still queued never reached the child: retryable
                error = _cut_off(retryable=call.state is CallState.QUEUED)
            child.cancel(call, error)
        elif mode is _TASK and self.scope is not None:
            self.scope.cancel()

    def forward_now(self) -> bool:
        """Forward to the target's backend without a task, if an instance takes it right now."""
        ports, session, req, target = self.ports, self.session, self, self.target
        assert target is not None
        backend = ports.backend_now(target.backend)
        if backend is None:
            return False
        picked = backend.pick_now(session, asks=bool(backend.askers)
                                  and backend.waits_for_parked(asker_key(req)),
                                  principal=self.principal)
        if picked is None:
            return False
        inst, child = picked
        req.backend = backend.name
        if not req.counted:
            req.counted = True
            ports.bus.emit(RequestStarted(session.conn_id, self.label, backend.name))
        self.pool, self.inst, self.child = backend, inst, child
        self.forwarded_at = session.now()  # the time before it is the gateway's (overhead)
        self.mode = _FORWARDED
        trace = req.trace
        try:
            fields, meta = handlers.outgoing(ports, session, target, child.era is _MODERN,
                                             None if trace is None
                                             else trace.call(backend.name, inst.name))
            self.call = child.start(req.method, UNSET, handle=self, now=self.forwarded_at,
                                    owner=session, hard_timeout=backend.cfg.max_call_duration,
                                    progress=target.progress, fields=fields, meta=meta)
        except errors.NotDelivered as exc:  # the child just died: the slow path waits for the next
            if trace is not None:
                trace.call_done(exc.code)
            backend.release(inst, session)
            self.child = None
            self.mode = _INLINE
            return False
        except errors.GatewayError as exc:
            backend.release(inst, session)
            self.child = None
            self.mode = _INLINE
            if trace is not None:
                trace.call_done(exc.code)
            self.end(exc=exc)
        return True

    def finished(self, result: Raw | None, error: errors.GatewayError | None) -> None:
        """The forwarded call is over (see :class:`gateway.protocol.routing.Finished`)."""
        assert self.pool is not None and self.inst is not None
        self.call = None
        if self.trace is not None:
            self.trace.call_done(None if error is None else error.code)
        now = self.session.now()
        self.backend_time = now - self.forwarded_at
        self.pool.release(self.inst, self.session)
        if (error is not None and isinstance(error, errors.NotDelivered) and not self.retried
                and self.target is not None
                and not self.session.closed.is_set() and self.session.nursery is not None):
            # The child died before reading it: once more, on the next child (slow path).
            LOGGER.info("backend %s died before %s reached it; retrying once", self.inst.name,
                        self.method, extra=self.session.log_fields)
            self.retried = True
            self.child = None
            self.scope, self.mode = trio.CancelScope(), _TASK
            self.session.nursery.start_soon(_run_slow, self)
            return
        if (result is not None and not self.modern and self.target is not None
                and self.child is not None and self.child.era is _MODERN
                and self.method in inputs.MRTR_METHODS and era.is_input_required(result)
                and not self.session.closed.is_set() and self.session.nursery is not None):
            # A modern child asks for input; this legacy client is asked the legacy way (a task).
            self.scope, self.mode = trio.CancelScope(), _TASK
            self.session.nursery.start_soon(_run_slow, self, result)
            return
        self.end(result, error, cancelled=result is None and error is None, now=now)

    def end(self, result: Raw | None = None, exc: BaseException | None = None, *,
            cancelled: bool = False, now: float | None = None) -> None:
        """Answer the request (a cancelled one gets no answer) and account for it, once
        (``now``: the time, when the caller has it)."""
        if self.ended:
            return
        self.ended = True
        ports, session, req = self.ports, self.session, self
        code: int | None = None
        response: bytes | None = None
        if cancelled and ports.calls_cut_off:  # drain grace over: say so, not silence
            exc = _cut_off()
        if (exc is not None and isinstance(exc, errors.Denied)
                and isinstance(exc.data.get("url"), str)):
            link = exc.data["url"]
            asked = authorize_answer(exc, req.method, self.modern,
                                     self.caps if self.modern else session.caps,
                                     session.protocol_version)
            if isinstance(asked, Raw):
                result, exc = asked, None
            else:
                exc = asked
                if isinstance(asked, errors.URLElicitationRequired):
                    session.asked_url(url_elicitation_id(link))
        if cancelled and exc is None:
            outcome = _CANCELLED  # a cancelled request gets no response
        elif exc is None:
            assert result is not None
            outcome = _OK
            if self.modern:
                result = era.complete(req.method, result, per_caller=ports.policy.per_caller)
            response = jsonrpc.encode_result(self.id, result)
        else:
            outcome = _ERROR
            if not isinstance(exc, errors.GatewayError):
                LOGGER.error("connection %s: %s failed", session.conn_id, req.method,
                             exc_info=exc, extra=session.log_fields)
                exc = errors.InternalError(f"internal error while handling {req.method}")
            if self.modern:
                exc = era.modern_error(exc)
            code = exc.code
            response = error_response(self.id, exc)
        flow = self.flow
        if flow is not None and flow.waiting:  # its id was answered input_required: ended
            response = None  # between rounds, nobody hears of it (the retry gets invalid_state)
        sink = ports.audit
        if sink is None or req.method not in audit.AUDITED or audit.finished(
                self, ports.policy, sink, outcome=outcome, code=code, response=response,
                instance=None if self.inst is None else self.inst.name, reply=self.reply):
            self.reply(response, self.id)
        session.inflight.pop(self.id, None)
        if self.held is not None:
            ports.limits.release(self.held)
        if flow is not None:
            flow.call_ended()
        session.buffers.release(self.size)
        if not session.inflight and ports.draining:  # only the drain waits for this
            ports.connections_changed()
        principal = self.principal
        if now is None:
            now = session.now()
        if req.trace is not None:
            req.trace.end(outcome, code, req.backend, req.tool)
        ports.bus.emit(RequestFinished(session.conn_id, self.label, req.backend, outcome, code,
                                     now - self.started, req.backend_time, req.tool,
                                     principal.label if principal is not None else NO_PRINCIPAL))
        if not session.inflight:
            settled = session.on_settled
            if settled is not None:  # a connection without a task of its own may end now
                settled()


def _cut_off(*, retryable: bool = False) -> errors.GatewayError:
    if retryable:
        return errors.Denied("the gateway shut down before this call reached the backend; send it "
                             "elsewhere", reason="shutdown", retryable=True)
    return errors.Denied("the gateway shut down before this call finished; it may have had effects",
                         reason="shutdown", retryable=False)


#: Requests ``[[auth.limits]]`` do not count: opening a connection, liveness, a listen held
#: open for notifications.
UNLIMITED = frozenset({"initialize", "ping", "subscriptions/listen"})


def _admit(ports: ServingPorts, served: Served, principal: str) -> None:
    """Take a slot of ``principal``'s ``[[auth.limits]]`` for ``served``, or raise -32006."""
    refused = ports.limits.admit(principal, trio.current_time())
    if refused is not None:
        raise errors.Overloaded(
            f"too many requests from this principal ({refused.limit} = {refused.value:g}); "
            f"retry after {refused.retry_after:.3g}s", reason="rate_limited",
            limit=refused.limit, value=refused.value, retryAfter=round(refused.retry_after, 3))
    served.held = principal


def serve_request(ports: ServingPorts, session: ClientSession, env: jsonrpc.Envelope,
                  id: int | str, method: str, size: int,
                  reply: Callable[[bytes | None, int | str | None], None],
                  params: dict[str, Raw] | None = None, judged: era.Modern | None = None) -> None:
    """Serve one admitted request (``env``, its ``id`` and ``method``): at once when the gateway
    answers it or a backend instance takes it now (no task), else in a task.  ``params``: its
    params' top level, when its transport decoded them already (None: decoded here);
    ``judged``: a modern request's ``_meta`` as its transport judged it already
    (:func:`gateway.protocol.era.check_http`; None: judged here)."""
    principal = session.principal  # read once
    served = Served(ports, session, id, method, size, reply, principal)
    session.inflight[id] = served
    session.buffers.charge(size)  # the request's bytes live until it is answered
    req: Request = served
    targeter = handlers.FORWARDED.get(method)
    handler = HANDLERS.get(method) if targeter is None else None  # (no method is both)
    tracer = ports.tracer
    if tracer is not None:
        req.trace = tracer.request(method, None if env.params is UNSET else env.params,
                                   session.transport, None if principal is None else principal.name)
    try:
        if (handler is None and targeter is None and method not in handlers.ASYNC_HANDLERS
                and method != "server/discover"):
            raise errors.MethodNotFound(f"method {method!r} not found")
        if principal is not None and ports.limits.limits and method not in UNLIMITED:
            _admit(ports, served, principal.name)
        req.params = jsonrpc.params_dict(env.params) if params is None else params
        ready = session.state is _READY_LEGACY  # (one read: legacy and initialized)
        chosen = _LEGACY if ready else session.era
        if chosen is None:  # the first request chooses the connection's era
            chosen = era.era_of(method, req.params)
            session.choose_era(chosen)
        if chosen is _MODERN:
            served.modern = True
            caps, level = era.modern_meta(method, req.params) if judged is None else judged
            if session.mrtr is None:  # a modern WebSocket/unix connection: bridged like a flow
                session.bridge_with(ports.bridge)
            served.caps = mcp.client_caps(caps)  # what a child may ask this request's caller
            # its stream gets log messages
            if level is not None and session.set_log_level(level):
                ports.log_levels_changed()
            if (session.transport is not Transport.HTTP
                    and ports.bridge.continues(method, req.params)):
                # A retry: it continues the call its state names, which takes over its id
                # (``inflight`` then holds that call under it); this entry is dropped unanswered.
                ports.bridge.resume(method, req.params, served.id, caps, owner=session,
                                  principal=None if principal is None else principal.key)
                served.ended = True
                if req.trace is not None:
                    req.trace.end("continued", None, "", None)
                session.buffers.release(size)
                if served.held is not None:  # the call it continues holds its own slot
                    ports.limits.release(served.held)
                return
            if method == "server/discover":
                served.end(era.discover(ports.advertised_capabilities(), ports.server_name,
                                        __version__))
                return
        elif method == "server/discover":
            raise errors.MethodNotFound(f"method {method!r} not found: this connection speaks "
                                        f"{session.protocol_version or 'a legacy revision'}")
        elif not ready and not session.initialized and method not in PRE_INIT:
            raise errors.InvalidRequest(f"{method}: the connection is not initialized yet")
        if handler is not None:
            served.end(handler(ports, session, req))
            return
        if targeter is not None:
            if req.trace is not None and ports.policy.active:
                target = served.target = _decided(targeter, ports, session, req, req.trace)
            else:
                target = served.target = targeter(ports, session, req)
            if "_meta" in target.params:  # decoded once, here: a bad token fails it at once
                target.progress, target.meta = handlers.progress_token(req, target.params)
            if served.modern and target.meta is not None:  # kept aside: only a modern child
                target.envelope, target.meta = era.strip_envelope(  # gets it (envelope_of)
                    target.params, target.meta)
            if target.consent is None and served.forward_now():
                return
    except Exception as exc:
        served.end(exc=exc)
        return
    served.scope, served.mode = trio.CancelScope(), _TASK
    assert session.nursery is not None
    session.nursery.start_soon(_run_slow, served)


def _decided(targeter: handlers.Targeter, ports: ServingPorts, session: ClientSession,
             req: Request, trace: RequestTrace) -> Target:
    """``targeter``'s target, its policy decision a span of ``trace``."""
    start = time.time_ns()
    try:
        target = targeter(ports, session, req)
    except errors.Denied:
        trace.span("policy", start, "deny")
        raise
    except BaseException:
        trace.span("policy", start, "error")
        raise
    trace.span("policy", start, "allow" if target.consent is None else "ask")
    return target


def url_elicitation_id(url: str) -> str:
    """The ``elicitationId`` of the gateway's own URL-mode elicitation of ``url`` (pure)."""
    return hashlib.sha256(url.encode()).hexdigest()[:32]


def authorize_answer(exc: errors.Denied, method: str, modern: bool, caps: mcp.ClientCaps | None,
                     version: str | None) -> Raw | errors.GatewayError:
    """A call refused until its caller authorizes at ``exc.data["url"]``, as the caller can
    read it: a 2026-07-28 caller that declared URL elicitation gets an ``InputRequiredResult``
    with a URL-mode elicitation (its retry is a new call), a 2025-11-25 one -32042
    ``URLElicitationRequiredError``, any other the -32005 with ``data.url`` (and the URL at the
    end of its message, for a client that shows only that) (pure)."""
    url = str(exc.data["url"])
    ask = {"mode": "url", "message": exc.message, "url": url}
    plain = errors.Denied(f"{exc.message}: {url}", reason=exc.reason, **exc.data)
    if caps is None or not caps.elicitation_url:
        return plain
    if modern:
        if method not in inputs.MRTR_METHODS:
            return plain
        return jsonrpc.encode_dict({"resultType": "input_required", "inputRequests": {
            "authorize": {"method": "elicitation/create", "params": ask}}})
    if version != "2025-11-25":
        return plain
    elicitation = {**ask, "elicitationId": url_elicitation_id(url)}
    return errors.URLElicitationRequired(exc.message, elicitations=[elicitation],
                                         **{k: v for k, v in exc.data.items() if k == "backend"})


async def _run_slow(served: Served, first: Raw | None = None) -> None:
    """Serve a request that must wait (consent, an instance starting or busy, a backend's answer,
    a modern backend's input requests to a legacy client: ``first`` is its ``input_required``)."""
    ports, session, req = served.ports, served.session, served
    assert served.scope is not None
    result: Raw | None = None
    exc: BaseException | None = None
    try:
        with served.scope:
            try:
                if served.target is not None:
                    got = first or await handlers.forward(ports, session, req, served.target)
                    if (not served.modern and req.method in inputs.MRTR_METHODS
                            and era.is_input_required(got)):  # cancelled meanwhile: no answer
                        got = await inputs.resolve(ports, session, req, served.target, got,
                                                   served.started)
                    result = got
                else:
                    result = await handlers.ASYNC_HANDLERS[req.method](ports, session, req)
            except Exception as e:
                exc = e
    finally:
        served.end(result, exc, cancelled=result is None and exc is None)
