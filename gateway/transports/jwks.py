"""Fetching an issuer's JWKS document over HTTP(S) (urllib, run in a worker thread): the one
outbound HTTP request of the daemon, bounded in time and size.  Every failure is
:class:`JwksFetchError`."""

from __future__ import annotations

import urllib.error
import urllib.request

import trio

#: Bounds on one fetch: seconds for the whole exchange, bytes of the document.
FETCH_TIMEOUT = 10.0
MAX_BYTES = 256 * 1024


class JwksFetchError(Exception):
    pass


def _fetch_sync(uri: str, timeout: float, max_bytes: int) -> bytes:
    request = urllib.request.Request(uri, headers={"accept": "application/json",
                                                   "user-agent": "mcp-gateway"})
    try:
        # the scheme is checked by config
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if response.status != 200:
                raise JwksFetchError(f"HTTP {response.status}")
            data: bytes = response.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise JwksFetchError(f"HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise JwksFetchError(str(getattr(exc, "reason", exc))) from None
    if len(data) > max_bytes:
        raise JwksFetchError(f"the document is over {max_bytes} bytes")
    return data


async def fetch(uri: str) -> bytes:
    """The body of ``uri`` (200 only), within :data:`FETCH_TIMEOUT` and :data:`MAX_BYTES`.
    Cancelling abandons the thread (it ends by its own timeout)."""
    with trio.fail_after(FETCH_TIMEOUT + 1.0):
        return await trio.to_thread.run_sync(_fetch_sync, uri, FETCH_TIMEOUT, MAX_BYTES,
                                             abandon_on_cancel=True)
