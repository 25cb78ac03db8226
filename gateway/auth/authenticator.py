"""Who the caller is, from the ``Authorization`` header of an HTTP request or a WebSocket
upgrade: the daemon's one :class:`Authenticator`, built from ``[auth]`` and rebuilt by a reload.

When ``[auth]`` holds an authenticator, every ``/mcp`` request and WebSocket upgrade must carry
``Authorization: Bearer <token>`` (the unix socket is authenticated by its peer's uid instead).
A token is looked up among the static tokens (:mod:`gateway.auth.tokens`, constant time), then,
with OAuth configured, verified as a JWT against the issuer's keys (:mod:`gateway.auth.jwt`).
Anything else is :class:`Unauthorized` (401 with a ``WWW-Authenticate`` challenge).  The token
is never logged, stored or passed on, only the principal it names.  A reload swaps the tables
(:meth:`Authenticator.reconfigure`) and :meth:`still_valid` names the principals that lost
their credential; refusals are logged at most :data:`gateway.limits.LOG_BURST` per minute.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import trio

from gateway.auth import challenge
from gateway.auth.principal import Principal
from gateway.auth.tokens import BearerEntry, BearerTable, file_problem, parse_tokens_file
from gateway.config import AuthSection, GatewayConfig, read_regular
from gateway.errors import ConfigError
from gateway.events import ConnectionRefused, EventBus
from gateway.limits import LogBudget

if TYPE_CHECKING:
    from gateway.auth.jwks import JwksCache

LOGGER = logging.getLogger(__name__)

#: The largest tokens file read.
MAX_TOKENS_FILE = 1024 * 1024
_GLOB = set("*?[")


class Unauthorized(Exception):
    """No usable credential: 401.  ``error`` is ``"invalid_token"`` when a token was presented
    (None when there was none), ``kind`` a short word for logs."""

    def __init__(self, description: str, *, error: str | None = "invalid_token",
                 kind: str = "invalid") -> None:
        super().__init__(description)
        self.error = error
        self.kind = kind


def load_tokens_file(path: str, gateway_uid: int | None = None) -> list[BearerEntry]:
    """Read ``auth.tokens_file``, refusing it when others may read or change it.

    Raises:
        ConfigError: ``auth.tokens_file: …`` (unreadable, bad mode or owner, bad lines).
    """
    uid = os.geteuid() if gateway_uid is None else gateway_uid
    # read on the event loop (start, SIGHUP): read_regular neither waits on a FIFO nor reads a
    # device without end
    try:
        data = read_regular(path, MAX_TOKENS_FILE, flags=os.O_NOFOLLOW,
                            problem=lambda st: file_problem(st.st_mode, st.st_uid, uid))
    except OSError as exc:
        raise ConfigError([f"auth.tokens_file: {path}: {exc.strerror or exc}"]) from None
    except ValueError as exc:
        raise ConfigError([f"auth.tokens_file: {path}: {exc}"]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:  # named by line, as parse_tokens_file names bad lines
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError([f"auth.tokens_file: {path}:{line}: not UTF-8 text"]) from None
    try:
        return parse_tokens_file(text, path)
    except ValueError as exc:
        raise ConfigError([f"auth.tokens_file: {exc}"]) from None


def configured_names(cfg: GatewayConfig, entries: list[BearerEntry]) -> frozenset[str]:
    """Principal names an operator wrote down (bearer entries; rules and limits naming one
    principal, not a glob): the only names metrics and logs may carry."""
    names = {e.principal for e in entries}
    for pattern in [r.principal for r in cfg.policy.rules] + [lim.principal
                                                              for lim in cfg.auth.limits]:
        if pattern and not _GLOB & set(pattern):
            names.add(pattern)
    return frozenset(names)


def tokens_path(cfg: GatewayConfig) -> str | None:
    """``auth.tokens_file`` relative to the config's directory; None when not set."""
    path = cfg.auth.tokens_file
    return None if not path else os.path.join(cfg.base_dir, path)


def _with_port(host: str, port: int) -> str:
    """``host`` (a Host header: name, IPv4 or [IPv6], maybe a port) with ``port``."""
    name, _, old = host.rpartition(":")
    if not (old.isdigit() and name and not host.endswith("]")):
        name = host
    return f"{name}:{port}"


