"""The authorizer: applies ``[policy]`` to each ``tools/call``, with real consent prompts.

``ask`` parks the call and sends the gateway's own ``elicitation/create`` (a form with one
boolean) to the calling connection, which keeps reading meanwhile.  The parked call is closed
exactly once by: approval (the tool runs), decline / cancel / accept-without-yes, an error
answer, owner disconnect, timeout, or shutdown.  Every path but approval raises
:class:`~gateway.errors.Denied` with a ``data.reason``.  Silence is not consent.  If the client
cancels the parked call, the prompt is withdrawn with ``notifications/cancelled``.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from gateway import errors
from gateway.config import GatewayConfig, PolicySection
from gateway.events import EventBus, ServerRequestFinished, ServerRequestOutcome
from gateway.protocol import jsonrpc
from gateway.protocol import policy as pure
from gateway.protocol.catalog import Catalog

if TYPE_CHECKING:
    from gateway.session import ClientSession, ServerRequest

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


class Policy:
    def __init__(self, cfg: PolicySection, bus: EventBus, full: GatewayConfig | None = None) -> None:
        self.cfg = cfg
        self._bus = bus
        self._full = full
        self.rules = [pure.Rule(r.match, r.action) for r in cfg.rules]
        self.sensitive: set[str] = set()
        self._pending: set[ServerRequest] = set()

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

    def unruled_sensitive(self) -> list[str]:
        """Sensitive tools no rule names (a boot error)."""
        return sorted(
            t for t in self.sensitive
            if pure.decide(t, self.rules, self.cfg.default, sensitive=True).sensitive_unruled
        )

    @property
    def active(self) -> bool:
        """False when every call is allowed without looking (the fast path)."""
        return bool(self.rules or self.sensitive or self.cfg.default != "allow")

    def pending_count(self) -> int:
        return len(self._pending)

    def check(self, tool: str) -> bool:
        """Whether a call of ``tool`` needs the user's consent first (False: allowed).

        Raises:
            Denied: policy denies it, or it is sensitive and no rule names it.
        """
        decision = pure.decide(tool, self.rules, self.cfg.default, sensitive=tool in self.sensitive)
        if decision.sensitive_unruled:
            raise errors.Denied(
                f"tool {tool!r} is marked destructive/sensitive and no [policy] rule names it",
                tool=tool,
            )
        if decision.action == "deny":
            raise errors.Denied(f"tool {tool!r} is denied by policy", tool=tool)
        return decision.action == "ask"

    async def authorize(self, session: ClientSession, tool: str, arguments: Any = None) -> None:
        """Return when ``session`` may call ``tool``; raise Denied otherwise."""
        if self.check(tool):
            await self.ask(session, tool, arguments)

    async def ask(self, session: ClientSession, tool: str, arguments: Any) -> None:
        if not session.caps.elicitation_form:
            raise errors.Denied(
                f"tool {tool!r} needs the user's consent, but the client did not declare elicitation",
                reason="authorization_required", tool=tool,
            )
        shown = json.dumps(arguments, sort_keys=True, ensure_ascii=False) if arguments is not None else "{}"
        if len(shown) > MAX_ARGS_SHOWN:
            shown = shown[:MAX_ARGS_SHOWN] + "…"
        req = session.open_request(
            "elicitation/create",
            {"mode": "form", "message": f"Allow the tool {tool} to run with arguments {shown}?",
             "requestedSchema": pure.consent_schema()},
        )
        self._pending.add(req)
        outcome = ServerRequestOutcome.TIMEOUT
        try:
            with trio.move_on_after(self.cfg.elicitation_timeout):
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
            if pure.consent_granted(answer):
                return
            raise errors.Denied(f"the user declined to run {tool!r}", reason="declined", tool=tool)
        reason = DENY_REASONS.get(outcome, str(outcome))
        raise errors.Denied(f"consent for {tool!r} was not given ({reason})", reason=reason, tool=tool)
