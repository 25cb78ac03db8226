"""Each OAuth caller's own upstream token, by RFC 8693 token exchange (a per-principal source).

:class:`TokenExchangeSource` (``[backends.NAME.token_exchange]``) hands an ``[auth.oauth]``
principal's inbound access token, as ``subject_token``, to the configured token endpoint and
asks for an access token for the remote (``audience`` and/or ``resource``, ``scope``); the
gateway authenticates as ``[oauth]`` does (:func:`gateway.backend.oauth.client_auth`).  A token
is cached per principal key and audience, used until :data:`REFRESH_AT` of a lifetime that ends
no later than the inbound token's ``exp``, and kept while a renewal fails and it is still
valid; :data:`MAX_PRINCIPALS` entries at most (expired ones go first, then the least recently
used).  A principal of another kind is refused (not retryable); an unreachable server or a 5xx
or 429 answer is retryable, any other refusal not.  Neither token is ever logged or shown.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from gateway.auth.principal import Principal
from gateway.backend import httpclient
from gateway.backend.credentials import CredentialsUnavailable
from gateway.backend.oauth import Endpoints, TokenFailed, client_auth, parse_token
from gateway.config import TokenExchange

LOGGER = logging.getLogger(__name__)

GRANT_TYPE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
#: A new token is asked for once this share of the held one's lifetime is over.
REFRESH_AT = 0.8
#: Seconds before a failed renewal is tried again while the held token is still valid.
RETRY_AFTER = 10.0
#: Principals (times audiences) whose tokens are held at once.
MAX_PRINCIPALS = 4096


@dataclass
class _Held:
    token: str | None = None
    refresh_at: float = -math.inf  # trio time
    expires: float = -math.inf  # trio time
    lock: trio.Lock = field(default_factory=trio.Lock)


class TokenExchangeSource:
    """The ``PrincipalCredentials`` of a remote with ``[token_exchange]``."""

    kind = "token_exchange"

    def __init__(self, backend: str, cfg: TokenExchange,
                 opener: httpclient.Opener | None = None,
                 environ: dict[str, str] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.cfg = cfg
        self.audience = " ".join(filter(None, (cfg.audience, cfg.resource)))
        self._environ = environ
        self._wall = wall  # the clock of an inbound token's exp
        self._http = Endpoints(cfg.ca_file, opener)
        self._held: OrderedDict[tuple[str, str], _Held] = OrderedDict()
        self.exchanges = 0
        self.failures = 0
        self.last_error: str | None = None

    async def headers(self, principal: Principal) -> list[tuple[str, str]]:
        """``Authorization: Bearer`` with ``principal``'s exchanged token.

        Raises:
            CredentialsUnavailable: not an OAuth principal, its token expired, or the exchange
                failed with no valid token held.
        """
        if principal.via != "oauth" or not principal.token:
            raise CredentialsUnavailable(
                f"backend {self.backend} gets each caller's upstream token by exchanging the "
                f"caller's OAuth access token (token_exchange); a caller authenticated by "
                f"{principal.via} has none to exchange: sign in with an OAuth access token",
                retryable=False)
        key = (principal.key, self.audience)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held()
            self._bound()
        self._held.move_to_end(key)
        if held.token is None or trio.current_time() >= held.refresh_at:
            async with held.lock:
                if held.token is None or trio.current_time() >= held.refresh_at:
                    await self._renew(principal, held)
        assert held.token is not None
        return [("authorization", f"Bearer {held.token}")]

    def forget(self, principal_key: str) -> None:
        """Drop the tokens held for ``principal_key`` (every audience)."""
        for key in [k for k in self._held if k[0] == principal_key]:
            del self._held[key]

    def refresh(self) -> None:
        """A reload: the ``ca_file`` is read again at the next exchange."""
        self._http.refresh()

    def step_up(self, principal: Principal, challenge: str | None) -> None:
        """(The exchange asks for the configured scope only: the 403 goes to the caller.)"""

    def status(self) -> dict[str, Any]:
        """For ``/status``: counts and the last error, never a token nor a principal."""
        return {"token_endpoint": self.cfg.token_url, "audience": self.audience,
                "principals": len(self._held), "exchanges": self.exchanges,
                "failures": self.failures, "last_error": self.last_error}

    def _bound(self) -> None:
        """At most :data:`MAX_PRINCIPALS` entries: expired ones dropped, then the oldest."""
        if len(self._held) <= MAX_PRINCIPALS:
            return
        now = trio.current_time()
        for key in [k for k, h in self._held.items() if h.token is not None
                    and h.expires <= now]:
            del self._held[key]
        while len(self._held) > MAX_PRINCIPALS:
            self._held.popitem(last=False)

    async def _renew(self, principal: Principal, held: _Held) -> None:
        """Exchange ``principal``'s token now (its entry's lock held)."""
        now = trio.current_time()
        left = math.inf if principal.expires is None else principal.expires - self._wall()
        if left <= 0:
            held.token = None
            raise CredentialsUnavailable("the caller's OAuth access token has expired: "
                                         "sign in again", retryable=False)
        try:
            token, lifetime = await self._exchange(principal)
        except CredentialsUnavailable as exc:
            self.failures += 1
            self.last_error = exc.detail
            LOGGER.warning("%s (principal %s)", exc.detail, principal.label)
            if held.token is not None and now < held.expires:
                held.refresh_at = min(now + RETRY_AFTER, held.expires)
                return  # the held token serves until it expires
            held.token = None
            raise
        lifetime = min(lifetime if lifetime is not None else math.inf, left)
        held.token, self.last_error = token, None
        held.expires = now + lifetime
        held.refresh_at = now + REFRESH_AT * lifetime

    async def _exchange(self, principal: Principal) -> tuple[str, float | None]:
        """One token exchange: the token and its lifetime (None: not said).

        Raises:
            CredentialsUnavailable: retryable when the server was unreachable or failing.
        """
        cfg = self.cfg
        self.exchanges += 1
        where = httpclient.parse_url(cfg.token_url).text
        form = {"grant_type": GRANT_TYPE, "subject_token": principal.token,
                "subject_token_type": ACCESS_TOKEN_TYPE,
                "requested_token_type": ACCESS_TOKEN_TYPE}
        for name in ("audience", "resource", "scope"):
            if getattr(cfg, name):
                form[name] = getattr(cfg, name)
        head: list[tuple[str, str]] = []
        try:
            client_auth(cfg, cfg.assertion_audience or cfg.token_url, form, head, self._environ)
        except TokenFailed as exc:
            raise CredentialsUnavailable(f"backend {self.backend}: token exchange: "
                                         f"{exc.detail}", retryable=False) from None
        try:
            response, body = await self._http.post_form(cfg.token_url, form, head)
        except TokenFailed as exc:
            raise CredentialsUnavailable(f"backend {self.backend}: token exchange: "
                                         f"{exc.detail}", retryable=True) from None
        try:
            return parse_token(response, body, where)
        except TokenFailed as exc:
            retryable = response.status >= 500 or response.status == 429
            raise CredentialsUnavailable(f"backend {self.backend}: token exchange: "
                                         f"{exc.detail}", retryable=retryable) from None
