"""The caller's identity as the rest of the gateway sees it (pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: set on a :class:`~gateway.session.ClientSession` when it is authenticated
    (``None`` there: authentication is not configured and the listener is loopback).

    ``name`` is what policy rules match (a configured bearer principal, the OAuth
    ``principal_claim``, or the unix peer's user name); ``label`` is what metrics and logs carry:
    the name when the operator configured it (a bearer principal, or one named in a rule or
    limit), else ``"other"`` (bounded: never a raw token subject).
    """

    name: str
    groups: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()
    via: str = "none"  # "bearer" | "oauth" | "peer"
    label: str = "other"
