"""Prometheus metrics for the gateway: event-fed counters and histograms, snapshot-fed gauges.

* Counters and histograms move only through :class:`gateway.events.EventBus` events; business
  logic never touches a metric.  The event-fed series are plain numbers keyed by label-value
  tuples (:class:`_EventSeries`), not prometheus_client objects (whose every update takes a
  lock a one-thread trio process does not need), rendered at scrape time exactly as
  prometheus_client would (``tests/unit/golden`` pins that scrape).
* State gauges are computed at scrape time from one :class:`GatewayStatus` snapshot, so they
  cannot drift; the in-flight gauge follows ``RequestStarted``/``RequestFinished``.  Finished
  requests are held and folded in by label set before each scrape (exact at every scrape).
* Label values come from bounded sets; untrusted tool names are capped at ``max_tool_series``
  (call counts, all backends) and ``max_tool_latency_series`` (latency, per backend).
* The registry is private, ``_created`` series are off, and there is no multiprocess mode.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

import trio
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway import errors, events, procfs
from gateway.status import GatewayStatus

LOGGER = logging.getLogger(__name__)

PREFIX = "mcp_gateway_"
#: 0.1 ms (proxy overhead) … 60 s (slow tools/call); 18 buckets plus +Inf.
# fmt: off
BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5,
           10, 30, 60)
# fmt: on
#: The supervisor's instance states, in "most alive first" order (see :func:`summary_state`).
STATES = ("RUNNING", "STARTING", "UNHEALTHY", "AUTHORIZING", "BACKOFF", "STOPPING", "FATAL",
          "STOPPED")
GATEWAY_BACKEND = "_gateway"  # backend label for requests the gateway answers itself
OVERFLOW_TOOL = "_overflow"
#: ``RequestFinished`` events held before they are folded into their series (a scrape folds
#: whatever is held first)
FOLD_EVERY = 256
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
    "requests_total": (
        "Client requests finished.",
        ("method", "backend", "outcome", "principal"),
    ),
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
    "input_required_results_total": (
        "Modern calls answered input_required for a legacy backend's requests (era bridging).",
        ("backend",),
    ),
    "request_states_refused_total": ("Retries whose requestState was refused.", ("reason",)),
    "config_reloads_total": ("Configuration reload attempts.", ("result",)),
    "audit_records_dropped_total": (
        "Audit records lost: the queue was full (on_full = drop) or a write failed.", ()),
}
HISTOGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "request_duration_seconds": ("Client request receipt to answer.", ("method", "backend")),
    "overhead_seconds": ("Request time spent in the gateway, not the backend.", ("method",)),
    "tool_call_duration_seconds": ("tools/call receipt to answer per tool (capped per backend).",
                                   ("backend", "tool")),
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
    "backend_up": ("1 if any instance of the backend is RUNNING.",
                   ("backend", "required", "connector")),
    "backend_state": ("One-hot summary state of the backend.", ("backend", "state")),
    "backend_instances": ("Backend instances per state.", ("backend", "state")),
    "backend_resident_memory_bytes": ("RSS of the backend's process groups.", ("backend",)),
    "backend_catalog_items": ("Catalog entries a backend advertises.", ("backend", "kind")),
    "backend_era_instances": ("Running children of the backend by the protocol era they speak "
                              "(legacy: initialize; modern: 2026-07-28).", ("backend", "era")),
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
        return [*fam.values(), *_token_fetches(snap)]

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
            fam["backend_up"].add_metric(
                [b.name, "true" if b.required else "false", b.connector],
                1.0 if "RUNNING" in states else 0.0)
            summary = summary_state(states)
            for s in STATES:
                fam["backend_state"].add_metric([b.name, s], 1.0 if s == summary else 0.0)
                fam["backend_instances"].add_metric([b.name, s], states.count(s))
            if memory is not None:
                rss = sum(memory.get(i.pid, 0) for i in b.instances if i.pid is not None)
                fam["backend_resident_memory_bytes"].add_metric([b.name], rss)
            for kind in CATALOG_KINDS:
                fam["backend_catalog_items"].add_metric([b.name, kind], getattr(b, kind))
            eras = [i.era for i in b.instances]
            for e in ("legacy", "modern"):
                fam["backend_era_instances"].add_metric([b.name, e], eras.count(e))


def _token_fetches(snap: GatewayStatus | None) -> list[Metric]:
    """The remote backends' access token fetches by outcome (``[oauth]``), from their counts
    in the snapshot; no family at all while no backend has ``[oauth]``."""
    remotes = [b for b in snap.backends if b.oauth is not None] if snap is not None else []
    if not remotes:
        return []
    fam = CounterMetricFamily(PREFIX + "backend_token_fetches",
                              "Access token fetches of remote backends ([oauth]), by outcome.",
                              labels=("backend", "outcome"))
    for b in remotes:
        assert b.oauth is not None
        fam.add_metric([b.name, "ok"], b.oauth["fetches"] - b.oauth["failures"])
        fam.add_metric([b.name, "failed"], b.oauth["failures"])
    return [fam]


#: A histogram series: the count per bucket (``BUCKETS`` then +Inf), then the sum.
_Buckets = list[float]
_LE = tuple(floatToGoString(bound) for bound in (*BUCKETS, math.inf))
_SUM = len(_LE)


def _observe(series: dict[tuple[str, ...], _Buckets], key: tuple[str, ...], value: float) -> None:
    buckets = series.get(key) or _new_series(series, key)
    buckets[bisect_left(BUCKETS, value)] += 1.0  # the first bound >= value, else +Inf
    buckets[_SUM] += value


def _new_series(series: dict[tuple[str, ...], _Buckets], key: tuple[str, ...]) -> _Buckets:
    buckets = series[key] = [0.0] * (_SUM + 1)
    return buckets


class _Cells:
    """Where the events of one ``RequestFinished`` label set go, while a fold runs."""

    __slots__ = ("calls", "durations", "inflight", "latency", "overflows", "overheads",
                 "requests", "tool")

    def __init__(self, inflight: tuple[str, ...] | None, requests: tuple[str, ...],
                 durations: _Buckets) -> None:
        self.calls = 0
        self.inflight = inflight  # the in-flight gauge's key (None: no backend was chosen)
        self.requests = requests
        self.durations = durations
        self.overheads: _Buckets | None = None
        self.latency: _Buckets | None = None
        self.tool: tuple[str, str] | None = None  # the tool calls series
        self.overflows = False  # a new tool past max_tool_series: every call of it is counted


class _EventSeries(Collector):
    """The event-fed counters, gauges and histograms as plain numbers, rendered per scrape.

    ``counters[name]``, ``gauges[name]`` and ``histograms[name]`` map a tuple of label values
    (in the order the table names the labels) to a value or a :data:`_Buckets` list.  Unlabelled
    series exist from the start with the key ``()``.  Only the trio thread touches them.
    """

    def __init__(self) -> None:
        #: brings the series up to date before a scrape reads them (held events folded in)
        self.before_collect: Callable[[], None] | None = None
        self.counters: dict[str, dict[tuple[str, ...], float]] = {n: {} for n in COUNTERS}
        self.gauges: dict[str, dict[tuple[str, ...], float]] = {n: {} for n in GAUGES}
        self.histograms: dict[str, dict[tuple[str, ...], _Buckets]] = {n: {} for n in HISTOGRAMS}
        for table, values in ((COUNTERS, self.counters), (GAUGES, self.gauges)):
            for name, (_, labels) in table.items():
                if not labels:
                    values[name][()] = 0.0
        for name, (_, labels) in HISTOGRAMS.items():
            if not labels:
                self.histograms[name][()] = [0.0] * (_SUM + 1)

    def describe(self) -> Iterable[Metric]:
        return self._families(samples=False)

    def collect(self) -> Iterable[Metric]:
        if self.before_collect is not None:
            self.before_collect()
        return self._families(samples=True)

    def _families(self, *, samples: bool) -> list[Metric]:
        families: list[Metric] = []
        for name, (doc, labels) in COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for key, value in self.counters[name].items() if samples else ():
                counter.add_metric([str(v) for v in key], value)
            families.append(counter)
        for name, (doc, labels) in GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for key, value in self.gauges[name].items() if samples else ():
                gauge.add_metric([str(v) for v in key], value)
            families.append(gauge)
        for name, (doc, labels) in HISTOGRAMS.items():
            histogram = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            for key, buckets in self.histograms[name].items() if samples else ():
                cumulative, total = [], 0.0
                for le, count in zip(_LE, buckets[:_SUM], strict=True):
                    total += count
                    cumulative.append((le, total))
                histogram.add_metric([str(v) for v in key], cumulative, buckets[_SUM])
            families.append(histogram)
        return families


class GatewayMetrics:
    """Every metric the gateway exports, on a private registry, fed by the event bus.

    Args:
        bus: the events to subscribe to (unsubscribe again with :meth:`close`).
        status: returns the current snapshot; called once per scrape, in the trio thread.
        max_tool_series: distinct ``(backend, tool)`` series before calls land in
            ``tool="_overflow"`` (counted by ``mcp_gateway_tool_series_overflow_total``).
        max_tool_latency_series: distinct tools per backend with their own latency histogram;
            the backend's other tools share ``tool="_overflow"``.
        version: the gateway version for ``mcp_gateway_build_info``.
        proc: the procfs mount (tests may point it elsewhere).
    """

    def __init__(
        self,
        bus: events.EventBus,
        status: Callable[[], GatewayStatus],
        *,
        max_tool_series: int = 500,
        max_tool_latency_series: int = 100,
        version: str,
        proc: str = procfs.PROC,
    ) -> None:
        disable_created_metrics()
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        reg.register(_StatusCollector(status, proc))
        series = _EventSeries()
        reg.register(series)
        self._max_tool_series = max_tool_series
        self._tool_series: set[tuple[str, str]] = set()
        self._max_latency_series = max_tool_latency_series
        self._latency_tools: dict[str, set[str]] = {}  # backend -> tools with their own series
        self._c, self._g, self._h = series.counters, series.gauges, series.histograms
        # The per-call series, bound once (see _on_request_started/_on_request_finished).
        self._inflight = self._g["inflight_requests"]
        self._requests = self._c["requests_total"]
        self._durations = self._h["request_duration_seconds"]
        self._overheads = self._h["overhead_seconds"]
        self._tool_calls = self._c["tool_calls_total"]
        self._tool_durations = self._h["tool_call_duration_seconds"]
        self._finished: list[events.RequestFinished] = []  # not folded in yet (_fold)
        series.before_collect = self._fold
        self._g["build_info"][(version, platform.python_version(), trio.__version__)] = 1.0
        for name in (*errors.CODE_NAMES.values(), "other"):
            self._c["jsonrpc_errors_total"][(name,)] = 0.0
        for transport in ("websocket", "unix", "http"):
            self._c["client_connections_refused_total"][(transport, "max_connections")] = 0.0
        self._c["audit_records_dropped_total"][()] = 0.0
        for result in ("success", "failure"):
            self._c["config_reloads_total"][(result,)] = 0.0
        self._g["config_last_reload_success"][()] = 1.0  # the startup load counts, as in Prometheus
        self._g["config_last_reload_success_timestamp_seconds"][()] = time.time()
        inc = self._inc
        handlers: dict[type, Callable[[Any], None]] = {
            events.ConnectionOpened: lambda e: inc("client_connections_opened_total", e.transport),
            events.ConnectionClosed: lambda e: inc(
                "client_connections_closed_total", e.transport, e.reason
            ),
            events.ConnectionRefused: lambda e: inc(
                "client_connections_refused_total", e.transport, e.reason
            ),
            events.RequestStarted: self._on_request_started,
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
            events.InputRequired: lambda e: inc("input_required_results_total",
                                                _backend(e.backend)),
            events.RequestStateRefused: lambda e: inc("request_states_refused_total", e.reason),
            events.ReloadFinished: self._on_reload,
            events.AuditRecordsDropped: lambda e: inc("audit_records_dropped_total",
                                                           amount=e.count),
        }
        self._unsubscribe = [bus.subscribe(handler, kind) for kind, handler in handlers.items()]

    def close(self) -> None:
        """Stop listening to the bus (the registry keeps its values)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []

    def exposition(self, accept_header: str | None) -> tuple[bytes, str]:
        """Render the registry in the format the ``Accept`` header asks for.

        Call it in the trio thread: the event-fed series are read without a lock.

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

    def _inc(self, name: str, *labels: str, amount: float = 1.0) -> None:
        values = self._c[name]
        values[labels] = values.get(labels, 0.0) + amount

    def _observe(self, name: str, value: float, *labels: str) -> None:
        _observe(self._h[name], labels, value)

    # The per-call handlers: a few dict operations each, with the series dicts bound in __init__.

    def _on_request_started(self, e: events.RequestStarted) -> None:
        key = (e.backend or GATEWAY_BACKEND,)
        self._inflight[key] = self._inflight.get(key, 0.0) + 1.0

    def _on_request_finished(self, e: events.RequestFinished) -> None:
        finished = self._finished
        finished.append(e)
        if len(finished) >= FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """Fold the held ``RequestFinished`` events into their series (before every scrape, and
        every :data:`FOLD_EVERY` events), in arrival order (the same sums, bit for bit).  The
        series of a label set are looked up at its first event (which decides its tool series
        as it would alone) and its counters moved once."""
        finished, self._finished = self._finished, []
        cells: dict[tuple[str, str, events.RequestOutcome, str, str | None], _Cells] = {}
        for e in finished:
            key = (e.method, e.backend, e.outcome, e.principal, e.tool)
            cell = cells.get(key)
            if cell is None:
                cell = cells[key] = self._cells(e)
            cell.calls += 1
            duration = e.duration
            slot = bisect_left(BUCKETS, duration)  # the first bound >= duration, else +Inf
            buckets = cell.durations
            buckets[slot] += 1.0
            buckets[_SUM] += duration
            latency = cell.latency
            if latency is not None:  # the same value, the same bucket
                latency[slot] += 1.0
                latency[_SUM] += duration
            if e.backend_time is not None:
                overhead = duration - e.backend_time
                if overhead < 0.0:
                    overhead = 0.0
                overheads = cell.overheads
                if overheads is None:  # made by the first event that has one
                    by = (e.method,)
                    overheads = cell.overheads = (self._overheads.get(by)
                                                  or _new_series(self._overheads, by))
                overheads[bisect_left(BUCKETS, overhead)] += 1.0
                overheads[_SUM] += overhead
            if e.error_code is not None:
                self._inc("jsonrpc_errors_total", errors.code_name(e.error_code))
        for cell in cells.values():
            n = float(cell.calls)
            if cell.inflight is not None:
                self._inflight[cell.inflight] = self._inflight.get(cell.inflight, 0.0) - n
            self._requests[cell.requests] = self._requests.get(cell.requests, 0.0) + n
            if cell.tool is not None:
                if cell.overflows:
                    self._inc("tool_series_overflow_total", amount=n - 1.0)  # the first: counted
                self._tool_calls[cell.tool] = self._tool_calls.get(cell.tool, 0.0) + n

    def _cells(self, e: events.RequestFinished) -> _Cells:
        """The series of ``e``'s label set (its tool series decided now, as for ``e`` alone)."""
        method = e.method
        backend = e.backend or GATEWAY_BACKEND
        key: tuple[str, ...] = (method, backend)
        cell = _Cells((backend,) if e.backend else None, (method, backend, e.outcome, e.principal),
                      self._durations.get(key) or _new_series(self._durations, key))
        if e.tool is not None:
            tool = e.tool[:MAX_TOOL_LABEL_CHARS]
            key = (backend, tool)
            if key not in self._tool_series:
                key = self._new_tool_series(key)
                cell.overflows = key[1] == OVERFLOW_TOOL
            cell.tool = key
            if e.backend:  # a call the gateway refused itself has no backend latency to show
                key = (backend, self._latency_tool(backend, tool))
                cell.latency = self._tool_durations.get(key) or _new_series(self._tool_durations,
                                                                            key)
        return cell

    def _new_tool_series(self, key: tuple[str, str]) -> tuple[str, str]:
        """``key`` as the label values of a new tool series, or the overflow series when full."""
        if len(self._tool_series) >= self._max_tool_series:
            self._inc("tool_series_overflow_total")
            return (key[0], OVERFLOW_TOOL)
        self._tool_series.add(key)
        return key

    def _latency_tool(self, backend: str, tool: str) -> str:
        """``tool`` as its latency series' label, or ``_overflow`` once the backend's are full."""
        tools = self._latency_tools.get(backend)
        if tools is None:
            tools = self._latency_tools[backend] = set()
        elif tool in tools:
            return tool
        if len(tools) >= self._max_latency_series:
            return OVERFLOW_TOOL
        tools.add(tool)
        return tool

    def _on_backend_started(self, e: events.BackendStarted) -> None:
        self._inc("backend_starts_total", e.backend)
        self._observe("backend_start_duration_seconds", e.start_duration, e.backend)

    def _on_backend_stderr(self, e: events.BackendStderr) -> None:
        if e.logged:
            self._inc("backend_stderr_lines_total", e.backend, "true", amount=e.logged)
        if e.suppressed:
            self._inc("backend_stderr_lines_total", e.backend, "false", amount=e.suppressed)

    def _on_catalog_changed(self, e: events.CatalogChanged) -> None:
        for kind in e.kinds:
            self._inc("catalog_changes_total", kind)

    def _on_reload(self, e: events.ReloadFinished) -> None:
        self._inc("config_reloads_total", "success" if e.success else "failure")
        self._g["config_last_reload_success"][()] = 1.0 if e.success else 0.0
        if e.success:
            self._g["config_last_reload_success_timestamp_seconds"][()] = time.time()


def _backend(name: str) -> str:
    return name or GATEWAY_BACKEND