class Authenticator:
    """The configured authenticators (see the module docstring)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.auth = AuthSection()
        self.name = "mcp-gateway"  # gateway.name: the challenge's realm, the resource_name
        self.http_port: int | None = None  # the HTTP listener's (set by the service once bound)
        self.public_url: str | None = None
        self.tls = False
        self.bearer = BearerTable([])
        self.labels: frozenset[str] = frozenset()
        self.jwks: JwksCache | None = None
        self.refusals = 0  # all refusals since start
        self.bus: EventBus | None = None  # the hub's, once the service sets it
        self._log = LogBudget()  # refusal lines
        self.reconfigure(cfg)

    # ---- configuration ----------------------------------------------------------------------

    def reconfigure(self, cfg: GatewayConfig) -> None:
        """Adopt ``cfg``'s ``[auth]`` (reads the tokens file; the JWKS cache is kept when the
        OAuth keys' URI did not change).

        Raises:
            ConfigError: the tokens file cannot be used (nothing changes then).
        """
        entries = [BearerEntry(b.principal, b.token_sha256.lower(), frozenset(b.groups))
                   for b in cfg.auth.bearer]
        path = tokens_path(cfg)
        if path is not None:
            entries += load_tokens_file(path)
        oauth = cfg.auth.oauth
        jwks = None
        if oauth is not None:
            old = self.jwks
            if old is not None and old.uri == oauth.jwks_uri:
                old.min_interval = oauth.jwks_refresh_min_interval
                jwks = old
            else:  # PyJWT and cryptography are imported only when OAuth is configured
                from gateway.auth.jwks import JwksCache

                jwks = JwksCache(oauth.jwks_uri, oauth.jwks_refresh_min_interval)
        self.auth = cfg.auth
        self.name = cfg.gateway.name
        self.public_url = cfg.listen.public_url
        self.tls = bool(cfg.listen.tls_cert)
        self.bearer = BearerTable(entries)
        self.labels = configured_names(cfg, entries)
        self.jwks = jwks

    @property
    def configured(self) -> bool:
        return self.auth.configured

    def _oauth_credential(self) -> str:
        oauth = self.auth.oauth
        assert oauth is not None
        return "|".join((oauth.issuer, oauth.audience, oauth.jwks_uri, oauth.principal_claim,
                         oauth.groups_claim or ""))

    async def start(self) -> None:
        """Fetch the OAuth keys once (at start; failures are logged, tokens then refetch)."""
        if self.jwks is not None:
            await self.jwks.prime()

    # ---- authentication ---------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal an ``Authorization`` header value names; None when authentication is
        not configured.

        Raises:
            Unauthorized: no header, not a Bearer token, or a token that does not verify.
        """
        if not self.configured:
            return None
        if authorization is None or not authorization.strip():
            raise Unauthorized("authentication required: send Authorization: Bearer <token>",
                               error=None, kind="missing")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or "," in token:
            raise Unauthorized("the Authorization header must be: Bearer <token>", kind="scheme")
        entry = self.bearer.match(token)
        if entry is not None:
            name = entry.principal
            return Principal(name, entry.groups, frozenset(), "bearer", name,
                             credential=entry.token_sha256)
        oauth = self.auth.oauth
        if oauth is None or self.jwks is None:
            raise Unauthorized("the token is not valid here", kind="unknown_token")
        from gateway.auth import jwt as jwts  # loaded with the JWKS cache: no import cost here

        if not jwts.looks_like_jwt(token):
            raise Unauthorized("the token is not valid here", kind="unknown_token")
        try:
            kid, alg = jwts.header(token)
            key = await self.jwks.key_for(kid)
            if key is None:
                raise jwts.TokenRefused("unknown_kid",
                                        "the token's key (kid) is not one of the issuer's")
            claims = jwts.verify(token, key, alg, oauth)
            return jwts.principal_of(claims, oauth, self.labels, self._oauth_credential(),
                                     token=token)
        except jwts.TokenRefused as exc:
            raise Unauthorized(str(exc), kind=exc.kind) from None

    def still_valid(self, principal: Principal | None, transport: str) -> bool:
        """Whether a connection or session opened as ``principal`` may go on under the current
        configuration (after a reload)."""
        if transport == "unix" or (principal is not None and principal.via == "peer"):
            return True  # authenticated by its peer credentials, not by [auth]
        if principal is None:
            return not self.configured
        if principal.via == "bearer":
            return any(e.principal == principal.name and e.token_sha256 == principal.credential
                       and e.groups == principal.groups for e in self.bearer.entries)
        if principal.via == "oauth":
            return self.auth.oauth is not None and principal.credential == self._oauth_credential()
        return False

    def still_named(self, principal: Principal) -> bool:
        """Whether ``principal`` is still one this configuration vouches for, whatever its
        credential (a bearer principal whose token a reload rotated still is): what the gateway
        holds upstream for it (refresh tokens) is kept."""
        if principal.via == "peer":
            return True
        if principal.via == "bearer":
            return any(e.principal == principal.name for e in self.bearer.entries)
        return principal.via == "oauth" and self.auth.oauth is not None

    # ---- what clients are told -------------------------------------------------------------

    def challenge(self, host: str | None, exc: Unauthorized | None = None,
                  scope: list[str] | None = None, *, websocket: bool = False) -> str:
        """The ``WWW-Authenticate`` value for a 401 (``exc``) or a 403 ``insufficient_scope``
        (``scope``: the scopes the request needs).  ``host``: the request's ``Host``; on the
        WebSocket listener (``websocket``) the metadata is still the HTTP listener's."""
        if websocket and host is not None:
            host = None if self.http_port is None else _with_port(host, self.http_port)
        metadata = challenge.metadata_location(self.auth, self.public_url,
                                               "https" if self.tls else "http", host)
        if scope is not None:
            return challenge.www_authenticate(metadata, realm=self.name, error="insufficient_scope",
                                              scope=scope,
                                              description="the request needs more scopes")
        if exc is None or exc.error is None:
            return challenge.www_authenticate(metadata, realm=self.name)
        return challenge.www_authenticate(metadata, realm=self.name, error=exc.error,
                                          description=str(exc))

    def metadata(self) -> dict[str, Any] | None:
        """The Protected Resource Metadata; None without an authorization server (404)."""
        oauth = self.auth.oauth
        return (None if oauth is None
                else challenge.metadata_document(oauth.audience, oauth, self.name))

    # ---- operator view ----------------------------------------------------------------------

    def refused(self, transport: str, where: str, why: str, label: str | None = None) -> None:
        """Log a refusal (rate-limited; the principal's label when known, never a token) and
        count it (``client_connections_refused_total{reason="unauthorized"}``)."""
        self.refusals += 1
        if self.bus is not None:
            self.bus.emit(ConnectionRefused(transport, "unauthorized"))
        self._log.warn(LOGGER, trio.current_time(),
                       "auth: %d more refusals in the last %.0fs not logged",
                       "auth: %s refused: %s (principal %s)", where, why, label or "-")

    def status(self, cfg: GatewayConfig) -> dict[str, Any]:
        auth = self.auth
        listeners: dict[str, Any] = {}
        if cfg.listen.websocket is not None:
            listeners["websocket"] = {"auth_required": auth.configured}
        if cfg.listen.http is not None:
            listeners["http"] = {"auth_required": auth.configured}
        if cfg.listen.unix is not None:
            listeners["unix"] = {"auth_required": False, "principal": "peer uid (SO_PEERCRED)"}
        oauth = None
        if auth.oauth is not None:
            jwks = self.jwks
            oauth = {"issuer": auth.oauth.issuer, "audience": auth.oauth.audience,
                     "jwks_uri": auth.oauth.jwks_uri, "jwks_keys": len(jwks.keys) if jwks else 0,
                     "jwks_fetches": jwks.fetches if jwks else 0,
                     "jwks_last_error": jwks.last_error if jwks else None}
        return {
            "configured": auth.configured,
            "bearer": {"count": len(self.bearer), "in_config": len(auth.bearer),
                       "tokens_file": auth.tokens_file},
            "oauth": oauth,
            "listeners": listeners,
            "refusals": self.refusals,
        }
