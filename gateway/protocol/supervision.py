"""Backend instance lifecycle as a pure state machine (no clock, no I/O), after supervisord::

    STOPPED ──start──► STARTING ──ready──► RUNNING ◄──healthy── UNHEALTHY
                          │                  │  └──missed ping──►──┘
                          │ exited/failed    │ exited / health restart
                          ▼                  ▼
                 BACKOFF (delay) or FATAL (crash loop) ; BACKOFF ──retry──► STARTING
    STARTING ──starved──► BACKOFF   (no resources to spawn it: never FATAL, not counted)
    RUNNING/UNHEALTHY ──recycled──► STARTING   (a restart the gateway chose: no failure, no delay)
    RUNNING/UNHEALTHY ──renewed───► STARTING   (the remote ended the session: a new one at once)
    STARTING/RUNNING/UNHEALTHY ──authorizing──► AUTHORIZING ──start──► STARTING  (not counted)
    any live state ──stop──► STOPPING ──stopped──► STOPPED ;  FATAL ──start──► STARTING

Each operation is guarded by the states it allows; an illegal one raises
:class:`IllegalTransition` (a bug).  The caller passes ``now`` and the jitter source.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from enum import Enum


class State(str, Enum):  # noqa: UP042 - StrEnum would change str() of a member
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    UNHEALTHY = "UNHEALTHY"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"
    STOPPING = "STOPPING"
    AUTHORIZING = "AUTHORIZING"


LIVE = frozenset({State.STARTING, State.RUNNING, State.UNHEALTHY, State.BACKOFF, State.FATAL,
                  State.AUTHORIZING})

#: A run at least this long resets the consecutive-failure count (and so the backoff delay).
STABLE_AFTER = 10.0
#: A remote session that a renewal began and that ends sooner than this is renewed as a failure
#: (counted, backed off): a remote forgetting every session at once does not make a tight loop.
RENEW_AFTER = 1.0
#: A spawn that failed for lack of resources is retried after at most this long (less when
#: ``backoff_max`` is less): the resources may come back any moment.
STARVED_BACKOFF_MAX = 5.0


class IllegalTransition(Exception):
    pass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_initial: float = 0.1
    backoff_max: float = 30.0
    max_restarts: int = 5
    window: float = 60.0


@dataclass(frozen=True, slots=True)
class Transition:
    old: State
    new: State
    reason: str
    delay: float | None = None  # BACKOFF: seconds until the next start


class Supervision:
    def __init__(self, policy: RestartPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.state = State.STOPPED
        self._rng = rng or random.Random()
        self._failures: deque[float] = deque()  # times of unexpected exits within the window
        self._consecutive = 0
        self._starved = 0  # spawns in a row that failed for lack of resources
        self._running_since: float | None = None
        self.starts = 0
        self.recycles = 0  # starts that were recycles (counted in ``starts`` too)
        self.renewals = 0  # starts that renewed an ended remote session (in ``starts`` too)
        self._renewing = False  # the current run began with a renewal

    def _go(self, new: State, reason: str, delay: float | None = None) -> Transition:
        t = Transition(self.state, new, reason, delay)
        self.state = new
        return t

    def _require(self, op: str, *allowed: State) -> None:
        if self.state not in allowed:
            raise IllegalTransition(f"{op} in state {self.state.value}")

    def start(self, reason: str = "start") -> Transition:
        self._require("start", State.STOPPED, State.BACKOFF, State.FATAL, State.AUTHORIZING)
        if self.state is State.FATAL:
            self._failures.clear()
            self._consecutive = 0
        self.starts += 1
        self._renewing = False
        return self._go(State.STARTING, reason)

    def ready(self, now: float) -> Transition:
        self._require("ready", State.STARTING)
        self._starved = 0
        self._running_since = now
        return self._go(State.RUNNING, "ready")

    def missed_ping(self) -> Transition:
        self._require("missed_ping", State.RUNNING, State.UNHEALTHY)
        return self._go(State.UNHEALTHY, "ping missed")

    def healthy(self) -> Transition:
        self._require("healthy", State.UNHEALTHY)
        return self._go(State.RUNNING, "ping answered")

    def exited(self, now: float, reason: str) -> Transition:
        """The child died (or was restarted for health) unexpectedly: BACKOFF or FATAL."""
        self._require("exited", State.STARTING, State.RUNNING, State.UNHEALTHY)
        if self._running_since is not None and now - self._running_since >= STABLE_AFTER:
            self._consecutive = 0
        self._running_since = None
        self._failures.append(now)
        while self._failures and self._failures[0] <= now - self.policy.window:
            self._failures.popleft()
        self._consecutive += 1
        if len(self._failures) > self.policy.max_restarts:
            return self._go(
                State.FATAL,
                f"{reason}; {len(self._failures)} failures within {self.policy.window:g}s",
            )
        base = min(
            self.policy.backoff_max,
            self.policy.backoff_initial * 2 ** min(self._consecutive - 1, 64),  # a float
        )
        delay = base * (0.5 + 0.5 * self._rng.random())  # jitter in [base/2, base]
        return self._go(State.BACKOFF, reason, delay)

    def starved(self, reason: str) -> Transition:
        """The child could not even be spawned for lack of resources (out of file descriptors,
        memory, processes): not the child's fault.  BACKOFF, never FATAL: it does not count
        toward the crash loop.  The delay starts at ``backoff_initial`` and doubles while the
        spawns keep failing, up to ``backoff_max`` or :data:`STARVED_BACKOFF_MAX`, whichever is
        less (with the same jitter as :meth:`exited`); the start it ends is not counted in
        :attr:`starts`."""
        self._require("starved", State.STARTING)
        self._starved += 1
        self.starts -= 1  # no child was started: not a (re)start in /status
        base = min(self.policy.backoff_max, STARVED_BACKOFF_MAX,  # 2**1024 is no float
                   self.policy.backoff_initial * 2 ** min(self._starved - 1, 64))
        return self._go(State.BACKOFF, reason, base * (0.5 + 0.5 * self._rng.random()))

    def recycled(self, now: float, reason: str = "recycled") -> Transition:
        """The gateway restarted a healthy child on purpose (a cancelled call it never answered,
        after draining): start the next one at once.  Not a failure: it never counts toward the
        crash loop (FATAL) nor grows the backoff delay."""
        self._require("recycled", State.RUNNING, State.UNHEALTHY)
        if self._running_since is not None and now - self._running_since >= STABLE_AFTER:
            self._consecutive = 0
        self._running_since = None
        self.starts += 1
        self.recycles += 1
        return self._go(State.STARTING, reason)

    def renewed(self, now: float, reason: str) -> Transition:
        """The remote ended the session (an HTTP 404): start a new one at once, not a failure;
        unless a renewal began this one and it ran less than :data:`RENEW_AFTER`: then it is
        one (:meth:`exited`)."""
        self._require("renewed", State.RUNNING, State.UNHEALTHY)
        if self._renewing and (self._running_since is None
                               or now - self._running_since < RENEW_AFTER):
            return self.exited(now, reason)
        self._renewing = True
        if self._running_since is not None and now - self._running_since >= STABLE_AFTER:
            self._consecutive = 0
        self._running_since = None
        self.starts += 1
        self.renewals += 1
        return self._go(State.STARTING, reason)

    def authorizing(self, reason: str) -> Transition:
        """The remote wants an authorization only an operator can give: wait for it.  Not a
        failure (no crash-loop count, no backoff), and the start it ends is not counted in
        :attr:`starts` (the one after the authorization is)."""
        self._require("authorizing", State.STARTING, State.RUNNING, State.UNHEALTHY)
        self._running_since = None
        self.starts -= 1
        return self._go(State.AUTHORIZING, reason)

    def stop(self, reason: str = "stop") -> Transition:
        self._require("stop", *LIVE)
        self._running_since = None
        return self._go(State.STOPPING, reason)

    def stopped(self) -> Transition:
        self._require("stopped", State.STOPPING)
        return self._go(State.STOPPED, "stopped")

    def uptime(self, now: float) -> float | None:
        if self.state in (State.RUNNING, State.UNHEALTHY) and self._running_since is not None:
            return now - self._running_since
        return None
