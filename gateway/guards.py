"""Boot guards: what it takes to expose a listener beyond loopback (fail closed).

Pure: plain values in, problems out (each a sentence naming the keys to set); nothing here
imports the config.  :mod:`gateway.config` reports them at load (so ``check-config`` and a
reload too), the service on the address a socket is really bound to (systemd's sockets too).
A *client* listener off loopback needs authentication the operator configured (a built-in
default never counts), TLS on the wire (the gateway's own, or a TLS-terminating proxy at
``listen.public_url``) and, when some backend serves resources, a rule allowing resource reads
(reads and subscriptions can hand out files and secrets).  The unix socket and stdio are never
off loopback.  The *admin* listener goes off loopback only with ``admin.allow_non_loopback``,
and there answers ``/status`` only to the bearer token of ``admin.token_sha256``.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")

AUTH_NEEDED = ("authentication the operator configured: [[auth.bearer]], auth.tokens_file or "
               "[auth.oauth] (the default, none, does not count)")
TLS_NEEDED = ("TLS so that no token crosses the network in clear: set listen.tls_cert and "
              "listen.tls_key, or listen.behind_proxy = true with listen.public_url = "
              "\"https://HOST/mcp\" behind a TLS-terminating proxy")
READ_RULE_NEEDED = ("a read rule for resources/read and resources/subscribe: add [[policy.rules]] "
                    "with kind = \"resource\", match = \"<URI glob>\", action = \"allow\" (or "
                    "exclude every backend's resources: resources = { exclude = [\"*\"] })")


def client_exposure_problems(*, auth_configured: bool, tls: bool, serves_resources: bool,
                             read_rule: bool) -> list[str]:
    """What a client listener (websocket, http) off loopback still lacks; empty: allowed.

    Args:
        auth_configured: the operator configured authentication (``AuthSection.configured``).
        tls: TLS on the wire (``listen.tls_cert`` and ``listen.tls_key``, or ``behind_proxy``).
        serves_resources: some backend may expose resources.
        read_rule: a ``[[policy.rules]]`` allows ``resource`` reads.
    """
    problems = []
    if not auth_configured:
        problems.append(AUTH_NEEDED)
    if not tls:
        problems.append(TLS_NEEDED)
    if serves_resources and not read_rule:
        problems.append(READ_RULE_NEEDED)
    return problems


def public_origin(public_url: str | None) -> tuple[str, str] | None:
    """``(host, origin)`` of ``listen.public_url`` (``("gw.example.com",
    "https://gw.example.com")``), None when it is not set."""
    if not public_url:
        return None
    parts = urlsplit(public_url)
    host = (parts.hostname or "").lower()
    return host, f"{parts.scheme.lower()}://{parts.netloc.lower().rpartition('@')[2]}"


def key_errors(*, tls_cert: str | None, tls_key: str | None, behind_proxy: bool,
               public_url: str | None, admin_token_sha256: str | None,
               check_files: bool) -> list[str]:
    """Errors in the keys themselves, wherever the listeners are bound: both TLS files
    (``listen.tls_cert``, ``listen.tls_key``) or neither (readable, with ``check_files``),
    ``listen.behind_proxy`` only with ``listen.public_url``, an https ``public_url`` (http only
    for a loopback host), a hex ``admin.token_sha256``."""
    errors: list[str] = []
    if (tls_cert is None) != (tls_key is None):
        errors.append("listen.tls_cert, listen.tls_key: set both (the certificate chain and its "
                      "private key, PEM) or neither")
    if check_files:
        for key, path in (("tls_cert", tls_cert), ("tls_key", tls_key)):
            if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                errors.append(f"listen.{key}: {path!r} is not a readable file")
    if behind_proxy and not public_url:
        errors.append("listen.behind_proxy: needs listen.public_url, the https URL clients use "
                      "(e.g. \"https://gateway.example.com/mcp\"); it names this gateway in "
                      "the Host/Origin allow-lists and as the OAuth resource")
    if public_url is not None:
        parts = urlsplit(public_url)
        loopback_http = (parts.scheme == "http"
                         and (parts.hostname or "") in ("localhost", "127.0.0.1", "::1"))
        if not parts.hostname or not (parts.scheme == "https" or loopback_http) \
                or parts.query or parts.fragment or parts.username is not None:
            errors.append(f"listen.public_url: {public_url!r} is not an https URL "
                          "(https://HOST[:PORT]/PATH, no query; http only for a loopback host)")
    if admin_token_sha256 is not None and not _HEX64.fullmatch(admin_token_sha256):
        errors.append("admin.token_sha256: expected the 64 hex digits of a SHA-256 "
                      "(e.g. printf %s TOKEN | sha256sum)")
    return errors
