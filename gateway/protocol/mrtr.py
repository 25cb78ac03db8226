"""Multi-round-trip requests (MRTR): the signed ``requestState`` the gateway hands a modern client
when it bridges a legacy child's server→client requests, and the pieces of an
``InputRequiredResult`` (pure).

The gateway keeps the child waiting and answers the client's call ``input_required`` with the
child's requests under their ids as keys; the client retries with ``inputResponses`` and the
state byte-exact.  The state is attacker-controlled, so it is signed:
``<replica_id>.<payload>.<mac>`` (HMAC-SHA256), the replica id readable so a load balancer can
route the retry to the replica holding the child.  :meth:`StateCodec.verify` refuses a state
that is forged, expired or malformed (``invalid_state``); refusing a replayed round is the flow
table's job.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from msgspec import Raw

from gateway import errors
from gateway.protocol import jsonrpc

#: The requests that may answer ``input_required`` (spec: MUST NOT on others).
METHODS = frozenset({"tools/call", "prompts/get", "resources/read"})
#: Params that belong to the round trip, not to the call itself (never forwarded to a legacy
#: child, left out of the digest).
ROUND_TRIP_KEYS = frozenset({"inputResponses", "requestState"})
#: Longest ``requestState`` accepted (a real one is a few hundred bytes).
MAX_STATE = 4096


class InvalidState(errors.InvalidParams):
    """-32602 ``invalid_state``; ``kind`` (the metric label) is kept on the exception only."""

    def __init__(self, why: str, kind: str = "malformed") -> None:
        super().__init__(f"requestState refused: {why}", reason="invalid_state")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Claims:
    flow: str  # the flow's id in the replica's table
    round: int  # which InputRequiredResult of the flow this state answers
    expires: int  # unix seconds
    backend: str
    keys: tuple[str, ...]  # the inputRequests keys of that round
    digest: str  # of the original call's params (see :func:`params_digest`)
    principal: str | None = None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class StateCodec:
    """Signs and verifies ``requestState`` for one replica."""

    def __init__(self, key: bytes, replica_id: str) -> None:
        if not key:
            raise ValueError("the state key must not be empty")
        if not replica_id or "." in replica_id:
            raise ValueError("replica_id must be non-empty and contain no '.'")
        self._key = key
        self.replica_id = replica_id

    def _mac(self, signed: str) -> str:
        return _b64(hmac.new(self._key, signed.encode("ascii"), hashlib.sha256).digest())

    def sign(self, claims: Claims) -> str:
        payload = _b64(json.dumps(
            {"f": claims.flow, "n": claims.round, "x": claims.expires, "b": claims.backend,
             "k": list(claims.keys), "d": claims.digest, "p": claims.principal},
            separators=(",", ":")).encode())
        signed = f"{self.replica_id}.{payload}"
        return f"{signed}.{self._mac(signed)}"

    def verify(self, state: object, now: float) -> Claims:
        """The claims of a state this replica signed and that has not expired.

        Raises:
            InvalidParams: (``reason: invalid_state``) anything else.
        """
        if not isinstance(state, str) or len(state) > MAX_STATE or not state.isascii():
            # (non-ASCII: never ours, and hmac.compare_digest / the ASCII mac input refuse it)
            raise InvalidState("not a state this gateway issued")
        replica, _, rest = state.partition(".")
        payload, _, mac = rest.partition(".")
        if replica != self.replica_id:
            raise InvalidState(f"it was issued by replica {replica[:64]!r}, this is "
                               f"{self.replica_id!r}", "foreign")
        if not payload or not hmac.compare_digest(mac, self._mac(f"{replica}.{payload}")):
            raise InvalidState("its signature does not verify (tampered, or signed with another "
                               "key)", "tampered")
        try:
            fields = json.loads(_unb64(payload))
            claims = Claims(flow=fields["f"], round=fields["n"], expires=fields["x"],
                            backend=fields["b"],
                            keys=tuple(fields["k"]), digest=fields["d"], principal=fields["p"])
        except (ValueError, KeyError, TypeError, binascii.Error):  # signed by us: cannot happen
            raise InvalidState("its payload is malformed") from None
        if claims.expires <= now:
            raise InvalidState("it has expired (gateway.state_ttl; a consent prompt: "
                               "policy.elicitation_timeout)", "expired")
        return claims

    def issued(self, state: object) -> bool:
        """Whether ``state`` is signed by this replica's key (expired or not): :meth:`verify`
        at the beginning of time."""
        try:
            self.verify(state, -math.inf)
        except InvalidState:
            return False
        return True

    def peek(self, state: str) -> str | None:
        """The flow id a state names, NOT verified (only to end a flow whose state was tampered)."""
        replica, _, rest = state.partition(".")
        if replica != self.replica_id:
            return None
        try:
            flow = json.loads(_unb64(rest.partition(".")[0])).get("f")
        except (ValueError, AttributeError, binascii.Error):
            return None
        return flow if isinstance(flow, str) else None


def params_digest(method: str, params: dict[str, Raw]) -> str:
    """A digest of a call's own params (not ``_meta``, not the round-trip keys): a retry must
    repeat the call it continues."""
    body = {k: _canonical(v) for k,
            v in params.items() if k != "_meta" and k not in ROUND_TRIP_KEYS}
    text = json.dumps([method, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return _b64(hashlib.sha256(text.encode()).digest()[:18])


def _canonical(raw: Raw) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return bytes(raw).decode("utf-8", "replace")


def input_responses(params: dict[str, Raw]) -> dict[str, Raw]:
    """The retry's ``inputResponses``: an object of objects (each value a result for the key's
    request), re-encoded one by one.

    Raises:
        InvalidParams: not an object, or a value that is not an object.
    """
    raw = params.get("inputResponses")
    if raw is None:
        return {}
    try:
        fields = jsonrpc.raw_dict(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise errors.InvalidParams(
            "inputResponses must be an object keyed by inputRequests keys") from None
    for key, value in fields.items():
        if bytes(value).lstrip()[:1] != b"{":
            raise errors.InvalidParams(f"inputResponses[{key[:64]!r}] must be an object (the "
                                       "result of "
                                       "that input request)")
    return fields


_Owner = TypeVar("_Owner", bound=Hashable)


@dataclass(frozen=True, slots=True)
class ParkWait(Generic[_Owner]):
    """A call that may ask its caller for input waits before it goes to a shared child."""

    preempt: tuple[_Owner, ...]  # parked flows past the limit: end them now
    until: float  # when the next parked one reaches the limit (``inf``: none is left to end)


def park_wait(parked: Mapping[_Owner, float], leaving: bool, now: float,
              limit: float) -> ParkWait[_Owner] | None:
    """Whether a call that may ask for input must wait before it goes to a ``shared`` child.

    A child's request is attributed only while one caller's calls are at that child, and a
    parked flow's call (answered ``input_required``, its client gone between rounds) stays
    there until the client retries: another caller's request would be refused as
    unattributable.  ``parked`` maps the *other* callers' parked flows on the child to when
    each parked; ``leaving``: a flow ended for this (preempted) still has its call at the
    child, which has not answered it yet.  None: nothing blocks, the call goes now.  Otherwise
    the flows parked ``limit`` seconds or more are to be ended now; a flow parked for less is
    never ended (its client may still retry in time).
    """
    if not parked and not leaving:
        return None
    due = tuple(owner for owner, since in parked.items() if now - since >= limit)
    until = min((since + limit for since in parked.values() if now - since < limit),
                default=math.inf)
    return ParkWait(due, until)


def input_required(requests: dict[str, tuple[str, Raw]], state: str) -> Raw:
    """An ``InputRequiredResult``: ``requests`` maps each key to (method, params)."""
    return jsonrpc.encode_dict({
        "resultType": "input_required",
        "inputRequests": {key: {"method": method, "params": params}
                          for key, (method, params) in requests.items()},
        "requestState": state,
    })
