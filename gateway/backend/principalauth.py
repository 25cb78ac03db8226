"""Each caller's own upstream token by the authorization code flow (a per-principal source).

:class:`PrincipalAuthorizationCode` keeps one :class:`~gateway.backend.authcode.AuthorizationCode`
per principal, its state file ``STATE_DIR/oauth/BACKEND/PRINCIPAL.json`` (0600, the refresh
token; deleted when a reload removes the principal).  The discovery and the registration are
done once per backend and shared.  A principal without a token gets the URL of the gateway's
own authorize page (``listen.redirect_path?start=ID``, single use, :data:`START_TTL`): it names
the backend and the principal and asks for consent, its link good only with the ``SameSite=Strict``
cookie the page set (no cross-site consent); continuing sets a ``__Host-`` cookie holding a secret
bound to the flow's single-use ``state`` and sends the browser to the authorization server.
The redirect back completes only with that cookie, so a state begun by one principal cannot be
completed in another's browser; a wrong, reused or unbound one is refused and nothing
is stored.  A revoked refresh token gives that principal alone a new URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import html
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import trio

from gateway.auth.principal import Principal
from gateway.backend import httpclient, oauth
from gateway.backend.authcode import AuthorizationCode, NeedsAuthorization
from gateway.backend.credentials import CredentialsUnavailable, principal_file_name
from gateway.config import RemoteOAuth
from gateway.limits import LogBudget

LOGGER = logging.getLogger(__name__)

#: Seconds the gateway's authorize page link stays good, and how many may be open at once.
START_TTL = 600.0
MAX_STARTS = 1024
#: Consent pages of one link whose continue link stays good (the latest shown).
MAX_PAGES = 4
#: Principals whose flows are held in memory at once (the least recently used dropped first;
#: their refresh tokens stay in their state files).
MAX_PRINCIPALS = 4096
#: The cookies binding a flow to the browser that consented (one per flow: ``-`` and a digest of
#: its state, so one browser may authorize several backends at once).
COOKIE = "__Host-mcp-gateway-authorize"


@dataclass
class _Start:
    principal_key: str
    identity: str
    label: str
    expires: float  # trio time
    consents: list[bytes] = field(default_factory=list)  # the pages shown: their tokens' hashes


@dataclass
class _Bound:
    principal_key: str
    secret_hash: bytes
    flow: AuthorizationCode
    link: str  # the authorize page's URL the caller was given


@dataclass(frozen=True, slots=True)
class Page:
    """What the redirect endpoint answers: status, body, content type, extra headers."""

    status: int
    body: str
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()
    authorized: str | None = None  # an authorization completed: the link its caller was given


def identity_of(principal_key: str, via: str, name: str) -> str:
    """A principal's state file name: its credentials file name, else a digest of its key."""
    return principal_file_name(via, name) or \
        "key-" + hashlib.sha256(principal_key.encode()).hexdigest()[:32]


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class PrincipalAuthorizationCode:
    """The ``PrincipalCredentials`` of a per-principal remote with ``[oauth]`` grant =
    ``"authorization_code"``."""

    kind = "authorization_code"

    def __init__(self, backend: str, url: str, cfg: RemoteOAuth,
                 opener: httpclient.Opener | None = None) -> None:
        self.backend, self.url, self.cfg = backend, url, cfg
        self._opener = opener
        self.redirect_uri = ""
        self.state_dir: str | None = None
        self._shared = AuthorizationCode(backend, url, cfg, opener)  # discovery, registration
        self._flows: dict[str, AuthorizationCode] = {}
        self._files: dict[str, str] = {}  # principal key → its state file
        self._seen: dict[str, Principal] = {}  # principal key → the principal (for drop_unless)
        self._starts: dict[str, _Start] = {}
        self._bound: dict[str, _Bound] = {}  # state → the flow it completes
        self._lock = trio.Lock()
        self.authorizations = 0
        self.refused = 0
        self._refusal_log = LogBudget()  # the redirect and consent pages' refusals

    def _refusal(self, detail: str) -> None:
        """One refused request of the pages anyone can reach: counted, logged rate-limited."""
        self.refused += 1
        self._refusal_log.warn(
            LOGGER, trio.current_time(), "backend " + self.backend.replace("%", "%%")
            + ": %d more refused authorization requests in the last %.0fs not logged",
            "backend %s: %s", self.backend, detail)

    def place(self, redirect_uri: str, state_dir: str) -> None:
        """Where the redirect comes back and the principals' state files live."""
        self.redirect_uri, self.state_dir = redirect_uri, state_dir
        self._shared.place(redirect_uri, state_dir)

    # ---- the seam ---------------------------------------------------------------------------

    async def headers(self, principal: Principal) -> list[tuple[str, str]]:
        """``Authorization: Bearer`` with the principal's own token (refreshed when due).

        Raises:
            CredentialsUnavailable: not authorized yet (not retryable, ``url`` where to), or
                the authorization server cannot be reached (retryable).
        """
        flow = self._flow(principal)
        try:
            await flow.fresh()
            if flow.token is None:
                await self._learn(flow)
                raise NeedsAuthorization("not authorized")
        except NeedsAuthorization:
            if flow.client_expired():
                with contextlib.suppress(oauth.TokenFailed):
                    await self._learn(flow)  # the backend registers anew
            raise CredentialsUnavailable(
                f"backend {self.backend} needs this caller's own authorization at "
                f"{flow.issuer or self._shared.issuer}: open the URL, sign in, then call again",
                retryable=False, url=self._start_url(principal)) from None
        except oauth.TokenFailed as exc:
            raise CredentialsUnavailable(f"backend {self.backend}: {exc.detail}",
                                         retryable=True) from None
        return [("authorization", f"Bearer {flow.token}")]

    def forget(self, principal_key: str) -> None:
        """Drop the tokens held in memory (the refresh token stays in the state file)."""
        self._flows.pop(principal_key, None)

    def step_up(self, principal: Principal, challenge: str | None) -> None:
        """A 403 ``insufficient_scope`` for a scope the principal's grant lacks: it authorizes
        again, asking for it (at most ``MAX_STEP_UPS`` times; then the 403 goes to the caller).

        Raises:
            CredentialsUnavailable: the URL of the principal's authorize page.
        """
        flow = self._flow(principal)
        try:
            flow.step_up(challenge)
        except NeedsAuthorization:
            raise CredentialsUnavailable(
                f"backend {self.backend} needs this caller to authorize scope "
                f"{flow.challenged!r:.200} at {flow.issuer or self._shared.issuer}: open the URL, "
                "sign in, then call again", retryable=False,
                url=self._start_url(principal)) from None

    def refresh(self) -> None:
        """A reload: each flow reads its ``ca_file`` again and may step up again."""
        self._shared.refresh()
        for flow in self._flows.values():
            flow.refresh()

    def drop_unless(self, keep: Callable[[Principal], bool]) -> int:
        """A reload: the principals seen since start that ``keep`` refuses are dropped (their
        state files deleted); how many."""
        gone = [key for key, principal in self._seen.items() if not keep(principal)]
        for key in gone:
            self.drop(key)
        return len(gone)

    def drop(self, principal_key: str) -> None:
        """The principal is gone (a reload removed it): its state file deleted too."""
        self.forget(principal_key)
        self._seen.pop(principal_key, None)
        path = self._files.pop(principal_key, None)
        if path is not None:
            try:
                os.unlink(path)
                LOGGER.info("backend %s: %s deleted (its principal was removed)", self.backend,
                            path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                LOGGER.error("backend %s: cannot delete %s: %s", self.backend, path,
                             exc.strerror or exc)
        for state in [s for s, b in self._bound.items() if b.principal_key == principal_key]:
            del self._bound[state]
        for start in [s for s, v in self._starts.items() if v.principal_key == principal_key]:
            del self._starts[start]

    def status(self) -> dict[str, Any]:
        """For ``/status``: counts, never a token nor a principal."""
        return {"grant": "authorization_code", "issuer": self._shared.issuer,
                "principals": len(self._flows), "pending": len(self._starts) + len(self._bound),
                "authorizations": self.authorizations, "refused": self.refused,
                "last_error": self._shared.last_error}

    # ---- flows ------------------------------------------------------------------------------

    def _flow(self, principal: Principal) -> AuthorizationCode:
        self._seen.pop(principal.key, None)
        self._seen[principal.key] = principal  # the latest last
        while len(self._seen) > MAX_PRINCIPALS:
            self._files.pop(next(iter(self._seen)), None)
            del self._seen[next(iter(self._seen))]
        return self._flow_of(principal.key, identity_of(principal.key, principal.via,
                                                        principal.name))

    def _flow_of(self, key: str, identity: str) -> AuthorizationCode:
        flow = self._flows.pop(key, None)
        if flow is None:
            flow = AuthorizationCode(self.backend, self.url, self.cfg, self._opener)
            flow.registers = False  # the backend's registration is the shared flow's
            if self.state_dir is not None:
                flow.place(self.redirect_uri, self.state_dir, identity)
                if flow.path is not None:
                    self._files[key] = flow.path
            while len(self._flows) >= MAX_PRINCIPALS:
                del self._flows[next(iter(self._flows))]
        self._flows[key] = flow  # the most recently used last
        return flow

    async def _learn(self, flow: AuthorizationCode) -> None:
        """Where to authorize, learned once for the backend (the remote's metadata, the
        registration) and given to ``flow``."""
        shared = self._shared
        async with self._lock:
            if shared.meta is None or shared.client_id is None or shared.client_expired():
                try:
                    await shared.renew(None, None)
                except NeedsAuthorization:
                    pass
        self._copy(flow)

    def _copy(self, flow: AuthorizationCode) -> None:
        shared = self._shared
        if shared.meta is not None and (flow.issuer != shared.issuer
                                        or flow.client_id != shared.client_id):
            if flow.client_id is not None:  # registered anew: grants of the old client are lost
                flow.refresh_token = None
            flow.issuer, flow.meta = shared.issuer, shared.meta
            flow.token_endpoint = shared.token_endpoint
            flow.client_id, flow.client_secret = shared.client_id, shared.client_secret
            flow.client_secret_expires_at = shared.client_secret_expires_at
            flow.client_method = shared.client_method
            flow.resource, flow.resource_scopes = shared.resource, shared.resource_scopes
            flow.challenged = shared.challenged

    def _start_url(self, principal: Principal) -> str:
        """The gateway's authorize page for ``principal`` (one open link per principal)."""
        now = trio.current_time()
        for start in [s for s, v in self._starts.items() if v.expires <= now]:
            del self._starts[start]
        for start, held in self._starts.items():
            if held.principal_key == principal.key:
                return self._page_url(start)
        while len(self._starts) >= MAX_STARTS:
            del self._starts[next(iter(self._starts))]
        start = secrets.token_urlsafe(24)
        self._starts[start] = _Start(principal.key, identity_of(principal.key, principal.via,
                                                                principal.name),
                                     principal.label, now + START_TTL)
        return self._page_url(start)

    def _page_url(self, start: str) -> str:
        return f"{self.redirect_uri}?{urlencode({'start': start})}"

    # ---- the redirect endpoint --------------------------------------------------------------

    def owns_start(self, start: str) -> bool:
        return start in self._starts

    def owns_state(self, state: str) -> bool:
        return state in self._bound

    def start_page(self, start: str, consent: str | None, cookie_header: str | None) -> Page:
        """``?start=ID``: the consent page (a token in its link and in a ``SameSite=Strict``
        cookie); ``?start=ID&consent=TOKEN`` with that cookie: the flow's cookie set and the
        browser sent to the authorization server (the link used up).  A consent without the
        page's cookie (a cross-site link, another browser) is refused and uses nothing up."""
        held = self._starts.get(start)
        if held is None or held.expires <= trio.current_time():
            self._starts.pop(start, None)
            return Page(400, "refused: unknown, used or expired authorization link")
        frame = (("x-frame-options", "DENY"),
                 ("content-security-policy", "default-src 'none'; frame-ancestors 'none'"))
        name = _consent_cookie(start)
        if consent is None:
            token = secrets.token_urlsafe(24)
            held.consents = [*held.consents[-(MAX_PAGES - 1):], _hash(token)]
            who, what = html.escape(held.label), html.escape(self.backend)
            issuer = html.escape(str(self._shared.issuer))
            go = html.escape(f"{self._page_url(start)}&{urlencode({'consent': token})}")
            cookie = (f"{name}={token}; Path=/; Secure; HttpOnly; SameSite=Strict; "
                      f"Max-Age={int(START_TTL)}")
            return Page(200, f"<!doctype html><title>Authorize {what}</title>"
                             f"<p>The MCP gateway asks to act on backend <b>{what}</b> with your "
                             f"account at <b>{issuer}</b>, for the gateway caller <b>{who}</b>."
                             f"<p>Continue only if you are {who} and asked for this."
                             f'<p><a href="{go}">Continue to {issuer}</a>',
                        "text/html; charset=utf-8", (("set-cookie", cookie), *frame))
        shown = _cookie(cookie_header, name)
        if shown is None or shown != consent or \
                not any(hmac.compare_digest(_hash(consent), h) for h in held.consents):
            self._refusal("a consent without the cookie of the page that asked for it: refused")
            return Page(403, "refused: consent is given on the authorization page itself "
                             "(open the link the gateway gave the caller and continue there)",
                        headers=frame)
        clear = (("set-cookie", f"{name}=; Path=/; Secure; HttpOnly; SameSite=Strict; "
                                "Max-Age=0"),)
        del self._starts[start]
        flow = self._flow_of(held.principal_key, held.identity)
        self._copy(flow)
        try:
            url = flow.begin()
        except oauth.TokenFailed as exc:
            return Page(409, f"refused: {exc.detail}")
        state = parse_qs(urlsplit(url).query)["state"][0]
        secret = secrets.token_urlsafe(32)
        for old in [s for s, b in self._bound.items() if b.principal_key == held.principal_key]:
            del self._bound[old]
        while len(self._bound) >= MAX_STARTS:
            del self._bound[next(iter(self._bound))]
        self._bound[state] = _Bound(held.principal_key, _hash(secret), flow,
                                    self._page_url(start))
        cookie = (f"{_flow_cookie(state)}={secret}; Path=/; Secure; HttpOnly; SameSite=Lax; "
                  f"Max-Age={int(START_TTL)}")
        return Page(303, f"continue at {url}\n", headers=(("location", url),
                                                          ("set-cookie", cookie), *clear,
                                                          *frame))

    async def complete(self, params: dict[str, str], cookie_header: str | None) -> Page:
        """The authorization server's redirect back: completed only in the browser that
        consented (its cookie), for the principal the state was begun for."""
        state = params.get("state", "")
        bound = self._bound.pop(state, None)
        clear = (("set-cookie", f"{_flow_cookie(state)}=; Path=/; Secure; HttpOnly; SameSite=Lax; "
                                "Max-Age=0"),)
        if bound is None:
            self.refused += 1
            return Page(400, "refused: unknown or already used state")
        secret = _cookie(cookie_header, _flow_cookie(state))
        if secret is None or not hmac.compare_digest(_hash(secret), bound.secret_hash):
            self._refusal("an authorization redirect without the cookie of the browser that "
                          "consented: refused")
            return Page(400, "refused: this authorization was begun in another browser "
                             "(open the link the gateway gave the caller in this one)",
                        headers=clear)
        try:
            await bound.flow.complete(params)
        except oauth.TokenFailed as exc:
            self._refusal(f"authorization refused: {exc.detail}")
            return Page(400, f"refused: {exc.detail}", headers=clear)
        self.authorizations += 1
        if self._flows.get(bound.principal_key) is not bound.flow:
            self._flows[bound.principal_key] = bound.flow
        LOGGER.info("backend %s: a principal authorized", self.backend)
        return Page(200, f"backend {self.backend} is authorized for you; this page may be "
                         "closed and the call made again", headers=clear, authorized=bound.link)


def _flow_cookie(state: str) -> str:
    return f"{COOKIE}-{hashlib.sha256(state.encode()).hexdigest()[:16]}"


def _consent_cookie(start: str) -> str:
    """The consent page's cookie, one per link (pages of two links open in one browser)."""
    return "__Host-mcp-gateway-consent-" + hashlib.sha256(start.encode()).hexdigest()[:16]


def _cookie(header: str | None, name: str) -> str | None:
    """The value of the cookie ``name`` in a Cookie header, whatever else the browser holds for
    this host (a value with spaces or quotes, a cookie without ``=``: skipped, not fatal)."""
    for part in (header or "").split(";"):
        key, eq, value = part.strip().partition("=")
        if eq and key == name:
            return value.strip()
    return None
