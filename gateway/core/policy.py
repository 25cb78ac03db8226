"""The authorizer: applies ``[policy]`` to each ``tools/call``, with real consent prompts.

``ask`` parks the call and sends the gateway's own ``elicitation/create`` (one boolean) to the
calling connection, which keeps reading meanwhile; a modern caller is asked in its call's
``InputRequiredResult`` instead (:mod:`gateway.core.bridge`).  The parked call ends exactly
once; every path but approval raises :class:`~gateway.errors.Denied` with a ``data.reason``
(silence is not consent).  Each caller sees only what it may call: :meth:`Policy.view` is the
caller's part of a merged list, cached per view key until the catalog or the policy changes.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import trio

from gateway import errors
from gateway.config import GatewayConfig, PolicyRule, PolicySection
from gateway.events import EventBus, ServerRequestFinished, ServerRequestOutcome
from gateway.protocol import jsonrpc
from gateway.protocol import policy as pure
from gateway.protocol.catalog import Catalog, backends_of

if TYPE_CHECKING:
    from gateway.auth.principal import Principal
    from gateway.core.session import ClientSession, ServerRequest

Caller = pure.Caller
Kind = pure.Kind

LOGGER = logging.getLogger(__name__)

#: Arguments shown in a consent prompt are cut to this many characters.
MAX_ARGS_SHOWN = 500
#: The ``data.reason`` of the Denied a consent prompt ends with, by how the prompt ended
#: (an outcome not listed is its own reason, e.g. ``timeout``).
DENY_REASONS = {
    ServerRequestOutcome.ERROR: "declined",
    ServerRequestOutcome.OWNER_GONE: "declined",
    ServerRequestOutcome.SHUTDOWN: "shutdown",
}
#: The audit log's consent outcome of a prompt that was not answered.
CONSENT_OUTCOMES = {
    ServerRequestOutcome.ERROR: "declined",
    ServerRequestOutcome.TIMEOUT: "timed_out",
}
#: The ``inputRequests`` key of the consent prompt in a modern caller's ``InputRequiredResult``.
CONSENT_KEY = "consent"
#: ``ClientSession.transport`` → the ``transport`` a policy rule names.
TRANSPORTS = {"websocket": "ws", "http": "http", "unix": "unix"}
#: Distinct per-caller views cached at most (past it the cache starts over).
MAX_VIEWS = 1024
#: The merged catalog's lists, by the policy kind that governs them and the field that names
#: an item.
LISTS: dict[str, tuple[Kind, str]] = {
    "tools": ("tool", "name"),
    "prompts": ("prompt", "name"),
    "resources": ("resource", "uri"),
    "templates": ("resource", "uriTemplate"),
}


def caller_of(session: ClientSession) -> Caller:
    """The caller ``session`` is, for policy."""
    transport = TRANSPORTS.get(session.transport, session.transport)
    principal = session.principal
    if principal is None:
        return Caller(transport)
    return Caller(transport, principal.name, principal.groups, principal.scopes)


def _rule(r: PolicyRule) -> pure.Rule:
    return pure.Rule(r.match, r.action, r.kind, r.principal, r.group, r.transport,
                     frozenset(r.scopes))


class Policy:
    def __init__(self, cfg: PolicySection, bus: EventBus,
                 full: GatewayConfig | None = None) -> None:
        self.cfg = cfg
        self._bus = bus
        self._full = full
        self.rules = [_rule(r) for r in cfg.rules]
        #: some rule can decide differently for different callers: lists are filtered per caller
        self.per_caller = any(r.per_caller for r in self.rules)
        self.scoped = any(r.scopes for r in self.rules)  # some rule wants OAuth scopes
        self.sensitive: set[str] = set()
        #: False when every call is allowed without looking (the fast path); follows the rules,
        #: the default and the sensitive tools (:meth:`catalog_changed`)
        self.active = bool(self.rules or cfg.default != "allow")
        self._pending: set[ServerRequest] = set()
        self._views: dict[Caller, dict[str, list[dict[str, Any]]]] = {}
        self._seen: dict[Caller, frozenset[str]] = {}  # per view key: the backends it shows
        # per (kind, name): the rules whose kind and glob match it (the same for every caller)
        self._named: dict[tuple[Kind, str], list[pure.Rule]] = {}
        self._index = pure.RuleIndex(self.rules)

    def reconfigured(self, full: GatewayConfig) -> Policy:
        """The policy of a reloaded config; prompts parked under this one stay tracked."""
        new = Policy(full.policy, self._bus, full)
        new._pending = self._pending
        return new

    def catalog_changed(self, catalog: Catalog) -> None:
        sensitive = set()
        for name, tool in catalog.tool_defs.items():
            route = catalog.tool_routes[name]
            backend_cfg = self._full.backends.get(route.backend) if self._full is not None else None
            if pure.is_sensitive(tool, backend_cfg.sensitive if backend_cfg else [], route.name):
                sensitive.add(name)
        self.sensitive = sensitive
        self.active = bool(self.rules or sensitive or self.cfg.default != "allow")
        self._views = {}
        self._seen = {}
        self._named = {}

    def _rules_for(self, kind: Kind, name: str) -> list[pure.Rule]:
        """The rules that can decide on ``name`` (kind and glob match), in order: deciding
        with them is deciding with all rules, without matching every glob for every caller."""
        key = (kind, name)
        rules = self._named.get(key)
        if rules is None:
            if len(self._named) >= MAX_VIEWS * 64:
                self._named = {}
            rules = self._named[key] = self._index.naming(name, kind)
        return rules

    def unruled_sensitive(self) -> list[str]:
        """Sensitive tools no rule names (a boot error)."""
        return sorted(t for t in self.sensitive if not pure.names(t, self.rules))

    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def filtering(self) -> bool:
        """Whether a caller's lists can differ from the merged ones (something may be hidden)."""
        return bool(self.rules or self.sensitive or self.cfg.default == "deny")

    def view_key(self, caller: Caller) -> Caller:
        """The key of ``caller``'s view: one shared key when no rule tells callers apart."""
        return caller if self.per_caller else pure.ANONYMOUS

    def view(self, catalog: Catalog, kind: str, caller: Caller) -> list[dict[str, Any]]:
        """What ``caller`` sees of the merged list ``kind`` (``tools``, ``prompts``,
        ``resources``, ``templates``) of ``catalog``, the catalog the policy was last told of."""
        items: list[dict[str, Any]] = getattr(catalog, kind)
        if not self.filtering:
            return items
        key = self.view_key(caller)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_VIEWS:
                self._views = {}
            views = self._views[key] = {}
        seen = views.get(kind)
        if seen is None:
            seen = views[kind] = [item for item in items if self._visible(kind, item, key)]
        return seen

    def backends_seen(self, catalog: Catalog, caller: Caller) -> frozenset[str]:
        """The backends something of which is in ``caller``'s view of ``catalog``."""
        key = self.view_key(caller) if self.filtering else pure.ANONYMOUS
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= MAX_VIEWS:
                self._seen = {}
            seen = self._seen[key] = backends_of(catalog, *(self.view(catalog, kind, caller)
                                                            for kind in LISTS))
        return seen

    def _visible(self, kind: str, item: dict[str, Any], caller: Caller) -> bool:
        policy_kind, field = LISTS[kind]
        name = item.get(field)
        if not isinstance(name, str):
            return False
        rules = self._rules_for(policy_kind, name)
        sensitive = policy_kind == "tool" and name in self.sensitive
        if not rules:  # no rule names it: the default (tools) or allowed; sensitive: never
            return policy_kind != "tool" or (not sensitive and self.cfg.default != "deny")
        return pure.visible(name, rules, self.cfg.default, sensitive=sensitive, caller=caller,
                            kind=policy_kind)

    def check(self, name: str, caller: Caller = pure.ANONYMOUS, kind: Kind = "tool") -> bool:
        """Whether ``caller``'s use of ``name`` (a tool or prompt name, a resource URI) needs
        the user's consent first (False: allowed).

        Raises:
            Denied: policy denies it (``data.reason`` ``denied``, or ``insufficient_scope`` with
                ``data.scopes`` when a rule would allow it with those scopes), or it is a
                sensitive tool no rule names for this caller.
        """
        what = {"tool": "tool", "prompt": "prompt", "resource": "uri"}[kind]
        if (kind == "resource" and pure.climbs(name)
                and any(r.kind == "resource" for r in self.rules)):
            # a glob on the URI cannot tell where a dot segment leads: refused, not guessed
            raise errors.Denied(f"resource {name!r} has a '.' or '..' path segment; "
                                "resource rules cannot be applied to it", uri=name)
        decision = self.decision(name, caller, kind)
        if decision.action != "deny":
            return decision.action == "ask"
        if decision.scopes:
            raise errors.Denied(
                f"{kind} {name!r} needs the scopes {' '.join(decision.scopes)}",
                reason="insufficient_scope", scopes=list(decision.scopes), **{what: name})
        if decision.sensitive_unruled:
            raise errors.Denied(
                f"tool {name!r} is marked destructive/sensitive and no [policy] rule names it",
                tool=name,
            )
        raise errors.Denied(f"{kind} {name!r} is denied by policy", **{what: name})

    def decision(self, name: str, caller: Caller, kind: Kind) -> pure.Decision:
        """The decision of the rules on ``caller``'s use of ``name`` (:meth:`check`'s, the
        audit log's)."""
        return pure.decide(name, self._rules_for(kind, name), self.cfg.default, caller=caller,
                           kind=kind, sensitive=kind == "tool" and name in self.sensitive)

    #: The requests whose target policy rules govern: method -> (kind, param naming it).
    TARGETS: ClassVar[dict[str, tuple[Kind, str]]] = {
        "tools/call": ("tool", "name"), "prompts/get": ("prompt", "name"),
        "resources/read": ("resource", "uri"), "resources/subscribe": ("resource", "uri"),
    }

    def missing_scopes(self, principal: Principal, method: str, params: object) -> list[str] | None:
        """The scopes a rule wants for an HTTP request that ``principal``'s token lacks (the
        deciding rule would allow it with them), or None: answered 403 ``insufficient_scope``
        on ``/mcp`` before the request runs (a WebSocket gets the -32005 of :meth:`check`)."""
        target = self.TARGETS.get(method)
        if not self.scoped or target is None or not isinstance(params, msgspec.Raw):
            return None
        kind, key = target
        try:
            name = jsonrpc.loads(jsonrpc.params_dict(params)[key])
        except Exception:  # malformed params are the request's to answer
            return None
        if not isinstance(name, str):
            return None
        caller = Caller("http", principal.name, principal.groups, principal.scopes)
        decision = self.decision(name, caller, kind)
        return list(decision.scopes) if decision.action == "deny" and decision.scopes else None

    async def authorize(self, session: ClientSession, tool: str, arguments: Any = None) -> None:
        """Return when ``session`` may call ``tool``; raise Denied otherwise."""
        if self.check(tool, caller_of(session)):
            await self.ask(session, tool, arguments)

    async def ask(self, session: ClientSession, tool: str, arguments: Any, kind: Kind = "tool",
                  request_id: int | str | None = None) -> None:
        """Return when the user consents to ``session``'s request ``request_id`` using ``tool``.

        A legacy caller is sent the prompt; a modern (2026-07-28) one is asked in its call's
        ``InputRequiredResult`` (key :data:`CONSENT_KEY`, gateway.core.bridge) and answers with
        its retry.  Either way the prompt ends at ``elicitation_timeout`` (a modern one at
        ``gateway.state_ttl`` if that is shorter); a cancelled call withdraws its prompt
        (``notifications/cancelled``).

        Raises:
            Denied: declined, timed out, the owner left, shutdown; ``authorization_required``
                when the caller did not declare form elicitation (a modern caller:
                MissingCapability, -32021).
        """
        what = {"tool": "tool", "prompt": "prompt", "resource": "uri"}[kind]
        # the call asking (its id changes with a modern caller's retry): told the outcome
        asked = session.inflight.get(request_id) if request_id is not None else None
        bridge = session.mrtr
        served = None if bridge is None else asked
        if served is not None and not served.modern:
            served = None  # a legacy request: its caller is sent the prompt
        modern = served is not None
        if served is not None and (served.caps is None or not served.caps.elicitation_form):
            raise errors.MissingCapability(
                f"{kind} {tool!r} needs the user's consent, but the request did not declare form "
                "elicitation in its client capabilities", reason="authorization_required",
                **{what: tool}, requiredCapabilities={"elicitation": {"form": {}}})
        if not modern and not session.caps.elicitation_form:
            raise errors.Denied(
                f"{kind} {tool!r} needs the user's consent, but the client did not declare "
                "elicitation",
                reason="authorization_required", **{what: tool},
            )
        shown = ("{}" if arguments is None
                 else json.dumps(arguments, sort_keys=True, ensure_ascii=False))
        if len(shown) > MAX_ARGS_SHOWN:
            shown = shown[:MAX_ARGS_SHOWN] + "…"
        message = {"tool": f"Allow the tool {tool} to run with arguments {shown}?",
                   "prompt": f"Allow the prompt {tool} with arguments {shown}?",
                   "resource": f"Allow reading the resource {tool}?"}[kind]
        timeout = self.cfg.elicitation_timeout
        if modern:
            assert bridge is not None
            timeout = min(timeout, bridge.ttl)
            bridge.admit()  # max_parked_flows: a parked prompt holds its call between two POSTs
        deadline = trio.current_time() + timeout
        req = session.open_request(
            "elicitation/create",
            {"mode": "form", "message": message, "requestedSchema": pure.consent_schema()},
            send=not modern,
        )
        if served is not None:
            assert bridge is not None
            bridge.ask(session, served, CONSENT_KEY, req, deadline)
        self._pending.add(req)
        outcome = ServerRequestOutcome.TIMEOUT
        try:
            with trio.move_on_at(deadline):
                await req.done.wait()
            outcome = req.outcome or ServerRequestOutcome.TIMEOUT
        finally:
            self._pending.discard(req)
            if not req.done.is_set():
                # timeout, or the client cancelled the parked call: withdraw the prompt
                withdrawn = (ServerRequestOutcome.TIMEOUT if outcome == ServerRequestOutcome.TIMEOUT
                             else ServerRequestOutcome.CANCELLED)
                session.cancel_request(req, withdrawn, "the consent prompt was withdrawn")
            self._bus.emit(ServerRequestFinished("", "elicitation/create", req.outcome or outcome,
                                                 trio.current_time() - req.started))
        if outcome == ServerRequestOutcome.ANSWERED:
            try:
                answer = jsonrpc.loads(req.result) if req.result is not None else None
            except msgspec.DecodeError:
                answer = None
            granted = pure.consent_granted(answer)
            if asked is not None:
                asked.req.consent = "accepted" if granted else "declined"
            if granted:
                return
            raise errors.Denied(f"the user declined {kind} {tool!r}", reason="declined",
                                **{what: tool})
        if asked is not None:
            asked.req.consent = CONSENT_OUTCOMES.get(outcome, "cancelled")
        reason = DENY_REASONS.get(outcome, str(outcome))
        raise errors.Denied(f"consent for {tool!r} was not given ({reason})", reason=reason,
                            **{what: tool})
