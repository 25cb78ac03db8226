"""The ``principal`` label of metrics and log lines: bounded, never a raw token subject (pure).

A principal's label is its name when the operator wrote that name in the config — a
``[[auth.bearer]]`` principal, a line of ``auth.tokens_file`` (names passed in as ``extra``), or
the ``principal`` of a policy rule or an ``[[auth.limits]]`` entry that is a plain name, not a
glob — else :data:`OTHER`.  A request without a principal (authentication not configured,
loopback) is labelled :data:`NO_PRINCIPAL`.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.config import GatewayConfig

OTHER = "other"
NO_PRINCIPAL = "_none"
_GLOB_CHARS = frozenset("*?[")


def _plain(name: str | None) -> bool:
    return bool(name) and not (_GLOB_CHARS & set(name or ""))


def configured_names(cfg: GatewayConfig, extra: Iterable[str] = ()) -> frozenset[str]:
    """The principal names the operator configured (the label set, besides ``other``)."""
    names = {b.principal for b in cfg.auth.bearer}
    names.update(r.principal for r in cfg.policy.rules if r.principal is not None
                 and _plain(r.principal))
    names.update(lim.principal for lim in cfg.auth.limits if _plain(lim.principal))
    names.update(extra)
    names.discard(NO_PRINCIPAL)
    return frozenset(names)


def label_for(name: str, configured: frozenset[str]) -> str:
    return name if name in configured else OTHER
