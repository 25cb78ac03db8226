"""A remote backend's own access token: OAuth 2.1 client credentials, one token per backend.

:class:`TokenSource` fetches the token from the configured ``token_url``, or from the one the
remote's metadata names (its 401's ``resource_metadata``, else the well-known protected-resource
URIs, then the authorization server's RFC 8414 or OpenID metadata), authenticating with
``client_secret_basic``, ``client_secret_post`` or a signed ``private_key_jwt`` assertion, and
asks for the RFC 8707 ``resource``.  It keeps the token and fetches the next one at
:data:`REFRESH_AT` of its lifetime (the old one is used while that fails and it is still
valid); a 401 from the remote gets one fetch more, and none when the refused token is younger
than :data:`RENEW_MIN_INTERVAL`.  Secrets are read at each fetch; neither they nor the token
are ever logged or shown (``status()`` gives the endpoint, validity and the last error).
The client authentication (:func:`client_auth`), the exchange on a connection of its own
(:class:`Endpoints`) and the token answer (:func:`parse_token`) serve token exchange too.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import ssl
import time
import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote_plus, urlencode

import jwt as pyjwt
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway.backend import httpclient
from gateway.config import ClientAuth, RemoteOAuth, endpoint_url_ok, read_regular
from gateway.protocol import oauthflow

LOGGER = logging.getLogger(__name__)

#: Seconds a token or metadata exchange may take in all.
FETCH_TIMEOUT = 10.0
#: The most bytes of a token or metadata answer, of a secret or key file, of a token.
MAX_BODY = 65536
MAX_SECRET = 16384
MAX_TOKEN = 8192
#: A token's lifetime at most, in seconds (one year): a longer ``expires_in`` is held as this.
MAX_LIFETIME = 365 * 86400.0
#: The next token is fetched once this share of the current one's lifetime is over.
REFRESH_AT = 0.8
#: Seconds a refused token must have been held before a 401 fetches another one.
RENEW_MIN_INTERVAL = 10.0
#: Seconds a client assertion is valid.
ASSERTION_LIFETIME = 60
_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
_FORM_HEAD = (("content-type", "application/x-www-form-urlencoded"),
              ("accept", "application/json"))


class TokenFailed(Exception):
    """No token could be had: ``detail`` says why (never a secret nor a token)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def read_secret(ref: str | dict[str, str] | None, what: str,
                environ: dict[str, str] | None = None) -> bytes:
    """A secret by its reference (``{ file = … }`` or ``{ env = … }``), read now.

    Raises:
        TokenFailed: unset, unreadable, empty (named, never the value).
    """
    env = os.environ if environ is None else environ
    if not isinstance(ref, dict):
        raise TokenFailed(f"{what} is not configured")
    if "env" in ref:
        if ref["env"] not in env:
            raise TokenFailed(f"{what}: environment variable {ref['env']} is not set")
        data = env[ref["env"]].encode()
    else:
        try:
            data = read_regular(ref["file"], MAX_SECRET)
        except OSError as exc:
            raise TokenFailed(f"{what}: cannot read {ref['file']}: "
                              f"{exc.strerror or exc}") from None
        except ValueError as exc:
            raise TokenFailed(f"{what}: {ref['file']}: {exc}") from None
    data = data.strip()
    if not data:
        raise TokenFailed(f"{what} is empty")
    return data


def client_secret(cfg: ClientAuth, environ: dict[str, str] | None = None) -> str:
    """The configured ``client_secret``, read now.

    Raises:
        TokenFailed: unset, unreadable, empty or not UTF-8 (named, never the value).
    """
    try:
        return read_secret(cfg.client_secret, "client_secret", environ).decode()
    except UnicodeDecodeError:
        raise TokenFailed("client_secret is not UTF-8 text") from None


def _signing_key(pem: bytes, algorithm: str) -> Any:
    """The private key in ``pem``, of the type ``algorithm`` signs with.

    Raises:
        TokenFailed: not a PEM private key, or the wrong type.
    """
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TokenFailed(f"private_key: not an unencrypted PEM private key ({exc})") from None
    if algorithm == "RS256" and not isinstance(key, rsa.RSAPrivateKey):
        raise TokenFailed("private_key: RS256 needs an RSA key")
    if algorithm == "ES256" and not (isinstance(key, ec.EllipticCurvePrivateKey)
                                     and isinstance(key.curve, ec.SECP256R1)):
        raise TokenFailed("private_key: ES256 needs a P-256 EC key")
    return key


