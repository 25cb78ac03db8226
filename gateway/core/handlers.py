"""Client request handlers: one function per MCP method the gateway serves.

Three kinds: :data:`HANDLERS` answer from the gateway's own state, synchronously (no task);
:data:`FORWARDED` decide synchronously where a request goes (a :class:`Target`), and
``gateway.core.connection`` forwards it without a task when it can, else runs :func:`forward` (the
slow path: consent, waiting for an instance); :data:`ASYNC_HANDLERS` need a backend's answer
before they can answer.  Each takes the narrowest port it reads (:mod:`gateway.core.ports`),
the session and a :class:`Request`, and returns the ``result`` (Raw) or a Target, or raises a
:class:`~gateway.errors.GatewayError`.  Handlers never build error responses themselves:
:mod:`gateway.core.serving` is the one place that does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
import trio
from msgspec import Raw

from gateway import __version__, errors
from gateway.core.listen import ListenPorts, listen
from gateway.core.policy import caller_of
from gateway.core.ports import BackendDirectory, CatalogView
from gateway.core.request import Request, Target, asker_key
from gateway.core.tracing import TRACE_KEYS
from gateway.events import EventBus, RequestStarted
from gateway.protocol import catalog as cat
from gateway.protocol import era, jsonrpc, mcp, mrtr
from gateway.protocol.mcp import declared_capabilities
from gateway.protocol.policy import Kind

LOGGER = logging.getLogger(__name__)

if TYPE_CHECKING:
    from gateway.core.session import ClientSession
    from gateway.core.tracing import RequestTrace

T = TypeVar("T")


class HandlerPorts(ListenPorts, Protocol):
    """What the handlers need, all told (each handler is typed with the narrowest port it
    uses): the catalog view, the backend directory, the lifecycle, the listens, the bus."""

    @property
    def bus(self) -> EventBus: ...


#: What the policy asks the user before a call: (name, arguments, kind).
Consent = tuple[str, Any, Kind]
Handler = Callable[["HandlerPorts", "ClientSession", Request], Raw]
AsyncHandler = Callable[["HandlerPorts", "ClientSession", Request], Awaitable[Raw]]


def _str_param(req: Request, key: str) -> str:
    raw = req.params.get(key)
    if raw is None:
        raise errors.InvalidParams(f"{req.method}: missing required parameter {key!r}")
    try:
        value = jsonrpc.loads(raw)
    except msgspec.DecodeError:
        raise errors.InvalidParams(f"{req.method}: {key!r} is not valid JSON") from None
    if not isinstance(value, str):
        raise errors.InvalidParams(f"{req.method}: {key!r} must be a string")
    return value


def _reject_tasks(req: Request) -> None:
    if "task" in req.params:
        raise errors.InvalidParams(
            f"{req.method}: task-augmented requests are not supported by this gateway",
            reason="tasks_unsupported",
        )


# ---- answered by the gateway itself ----------------------------------------------------------


def initialize(ports: CatalogView, session: ClientSession, req: Request) -> Raw:
    session.check_initialize()  # a second one is refused before its params are looked at
    try:
        params = mcp.decode_initialize_params(jsonrpc.encode_dict(req.params))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.InvalidParams(f"initialize: {exc}") from None
    # synchronous: two racing ones cannot both pass
    version = mcp.negotiate_version(params.protocolVersion)
    session.initialize(version, mcp.ClientCaps(params.capabilities))
    session.client_info = {"name": params.clientInfo.name, "version": params.clientInfo.version}
    return jsonrpc.encode_dict(
        {
            "protocolVersion": version,
            "capabilities": ports.advertised_capabilities(),
            "serverInfo": {"name": ports.server_name, "version": __version__},
        }
    )


def ping(ports: HandlerPorts, session: ClientSession, req: Request) -> Raw:
    return jsonrpc.EMPTY_RESULT


def _lister(kind: str, field: str) -> Handler:
    """A list handler: the caller's view of the merged list (what policy lets it call), paged
    over that view (a cursor is an offset into it)."""
    def handler(ports: CatalogView, session: ClientSession, req: Request) -> Raw:
        cursor = _str_param(req, "cursor") if "cursor" in req.params else None
        items = ports.policy.view(ports.catalog, kind, caller_of(session))
        got = cat.page(kind, items, cursor, ports.cfg.gateway.page_size)
        if got is None:
            raise errors.InvalidParams(f"{req.method}: invalid cursor")
        chunk, nxt = got
        body: dict[str, Any] = {field: chunk}
        if nxt is not None:
            body["nextCursor"] = nxt
        return jsonrpc.encode_dict(body)

    return handler


def set_level(ports: BackendDirectory, session: ClientSession, req: Request) -> Raw:
    level = _str_param(req, "level")
    if level not in mcp.LOG_RANK:
        raise errors.InvalidParams(f"logging/setLevel: unknown level {level!r}")
    if session.set_log_level(level):
        ports.log_levels_changed()
    return jsonrpc.EMPTY_RESULT


async def subscribe(ports: HandlerPorts, session: ClientSession, req: Request) -> Raw:
    uri = _str_param(req, "uri")
    if ports.policy.active and req.method == "resources/subscribe":
        ports.policy.check(uri, caller_of(session), "resource")  # ask: updates carry no content
    backend = await ports.backend(ports.backend_name_for_uri(uri))
    if req.method == "resources/subscribe":
        await backend.subscribe(session, uri)
    else:
        await backend.unsubscribe(session, uri)
    return jsonrpc.EMPTY_RESULT


def tasks_unsupported(ports: HandlerPorts, session: ClientSession, req: Request) -> Raw:
    raise errors.MethodNotFound(
        f"{req.method}: tasks are not supported by this gateway", reason="tasks_unsupported"
    )


# ---- forwarded to a backend ----------------------------------------------------------------------


Targeter = Callable[["HandlerPorts", "ClientSession", Request], Target]


def progress_token(req: Request, params: dict[str, Raw]) -> tuple[Any, dict[str, Raw] | None]:
    """The caller's progress token (None: it asked for none) and its ``_meta``, decoded one
    level."""
    if "_meta" not in params:
        return None, None
    try:
        meta = jsonrpc.raw_dict(params["_meta"])
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise errors.InvalidParams(f"{req.method}: _meta must be an object") from None
    if "progressToken" not in meta:
        return None, meta
    try:
        client_token = jsonrpc.loads(meta["progressToken"])
    except msgspec.DecodeError:
        client_token = None
    if not isinstance(client_token, str | int) or isinstance(client_token, bool):
        raise errors.InvalidParams(
            f"{req.method}: _meta.progressToken must be a string or an integer")
    return client_token, meta


def outgoing(ports: CatalogView, session: ClientSession, target: Target, modern: bool,
             trace: dict[str, Raw] | None = None) -> tuple[dict[str, Raw], dict[str, Raw] | None]:
    """What a forwarded request carries to the child that takes it, decided before the child is
    called: ``(params, meta)``, ``meta`` the ``_meta`` the child's router puts its progress token
    into (None: the caller asked for no progress; see
    :func:`gateway.protocol.routing.request_params`).  Only the token changes, the rest passes
    as is; a ``modern`` child also gets the modern envelope (:func:`envelope_of`), a legacy one
    no round trips.  ``trace``: the trace context keys of the gateway's call (tracing on), put
    into ``_meta`` for either era in place of the caller's."""
    params = target.params
    meta = target.meta if target.progress is not None else None
    if modern:  # ``target.meta`` is its ``_meta`` decoded already (:func:`progress_token`)
        with_env = {**(target.meta or {}), **envelope_of(ports, session, target)}
        if trace is not None:
            with_env = {**_untraced(with_env), **trace}
        if meta is not None:  # the token goes into _meta with the envelope
            return params, with_env
        return {**params, "_meta": jsonrpc.encode_dict(with_env)}, None
    if "inputResponses" in params or "requestState" in params:  # a legacy child's call has no
        params = {k: v for k, v in params.items() if k not in mrtr.ROUND_TRIP_KEYS}  # round trips
    if trace is not None:
        traced = {**_untraced(target.meta or {}), **trace}
        if meta is not None:
            return params, traced
        return {**params, "_meta": jsonrpc.encode_dict(traced)}, None
    return params, meta


