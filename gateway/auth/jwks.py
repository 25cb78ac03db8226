"""The issuer's signing keys, cached: fetched at start and again when a token names a key id the
cache does not know (a key rotation), at most once per ``jwks_refresh_min_interval``.

Theory of operation: :meth:`JwksCache.key_for` answers from memory when it can.  An unknown
``kid`` triggers one fetch if the last one is at least the minimum interval old; concurrent
callers wait for that one fetch (a lock) and then look again, so a flood of tokens with random
key ids costs at most one fetch per interval.  A fetch that fails, or returns no usable key,
leaves the last good key set in place (logged, shown in ``/status``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from gateway.auth.jwt import Key, parse_jwks
from gateway.transports import jwks as fetcher

LOGGER = logging.getLogger(__name__)

#: Skipped JWKS entries logged one by one per fetch; the rest are counted in one line.
MAX_SKIPPED_LOGGED = 8


class JwksCache:
    def __init__(self, uri: str, min_interval: float,
                 fetch: Callable[[str], Awaitable[bytes]] = fetcher.fetch) -> None:
        self.uri = uri
        self.min_interval = min_interval
        self.keys: dict[str, Key] = {}
        self.fetches = 0
        self.last_error: str | None = None
        self._fetch = fetch
        self._last: float | None = None  # trio time of the last fetch attempt
        self._lock = trio.Lock()

    async def refresh(self) -> bool:
        """Fetch the document now; True when it gave a usable key set (which replaces the old)."""
        self._last = trio.current_time()
        self.fetches += 1
        try:
            keys, skipped = parse_jwks(await self._fetch(self.uri))
        except (fetcher.JwksFetchError, ValueError, trio.TooSlowError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            LOGGER.warning("auth: cannot fetch the JWKS from %s (%s); keeping the %d keys known",
                           self.uri, exc or "timed out", len(self.keys))
            return False
        for why in skipped[:MAX_SKIPPED_LOGGED]:  # bounded: a document may hold 100k junk keys
            LOGGER.info("auth: JWKS %s: skipped %s", self.uri, why)
        if len(skipped) > MAX_SKIPPED_LOGGED:
            LOGGER.info("auth: JWKS %s: skipped %d more entries", self.uri,
                        len(skipped) - MAX_SKIPPED_LOGGED)
        if not keys:
            self.last_error = "no usable signing key in the document"
            LOGGER.warning("auth: the JWKS from %s holds no usable key (RS256/ES256 with a kid); "
                           "keeping the %d keys known", self.uri, len(self.keys))
            return False
        self.keys = keys
        self.last_error = None
        LOGGER.info("auth: JWKS from %s: %d keys", self.uri, len(keys))
        return True

    async def prime(self) -> None:
        """The first fetch (at start, or when a reload configures OAuth); callers of
        :meth:`key_for` meanwhile wait for it."""
        async with self._lock:
            if not self.keys:
                await self.refresh()

    async def key_for(self, kid: str) -> Key | None:
        """The key ``kid`` names, fetching the document again if it is unknown and the last
        fetch is old enough."""
        key = self.keys.get(kid)
        if key is not None:
            return key
        async with self._lock:
            key = self.keys.get(kid)  # another caller's fetch may have brought it
            if key is None and self._due():
                await self.refresh()
                key = self.keys.get(kid)
        return key

    def _due(self) -> bool:
        return self._last is None or trio.current_time() - self._last >= self.min_interval
