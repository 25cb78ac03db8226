"""Era bridging: a legacy child's server→client requests during a modern client's call become an
``InputRequiredResult``, and the client's retry carries the answers back to the waiting child.

A modern POST is served by its own flow session; its :class:`Flow` records the child's requests
under their ids instead of sending them, and after :data:`GATHER` seconds answers the POST
``input_required`` with a signed ``requestState`` (:mod:`gateway.protocol.mrtr`) and *parks*:
the call stays in flight at the child, its timeouts paused.  :meth:`Bridge.resume` checks the
retry (the state verifies and names a parked flow of this replica, its current round, the same
call), hands each answer to the child and asks again for the rest.  The gateway's own consent
prompt (:meth:`Bridge.ask`) takes the same path.  A flow not resumed within ``state_ttl``,
presented tampered, or preempted on a shared backend is ended (its requests declined, its call
given up at the child without ``notifications/cancelled``); its retry gets ``invalid_state``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec
import trio
from msgspec import Raw

from gateway import errors
from gateway.core.session import Transport
from gateway.errors import CloseReason, ConfigError
from gateway.events import EventBus, InputRequired, RequestStateRefused, ServerRequestOutcome
from gateway.protocol import jsonrpc, mcp, mrtr

if TYPE_CHECKING:
    from gateway.backend.child import ChildConnection
    from gateway.config import GatewaySection
    from gateway.core.serving import Served
    from gateway.core.session import Call, ClientSession, ServerRequest

LOGGER = logging.getLogger(__name__)

#: Seconds a flow waits, after the first request of a round, for more before it answers.
GATHER = 0.02
#: Preempted flows remembered (until their state expires) so their retry is told ``preempted``.
MAX_PREEMPTED = 4096


def load_key(path: str) -> bytes:
    """The state key in ``path`` (hex), generated (32 random bytes, mode 0600) when absent.

    Raises:
        ValueError: the file exists but holds no usable key.
        OSError: it can be neither read nor created.
    """
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except FileNotFoundError:
        key = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(key.hex() + "\n")
        LOGGER.info("generated the requestState key %s", path)
        return key
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: the requestState key must be hex") from None
    if len(key) < 16:
        raise ValueError(f"{path}: the requestState key must be at least 16 bytes (32 hex digits)")
    return key


def replica_id(configured: str) -> str:
    """``gateway.replica_id``, or the host name's first label (made safe for a state)."""
    if configured:
        return configured
    label = os.uname().nodename.split(".", 1)[0]
    return re.sub(r"[^A-Za-z0-9_-]", "-", label)[:64] or "gateway"


def from_config(g: GatewaySection) -> Bridge:
    """The bridge ``[gateway]`` describes (reads or creates ``state_key_file``)."""
    try:
        key = load_key(g.state_key_file) if g.state_key_file else secrets.token_bytes(32)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"gateway.state_key_file: {exc}"]) from None
    return Bridge(mrtr.StateCodec(key, replica_id(g.replica_id)), g.state_ttl, g.shared_park_limit,
                  g.max_parked_flows)


