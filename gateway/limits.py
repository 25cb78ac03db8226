"""Daemon-wide resource limits: one byte budget for queued messages, one cap on connections,
and the per-principal limits of ``[[auth.limits]]``: calls (:class:`PrincipalLimits`) and what a
principal holds at once (:class:`PrincipalCaps`).  Pure data: the hub creates one
:class:`ByteBudget` and one :class:`ConnectionSlots` and hands them to their users.

Every queue of client or backend messages charges its bytes to an :class:`Account` on the
budget (a client connection's covers its outbound queue and its requests being served; a
child's, its write queue), closed exactly once when the queue is dropped, so every charged byte
leaves the total exactly once.  A new client request is admitted only if it fits
(:meth:`ByteBudget.admits`, else -32006 ``overloaded``); a charge that cannot be refused and
goes over the limit evicts the client account holding the most bytes (its connection closes,
``overflow``), one eviction at a time.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway import errors

#: Seconds a client message may stay incomplete: from the first bytes of a WebSocket frame or
#: line until the message is whole.  A connection that lets this pass is answered -32600
#: ``incomplete_message`` and closed (WebSocket 1008), so a peer that starts a message and falls
#: silent cannot hold a slot and a partial buffer of up to ``max_message_bytes`` forever.
#: Idle connections between messages are not affected.
INCOMPLETE_MESSAGE_TIMEOUT = 30.0
#: Seconds a client connection may go without a complete request head: from its accept (TLS
#: handshake included) to the end of its first request head or WebSocket upgrade, and from the
#: first byte of each later request on a keep-alive HTTP connection to the end of its head.  A
#: peer that connects and sends nothing (slow loris) holds its ``max_connections`` slot no longer.
#: Read when a connection starts (tests lower it).
HEAD_TIMEOUT = 10.0


class Account:
    """One queue's share of a :class:`ByteBudget` (open it with :meth:`ByteBudget.open`)."""

    __slots__ = ("_budget", "closed", "evict", "held", "name")

    def __init__(self, budget: ByteBudget, name: str, evict: Callable[[], None] | None) -> None:
        self._budget = budget
        self.name = name
        self.evict = evict  # None: not a client connection, never evicted
        self.held = 0
        self.closed = False

    def __repr__(self) -> str:
        return f"<Account {self.name} {self.held}B{' closed' if self.closed else ''}>"

    def charge(self, n: int) -> None:
        """``n`` more bytes are queued.  May evict the largest client account (maybe this one)."""
        if self.closed:
            return
        self.held += n
        budget = self._budget
        budget.total += n
        if budget.total > budget.limit:
            budget.overrun()

    def release(self, n: int) -> None:
        """``n`` of this account's bytes left their queue (written, or dropped)."""
        if self.closed:
            return  # already released by close()
        self.held -= n
        self._budget.total -= n

    def close(self) -> None:
        """The queue is gone: release everything still held (idempotent)."""
        if self.closed:
            return
        self.closed = True
        budget = self._budget
        budget.total -= self.held
        self.held = 0
        budget.accounts.discard(self)
        if budget.evicting is self:
            budget.evicting = None


