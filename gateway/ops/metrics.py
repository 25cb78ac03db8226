"""Prometheus metrics for the gateway: event-fed counters and histograms, snapshot-fed gauges.

Theory of operation:

* Counters and histograms move only through :class:`gateway.events.EventBus` events (handlers
  run synchronously in the emitting task and are cheap); business logic never touches a metric.
* State gauges (connections, backend up/state/RSS, pending server requests, readiness) are
  computed at scrape time from one :class:`GatewayStatus` snapshot, so they cannot drift.  The
  in-flight gauge is the exception: it follows ``RequestStarted``/``RequestFinished`` pairs.
* Label values come from bounded sets: enums in the events, backend names from config, error
  codes via :func:`errors.code_name`, tool names (untrusted) capped at ``max_tool_series``.
* The registry is private, ``_created`` series are off (a process-wide prometheus_client
  switch), and there is no multiprocess mode.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterable
from typing import Any

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from gateway import errors, events, procfs
from gateway.status import GatewayStatus

LOGGER = logging.getLogger(__name__)

PREFIX = "mcp_gateway_"
#: 100 µs (proxy overhead) … 60 s (slow tools/call); 18 buckets plus +Inf.
# fmt: off
BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5,
           10, 30, 60)
# fmt: on
#: The supervisor's instance states, in "most alive first" order (see :func:`summary_state`).
STATES = ("RUNNING", "STARTING", "UNHEALTHY", "BACKOFF", "STOPPING", "FATAL", "STOPPED")
GATEWAY_BACKEND = "_gateway"  # backend label for requests the gateway answers itself
OVERFLOW_TOOL = "_overflow"
MAX_TOOL_LABEL_CHARS = 128
CATALOG_KINDS = ("tools", "prompts", "resources", "templates")

# The metric tables: name after PREFIX -> (help, label names).
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "client_connections_opened_total": ("Client connections accepted.", ("transport",)),
    "client_connections_closed_total": ("Client connections closed.", ("transport", "reason")),
    "client_connections_refused_total": (
        "Client connections turned away.",
        ("transport", "reason"),
    ),
    "requests_total": ("Client requests finished.", ("method", "backend", "outcome")),
    "jsonrpc_errors_total": ("JSON-RPC errors returned to clients.", ("code",)),
    "tool_calls_total": ("tools/call requests per tool (capped).", ("backend", "tool")),
    "tool_series_overflow_total": ('Tool calls counted as tool="_overflow".', ()),
    "backend_starts_total": ("Backend instances started.", ("backend",)),
    "backend_exits_total": ("Backend processes that ended.", ("backend", "reason")),
    "backend_protocol_errors_total": ("Non-JSON-RPC lines from backends.", ("backend", "kind")),
    "backend_stderr_lines_total": (
        "Backend stderr lines, logged or held back by the rate limit.",
        ("backend", "logged"),
    ),
    "catalog_changes_total": ("Changes of the merged catalog.", ("kind",)),
    "server_requests_total": ("Server requests finished.", ("backend", "method", "outcome")),
    "unroutable_server_requests_total": (
        "Undeliverable server requests.",
        ("backend", "method", "reason"),
    ),
    "refused_answers_total": ("Client answers to requests they do not own.", ("reason",)),
    "config_reloads_total": ("Configuration reload attempts.", ("result",)),
}
HISTOGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "request_duration_seconds": ("Client request receipt to answer.", ("method", "backend")),
    "overhead_seconds": ("Request time spent in the gateway, not the backend.", ("method",)),
    "queue_wait_seconds": ("Time calls waited for a backend instance.", ("backend",)),
    "backend_start_duration_seconds": ("Spawn to completed MCP handshake.", ("backend",)),
    "event_loop_lag_seconds": ("Overshoot of a periodic trio.sleep.", ()),
}
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "build_info": ("Build metadata (always 1).", ("version", "python_version", "trio_version")),
    "inflight_requests": ("Client requests being processed.", ("backend",)),
    "config_last_reload_success": ("1 if the last config (re)load succeeded.", ()),
    "config_last_reload_success_timestamp_seconds": ("Last successful config (re)load.", ()),
}
#: Gauges computed from the status snapshot at scrape time.
STATUS_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ready": ("1 when /readyz answers 200.", ()),
    "client_connections_active": ("Open client sessions.", ("transport",)),
    "backend_up": ("1 if any instance of the backend is RUNNING.", ("backend",)),
    "backend_state": ("One-hot summary state of the backend.", ("backend", "state")),
    "backend_instances": ("Backend instances per state.", ("backend", "state")),
    "backend_resident_memory_bytes": ("RSS of the backend's process groups.", ("backend",)),
    "backend_catalog_items": ("Catalog entries a backend advertises.", ("backend", "kind")),
    "server_requests_pending": ("Server-to-client requests awaiting an answer.", ()),
    "buffered_bytes": ("Bytes of client and backend messages queued in the gateway.", ()),
}


def summary_state(states: Iterable[str]) -> str:
    """One state for a backend with several instances: the most alive one (STOPPED if none)."""
    present = set(states)
    return next((s for s in STATES if s in present), "STOPPED")


class _StatusCollector(Collector):
    """Gauges read from one status snapshot per scrape."""

    def __init__(self, status: Callable[[], GatewayStatus], proc: str) -> None:
        self._status = status
        self._proc = proc

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._status())

    def _families(self, snap: GatewayStatus | None) -> list[Metric]:
        fam = {
            name: GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for name, (doc, labels) in STATUS_GAUGES.items()
        }
        if snap is not None:
            self._fill(fam, snap)
        return list(fam.values())

    def _fill(self, fam: dict[str, GaugeMetricFamily], snap: GatewayStatus) -> None:
        fam["ready"].add_metric([], 1.0 if snap.ready else 0.0)
        fam["server_requests_pending"].add_metric([], snap.pending_server_requests)
        fam["buffered_bytes"].add_metric([], snap.buffered_bytes)
        for transport, count in sorted(snap.connections.items()):
            fam["client_connections_active"].add_metric([transport], count)
        pids = [i.pid for b in snap.backends for i in b.instances if i.pid is not None]
        memory = procfs.group_rss(pids, self._proc)
        for b in snap.backends:
            states = [i.state for i in b.instances]
            fam["backend_up"].add_metric([b.name], 1.0 if "RUNNING" in states else 0.0)
            summary = summary_state(states)
            for s in STATES:
                fam["backend_state"].add_metric([b.name, s], 1.0 if s == summary else 0.0)
                fam["backend_instances"].add_metric([b.name, s], states.count(s))
            if memory is not None:
                rss = sum(memory.get(i.pid, 0) for i in b.instances if i.pid is not None)
                fam["backend_resident_memory_bytes"].add_metric([b.name], rss)
            for kind in CATALOG_KINDS:
                fam["backend_catalog_items"].add_metric([b.name, kind], getattr(b, kind))


class GatewayMetrics:
    """Every metric the gateway exports, on a private registry, fed by the event bus.

    Args:
        bus: the events to subscribe to (unsubscribe again with :meth:`close`).
        status: returns the current snapshot; called once per scrape, in the trio thread.
        max_tool_series: distinct ``(backend, tool)`` series before calls land in
            ``tool="_overflow"`` (counted by ``mcp_gateway_tool_series_overflow_total``).
        version: the gateway version for ``mcp_gateway_build_info``.
        proc: the procfs mount (tests may point it elsewhere).
    """

    def __init__(
        self,
        bus: events.EventBus,
        status: Callable[[], GatewayStatus],
        *,
        max_tool_series: int = 500,
        version: str,
        proc: str = procfs.PROC,
    ) -> None:
        disable_created_metrics()
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        reg.register(_StatusCollector(status, proc))
        self._max_tool_series = max_tool_series
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._tool_series: set[tuple[str, str]] = set()
        self._c = {n: Counter(PREFIX + n, d, ls, registry=reg) for n, (d, ls) in COUNTERS.items()}
        self._g = {n: Gauge(PREFIX + n, d, ls, registry=reg) for n, (d, ls) in GAUGES.items()}
        self._h = {
            n: Histogram(PREFIX + n, d, ls, registry=reg, buckets=BUCKETS)
            for n, (d, ls) in HISTOGRAMS.items()
        }
        self._g["build_info"].labels(version, platform.python_version(), trio.__version__).set(1)
        for name in (*errors.CODE_NAMES.values(), "other"):
            self._c["jsonrpc_errors_total"].labels(name)
        for transport in ("websocket", "unix"):
            self._c["client_connections_refused_total"].labels(transport, "max_connections")
        for result in ("success", "failure"):
            self._c["config_reloads_total"].labels(result)
        self._g["config_last_reload_success"].set(1)  # the startup load counts, as in Prometheus
        self._g["config_last_reload_success_timestamp_seconds"].set(time.time())
        inc = self._inc
        self._handlers: dict[type, Callable[[Any], None]] = {
            events.ConnectionOpened: lambda e: inc("client_connections_opened_total", e.transport),
            events.ConnectionClosed: lambda e: inc(
                "client_connections_closed_total", e.transport, e.reason
            ),
            events.ConnectionRefused: lambda e: inc(
                "client_connections_refused_total", e.transport, e.reason
            ),
            events.RequestStarted: lambda e: self._inflight(e.backend).inc(),
            events.QueueWaited: lambda e: self._observe("queue_wait_seconds", e.seconds, e.backend),
            events.RequestFinished: self._on_request_finished,
            events.BackendStarted: self._on_backend_started,
            events.BackendExited: lambda e: inc("backend_exits_total", e.backend, e.reason),
            events.BackendProtocolError: lambda e: inc(
                "backend_protocol_errors_total", e.backend, e.kind
            ),
            events.BackendStderr: self._on_backend_stderr,
            events.CatalogChanged: self._on_catalog_changed,
            events.ServerRequestFinished: lambda e: inc(
                "server_requests_total", _backend(e.backend), e.method, e.outcome
            ),
            events.ServerRequestRefused: lambda e: inc(
                "unroutable_server_requests_total", e.backend, e.method, e.reason
            ),
            events.AnswerRefused: lambda e: inc("refused_answers_total", e.reason),
            events.ReloadFinished: self._on_reload,
        }
        self._unsubscribe = bus.subscribe(self._on_event)

    def close(self) -> None:
        """Stop listening to the bus (the registry keeps its values)."""
        self._unsubscribe()

    def exposition(self, accept_header: str | None) -> tuple[bytes, str]:
        """Render the registry in the format the ``Accept`` header asks for.

        Returns:
            ``(body, content_type)``: OpenMetrics when asked for, else the Prometheus text format.
        """
        encoder, content_type = choose_encoder(accept_header or "")
        return encoder(self.registry), content_type

    async def run_lag_probe(
        self,
        *,
        interval: float = 0.5,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Observe how late ``trio.sleep(interval)`` wakes up, forever."""
        task_status.started()
        while True:
            start = trio.current_time()
            await trio.sleep(interval)
            lag = max(0.0, trio.current_time() - start - interval)
            self._observe("event_loop_lag_seconds", lag)

    def _on_event(self, event: events.Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    # Labelled children are cached: prometheus_client's labels() costs microseconds per call,
    # and the label sets are bounded by construction, so the cache is too.

    def _child(self, family: Any, name: str, labels: tuple[str, ...]) -> Any:
        key = (name, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels) if labels else family
        return child

    def _inc(self, name: str, *labels: str) -> None:
        self._child(self._c[name], name, labels).inc()

    def _observe(self, name: str, value: float, *labels: str) -> None:
        self._child(self._h[name], name, labels).observe(value)

    def _inflight(self, backend: str) -> Gauge:
        return self._child(self._g["inflight_requests"], "inflight_requests", (_backend(backend),))

    def _on_request_finished(self, e: events.RequestFinished) -> None:
        backend = _backend(e.backend)
        if e.backend:  # RequestStarted is emitted exactly when a backend is chosen
            self._inflight(backend).dec()
        self._inc("requests_total", e.method, backend, e.outcome)
        self._observe("request_duration_seconds", e.duration, e.method, backend)
        if e.backend_time is not None:
            overhead = max(0.0, e.duration - e.backend_time)
            self._observe("overhead_seconds", overhead, e.method)
        if e.error_code is not None:
            self._inc("jsonrpc_errors_total", errors.code_name(e.error_code))
        if e.tool is not None:
            self._inc("tool_calls_total", backend, self._tool_label(backend, e.tool))

    def _tool_label(self, backend: str, tool: str) -> str:
        tool = tool[:MAX_TOOL_LABEL_CHARS]
        if (backend, tool) not in self._tool_series:
            if len(self._tool_series) >= self._max_tool_series:
                self._inc("tool_series_overflow_total")
                return OVERFLOW_TOOL
            self._tool_series.add((backend, tool))
        return tool

    def _on_backend_started(self, e: events.BackendStarted) -> None:
        self._inc("backend_starts_total", e.backend)
        self._observe("backend_start_duration_seconds", e.start_duration, e.backend)

    def _on_backend_stderr(self, e: events.BackendStderr) -> None:
        name = "backend_stderr_lines_total"
        if e.logged:
            self._child(self._c[name], name, (e.backend, "true")).inc(e.logged)
        if e.suppressed:
            self._child(self._c[name], name, (e.backend, "false")).inc(e.suppressed)

    def _on_catalog_changed(self, e: events.CatalogChanged) -> None:
        for kind in e.kinds:
            self._inc("catalog_changes_total", kind)

    def _on_reload(self, e: events.ReloadFinished) -> None:
        self._inc("config_reloads_total", "success" if e.success else "failure")
        self._g["config_last_reload_success"].set(1 if e.success else 0)
        if e.success:
            self._g["config_last_reload_success_timestamp_seconds"].set(time.time())


def _backend(name: str) -> str:
    return name or GATEWAY_BACKEND