class Bridge:
    """The replica's parked flows, by id, and the codec that signs their states."""

    def __init__(self, codec: mrtr.StateCodec, ttl: float, park_limit: float = 30.0,
                 max_parked: int = 4096) -> None:
        self.codec = codec
        self.ttl = ttl
        self.park_limit = park_limit  # gateway.shared_park_limit
        self.max_parked = max_parked  # gateway.max_parked_flows
        # flow id -> unix time its last state expires: preempted, its retry is told so
        self.preempted: dict[str, float] = {}
        # owners whose flow was preempted (a call of theirs may still be at the child)
        self.leaving: weakref.WeakSet[ClientSession] = weakref.WeakSet()
        # Whether a retry goes to a modern child, whose own requestState passes through as is
        # (set by the service: Hub.targets_modern).
        self.passthrough: Callable[[str, dict[str, Raw]], bool] = lambda method, params: False
        self.flows: dict[str, Flow] = {}
        self.bus = EventBus()  # the hub's, once the service sets it
        # Counts a flow about to park toward its owner's principal (raises a GatewayError at
        # its cap); returns what gives the place back (set by the hub: max_parked_flows).
        self.count_parked: Callable[[ClientSession], Callable[[], None]] = lambda owner: _nothing
        self.counted: dict[str, Callable[[], None]] = {}  # parked flow id -> gives its place back
        # a call of this backend parked (set by the hub: wakes the calls waiting behind it)
        self.on_park: Callable[[str], None] = lambda backend: None

    def flow_of(self, owner: ClientSession, call: Call | None = None) -> Flow:
        """The flow of ``call``, by default the owner's call in flight (ownership bridges a
        child's request only while its owner has exactly one, open listens aside)."""
        # a session's calls are gateway.core.serving.Served, the only kind there is
        served = cast("Served", owner.calls()[0] if call is None else call)
        flow = cast("Flow | None", served.flow)  # a BridgedCall: this module's Flow, see _flow
        if flow is None:
            flow = Flow(self, owner, served)
        owner.set_flow(flow)
        return flow

    def requested(self, owner: ClientSession, key: str, req: ServerRequest) -> None:
        """The routing core gave ``owner`` (a modern flow) the child's request ``key``."""
        flow = self.flow_of(owner)
        flow.deadline = None  # the round ends at state_ttl
        flow.requested(key, req)

    @property
    def full(self) -> bool:
        """Whether ``gateway.max_parked_flows`` calls are parked: no call may park until one
        ends (each holds its session, its request and a task between two POSTs)."""
        return len(self.flows) >= self.max_parked

    def admit(self) -> None:
        """Raise -32006 ``overloaded`` if no more calls may park (asked before a consent prompt)."""
        if self.full:
            raise errors.Overloaded(
                f"{len(self.flows)} calls already wait for their clients' input "
                "(gateway.max_parked_flows); retry later", limit=self.max_parked)

    def ask(self, owner: ClientSession, served: Call, key: str, req: ServerRequest,
            deadline: float) -> None:
        """The gateway's own request ``req`` (a consent prompt) for ``served``, a modern call of
        ``owner``: asked in its ``InputRequiredResult`` under ``key``.  The asker ends the call
        at ``deadline`` (trio time) if no retry answered it; the state expires then."""
        flow = self.flow_of(owner, served)
        flow.deadline = deadline
        flow.requested(key, req)

    def continues(self, method: str, params: dict[str, Raw]) -> bool:
        """Whether a request is the retry of a parked flow of this gateway: it carries a
        ``requestState`` the gateway signed, or one for a backend that is not modern (whose
        own states pass through to it)."""
        if "requestState" not in params or method not in mrtr.METHODS:
            return False
        if not self.passthrough(method, params):
            return True
        try:  # a modern backend's call under an ask rule: the consent round's state is ours
            return self.codec.issued(jsonrpc.loads(params["requestState"]))
        except msgspec.DecodeError:
            return False

    def resume(self, method: str, params: dict[str, Raw], request_id: int | str,
               caps: dict[str, object], *, principal: str | None = None,
               owner: ClientSession | None = None) -> ClientSession:
        """Continue the flow a retry's ``requestState`` names; returns its owner, whose flow
        session must now carry ``request_id``'s stream.  ``principal`` (its
        :attr:`~gateway.auth.principal.Principal.key`) must be the one the state was issued
        to: another principal's retry is refused (and the flow goes on waiting for its own).
        ``owner`` is the connection a WebSocket/unix retry came on, which must be the call's;
        None for a retry on ``/mcp``, which continues only a flow of ``/mcp``.

        Raises:
            InvalidParams: ``invalid_state`` (a forged, expired, replayed or foreign state, or
                a flow that is gone), or malformed ``inputResponses``.
        """
        try:
            claims = self.codec.verify(jsonrpc.loads(params["requestState"]), time.time())
            if claims.principal != principal:
                raise mrtr.InvalidState("it was issued to another principal", "principal")
            flow = self.flows.get(claims.flow)
            if flow is None and claims.flow in self.preempted:
                raise mrtr.InvalidState(
                    "its call was ended: parked longer than gateway.shared_park_limit while "
                    "another caller waited for its shared backend", "preempted")
            if flow is None:
                raise mrtr.InvalidState("its call is over or expired, or was served by another "
                                        "process of this replica", "gone")
            if (flow.owner is not owner if owner is not None
                    else flow.owner.transport is not Transport.HTTP):
                # (a WebSocket/unix call's state presented on /mcp, or the reverse: the flow goes
                # on waiting for its own retry; its answer could only reach its own connection)
                raise mrtr.InvalidState("on a WebSocket or unix connection, the retry must come "
                                        "on the connection of the call", "gone")
            if not flow.parked or claims.round != flow.round:
                raise mrtr.InvalidState(
                    "it was already used (a requestState is good for one retry)", "used")
            if claims.digest != mrtr.params_digest(method, params) or method != flow.method:
                flow.end("a retry presented its state with other params")
                raise mrtr.InvalidState("the retry's params differ from the call it continues",
                                        "other_params")
        except mrtr.InvalidState as exc:
            self.bus.emit(RequestStateRefused(exc.kind))
            if exc.kind == "tampered":
                self._end_tampered(params, principal, owner)
            raise
        except msgspec.DecodeError:
            self.bus.emit(RequestStateRefused("malformed"))
            raise mrtr.InvalidState("not a string") from None
        answers = mrtr.input_responses(params)  # before anything changes: a bad one changes nothing
        flow.resume(request_id, answers, caps)
        return flow.owner

    # ---- parking: what a shared backend asks before a call that may ask for input -------------

    def parked_since(self, owner: ClientSession) -> float | None:
        """When ``owner``'s flow parked (trio time), if it is parked."""
        flow = _flow(owner)
        return flow.parked_at if flow is not None and flow.parked else None

    def was_preempted(self, owner: ClientSession) -> bool:
        return owner in self.leaving

    def preempt(self, owner: ClientSession, child: ChildConnection) -> None:
        """End ``owner``'s parked flow, whose call at ``child`` keeps another caller's input
        request from being attributed there (see :func:`gateway.protocol.mrtr.park_wait`)."""
        flow = _flow(owner)
        if flow is not None and flow.parked:
            flow.preempt(child)

    def _remember_preempted(self, flow_id: str) -> None:
        now = time.time()
        preempted = self.preempted
        for old in [f for f, expires in preempted.items() if expires <= now]:
            del preempted[old]
        while len(preempted) >= MAX_PREEMPTED:
            del preempted[next(iter(preempted))]
        preempted[flow_id] = now + self.ttl + 1

    def _end_tampered(self, params: dict[str, Raw], principal: str | None,
                      owner: ClientSession | None) -> None:
        """A state whose signature fails but that names a parked flow of ours, presented by that
        flow's own principal (on a WebSocket: on its connection): its state is compromised; end
        it now instead of at its expiry, so its child stops waiting.  The flow id is readable in
        any state, so a forgery by anyone else (or by an unauthenticated caller) ends nothing:
        that flow waits for its own retry, at most ``state_ttl``."""
        if principal is None:
            return
        try:
            flow_id = self.codec.peek(jsonrpc.loads(params["requestState"]))
        except Exception:  # anything unreadable names no flow
            return
        flow = self.flows.get(flow_id) if flow_id else None
        if flow is None or not flow.parked or flow.owner.principal is None:
            return
        if flow.owner.principal.key != principal or (owner is not None and flow.owner is not owner):
            return
        flow.end("its requestState was presented tampered")