def basic_auth(head: list[tuple[str, str]], client_id: str, secret: str) -> None:
    """``client_secret_basic`` (RFC 6749 §2.3.1: each form-encoded, joined, base64-encoded)."""
    pair = f"{quote_plus(client_id)}:{quote_plus(secret)}".encode()
    head.append(("authorization", "Basic " + base64.b64encode(pair).decode()))


def client_auth(cfg: ClientAuth, aud: str, form: dict[str, str], head: list[tuple[str, str]],
                environ: dict[str, str] | None = None) -> None:
    """Authenticate a token request as ``cfg`` says: ``client_secret_basic`` (``head``),
    ``client_secret_post`` or a ``private_key_jwt`` assertion for ``aud`` (``form``).

    Raises:
        TokenFailed: a secret or key missing or unusable (named, never the value).
    """
    if cfg.auth_method == "private_key_jwt":
        key = _signing_key(read_secret(cfg.private_key, "private_key", environ), cfg.algorithm)
        now = int(time.time())
        claims = {"iss": cfg.client_id, "sub": cfg.client_id, "aud": aud,
                  "iat": now, "exp": now + ASSERTION_LIFETIME, "jti": uuid.uuid4().hex}
        extra = {"kid": cfg.key_id} if cfg.key_id else None
        form["client_id"] = cfg.client_id
        form["client_assertion_type"] = _ASSERTION_TYPE
        form["client_assertion"] = pyjwt.encode(claims, key, algorithm=cfg.algorithm,
                                                headers=extra)
        return
    secret = client_secret(cfg, environ)
    if cfg.auth_method == "client_secret_post":
        form["client_id"], form["client_secret"] = cfg.client_id, secret
    else:
        basic_auth(head, cfg.client_id, secret)


