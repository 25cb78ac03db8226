"""The per-principal credential seam: where a remote backend gets each caller's own upstream
credentials (a token file, an RFC 8693 token exchange, the authorization code flow)."""

from __future__ import annotations

from typing import Protocol

from gateway.auth.principal import Principal


class CredentialsUnavailable(Exception):
    """No credentials for that principal now: ``detail`` says why (never a secret),
    ``retryable`` whether trying again later may succeed, ``url`` where the caller can
    authorize (None: nowhere)."""

    def __init__(self, detail: str, retryable: bool, url: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retryable = retryable
        self.url = url


class PrincipalCredentials(Protocol):
    kind: str  # "token_files" | "token_exchange" | "authorization_code"

    async def headers(self, principal: Principal) -> list[tuple[str, str]]:
        """The headers carrying ``principal``'s credentials upstream.

        Raises:
            CredentialsUnavailable: none can be had for that principal now.
        """
        ...

    def forget(self, principal_key: str) -> None:
        """Drop the cached tokens of that principal."""
        ...
