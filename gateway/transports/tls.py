"""TLS on the client listeners (``listen.tls_cert`` + ``listen.tls_key``): the server context,
loaded at start and again on reload (:func:`reload_into`, for renewed certificates), and the
handshake of each accepted connection.

The listener accepts TCP as always (a ``max_connections`` slot is taken at accept); the
connection's own task runs :func:`handshake`, bounded by :data:`HANDSHAKE_TIMEOUT`, then serves
over the ``trio.SSLStream`` through :class:`~gateway.transports.rawio.StreamIO` (direct fd I/O
cannot encrypt).  A peer that fails or stalls the handshake is closed and logged at debug level.
Streams are ``https_compatible``: an EOF without ``close_notify`` is an ordinary end.
"""

from __future__ import annotations

import logging
import ssl

import trio

LOGGER = logging.getLogger(__name__)

#: Bound on a client's TLS handshake (a connection that sends nothing holds its slot this long).
HANDSHAKE_TIMEOUT = 10.0
#: Bound on sending our ``close_notify`` when a TLS connection ends.
CLOSE_TIMEOUT = 1.0
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError)
#: A client's connection once its handshake is done.
Secured = trio.SSLStream[trio.SocketStream]


class TlsError(Exception):
    """The certificate or key cannot be loaded (message names the keys)."""


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context with the chain in ``cert`` and the private key in ``key`` (PEM), TLS 1.2
    or later, ALPN ``http/1.1``.

    Raises:
        TlsError: a file is missing or unreadable, or the key does not match the certificate.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # A client's TLS 1.2 renegotiation costs the server a handshake each time, as often as the
    # client asks: refused whatever the OpenSSL default (3.x refuses, 1.1.1 allowed it).
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TlsError(f"listen.tls_cert / listen.tls_key: cannot load {cert!r} with key {key!r}: "
                       f"{reason}") from None
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def reload_into(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    """Load a renewed certificate and key into the live ``ctx`` (``systemctl reload``): new
    connections get them, open ones keep theirs.  The pair is first loaded into a fresh context,
    so a bad pair leaves ``ctx`` as it was.

    Raises:
        TlsError: the pair cannot be loaded (``ctx`` unchanged).
    """
    server_context(cert, key)
    ctx.load_cert_chain(cert, key)


async def handshake(stream: trio.SocketStream, ctx: ssl.SSLContext,
                    what: str, deadline: float | None = None) -> Secured | None:
    """The server side of the TLS handshake on ``stream``, bounded by :data:`HANDSHAKE_TIMEOUT`
    (and by ``deadline``, when given and sooner).

    Returns:
        The encrypted stream, or None when the handshake failed or timed out (``stream`` is
        closed then).
    """
    tls = trio.SSLStream(stream, ctx, server_side=True, https_compatible=True)
    limit = trio.current_time() + HANDSHAKE_TIMEOUT
    with trio.move_on_at(limit if deadline is None else min(limit, deadline)) as scope:
        try:
            await tls.do_handshake()
            return tls
        except _BROKEN as exc:
            LOGGER.debug("%s: TLS handshake failed: %s", what, exc.__cause__ or exc)
    if scope.cancelled_caught:
        LOGGER.debug("%s: TLS handshake not done within %gs; closed", what, HANDSHAKE_TIMEOUT)
    await trio.aclose_forcefully(stream)
    return None


async def close(stream: Secured) -> None:
    """Send ``close_notify`` (bounded) and close the TCP connection."""
    with trio.move_on_after(CLOSE_TIMEOUT):
        try:
            await stream.aclose()
            return
        except _BROKEN:
            pass
    await trio.aclose_forcefully(stream.transport_stream)