def _untraced(meta: dict[str, Raw]) -> dict[str, Raw]:
    return {k: v for k, v in meta.items() if k not in TRACE_KEYS}


def envelope_of(ports: CatalogView, session: ClientSession, target: Target) -> dict[str, Raw]:
    """The modern envelope a request of ``session`` carries to a modern child of ``target``'s
    backend.  A modern caller's own envelope, without the input kinds the backend may not ask
    for (``declare``); for a legacy caller the gateway's: the capabilities declared to the
    backend that the caller declared too (input requests are pushed to it: it must be able to
    answer them; roots are answered from config outside per-session mode), and the level it set
    with ``logging/setLevel``."""
    cfg = ports.cfg.backends.get(target.backend)
    declare = frozenset(cfg.declare) if cfg is not None else frozenset()
    if target.envelope is not None:
        return era.restrict_envelope(target.envelope, declare)
    caps = session.caps
    per_session = cfg is not None and cfg.sharing == "per-session"
    allowed = {kind for kind in declare
               if (kind == "roots" and (caps.roots or not per_session))
               or (kind == "sampling" and caps.sampling)
               or (kind == "elicitation" and (caps.elicitation_form or caps.elicitation_url))}
    declared = declared_capabilities(allowed)
    if "elicitation" in declared:
        declared["elicitation"] = {k: {} for k, ok in (("form", caps.elicitation_form),
                                                       ("url", caps.elicitation_url)) if ok}
    return era.envelope(declared, log_level=session.log_level,
                        client_info={"name": ports.server_name, "version": __version__})


