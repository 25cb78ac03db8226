"""A remote backend's token by the OAuth 2.1 authorization code flow (one shared identity).

:class:`AuthorizationCode` learns where to authorize from the remote's 401 (protected-resource
metadata, then the authorization server's; the 2025-03-26 fallbacks), registers (the configured
``client_id``, a Client ID Metadata Document URL, or RFC 7591), and then waits for an operator:
:meth:`begin` gives the URL (PKCE S256, a single-use ``state``), :meth:`complete` takes the
redirect (``state``, RFC 9207 ``iss`` checked) and exchanges the code.  The refresh token,
the registration and the server's metadata are kept in ``STATE_DIR/oauth/BACKEND.json``
(mode 0600) and read at start.  A refused refresh token, a 401 that no refresh mends, a moved
authorization server (registered anew) or a 403 ``insufficient_scope`` asking for more (at most
:data:`MAX_STEP_UPS` times) raise :class:`NeedsAuthorization`: the instance waits in
AUTHORIZING.  An authorization server that cannot be reached raises a plain ``TokenFailed``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from gateway.backend import httpclient, oauth
from gateway.backend.credentials import owner_only
from gateway.config import RemoteOAuth, endpoint_url_ok, read_regular
from gateway.protocol import oauthflow

LOGGER = logging.getLogger(__name__)

#: Seconds an authorization URL stays good, and the most of them open at once per backend.
PENDING_TTL = 600.0
MAX_PENDING = 16
#: 403 ``insufficient_scope`` answers that may each start a new authorization (since start or
#: the last reload); past them the call fails with the 403.
MAX_STEP_UPS = 2
MAX_STATE_FILE = 65536
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class NeedsAuthorization(oauth.TokenFailed):
    """No token without an operator completing the flow (``mcp-gateway authorize``)."""


@dataclass(frozen=True, slots=True)
class Pending:
    verifier: str
    issuer: str
    scope: str | None
    client_id: str
    expires: float  # trio time


class AuthorizationCode(oauth.TokenSource):
    """The access token of one remote obtained by the authorization code flow."""

    kind = "authorization_code"

    def __init__(self, backend: str, url: str, cfg: RemoteOAuth,
                 opener: httpclient.Opener | None = None,
                 environ: dict[str, str] | None = None) -> None:
        super().__init__(backend, url, cfg, opener, environ)
        self.token_endpoint = None
        self.redirect_uri = ""
        self.path: str | None = None
        self.meta: dict[str, Any] | None = None
        self.resource_scopes: list[str] | None = None
        self.client_id: str | None = None
        self.client_secret: str | None = None
        self.client_secret_expires_at = 0.0  # a registered client's (epoch seconds; 0: never)
        self.client_method = "none"
        self.registers = True  # False: one of several identities, given the backend's client
        self.refresh_token: str | None = None
        self.asked: str | None = None  # the scope the held grant was asked with
        self.challenged: str | None = None  # the scope the remote's last challenge named
        self.stepping_up = False
        self.step_ups = 0
        self.authorizations = 0
        self._pending: dict[str, Pending] = {}
        self._authorized = trio.Event()

    # ---- placing and the state file ---------------------------------------------------------

    def place(self, redirect_uri: str, state_dir: str, identity: str | None = None) -> None:
        """Where the redirect comes back and the state file lives (``oauth/BACKEND.json``, or
        ``oauth/BACKEND/IDENTITY.json`` for one of several identities of a backend, such as a
        principal's); the file is read now."""
        self.redirect_uri = redirect_uri
        name = _SAFE.sub("_", self.backend)
        self.path = (os.path.join(state_dir, "oauth", name + ".json") if identity is None
                     else os.path.join(state_dir, "oauth", name, _SAFE.sub("_", identity)
                                       + ".json"))
        try:
            data = read_regular(self.path, MAX_STATE_FILE, flags=os.O_NOFOLLOW,
                                problem=owner_only)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            LOGGER.warning("backend %s: %s: ignored (%s)", self.backend, self.path,
                           exc.strerror if isinstance(exc, OSError) else exc)
            return
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            LOGGER.warning("backend %s: %s is not JSON: ignored", self.backend, self.path)
            return
        if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict):
            return
        self.meta, self.issuer = doc["meta"], doc.get("issuer")
        self.token_endpoint = self.meta.get("token_endpoint")
        self.client_id, self.client_secret = doc.get("client_id"), doc.get("client_secret")
        self.client_secret_expires_at = oauthflow.secret_expires_at(
            doc.get("client_secret_expires_at"))
        self.client_method = doc.get("client_method") or "none"
        self.refresh_token, self.asked = doc.get("refresh_token"), doc.get("scope")
        self.resource = doc.get("resource") or self.resource
        LOGGER.info("backend %s: authorization state read from %s", self.backend, self.path)

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {"issuer": self.issuer, "meta": self.meta, "client_id": self.client_id,
               "client_secret": self.client_secret,
               "client_secret_expires_at": self.client_secret_expires_at,
               "client_method": self.client_method,
               "refresh_token": self.refresh_token, "scope": self.asked,
               "resource": self.resource}
        folder = os.path.dirname(self.path)
        tmp = f"{self.path}.tmp"
        try:
            os.makedirs(folder, 0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, json.dumps(doc).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            LOGGER.error("backend %s: cannot keep the authorization state in %s: %s",
                         self.backend, self.path, exc.strerror or exc)

    # ---- what the link and the instance read ------------------------------------------------

    def status(self) -> dict[str, Any]:
        doc = super().status()
        doc.update(grant="authorization_code", issuer=self.issuer,
                   has_refresh_token=self.refresh_token is not None,
                   authorizing=self.token is None and self.meta is not None,
                   authorizations=self.authorizations, step_ups=self.step_ups)
        return doc

    def refresh(self) -> None:
        super().refresh()
        self.step_ups = 0

    def waiter(self) -> Callable[[], Awaitable[None]]:
        """What the instance awaits in AUTHORIZING: the next completed authorization."""
        event = self._authorized

        async def wait() -> None:
            await event.wait()
        return wait

    def _need(self, detail: str) -> NeedsAuthorization:
        self.token = None
        self._expires = self._refresh = -math.inf
        self.last_error = detail
        return NeedsAuthorization(detail)

    async def fresh(self) -> None:
        """Before a request: the held token, refreshed when due.

        Raises:
            NeedsAuthorization: none held and none to be had without an operator.
            TokenFailed: the authorization server cannot be reached and no valid token is held.
        """
        now = trio.current_time()
        if self.token is not None and now < self._refresh:
            return
        async with self._lock:
            now = trio.current_time()
            if self.token is not None and now < self._refresh:
                return
            if self.stepping_up:  # a refresh would bring the scope the remote refused back
                raise self._need(f"backend {self.backend} waits for an authorization with scope "
                                 f"{self.challenged!r:.200}")
            if self.refresh_token is None or self.token_endpoint is None:
                if self.token is not None and now < self._expires:
                    return
                if self.meta is None:
                    return  # nothing known yet: the remote's 401 starts the discovery
                if self.client_id is None or self.client_expired():  # a registration cut
                    await self._register()  # short (a start timed out), or its secret expired
                raise self._need(f"backend {self.backend} is not authorized: run "
                                 f"`mcp-gateway authorize {self.backend}`")
            try:
                await self._refresh_grant()
            except NeedsAuthorization:
                raise
            except oauth.TokenFailed:
                if self.token is not None and now < self._expires:
                    self._refresh = min(now + oauth.RENEW_MIN_INTERVAL, self._expires)
                    return
                raise

    async def renew(self, refused: str | None, challenge: str | None) -> None:
        """The remote answered 401: a refresh when one can be had, else the metadata read
        again (a moved authorization server means a new registration) and an operator needed.

        Raises:
            NeedsAuthorization, TokenFailed.
        """
        async with self._lock:
            if self.token is not None and self.token != refused:
                return
            params = oauthflow.challenge(challenge)
            if refused is not None and self.refresh_token is not None \
                    and self.token_endpoint is not None \
                    and trio.current_time() - self._fetched >= oauth.RENEW_MIN_INTERVAL:
                try:
                    await self._refresh_grant()
                    return
                except NeedsAuthorization:
                    pass
            await self._discover_flow(params)
            self.challenged = params.get("scope")
            self.stepping_up = False
            await self._register()
            raise self._need(f"{self._origin()} wants authorization: run "
                             f"`mcp-gateway authorize {self.backend}`")

    def step_up(self, challenge: str | None) -> None:
        """The remote answered 403: when it is ``insufficient_scope`` for a scope not asked
        for yet (and :data:`MAX_STEP_UPS` allows), a new authorization is needed.

        Raises:
            NeedsAuthorization: the instance waits for it; else the call fails with the 403.
        """
        params = oauthflow.challenge(challenge)
        if params.get("error") != "insufficient_scope" or self.meta is None:
            return
        wanted = params.get("scope")
        if oauthflow.covers(self.asked, wanted) or self.step_ups >= MAX_STEP_UPS:
            LOGGER.warning("backend %s: the remote wants scope %r, not granted (no further "
                           "authorization asked)", self.backend, wanted)
            return
        self.step_ups += 1
        self.challenged, self.stepping_up = wanted, True
        raise self._need(f"{self._origin()} wants scope {wanted!r:.200}: run "
                         f"`mcp-gateway authorize {self.backend}`")

    # ---- discovery and registration ---------------------------------------------------------

    async def _discover_flow(self, params: dict[str, str]) -> None:
        prm = await self._first_json(
            oauthflow.resource_metadata_urls(self.url, params.get("resource_metadata")))
        if prm is not None:
            try:
                resource, issuer = oauthflow.authorization_server(prm, self.url)
            except oauthflow.FlowError as exc:
                raise self._fail(exc.detail) from None
            scopes = prm.get("scopes_supported")
            self.resource_scopes = scopes if isinstance(scopes, list) else None
            meta = await self._first_json(oauthflow.metadata_urls(issuer))
            if meta is None:
                raise self._fail(f"no metadata for authorization server {issuer:.200}")
        else:  # 2025-03-26: the server's origin is its authorization server
            resource = self.cfg.resource or self.url
            issuer = oauthflow.legacy_issuer(self.url)
            self.resource_scopes = None
            meta = await self._first_json(oauthflow.metadata_urls(issuer))
            meta = meta or oauthflow.legacy_metadata(issuer)
        try:
            oauthflow.check_metadata(meta, issuer)
        except oauthflow.FlowError as exc:
            raise self._fail(exc.detail) from None
        for key in ("token_endpoint", "registration_endpoint"):
            if key in meta and not (isinstance(meta[key], str) and endpoint_url_ok(meta[key])):
                raise self._fail(f"the {key} of {issuer:.200} is not an https URL (or http "
                                 "to this machine)")
        if self.issuer is not None and self.issuer != issuer:
            LOGGER.warning("backend %s: its authorization server moved from %s to %s: "
                           "registering anew", self.backend, self.issuer, issuer)
            self.client_id = self.client_secret = self.refresh_token = None
        self.issuer, self.meta, self.token_endpoint = issuer, meta, meta["token_endpoint"]
        if not self.cfg.resource:
            self.resource = resource

    def _fail(self, detail: str) -> oauth.TokenFailed:
        self.last_error = detail
        LOGGER.warning("backend %s: %s", self.backend, detail)
        return oauth.TokenFailed(detail)

    async def _register(self) -> None:
        """A client id at the authorization server: configured, a metadata document URL, or
        registered now (RFC 7591)."""
        assert self.meta is not None
        if not self.registers or (self.client_id is not None and not self.client_expired()):
            return
        if self.client_id is not None:
            LOGGER.warning("backend %s: the client secret registered at %s expired; registering "
                           "anew (its grants are lost: authorize again)", self.backend, self.issuer)
            self.refresh_token = None
        self.client_id = self.client_secret = None
        self.client_secret_expires_at = 0.0
        meta, cfg = self.meta, self.cfg
        supported = meta.get("token_endpoint_auth_methods_supported")
        if cfg.client_id:
            self.client_id = cfg.client_id
            self.client_method = cfg.auth_method if cfg.client_secret is not None else "none"
            return
        if cfg.client_metadata_url and meta.get("client_id_metadata_document_supported") is True:
            self.client_id, self.client_method = cfg.client_metadata_url, "none"
            return
        endpoint = meta.get("registration_endpoint")
        if not isinstance(endpoint, str):
            raise self._fail(f"{self.issuer} offers no registration: configure "
                             "oauth.client_id (or oauth.client_metadata_url)")
        body = oauthflow.registration_body(
            self.redirect_uri, f"mcp-gateway ({self.backend})",
            oauthflow.scope_to_ask(self.challenged, self.resource_scopes,
                                   meta.get("scopes_supported"), offline=cfg.offline_access))
        response, data = await self._http.exchange(
            "POST", endpoint, [("content-type", "application/json"),
                               ("accept", "application/json")], json.dumps(body).encode())
        doc = oauth.json_body(data)
        if response.status not in (200, 201) or not isinstance(doc, dict) \
                or not isinstance(doc.get("client_id"), str) or not doc["client_id"]:
            raise self._fail(f"registration at {httpclient.parse_url(endpoint).text} failed "
                             f"(HTTP {response.status})")
        secret = doc.get("client_secret")
        self.client_id = doc["client_id"]
        self.client_secret = secret if isinstance(secret, str) and secret else None
        self.client_secret_expires_at = oauthflow.secret_expires_at(
            doc.get("client_secret_expires_at")) if self.client_secret is not None else 0.0
        self.client_method = oauthflow.client_auth_method(
            doc.get("token_endpoint_auth_method"), self.client_secret is not None,
            supported if isinstance(supported, list) else None)
        LOGGER.info("backend %s: registered at %s", self.backend, self.issuer)
        self._save()

    # ---- the operator's part ----------------------------------------------------------------

    def begin(self) -> str:
        """The URL an operator opens to authorize this backend (a new single-use ``state``).

        Raises:
            TokenFailed: the remote has not said yet where to authorize.
        """
        if self.meta is None or self.client_id is None or self.issuer is None:
            raise oauth.TokenFailed(f"backend {self.backend} has not asked for authorization "
                                    f"(no 401 from {self._origin()} yet)")
        now = trio.current_time()
        for state in [s for s, p in self._pending.items() if p.expires <= now]:
            del self._pending[state]
        while len(self._pending) >= MAX_PENDING:
            del self._pending[next(iter(self._pending))]
        verifier, s256 = oauthflow.pkce()
        state = oauthflow.new_state()
        scope = oauthflow.scope_to_ask(self.challenged, self.resource_scopes,
                                       self.meta.get("scopes_supported"),
                                       self.asked if self.stepping_up else None,
                                       offline=self.cfg.offline_access)
        self._pending[state] = Pending(verifier, self.issuer, scope, self.client_id,
                                       now + PENDING_TTL)
        return oauthflow.authorization_url(self.meta["authorization_endpoint"], self.client_id,
                                           self.redirect_uri, s256, state, self.resource, scope)

    def owns(self, state: str) -> bool:
        return state in self._pending

    async def complete(self, query: dict[str, str]) -> None:
        """The redirect with ``query`` came back (its ``state`` is one of :meth:`begin`'s): the
        code exchanged, the tokens kept.  Single use: the state is gone whatever happens.

        Raises:
            TokenFailed: refused (an error answer, a wrong ``iss``, an expired state, the
                token endpoint's refusal): nothing is stored.
        """
        pending = self._pending.pop(query.get("state", ""), None)
        if pending is None or pending.expires <= trio.current_time():
            raise oauth.TokenFailed("unknown or expired state")
        if "error" in query:
            raise oauth.TokenFailed(f"the authorization server answered "
                                    f"{query['error'][:64]!r}")
        assert self.meta is not None
        try:
            oauthflow.check_iss(query.get("iss"), pending.issuer,
                                self.meta.get("authorization_response_iss_parameter_supported")
                                is True)
        except oauthflow.FlowError as exc:
            raise self._fail(exc.detail) from None
        if pending.issuer != self.issuer or pending.client_id != self.client_id:
            raise oauth.TokenFailed("the authorization server changed since this URL was made")
        code = query.get("code")
        if not code:
            raise oauth.TokenFailed("the redirect has no code")
        async with self._lock:
            await self._grant({"grant_type": "authorization_code", "code": code,
                               "redirect_uri": self.redirect_uri,
                               "code_verifier": pending.verifier}, pending.scope)
        self.stepping_up = False
        self.authorizations += 1
        self._authorized.set()
        self._authorized = trio.Event()

    # ---- the token endpoint -----------------------------------------------------------------

    def _client_auth(self, form: dict[str, str], head: list[tuple[str, str]]) -> None:
        method = self.client_method
        secret = self.client_secret
        if secret is None and self.cfg.client_secret is not None \
                and self.client_id == self.cfg.client_id:
            secret = oauth.client_secret(self.cfg, self._environ)
        assert self.client_id is not None
        if method == "none" or secret is None:
            form["client_id"] = self.client_id
        elif method == "client_secret_post":
            form["client_id"], form["client_secret"] = self.client_id, secret
        else:
            oauth.basic_auth(head, self.client_id, secret)

    def client_expired(self) -> bool:
        """Whether the client registered here has a secret past its
        ``client_secret_expires_at`` (RFC 7591 §3.2.1): it must register again, and the grants
        it held are lost with it."""
        return oauthflow.secret_expired(self.client_secret_expires_at, time.time())

    async def _refresh_grant(self) -> None:
        assert self.refresh_token is not None
        if self.client_expired():
            self.refresh_token = None
            await self._register()
            self._save()
            raise self._need(f"the client secret registered at {self.issuer} expired: run "
                             f"`mcp-gateway authorize {self.backend}`")
        await self._grant({"grant_type": "refresh_token", "refresh_token": self.refresh_token},
                          self.asked)

    async def _grant(self, form: dict[str, str], scope: str | None) -> None:
        """A token request (the lock held).

        Raises:
            NeedsAuthorization: the grant is no longer good (``invalid_grant``).
            TokenFailed: unreachable or another refusal.
        """
        assert self.token_endpoint is not None
        self.fetches += 1
        where = httpclient.parse_url(self.token_endpoint).text
        form = {**form, "resource": self.resource}
        head: list[tuple[str, str]] = []
        try:
            self._client_auth(form, head)
            response, body = await self._http.post_form(self.token_endpoint, form, head)
            answer = oauthflow.token_answer(response.status, oauth.json_body(body), where,
                                            oauth.MAX_TOKEN, oauth.MAX_LIFETIME)
        except oauthflow.FlowError as exc:
            self.failures += 1
            if form["grant_type"] == "refresh_token" and "invalid_grant" in exc.detail:
                self.refresh_token = None
                self._save()
                raise self._need(f"{exc.detail}: run `mcp-gateway authorize "
                                 f"{self.backend}`") from None
            raise self._fail(exc.detail) from None
        except oauth.TokenFailed as exc:
            self._failed(exc)
            raise
        self._hold(answer.access_token, answer.lifetime)
        if answer.refresh_token is not None:
            self.refresh_token = answer.refresh_token
        self.asked = scope
        self._save()
        LOGGER.info("backend %s: access token from %s (%s)", self.backend, where,
                    form["grant_type"])
