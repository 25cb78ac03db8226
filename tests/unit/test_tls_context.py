"""The client listeners' TLS server context (gateway.transports.tls.server_context)."""

from __future__ import annotations

import ssl
from pathlib import Path

from tlsutil import make_certs

from gateway.transports import tls


def test_the_server_context_refuses_renegotiation_and_old_versions(tmp_path: Path) -> None:
    """Renegotiation is refused by the context itself, not left to the OpenSSL default (3.x
    refuses a client's renegotiation, 1.1.1 allowed it: a handshake's cost on demand)."""
    certs = make_certs(tmp_path)
    ctx = tls.server_context(str(certs.cert), str(certs.key))
    assert ctx.options & ssl.OP_NO_RENEGOTIATION
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE  # no client certificate is asked for
