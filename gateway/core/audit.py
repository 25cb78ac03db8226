"""What the audit log records of a call, gathered when it ends, only while audit is on.

:func:`finished` is called by :meth:`gateway.core.serving.Served.end` for a ``tools/call``,
``prompts/get`` or ``resources/read`` when the hub has an :class:`AuditSink`: it builds the
call's record and offers it to the sink.  A sink that is full and blocks takes the call's
answer over: it is sent by a task of the caller's connection once the record has a place, so
no other connection waits.  A bridged call (the gateway's rounds of ``input_required``) ends
once, with its number of rounds; a retry the gateway passes through to a modern backend is its
own record, marked ``continues``.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from gateway.core.policy import caller_of
from gateway.protocol import audit, era, jsonrpc

if TYPE_CHECKING:
    from gateway.core.policy import Policy
    from gateway.core.request import Request
    from gateway.core.session import BridgedCall, ClientSession

LOGGER = logging.getLogger(__name__)

#: The methods with an audit record, and the param naming what they use.
AUDITED = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
_KINDS: dict[str, Any] = {"tools/call": "tool", "prompts/get": "prompt",
                          "resources/read": "resource"}


class AuditSink(Protocol):
    """Where records go (:class:`gateway.ops.audit.AuditLog`)."""

    @property
    def redact_keys(self) -> frozenset[str]: ...
    @property
    def argument_globs(self) -> tuple[str, ...]: ...

    def offer(self, record: dict[str, Any]) -> bool:
        """Queue ``record``, or drop it (counted) when full and dropping; False: full and
        blocking (:meth:`put` waits for a place)."""
        ...

    async def put(self, record: dict[str, Any]) -> None: ...

    def lost(self) -> None:
        """A record could not be queued (counted as dropped, told by a gap record)."""
        ...


class AuditedCall(Protocol):
    """What the record reads of a call (:class:`gateway.core.serving.Served`)."""

    @property
    def id(self) -> int | str: ...
    @property
    def req(self) -> Request: ...
    @property
    def session(self) -> ClientSession: ...
    @property
    def modern(self) -> bool: ...
    @property
    def flow(self) -> BridgedCall | None: ...
    @property
    def started(self) -> float: ...


def _value(params: dict[str, msgspec.Raw], key: str) -> Any:
    raw = params.get(key)
    if raw is None:
        return None
    try:
        return jsonrpc.loads(raw)
    except msgspec.DecodeError:
        return None


def _client_info(served: AuditedCall) -> dict[str, Any] | None:
    info = served.session.client_info
    if served.modern:  # a modern request names its client in its own _meta
        meta = _value(served.req.params, "_meta")
        got = meta.get(era.CLIENT_INFO_KEY) if isinstance(meta, dict) else None
        info = got if isinstance(got, dict) else info
    if info is None:
        return None
    return {k: info[k] for k in ("name", "version") if isinstance(info.get(k), str)}


def record(served: AuditedCall, policy: Policy, sink: AuditSink, *, outcome: str,
           code: int | None, instance: str | None, now: float) -> dict[str, Any]:
    """The audit record of ``served``, a call of an audited method ending ``now``."""
    session, req = served.session, served.req
    method = req.method
    name = _value(req.params, AUDITED[method])
    name = name if isinstance(name, str) else None
    principal = session.principal
    consent: str | None = getattr(req, "consent", None)
    rec: dict[str, Any] = {
        "time": audit.timestamp(time.time()),
        "type": "call",
        "principal": None if principal is None else principal.name,
        "transport": str(session.transport),
        "client": _client_info(served),
        "method": method,
        ("uri" if method == "resources/read" else "name"): req.tool or name,
        "backend": req.backend or None,
        "instance": instance or getattr(req, "instance", None),
        "outcome": outcome,
        "error_code": code,
        "duration_us": round((now - served.started) * 1e6),  # an int: canonical JSON as is
        "consent": consent or "none",
        "rounds": served.flow.round if served.flow is not None else getattr(req, "rounds", 0),
    }
    decision, rule = "allow", None
    if name is not None and policy.active:
        decided = policy.decision(name, caller_of(session), _KINDS[method])
        decision, rule = decided.action, decided.rule
    if consent is not None:  # a prompt was shown: the call was under ask
        decision = "ask"
    rec["decision"], rec["rule"] = decision, rule
    if served.modern and served.flow is None and "requestState" in req.params:
        rec["continues"] = True  # a modern backend's round: the gateway cannot tie it to the first
    if "arguments" in req.params:
        try:
            args = jsonrpc.loads(req.params["arguments"])
            rec["args_sha256"] = audit.sha256_hex(args)
            if name is not None and any(fnmatch.fnmatchcase(req.tool or name, glob)
                                        for glob in sink.argument_globs):
                rec["arguments"] = audit.redact(args, sink.redact_keys)
        except (msgspec.DecodeError, ValueError):  # not data the gateway can print canonically
            # (a number out of range, too deep): no hash, never another value's
            rec["args_sha256"] = None
    return rec


def finished(served: AuditedCall, policy: Policy, sink: AuditSink, *, outcome: str,
             code: int | None, instance: str | None, response: bytes | None,
             reply: Callable[[bytes | None, int | str | None], None]) -> bool:
    """Record ``served``'s end; False when the sink took its answer over (see module doc)."""
    try:
        rec = record(served, policy, sink, outcome=outcome, code=code, instance=instance,
                     now=trio.current_time())
    except Exception:  # a bug here must not cost the call its answer: logged, counted lost
        LOGGER.exception("audit: no record for %s", served.req.method)
        sink.lost()
        return True
    if sink.offer(rec):
        return True
    call_id = served.id

    async def answer_when_recorded() -> None:
        try:
            await sink.put(rec)
        except trio.Cancelled:  # its connection closed while it waited: the record is lost
            sink.lost()
            raise
        finally:
            reply(response, call_id)

    nursery = served.session.nursery
    try:
        if nursery is None:
            raise RuntimeError("no nursery")
        nursery.start_soon(answer_when_recorded)
    except RuntimeError:  # the connection is closing: nowhere to wait; answered, record lost
        LOGGER.warning("audit queue full while connection %s closes: a %s record is lost",
                       served.session.conn_id, served.req.method)
        sink.lost()
        return True
    return False