def _flow(owner: ClientSession) -> Flow | None:
    """``owner``'s bridged call: a :class:`Flow` of this module, the only kind there is."""
    return cast("Flow | None", owner.flow)


class Flow:
    """One modern call bridged to a legacy child: its rounds, the child's requests it waits
    on, and whether it is parked (answered ``input_required``, waiting for the retry)."""

    __slots__ = ("bridge", "deadline", "digest", "gathering", "id", "method", "owner", "parked",
                 "parked_at", "pending", "resumed", "round", "served", "waiting")

    def __init__(self, bridge: Bridge, owner: ClientSession, served: Served) -> None:
        self.bridge = bridge
        self.owner = owner
        self.served = served  # the call it continues
        served.flow = self
        self.id = secrets.token_urlsafe(12)
        self.round = 0
        self.parked = False
        # the call's current id was answered input_required and no retry took it over yet:
        # nothing else may answer that id (the client is between rounds)
        self.waiting = False
        # set by an asker that ends the round itself (a consent prompt): no state_ttl timer
        self.deadline: float | None = None
        self.parked_at = 0.0  # trio time of the last park
        self.gathering = False
        self.pending: dict[str, ServerRequest] = {}
        self.method = ""
        self.digest = ""
        self.resumed: trio.Event | None = None

    def _unlist(self) -> None:
        """Not parked any more: off the bridge's list, its principal's place given back."""
        self.bridge.flows.pop(self.id, None)
        self.bridge.counted.pop(self.id, _nothing)()

    def requested(self, key: str, req: ServerRequest) -> None:
        self.pending[key] = req  # unique: the router refuses a request id still open at its child

        def forget(_req: ServerRequest) -> None:
            self.pending.pop(key, None)

        req.on_end.append(forget)
        self._gather()

    def _gather(self) -> None:
        if self.gathering or self.parked or self.owner.nursery is None:
            return
        self.gathering = True
        self.owner.nursery.start_soon(self._answer_after_gather)

    async def _answer_after_gather(self) -> None:
        await trio.sleep(GATHER)
        self.gathering = False
        self._answer()

    def _answer(self) -> None:
        """Answer the round's request with what the child waits for, and park."""
        served = self.served
        if served.ended or not self.pending or self.parked:
            return
        bridge = self.bridge
        try:
            # gateway.max_parked_flows, asked before the prompt too: calls asking at once all
            # passed that check (none parked yet); then its principal's max_parked_flows
            bridge.admit()
            bridge.counted[self.id] = bridge.count_parked(self.owner)
        except errors.GatewayError as exc:  # not parked
            served.end(exc=exc)
            self._let_go()  # (cancelled, a shared child was recycled after cancel_grace)
            served.cancel()  # (the task forwarding it, if any, ends)
            return
        if not self.digest:
            self.method = served.req.method
            self.digest = mrtr.params_digest(self.method, served.req.params)
        self.round += 1
        now = trio.current_time()
        ttl = bridge.ttl if self.deadline is None else max(0.0, self.deadline - now)
        state = bridge.codec.sign(mrtr.Claims(
            flow=self.id, round=self.round, expires=int(time.time() + ttl) + 1,
            backend=served.req.backend, keys=tuple(self.pending), digest=self.digest,
            principal=None if self.owner.principal is None else self.owner.principal.key))
        result = mrtr.input_required(
            {k: (r.method, _raw(r.params)) for k, r in self.pending.items()}, state)
        self.parked = self.waiting = True
        self.parked_at = now
        bridge.flows[self.id] = self  # only parked flows are listed: a retry finds them here
        served.reply(jsonrpc.encode_result(served.id, result), served.id)
        bridge.bus.emit(InputRequired(served.req.backend))
        bridge.on_park(served.req.backend)
        self.resumed = trio.Event()
        if self.deadline is None:
            assert self.owner.nursery is not None
            self.owner.nursery.start_soon(self._expire, self.resumed, now + bridge.ttl)

    async def _expire(self, resumed: trio.Event, deadline: float) -> None:
        try:
            with trio.move_on_at(deadline):
                await resumed.wait()
                return
            self.end("not resumed within gateway.state_ttl")
        finally:
            if not resumed.is_set():  # expired, ended, or cancelled
                self._unlist()

    def closed(self) -> None:
        """Its session is over (the call ended, or the flow was ended): a parked flow is gone."""
        self.parked = False
        self._unlist()
        if self.resumed is not None:
            self.resumed.set()  # its expiry timer stops
            self.resumed = None

    def resume(self, request_id: int | str, answers: dict[str, Raw],
               caps: dict[str, object]) -> None:
        served = self.served
        self.parked = self.waiting = False
        self._unlist()
        if self.resumed is not None:
            self.resumed.set()
            self.resumed = None
        self.owner.move_call(served.id, request_id, served)
        served.req.id = request_id  # the call itself (a Request)
        served.caps = mcp.ClientCaps(caps)
        for key, result in answers.items():
            req = self.pending.get(key)
            if req is not None:  # keys the child did not ask are ignored (the spec says so)
                req.finish(ServerRequestOutcome.ANSWERED, result=result)
        if self.pending:  # asked again, with whatever the child asks next
            self._gather()

    def end(self, why: str) -> None:
        """End the flow: the child's requests are declined or refused, its call cancelled at
        the child (given up without ``notifications/cancelled`` when it was parked asking:
        :meth:`_let_go`)."""
        LOGGER.info("bridged %s flow %s ended: %s", self.method or "call", self.id, why,
                    extra=self.owner.log_fields)
        was_parked, self.parked = self.parked, False  # (giving up ends its call: not again)
        if was_parked and self.pending:
            self._let_go()
        self._unlist()
        if self.owner.transport is Transport.HTTP:  # a flow session: it ends with its call
            self.owner.close(CloseReason.CLIENT_CLOSED)
            return
        # A WebSocket/unix connection goes on: only this call ends (without an answer: it was
        # answered input_required), its child's waiting requests declined or refused.
        self.owner.end_flow(self)
        for req in list(self.pending.values()):
            req.finish(ServerRequestOutcome.OWNER_GONE)
        self.closed()
        self.served.cancel()

    def _let_go(self, child: ChildConnection | None = None) -> None:
        """A parked flow ends (expired, its state tampered, a retry with other params), or one
        about to park is refused (``max_parked_flows``): as at a preemption, the child's
        requests are answered (an elicitation ``cancel``, others -32007) and its call given up
        without ``notifications/cancelled``: the tool finishes and its reply (dropped) frees
        the child's attribution set.  (Cancelled, a
        spec-following child never answers: the set stayed held for ``cancel_grace``, other
        callers' input requests there refused, then the shared child was recycled.)  Calls
        that may ask for input wait for that reply (``leaving``).  ``child``: only a call at
        that child is given up (None: wherever it is)."""
        self.bridge.leaving.add(self.owner)
        for req in list(self.pending.values()):
            req.finish(ServerRequestOutcome.OWNER_GONE)  # elicitation: cancel; others: -32007
        served = self.served
        if (served.call is not None and served.child is not None
                and (child is None or served.child is child)):
            served.child.give_up([served.call])
        elif served.req.at is not None and (child is None or served.req.at[0] is child):
            at, call = served.req.at  # forwarded by a task
            at.give_up([call])

    def preempt(self, child: ChildConnection) -> None:
        """Parked longer than ``gateway.shared_park_limit`` while another caller's call that
        may ask for input waits for ``child`` (a shared backend's): its requests are answered
        as cancelled, its call there given up without ``notifications/cancelled`` (the
        child's reply to it, once the cancel lets the tool finish, frees the attribution at
        once; a cancelled request is never answered), then it ends as usual; its retry gets
        ``invalid_state`` with reason ``preempted``."""
        bridge = self.bridge
        bridge._remember_preempted(self.id)
        why = (f"parked {trio.current_time() - self.parked_at:.1f}s, longer than "
               "gateway.shared_park_limit, while another caller waited for its shared backend")
        self.parked = False
        bridge.flows.pop(self.id, None)
        self._let_go(child)
        self.served.end(cancelled=True)  # (in a task: its call raises there, answered by nobody)
        self.end(why)

    def call_ended(self) -> None:
        """The call is over.  While parked nobody hears of it (the client is between rounds): end
        the flow now; its retry gets ``invalid_state``."""
        if self.parked:
            self.end("the call ended while waiting for the client's input")
        elif self.owner.transport is not Transport.HTTP:
            self.owner.end_flow(self)  # the connection's next call may ask for input afresh


def _nothing() -> None:
    pass


def _raw(params: Raw | dict[str, Any]) -> Raw:
    return params if isinstance(params, Raw) else jsonrpc.encode_dict(params)