async def forward(ports: HandlerPorts, session: ClientSession, req: Request, target: Target) -> Raw:
    """The slow path of a forwarded request: consent, a backend being replaced by a reload, an
    instance that must first start or become free.  (The fast path, in
    :mod:`gateway.core.connection`, forwards without a task when none of that applies.)"""
    trace = req.trace
    if target.consent is not None:
        if trace is None:
            await ports.policy.ask(session, *target.consent, request_id=req.id)
        else:
            await _traced("consent", trace, ports.policy.ask(session, *target.consent,
                                                              request_id=req.id))
    # looked up after consent: a reload may have removed it
    backend = await ports.backend(target.backend)
    req.backend = backend.name
    if not req.counted:
        req.counted = True
        ports.bus.emit(RequestStarted(session.conn_id, req.label, backend.name))
    client_token = target.progress
    started = trio.current_time()
    asks = backend.waits_for_parked(asker_key(req))
    for attempt in range(2):
        acquired = backend.acquire(session, asks=asks, principal=session.principal)
        inst, child = await (acquired if trace is None else _traced("wait", trace, acquired))
        req.instance = inst.name
        fields, meta = outgoing(ports, session, target, child.era is era.Era.MODERN,
                                None if trace is None else trace.call(backend.name, inst.name))
        code: int | None = None
        try:
            return await child.request(req.method, timeout=backend.cfg.request_timeout,
                                       hard_timeout=backend.cfg.max_call_duration, owner=session,
                                       progress=client_token, fields=fields, meta=meta,
                                       started=partial(_forwarded, req, child))
        except errors.NotDelivered as exc:
            code = exc.code
            if attempt:  # the child died before reading it twice in a row: give up
                raise
            LOGGER.info("backend %s died before %s reached it; retrying once", inst.name,
                        req.method)
        except errors.GatewayError as exc:
            code = exc.code
            raise
        finally:
            if trace is not None:
                trace.call_done(code)
            req.at = None
            req.backend_time = trio.current_time() - started
            backend.release(inst, session)
    raise AssertionError("unreachable")


async def _traced(name: str, trace: RequestTrace, step: Awaitable[T]) -> T:
    """Await ``step`` as a child span ``name`` of ``trace``."""
    start = time.time_ns()
    outcome = "error"
    try:
        got = await step
        outcome = "ok"
        return got
    except trio.Cancelled:
        outcome = "cancelled"
        raise
    finally:
        trace.span(name, start, outcome)


def _forwarded(req: Request, child: Any, call: Any) -> None:
    req.at = (child, call)  # a bridged flow gives it up at its child (gateway.core.bridge)


