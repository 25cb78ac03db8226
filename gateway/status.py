"""Point-in-time snapshots of the daemon for ``/status``, ``/readyz`` and gauge metrics.

The hub builds a :class:`GatewayStatus` on demand (cheap: a walk over a few dicts); the admin
endpoint serialises it and the metrics collector reads gauges from it at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.supervision import State


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    name: str  # "time/0"
    state: str  # a supervision.State's value: STOPPED / STARTING / RUNNING / UNHEALTHY / …
    pid: int | None
    restarts: int  # starts after the first one
    uptime: float | None  # seconds since RUNNING, None when not running
    last_exit: str | None  # e.g. "crashed (exit code 1)"
    # last stderr lines: of the running child, else of the last one that ended
    stderr_tail: tuple[str, ...]
    inflight: int  # calls waiting on this child (attribution set size)
    # per-session / affine: the conn id it serves; per-principal: its principal's label
    owner: str | None = None
    recycles: int = 0  # of ``restarts``, those that were recycles (not failures)
    draining: bool = False  # drained for a recycle: no new calls, those in flight end
    era: str | None = None  # "legacy" / "modern": what the running child's handshake found
    protocol_version: str | None = None  # the revision spoken with the running child
    origin: str | None = None  # where its link goes when that is not a process (no credentials)
    last_error: str | None = None  # the last transport failure its link saw
    latency: float | None = None  # seconds: the last health probe's round trip (None before one)


@dataclass(frozen=True, slots=True)
class BackendStatus:
    name: str
    required: bool
    sharing: str
    instances: tuple[InstanceStatus, ...]
    tools: int
    prompts: int
    resources: int
    templates: int
    protocol_mode: str = "prefer_legacy"  # the backend's config key
    modern_seen: bool = False  # a child of it spoke 2026-07-28: a legacy one after that is an error
    connector: str = "stdio"  # how its instances reach the upstream: stdio, memory
    # a remote's own access token (``[oauth]``): endpoint, valid_until, fetches, failures,
    # last_error; never the token
    oauth: dict[str, Any] | None = None
    # a per-principal remote's token exchange (``[token_exchange]``): endpoint, audience,
    # principals held, exchanges, failures, last_error; never a token nor a principal
    token_exchange: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ListenerStatus:
    """A bound client listener and how it is guarded (``auth_configured``: what the operator
    configured in ``[auth]``; there is no default authenticator to confuse with it)."""

    name: str  # websocket / http / unix
    address: str  # "127.0.0.1:8765", "[::]:8766", or the unix socket's path
    loopback: bool  # bound to loopback (a unix socket counts as local)
    tls: bool  # speaks TLS itself (listen.tls_cert / tls_key)
    auth_configured: bool  # [auth] holds an authenticator (the unix socket uses SO_PEERCRED)
    behind_proxy: bool = False  # listen.behind_proxy: TLS ends at a proxy in front
    public_url: str | None = None  # listen.public_url


@dataclass(frozen=True, slots=True)
class GatewayStatus:
    version: str
    backends: tuple[BackendStatus, ...]
    connections: dict[str, int] = field(default_factory=dict)  # by transport
    listeners_bound: bool = False
    draining: bool = False  # new requests are refused; calls in flight finish
    stopping: bool = False  # SIGTERM received: lame duck (gateway.drain_delay), then draining
    pending_server_requests: int = 0
    buffered_bytes: int = 0  # queued client/backend message bytes (gateway.buffered_bytes_total)
    client_requests_in_flight: int = 0  # client requests read and not yet answered, all sessions
    outbound_messages_queued: int = 0  # messages waiting in the sessions' outbound queues
    # max_connections slots taken: accepted connections, handshakes included
    connection_slots: int = 0
    # authenticators and listeners (gateway.auth)
    auth: dict[str, Any] = field(default_factory=dict)
    listeners: tuple[ListenerStatus, ...] = ()  # the client listeners bound, and their guards

    def not_ready_because(self) -> list[str]:
        """Why the daemon is not ready, in words for ``/readyz`` (empty when it is ready):
        listeners bound, every required backend has a RUNNING instance, not stopping."""
        problems = [] if self.listeners_bound else ["listeners not bound"]
        if self.draining:
            problems.append("draining")
        elif self.stopping:
            problems.append("stopping (draining after gateway.drain_delay)")
        for backend in self.backends:
            if backend.required and not any(i.state == State.RUNNING for i in backend.instances):
                problems.append(f"backend {backend.name} not running")
        return problems

    @property
    def ready(self) -> bool:
        return not self.not_ready_because()