class ByteBudget:
    """The daemon-wide account of queued message bytes, bounded by ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.accounts: set[Account] = set()
        self.evicting: Account | None = None  # evicted, its bytes not released yet
        self.evictions = 0

    def open(self, name: str, evict: Callable[[], None] | None = None) -> Account:
        """A new account; ``evict`` (client connections only) closes its owner on an overrun."""
        account = Account(self, name, evict)
        self.accounts.add(account)
        return account

    def admits(self, n: int) -> bool:
        """Whether ``n`` more refusable bytes (a new client request) fit under the limit."""
        return self.total + n <= self.limit

    def overrun(self) -> Account | None:
        """The total is over the limit: evict the client account holding the most bytes.

        Returns the evicted account, or None (an eviction is still under way, or no client
        account holds anything).
        """
        if self.evicting is not None:
            return None
        victim: Account | None = None
        for account in self.accounts:
            if account.evict is not None and account.held > 0 and (
                victim is None or account.held > victim.held):
                victim = account
        if victim is None:
            return None
        self.evicting = victim
        self.evictions += 1
        assert victim.evict is not None
        victim.evict()
        return victim


# ---- log lines anyone can cause -------------------------------------------------------------

#: Lines of one kind that a peer can cause (refusals): at most LOG_BURST per LOG_WINDOW seconds,
#: then one line saying how many were not written.
LOG_BURST = 10
LOG_WINDOW = 60.0


class LogBudget:
    """At most ``burst`` lines of one kind per ``window`` seconds; the rest counted."""

    __slots__ = ("_burst", "_logged", "_start", "_window", "unlogged")

    def __init__(self, burst: int = LOG_BURST, window: float = LOG_WINDOW) -> None:
        self._burst, self._window = burst, window
        self._start = -float("inf")
        self._logged = 0
        self.unlogged = 0  # lines not written in the current window

    def take(self, now: float) -> tuple[bool, int]:
        """Whether a line may be written at ``now``, and how many were not written in the
        window that just ended (say that first, when not 0)."""
        dropped = 0
        if now - self._start >= self._window:
            dropped, self._start, self._logged, self.unlogged = self.unlogged, now, 0, 0
        if self._logged >= self._burst:
            self.unlogged += 1
            return False, dropped
        self._logged += 1
        return True, dropped

    def warn(self, logger: logging.Logger, now: float, unlogged: str, msg: str,
             *args: object) -> None:
        """``msg % args`` as a warning when the budget allows it at ``now``; first, when the
        window that just ended left lines unwritten, ``unlogged % (how many, window seconds)``."""
        write, dropped = self.take(now)
        if dropped:
            logger.warning(unlogged, dropped, self._window)
        if write:
            logger.warning(msg, *args)


# ---- file descriptors: max_connections and what the daemon needs besides ----------------------

#: ``gateway.max_connections`` when it is not set; fewer when the open-files limit does not
#: leave room for so many (see :func:`fit_connections`).
DEFAULT_MAX_CONNECTIONS = 4096
#: fds the daemon holds whatever its config: stdin/stdout/stderr, trio's epoll, wakeup and signal
#: fds, the journal socket; and a margin for short-lived ones (a config, key or tokens file being
#: read, a JWKS fetch, a systemd notify datagram, /proc reads for /metrics and reaping).
FD_FIXED = 64
#: fds per backend child: its stdin, stdout and stderr pipes and trio's pidfd while it runs, and
#: while it is spawned the child's ends of the three pipes and the exec error pipe besides.
FD_PER_CHILD = 8
#: Connections one remote backend instance (``url``) holds at most unless its
#: ``max_connections`` says otherwise: its requests' answer streams, the notifications' and
#: answers' POSTs, the GET stream (a 2026-07-28 remote's ``subscriptions/listen`` in its place)
#: and the DELETE on close (gateway.backend.http splits them).
REMOTE_CONNECTIONS = 16
#: ``max_connections`` of a remote backend, at least (one request's answer stream beside the
#: two others', the GET stream and the DELETE) and at most.
REMOTE_CONNECTIONS_MIN = 5
REMOTE_CONNECTIONS_MAX = 1024
#: Seconds the start (and a reload) waits for a remote backend that is not ``required`` to
#: answer its first lists; past that it joins the catalog when it does (``list_changed``).
OPTIONAL_REMOTE_WAIT = 2.0
#: fds per configured TCP listener (a host name may bind an IPv4 and an IPv6 socket).
FD_PER_TCP_LISTENER = 2
#: Connections on the admin listener at once; one more closes the oldest not writing a response.
ADMIN_CONNECTIONS = 32
#: WebSocket connections beyond ``max_connections`` being answered 503 at once; more are closed
#: at once (an HTTP, unix or TLS one beyond the cap is answered or closed without waiting).
REFUSING_MAX = 64


def max_children(sharing: str, instances: int, max_sessions: int) -> int:
    """Children one backend may run at once: per-session or per-principal, ``max_sessions``
    owned children and the probe that serves the lists; else ``instances``."""
    return max_sessions + 1 if sharing in ("per-session", "per-principal") else instances


def fd_reserve(*, children: int, tcp_listeners: int, unix_listeners: int,
               remote_connections: int = 0) -> int:
    """fds the daemon needs besides its client connections: :data:`FD_FIXED`,
    :data:`FD_PER_CHILD` per backend child it may run, the connections every remote backend
    instance may hold (``remote_connections``: each one's ``max_connections``, by default
    :data:`REMOTE_CONNECTIONS`), the listeners, :data:`ADMIN_CONNECTIONS` and
    :data:`REFUSING_MAX` connections being turned away (each ``tcp_listeners`` counts
    :data:`FD_PER_TCP_LISTENER`, the admin listener among them)."""
    return (FD_FIXED + FD_PER_CHILD * children + remote_connections
            + FD_PER_TCP_LISTENER * tcp_listeners + unix_listeners + ADMIN_CONNECTIONS
            + REFUSING_MAX)


@dataclass(frozen=True, slots=True)
class ConnectionsFit:
    """What :func:`fit_connections` decided: the ``max_connections`` to use, and either a
    ``warning`` (the default was lowered) or a ``refusal`` (the daemon must not run so)."""

    max_connections: int
    warning: str | None = None
    refusal: str | None = None


def fit_connections(configured: int | None, fd_limit: int, reserve: int) -> ConnectionsFit:
    """Fit ``max_connections`` into the open-files (soft) limit ``fd_limit`` beside ``reserve``
    (:func:`fd_reserve`).

    ``configured`` None (not set): :data:`DEFAULT_MAX_CONNECTIONS`, lowered to what fits with a
    warning naming both numbers.  Set explicitly and too many: a refusal naming both.  Either way
    a limit that leaves no room for one connection is a refusal.
    """
    room = fd_limit - reserve
    wanted = DEFAULT_MAX_CONNECTIONS if configured is None else configured
    if wanted <= room:
        return ConnectionsFit(wanted)
    needs = (f"the open-files limit (RLIMIT_NOFILE, ulimit -n, LimitNOFILE=) is {fd_limit} and "
             f"the daemon needs {reserve} of them besides client connections (backend pipes, "
             "listeners, admin connections, a margin)")
    if configured is not None or room < 1:
        return ConnectionsFit(wanted, refusal=(
            f"gateway.max_connections = {wanted} does not fit: {needs}; raise the limit to at "
            "least "
            f"{wanted + reserve}" + (f" or set max_connections to at most {room}" if room >= 1
                                     else "")))
    return ConnectionsFit(room, warning=(
        f"max_connections lowered from its default {wanted} to {room}: {needs}; raise the limit to "
        f"at least {wanted + reserve} for the default"))


class ConnectionSlots:
    """Client connections open at once, bounded by ``limit`` (WebSocket and unix together).

    ``on_refused(transport)`` is called for each connection turned away.
    """

    def __init__(self, limit: int, on_refused: Callable[[str], None] | None = None) -> None:
        self.limit = limit
        self.used = 0
        self._on_refused = on_refused

    def acquire(self, transport: str) -> bool:
        """Take a slot for a new connection; False (and counted) when all are taken."""
        if self.used >= self.limit:
            if self._on_refused is not None:
                self._on_refused(transport)
            return False
        self.used += 1
        return True

    def release(self) -> None:
        """A connection that held a slot has ended."""
        assert self.used > 0, "release without acquire"
        self.used -= 1


# ---- per principal: [[auth.limits]] ------------------------------------------------------------

#: ``retryAfter`` (seconds) when a principal is at its ``max_inflight``: nothing says when one
#: of its calls ends, so this is a hint, not a promise.
INFLIGHT_RETRY_AFTER = 1.0
#: Principals whose state is kept at most; past it, those with nothing in flight are forgotten
#: (their buckets start full again).
MAX_TRACKED_PRINCIPALS = 4096


#: What one authenticated principal may hold at once, unless its ``[[auth.limits]]`` entry says
#: otherwise: legacy HTTP sessions, client connections, open ``subscriptions/listen`` requests,
#: bridged calls parked for the client's retry.  Callers without a principal have only the
#: daemon-wide caps.
DEFAULT_CAPS = {"max_sessions": 64, "max_connections": 256, "max_listens": 64,
                "max_parked_flows": 16}


@dataclass(frozen=True, slots=True)
class PrincipalLimit:
    """One ``[[auth.limits]]`` entry: ``pattern`` is a glob on the principal's name; ``caps``
    overrides :data:`DEFAULT_CAPS` (by name)."""

    pattern: str
    max_inflight: int | None = None
    calls_per_second: float | None = None
    caps: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class LimitRefusal:
    """Why a request is refused: ``limit`` is ``max_inflight`` or ``calls_per_second``."""

    limit: str
    value: float
    retry_after: float  # seconds


class _Usage:
    __slots__ = ("inflight", "stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.inflight = 0
        self.tokens = tokens
        self.stamp = stamp


class PrincipalLimits:
    """Calls in flight and calls per second per principal, across all of its connections.

    The first ``[[auth.limits]]`` entry whose glob matches a principal's name applies to it.
    ``calls_per_second`` is a token bucket holding one second's worth of calls (at least one):
    a request takes a token or is refused with the time until the next one.  Pure: the caller
    passes the time (``trio.current_time()``), admits a request with :meth:`admit` and, when
    it was admitted, calls :meth:`release` once when it ends.
    """

    def __init__(self, limits: Sequence[PrincipalLimit] = ()) -> None:
        self.limits = tuple(limits)
        self._usage: dict[str, _Usage] = {}
        self._matched: dict[str, PrincipalLimit | None] = {}

    def __bool__(self) -> bool:
        return bool(self.limits)

    def reconfigured(self, limits: Sequence[PrincipalLimit]) -> PrincipalLimits:
        """The limits of a reloaded config; calls in flight stay counted."""
        new = PrincipalLimits(limits)
        for name, usage in self._usage.items():
            if usage.inflight:
                new._usage[name] = usage
        return new

    def limit_for(self, name: str) -> PrincipalLimit | None:
        return _first_match(self.limits, self._matched, name)

    def inflight(self, name: str) -> int:
        usage = self._usage.get(name)
        return usage.inflight if usage is not None else 0

    def admit(self, name: str, now: float) -> LimitRefusal | None:
        """Admit one request of ``name`` at ``now`` (None: admitted, release it later)."""
        lim = self.limit_for(name)
        if lim is None or (lim.max_inflight is None and lim.calls_per_second is None):
            return None  # nothing to count (an entry with caps only)
        usage = self._usage.get(name)
        burst = max(1.0, lim.calls_per_second or 0.0)
        if usage is None:
            if len(self._usage) >= MAX_TRACKED_PRINCIPALS:
                self._usage = {n: u for n, u in self._usage.items() if u.inflight}
            usage = self._usage[name] = _Usage(burst, now)
        if lim.max_inflight is not None and usage.inflight >= lim.max_inflight:
            return LimitRefusal("max_inflight", lim.max_inflight, INFLIGHT_RETRY_AFTER)
        rate = lim.calls_per_second
        if rate is not None:
            usage.tokens = min(burst, usage.tokens + max(0.0, now - usage.stamp) * rate)
            usage.stamp = now
            if usage.tokens < 1.0:
                return LimitRefusal("calls_per_second", rate, (1.0 - usage.tokens) / rate)
            usage.tokens -= 1.0
        usage.inflight += 1
        return None

    def release(self, name: str) -> None:
        usage = self._usage.get(name)
        if usage is not None and usage.inflight > 0:
            usage.inflight -= 1


def _first_match(limits: tuple[PrincipalLimit, ...], cache: dict[str, PrincipalLimit | None],
                 name: str) -> PrincipalLimit | None:
    """The first entry of ``limits`` whose glob matches ``name`` (remembered in ``cache``)."""
    if name not in cache:
        if len(cache) >= MAX_TRACKED_PRINCIPALS:
            cache.clear()
        cache[name] = next((lim for lim in limits if fnmatch.fnmatchcase(name, lim.pattern)), None)
    return cache[name]


class Held:
    """One resource a principal holds (see :class:`PrincipalCaps`); :meth:`release` gives it
    back, once (later calls do nothing)."""

    __slots__ = ("_caps", "cap", "name")

    def __init__(self, caps: PrincipalCaps | None, cap: str, name: str) -> None:
        self._caps = caps
        self.cap = cap
        self.name = name

    def release(self) -> None:
        caps, self._caps = self._caps, None
        if caps is not None:
            caps._release(self.cap, self.name)


#: What an anonymous caller holds: nothing is counted.
NOT_COUNTED = Held(None, "", "")


#: What each cap counts, for messages.
CAP_WHAT = {"max_sessions": "HTTP sessions", "max_connections": "connections",
            "max_listens": "open listens", "max_parked_flows": "calls waiting for its input"}


class CapReached(errors.Overloaded):
    """A principal is at one of its caps: -32006 ``rate_limited`` with ``data.limit`` (the
    cap's name) and ``data.value``."""

    def __init__(self, cap: str, value: int) -> None:
        super().__init__(f"this principal holds too many {CAP_WHAT[cap]} ({cap} = {value}; "
                         "[[auth.limits]])", reason="rate_limited", limit=cap, value=value)
        self.cap = cap
        self.value = value


class PrincipalCaps:
    """How many sessions, connections, listens and parked flows each principal holds, bounded
    per principal (:data:`DEFAULT_CAPS`, or its first matching ``[[auth.limits]]`` entry).

    Pure.  :meth:`acquire` counts one or raises :class:`CapReached`; the :class:`Held` it
    returns is the only way to count it down, once.  A caller without a principal (``None``)
    is not counted.  A reload changes the caps, not the counts.
    """

    def __init__(self, limits: Sequence[PrincipalLimit] = ()) -> None:
        self.limits = tuple(limits)
        self._matched: dict[str, PrincipalLimit | None] = {}
        self._held: dict[str, dict[str, int]] = {cap: {} for cap in DEFAULT_CAPS}

    def reconfigure(self, limits: Sequence[PrincipalLimit]) -> None:
        self.limits = tuple(limits)
        self._matched = {}

    def cap_for(self, cap: str, name: str) -> int:
        lim = _first_match(self.limits, self._matched, name)
        if lim is not None:
            for key, value in lim.caps:  # the caps it sets (a few pairs): no dict per acquire
                if key == cap:
                    return value
        return DEFAULT_CAPS[cap]

    def held(self, cap: str, name: str) -> int:
        return self._held[cap].get(name, 0)

    def acquire(self, cap: str, name: str | None) -> Held:
        """Count one ``cap`` resource of principal ``name`` (None: anonymous, not counted).

        Raises:
            CapReached: ``name`` already holds its cap of them.
        """
        if name is None:
            return NOT_COUNTED
        counts = self._held[cap]
        value = self.cap_for(cap, name)
        held = counts.get(name, 0)
        if held >= value:
            raise CapReached(cap, value)
        counts[name] = held + 1
        return Held(self, cap, name)

    def _release(self, cap: str, name: str) -> None:
        counts = self._held[cap]
        left = counts[name] - 1
        if left:
            counts[name] = left
        else:
            del counts[name]