def call_tool(ports: CatalogView, session: ClientSession, req: Request) -> Target:
    if "task" in req.params:
        _reject_tasks(req)
    catalog = ports.catalog
    raw = req.params.get("name")
    hit = catalog.tool_wire.get(bytes(raw)) if raw is not None else None
    if hit is not None:
        name, route = hit
    else:  # absent, not a string, written with escapes, or unknown
        name = _str_param(req, "name")
        found = catalog.tool_routes.get(name)
        if found is None:
            raise errors.InvalidParams(f"unknown tool {name!r}")
        route = found
    req.tool = name
    consent: Consent | None = None
    if ports.policy.active and ports.policy.check(name, caller_of(session)):
        consent = (name, _arguments(req), "tool")
    params = dict(req.params)
    params["name"] = route.wire
    return Target(route.backend, params, consent)


def _arguments(req: Request) -> Any:
    raw_args = req.params.get("arguments")
    try:
        return jsonrpc.loads(raw_args) if raw_args is not None else None
    except msgspec.DecodeError:
        return None


def get_prompt(ports: CatalogView, session: ClientSession, req: Request) -> Target:
    name = _str_param(req, "name")
    route = ports.catalog.prompt_routes.get(name)
    if route is None:
        raise errors.InvalidParams(f"unknown prompt {name!r}")
    consent: Consent | None = None
    if ports.policy.active and ports.policy.check(name, caller_of(session), "prompt"):
        consent = (name, _arguments(req), "prompt")
    params = dict(req.params)
    params["name"] = route.wire
    return Target(route.backend, params, consent)


def read_resource(ports: CatalogView, session: ClientSession, req: Request) -> Target:
    _reject_tasks(req)
    uri = _str_param(req, "uri")
    consent: Consent | None = None
    if ports.policy.active and ports.policy.check(uri, caller_of(session), "resource"):
        consent = (uri, None, "resource")
    return Target(ports.backend_name_for_uri(uri), dict(req.params), consent)


def complete(ports: CatalogView, session: ClientSession, req: Request) -> Target:
    raw_ref = req.params.get("ref")
    try:
        ref = jsonrpc.loads(raw_ref) if raw_ref is not None else None
    except msgspec.DecodeError:
        ref = None
    if not isinstance(ref, dict):
        raise errors.InvalidParams("completion/complete: missing or invalid 'ref'")
    params = dict(req.params)
    caller = caller_of(session) if ports.policy.active else None
    if ref.get("type") == "ref/prompt":
        route = ports.catalog.prompt_routes.get(str(ref.get("name")))
        if route is None:
            raise errors.InvalidParams(f"unknown prompt {ref.get('name')!r}")
        if caller is not None:  # completing a prompt the caller may not get: refused alike
            ports.policy.check(str(ref.get("name")), caller, "prompt")
        params["ref"] = jsonrpc.encode_dict({**ref, "name": route.name})
        return Target(route.backend, params)
    if ref.get("type") == "ref/resource":
        uri = str(ref.get("uri"))
        name = ports.catalog.route_template(uri)
        if name is None:
            raise errors.InvalidParams(f"unknown resource or template {uri!r}")
        if caller is not None:
            ports.policy.check(uri, caller, "resource")
        return Target(name, params)
    raise errors.InvalidParams("completion/complete: ref.type must be ref/prompt or ref/resource")


#: Answered by the gateway itself, synchronously (no task).
HANDLERS: dict[str, Handler] = {
    "initialize": initialize,
    "ping": ping,
    "tools/list": _lister("tools", "tools"),
    "prompts/list": _lister("prompts", "prompts"),
    "resources/list": _lister("resources", "resources"),
    "resources/templates/list": _lister("templates", "resourceTemplates"),
    "logging/setLevel": set_level,
    "tasks/get": tasks_unsupported,
    "tasks/result": tasks_unsupported,
    "tasks/list": tasks_unsupported,
    "tasks/cancel": tasks_unsupported,
}

#: Forwarded to a backend: where to is decided synchronously (see :class:`Target`).
FORWARDED: dict[str, Targeter] = {
    "tools/call": call_tool,
    "prompts/get": get_prompt,
    "resources/read": read_resource,
    "completion/complete": complete,
}

#: Answered by the gateway after waiting for a backend (always in a task).
ASYNC_HANDLERS: dict[str, AsyncHandler] = {
    "resources/subscribe": subscribe,
    "resources/unsubscribe": subscribe,
    "subscriptions/listen": listen,  # modern connections only (see gateway.core.listen)
}

#: Methods a client may call before ``initialize``.
PRE_INIT = frozenset({"initialize", "ping"})
