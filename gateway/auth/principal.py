"""The caller's identity as the rest of the gateway sees it (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: set on a :class:`~gateway.core.session.ClientSession` when it is
    authenticated (``None`` there: authentication is not configured and the listener is
    loopback).

    ``name`` is what policy rules match (a configured bearer principal, the OAuth
    ``principal_claim``, or the unix peer's user name); ``label`` is what metrics and logs carry:
    the name when the operator configured it (a bearer principal, or one named in a rule or
    limit), else ``"other"`` (bounded: never a raw token subject).

    ``credential`` says which configured authenticator vouched for it (a bearer entry's
    fingerprint, or the OAuth issuer/audience) and ``expires`` when that ends (a JWT's ``exp``,
    unix seconds): a reload that removes the credential closes what the principal opened.
    Neither is shown in ``repr`` nor compared.

    ``token`` is an ``oauth`` principal's inbound access token itself (empty for the others),
    in memory only: what an RFC 8693 token exchange hands the authorization server as its
    ``subject_token``.  Never shown, logged, compared nor sent to a backend.
    """

    name: str
    groups: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()
    via: str = "none"  # "bearer" | "oauth" | "peer"
    label: str = "other"
    credential: str = field(default="", repr=False, compare=False)
    expires: float | None = field(default=None, repr=False, compare=False)
    token: str = field(default="", repr=False, compare=False)

    @property
    def key(self) -> str:
        """What a session, a connection or a requestState is bound to: the same name vouched
        for the same way (an OAuth ``sub`` "alice" is not the bearer principal "alice")."""
        return f"{self.via}:{self.name}"