class Endpoints:
    """Exchanges with an authorization server: each on a connection of its own, within
    :data:`FETCH_TIMEOUT`, its https verified with ``ca_file`` (read at the first one after
    :meth:`refresh`)."""

    def __init__(self, ca_file: str | None, opener: httpclient.Opener | None = None) -> None:
        self.ca_file = ca_file
        self._opener = opener
        self._tls: ssl.SSLContext | None = None

    def refresh(self) -> None:
        self._tls = None

    async def exchange(self, method: str, url: str, headers: list[tuple[str, str]],
                       body: bytes = b"") -> tuple[httpclient.Response, bytes]:
        """One exchange.

        Raises:
            TokenFailed: not an http(s) URL, unreachable, too slow, a body over
                :data:`MAX_BODY`.
        """
        try:
            origin = httpclient.parse_url(url)
        except ValueError:  # a URL a remote's document named: its host or port unusable
            raise TokenFailed(f"{url!r:.200} is not an http(s) URL with a host") from None
        if origin.tls and self._tls is None:
            try:
                self._tls = httpclient.tls_context(self.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise TokenFailed(f"ca_file {self.ca_file}: {exc}") from None
        pool = httpclient.Pool(origin, connect_timeout=FETCH_TIMEOUT, idle_max=0,
                               ssl_context=self._tls, opener=self._opener)
        try:
            with trio.fail_after(FETCH_TIMEOUT):
                conn = await pool.connect()
                response = await conn.request(method, origin.target, headers, body)
                return response, await conn.body(MAX_BODY)
        except httpclient.HttpFailure as exc:
            raise TokenFailed(f"{origin.text}: {exc.detail}") from None
        except trio.TooSlowError:
            raise TokenFailed(f"{origin.text}: no answer within {FETCH_TIMEOUT:g}s") from None
        finally:
            await pool.aclose()

    async def post_form(self, url: str, form: dict[str, str],
                        head: list[tuple[str, str]]) -> tuple[httpclient.Response, bytes]:
        """A token request: ``form`` form-encoded, JSON asked for, ``head`` (the client's
        Basic authorization, if any) after.

        Raises:
            TokenFailed: as :meth:`exchange`.
        """
        return await self.exchange("POST", url, [*_FORM_HEAD, *head], urlencode(form).encode())


def json_body(body: bytes) -> Any:
    """A JSON answer's document (None: not JSON)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def parse_token(response: httpclient.Response, body: bytes, where: str
                ) -> tuple[str, float | None]:
    """The token and its lifetime in seconds from a token answer
    (:func:`gateway.protocol.oauthflow.token_answer`).

    Raises:
        TokenFailed: an error answer (its ``error`` code and description) or a bad one.
    """
    try:
        answer = oauthflow.token_answer(response.status, json_body(body), where, MAX_TOKEN,
                                        MAX_LIFETIME)
    except oauthflow.FlowError as exc:
        raise TokenFailed(exc.detail) from None
    return answer.access_token, answer.lifetime


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class TokenSource:
    """The access token of one remote backend: fetched, cached, refreshed, renewed on a 401."""

    def __init__(self, backend: str, url: str, cfg: RemoteOAuth,
                 opener: httpclient.Opener | None = None,
                 environ: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.url = url
        self.cfg = cfg
        self._environ = environ
        self._http = Endpoints(cfg.ca_file, opener)
        self.token_endpoint: str | None = cfg.token_url or None
        self.issuer: str | None = None  # the authorization server's, when discovered
        self.resource = cfg.resource or url
        self.token: str | None = None
        self.fetches = 0
        self.failures = 0
        self.last_error: str | None = None
        self.valid_until: float | None = None  # wall clock, for /status
        self._fetched = -math.inf  # trio time of the token's fetch
        self._refresh = -math.inf  # trio time from which the next one is fetched
        self._expires = math.inf  # trio time it ends (inf: no expires_in given)
        self._lock = trio.Lock()

    # ---- what the link reads ----------------------------------------------------------------

    def headers(self) -> list[tuple[str, str]]:
        """``Authorization: Bearer …`` once a token is held."""
        return [] if self.token is None else [("authorization", f"Bearer {self.token}")]

    def status(self) -> dict[str, Any]:
        """For ``/status``: never the token nor a secret."""
        return {"token_endpoint": self.token_endpoint, "auth_method": self.cfg.auth_method,
                "has_token": self.token is not None,
                "valid_until": None if self.valid_until is None else _iso(self.valid_until),
                "fetches": self.fetches, "failures": self.failures,
                "last_error": self.last_error}

    async def fresh(self) -> None:
        """Before a request: fetch a token when none is held or the current one is due for
        refresh (and the endpoint is known: else the remote's 401 starts the discovery).

        Raises:
            TokenFailed: none could be had and none valid is held.
        """
        if self.token_endpoint is None or trio.current_time() < self._refresh:
            return
        async with self._lock:
            now = trio.current_time()
            if now < self._refresh:
                return  # fetched while this waited
            try:
                await self._fetch()
            except TokenFailed as exc:
                if self.token is not None and now < self._expires:
                    LOGGER.warning("backend %s: cannot refresh the access token (%s); using "
                                   "the current one until it expires", self.backend, exc.detail)
                    self._refresh = min(now + RENEW_MIN_INTERVAL, self._expires)
                    return
                raise

    async def renew(self, refused: str | None, challenge: str | None) -> None:
        """The remote answered 401 to ``refused`` (None: no token sent): discover the endpoint
        if need be and fetch another token, unless one newer than ``refused`` is held already.

        Raises:
            TokenFailed: none could be had, or the refused token was just fetched.
        """
        async with self._lock:
            if self.token is not None and self.token != refused:
                return
            age = trio.current_time() - self._fetched
            if refused is not None and age < RENEW_MIN_INTERVAL:
                self.last_error = (f"{self._origin()} refused an access token fetched "
                                   f"{age:.0f}s before (HTTP 401)")
                raise TokenFailed(self.last_error)
            if self.token_endpoint is None:
                await self._discover(oauthflow.challenge(challenge).get("resource_metadata"))
            await self._fetch()

    def refresh(self) -> None:
        """A reload: the ``ca_file`` is read again at the next exchange (the secrets are read
        at each fetch anyway)."""
        self._http.refresh()

    def _origin(self) -> str:
        return httpclient.parse_url(self.url).text

    # ---- HTTP -------------------------------------------------------------------------------

    async def _json(self, url: str) -> dict[str, Any] | None:
        """A metadata document (None: not there, any status but 200)."""
        response, body = await self._http.exchange("GET", url, [("accept", "application/json")])
        if response.status != 200:
            return None
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            raise TokenFailed(f"{url}: not a JSON document") from None
        if not isinstance(doc, dict):
            raise TokenFailed(f"{url}: not a JSON object")
        return doc

    async def _first_json(self, urls: list[str]) -> dict[str, Any] | None:
        """The first of the metadata documents at ``urls`` that is there (None: none)."""
        for url in urls:
            doc = await self._json(url)
            if doc is not None:
                return doc
        return None

    async def _discover(self, hint: str | None) -> None:
        """The token endpoint from the remote's protected-resource metadata (``hint``, else
        the well-known URIs) and its authorization server's metadata.

        Raises:
            TokenFailed: not found, or the documents do not fit together.
        """
        prm = await self._first_json(oauthflow.resource_metadata_urls(self.url, hint))
        if prm is None:
            raise TokenFailed(f"no protected-resource metadata for {self._origin()} "
                              "(no token_url configured)")
        try:
            resource, issuer = oauthflow.authorization_server(prm, self.url)
        except oauthflow.FlowError as exc:
            raise TokenFailed(exc.detail) from None
        meta = await self._first_json(oauthflow.metadata_urls(issuer))
        if meta is None:
            raise TokenFailed(f"no metadata for authorization server {issuer:.200}")
        try:
            oauthflow.check_issuer(meta, issuer)
        except oauthflow.FlowError as exc:
            raise TokenFailed(exc.detail) from None
        endpoint = meta.get("token_endpoint")
        if not isinstance(endpoint, str) or not endpoint_url_ok(endpoint):
            raise TokenFailed(f"the token endpoint of {issuer:.200} is not an https URL "
                              "(or http to this machine)")
        self.token_endpoint, self.issuer = endpoint, issuer
        if not self.cfg.resource:
            self.resource = resource
        LOGGER.info("backend %s: token endpoint %s (from %s's metadata)", self.backend,
                    httpclient.parse_url(endpoint).text, issuer)

    # ---- the token request ------------------------------------------------------------------

    def _client_auth(self, form: dict[str, str], head: list[tuple[str, str]]) -> None:
        aud = self.cfg.audience or self.issuer or self.token_endpoint
        assert aud is not None
        client_auth(self.cfg, aud, form, head, self._environ)

    async def _fetch(self) -> None:
        """Fetch a token now (the lock held).

        Raises:
            TokenFailed: counted and kept as ``last_error``.
        """
        assert self.token_endpoint is not None
        self.fetches += 1
        where = httpclient.parse_url(self.token_endpoint).text
        try:
            form = {"grant_type": "client_credentials", "resource": self.resource}
            if self.cfg.scope:
                form["scope"] = self.cfg.scope
            head: list[tuple[str, str]] = []
            self._client_auth(form, head)
            response, body = await self._http.post_form(self.token_endpoint, form, head)
            token, lifetime = parse_token(response, body, where)
        except TokenFailed as exc:
            self._failed(exc)
            raise
        self._hold(token, lifetime)
        LOGGER.info("backend %s: access token fetched from %s (%s)", self.backend, where,
                    f"valid {lifetime:g}s" if lifetime is not None else "no expiry given")

    def _failed(self, exc: TokenFailed) -> None:
        """A token request failed: counted, kept as ``last_error``, logged."""
        self.failures += 1
        self.last_error = exc.detail
        LOGGER.warning("backend %s: no access token: %s", self.backend, exc.detail)

    def _hold(self, token: str, lifetime: float | None) -> None:
        """A token just had, good for ``lifetime`` seconds (None: no expiry given): the next
        is fetched after :data:`REFRESH_AT` of it."""
        now = trio.current_time()
        self.token, self._fetched, self.last_error = token, now, None
        self._expires = now + lifetime if lifetime is not None else math.inf
        self._refresh = now + REFRESH_AT * lifetime if lifetime is not None else math.inf
        self.valid_until = time.time() + lifetime if lifetime is not None else None
