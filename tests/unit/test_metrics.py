"""GatewayMetrics: events in through a real EventBus, exposition out, parsed back."""

from __future__ import annotations

import os
import platform
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from helpers import poll
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families

from gateway import errors
from gateway import events as ev
from gateway.ops.metrics import BUCKETS, FOLD_EVERY, PREFIX, STATES, GatewayMetrics
from gateway.procfs import group_rss as process_group_rss
from gateway.status import BackendStatus, GatewayStatus, InstanceStatus

EXPECTED_FAMILIES = {
    "mcp_gateway_build_info",
    "mcp_gateway_ready",
    "mcp_gateway_client_connections_active",
    "mcp_gateway_client_connections_opened",  # the parser strips _total from counter families
    "mcp_gateway_client_connections_closed",
    "mcp_gateway_client_connections_refused",
    "mcp_gateway_buffered_bytes",
    "mcp_gateway_requests",
    "mcp_gateway_request_duration_seconds",
    "mcp_gateway_overhead_seconds",
    "mcp_gateway_inflight_requests",
    "mcp_gateway_queue_wait_seconds",
    "mcp_gateway_jsonrpc_errors",
    "mcp_gateway_tool_calls",
    "mcp_gateway_tool_series_overflow",
    "mcp_gateway_backend_up",
    "mcp_gateway_backend_state",
    "mcp_gateway_backend_instances",
    "mcp_gateway_backend_starts",
    "mcp_gateway_backend_exits",
    "mcp_gateway_backend_start_duration_seconds",
    "mcp_gateway_backend_protocol_errors",
    "mcp_gateway_backend_resident_memory_bytes",
    "mcp_gateway_backend_catalog_items",
    "mcp_gateway_catalog_changes",
    "mcp_gateway_server_requests_pending",
    "mcp_gateway_server_requests",
    "mcp_gateway_unroutable_server_requests",
    "mcp_gateway_refused_answers",
    "mcp_gateway_config_reloads",
    "mcp_gateway_config_last_reload_success",
    "mcp_gateway_config_last_reload_success_timestamp_seconds",
    "mcp_gateway_event_loop_lag_seconds",
    "process_resident_memory_bytes",
    "process_cpu_seconds",
    "python_info",
    "python_gc_objects_collected",
}


def instance(name: str, state: str, pid: int | None = None) -> InstanceStatus:
    return InstanceStatus(name, state, pid, 0, None, None, (), 0)


def backend(name: str, *instances: InstanceStatus, required: bool = True) -> BackendStatus:
    return BackendStatus(name, required, "shared", instances, 3, 1, 2, 0)


class Harness:
    def __init__(self, max_tool_series: int = 500, max_tool_latency_series: int = 100) -> None:
        self.bus = ev.EventBus()
        self.snapshot = GatewayStatus(
            "1.2.3", (backend("time", instance("time/0", "RUNNING")),), {"websocket": 2}, True
        )
        self.metrics = GatewayMetrics(
            self.bus, lambda: self.snapshot, max_tool_series=max_tool_series,
            max_tool_latency_series=max_tool_latency_series, version="1.2.3"
        )

    def emit(self, *events: ev.Event) -> None:
        for event in events:
            self.bus.emit(event)

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        body, _ = self.metrics.exposition(None)
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float | None:
        """The sample ``mcp_gateway_<name>{labels}``, or None when it is not exported."""
        return self.samples().get((PREFIX + name, frozenset(labels.items())))

    def label_values(self, name: str, label: str) -> set[str]:
        return {dict(k[1])[label] for k in self.samples() if k[0] == PREFIX + name}


@pytest.fixture
def h() -> Harness:
    return Harness()


def finished(method: str = "tools/call", backend: str = "time", **kw: object) -> ev.RequestFinished:
    fields: dict[str, object] = dict(
        conn_id="c1",
        method=method,
        backend=backend,
        outcome="ok",
        error_code=None,
        duration=0.010,
        backend_time=0.008,
    )
    fields.update(kw)
    return ev.RequestFinished(**fields)


def test_families_present_without_created_series(h: Harness) -> None:
    body, content_type = h.metrics.exposition(None)
    families = {f.name for f in text_string_to_metric_families(body.decode())}
    assert EXPECTED_FAMILIES <= families
    assert content_type.startswith("text/plain")
    assert not [name for name, _ in h.samples() if name.endswith("_created")]
    build = {"python_version": platform.python_version(), "trio_version": trio.__version__}
    assert h.value("build_info", version="1.2.3", **build) == 1


def test_request_counters_histograms_and_inflight(h: Harness) -> None:
    # RequestStarted is emitted only once a backend is chosen; requests the gateway answers
    # itself finish without one and must not move the in-flight gauge.
    h.emit(ev.RequestStarted("c1", "tools/call", "time"))
    assert h.value("inflight_requests", backend="time") == 1
    h.emit(finished(), finished("ping", "", backend_time=None, duration=0.0002))
    assert h.value("inflight_requests", backend="time") == 0
    assert not h.value("inflight_requests", backend="_gateway")
    assert h.value("requests_total", method="tools/call", backend="time", outcome="ok",
                   principal="_none") == 1
    assert h.value("request_duration_seconds_count", method="ping", backend="_gateway") == 1
    ping = {"method": "ping", "backend": "_gateway"}
    assert h.value("request_duration_seconds_bucket", le="0.00025", **ping) == 1
    # overhead only when a backend was involved: duration - backend_time
    assert h.value("overhead_seconds_count", method="tools/call") == 1
    assert h.value("overhead_seconds_sum", method="tools/call") == pytest.approx(0.002)
    assert h.value("overhead_seconds_count", method="ping") is None
    buckets = {k for k in h.samples() if k[0] == PREFIX + "overhead_seconds_bucket"}
    assert len(buckets) == len(BUCKETS) + 1
    h.emit(ev.QueueWaited("time", 0.3))
    assert h.value("queue_wait_seconds_sum", backend="time") == pytest.approx(0.3)


def test_error_code_labels_are_bounded(h: Harness) -> None:
    for code in (errors.METHOD_NOT_FOUND, errors.BACKEND_UNAVAILABLE, 42, -32099, -1):
        h.emit(finished(outcome="error", error_code=code))
    allowed = {*errors.CODE_NAMES.values(), "other"}
    assert h.label_values("jsonrpc_errors_total", "code") == allowed
    assert h.value("jsonrpc_errors_total", code="other") == 3
    assert h.value("jsonrpc_errors_total", code="method_not_found") == 1
    assert h.value("requests_total", method="tools/call", backend="time", outcome="error",
                   principal="_none") == 5


def test_tool_series_are_capped() -> None:
    h = Harness(max_tool_series=2)
    for tool in ("a", "b", "c", "a", "d", "x" * 1000):
        h.emit(finished(tool=tool))
    assert h.label_values("tool_calls_total", "tool") == {"a", "b", "_overflow"}
    assert h.value("tool_calls_total", backend="time", tool="a") == 2
    assert h.value("tool_calls_total", backend="time", tool="_overflow") == 3
    assert h.value("tool_series_overflow_total") == 3


def test_tool_latency_series_are_capped_per_backend() -> None:
    h = Harness(max_tool_latency_series=2)
    for backend, tool, seconds in (("time", "a", 0.002), ("time", "b", 0.3), ("time", "c", 7.0),
                                   ("time", "a", 0.004), ("fs", "c", 0.02), ("", "gone", 1.0)):
        h.emit(finished(backend=backend, tool=tool, duration=seconds))
    got = {(labels["backend"], labels["tool"]): value
           for (name, pairs), value in h.samples().items()
           if name == PREFIX + "tool_call_duration_seconds_count" and (labels := dict(pairs))}
    # each backend has its own cap; the refused call (no backend) has no latency series
    assert got == {("time", "a"): 2, ("time", "b"): 1, ("time", "_overflow"): 1, ("fs", "c"): 1}
    assert h.value("tool_call_duration_seconds_bucket", backend="time", tool="a", le="0.005") == 2
    assert h.value("tool_call_duration_seconds_bucket", backend="time", tool="_overflow",
                   le="5.0") == 0


def test_connection_and_backend_events(h: Harness) -> None:
    h.emit(
        ev.ConnectionOpened("c1", "websocket"),
        ev.ConnectionClosed("c1", "websocket", "client_closed", 3.0),
        ev.BackendStarted("time", "time/0", 100, 0.4),
        ev.BackendExited("time", "time/0", 100, "crashed", 1),
        ev.BackendProtocolError("time", "time/0", "not_json"),
        ev.CatalogChanged(("tools", "prompts")),
    )
    assert h.value("client_connections_opened_total", transport="websocket") == 1
    closed = {"transport": "websocket", "reason": "client_closed"}
    assert h.value("client_connections_closed_total", **closed) == 1
    assert h.value("client_connections_active", transport="websocket") == 2
    assert h.value("backend_starts_total", backend="time") == 1
    assert h.value("backend_exits_total", backend="time", reason="crashed") == 1
    assert h.value("backend_start_duration_seconds_sum", backend="time") == 0.4
    assert h.value("backend_protocol_errors_total", backend="time", kind="not_json") == 1
    assert h.value("catalog_changes_total", kind="prompts") == 1


def test_refused_connections_are_counted_and_buffered_bytes_follow_the_snapshot(h: Harness) -> None:
    refused = {"reason": "max_connections"}
    assert h.value("client_connections_refused_total", transport="unix", **refused) == 0
    h.emit(ev.ConnectionRefused("websocket", "max_connections"),
           ev.ConnectionRefused("websocket", "max_connections"))
    assert h.value("client_connections_refused_total", transport="websocket", **refused) == 2
    assert h.value("buffered_bytes") == 0
    h.snapshot = GatewayStatus("1.2.3", (), {}, True, buffered_bytes=12345)
    assert h.value("buffered_bytes") == 12345


def test_backend_gauges_follow_the_snapshot(h: Harness) -> None:
    assert h.value("backend_up", backend="time", required="true", connector="stdio") == 1
    assert h.value("ready") == 1
    h.snapshot = GatewayStatus(
        "1.2.3",
        (
            backend("time", instance("time/0", "BACKOFF")),
            backend(
                "fs", instance("fs/0", "STARTING"), instance("fs/1", "RUNNING"), required=False
            ),
            backend("none"),
        ),
        {},
        True,
    )
    assert h.value("backend_up", backend="time", required="true", connector="stdio") == 0
    # alerts: required only
    assert h.value("backend_up", backend="fs", required="false", connector="stdio") == 1
    assert h.value("ready") == 0
    for name, summary in (("time", "BACKOFF"), ("fs", "RUNNING"), ("none", "STOPPED")):
        one_hot = {s: h.value("backend_state", backend=name, state=s) for s in STATES}
        assert one_hot == {s: float(s == summary) for s in STATES}
    assert h.value("backend_instances", backend="fs", state="STARTING") == 1
    assert h.value("backend_catalog_items", backend="fs", kind="resources") == 2
    assert h.value("backend_resident_memory_bytes", backend="none") == 0


def test_server_request_and_answer_counters(h: Harness) -> None:
    h.snapshot = GatewayStatus("1.2.3", (), {}, True, pending_server_requests=4)
    h.emit(
        ev.ServerRequestFinished("time", "elicitation/create", "answered", 2.0),
        ev.ServerRequestFinished("", "elicitation/create", "timeout", 60.0),
        ev.ServerRequestRefused("time", "sampling/createMessage", "no_capability"),
        ev.AnswerRefused("c1", "unknown_id"),
    )
    assert h.value("server_requests_pending") == 4
    done = {"backend": "_gateway", "method": "elicitation/create", "outcome": "timeout"}
    assert h.value("server_requests_total", **done) == 1
    refused = {"backend": "time", "method": "sampling/createMessage", "reason": "no_capability"}
    assert h.value("unroutable_server_requests_total", **refused) == 1
    assert h.value("refused_answers_total", reason="unknown_id") == 1


def test_config_reload_metrics(h: Harness) -> None:
    started = h.value("config_last_reload_success_timestamp_seconds")
    assert h.value("config_last_reload_success") == 1 and started
    h.emit(ev.ReloadFinished(False, "bad toml"))
    assert h.value("config_last_reload_success") == 0
    assert h.value("config_reloads_total", result="failure") == 1
    assert h.value("config_last_reload_success_timestamp_seconds") == started
    h.emit(ev.ReloadFinished(True, None, added=("fs",)))
    assert h.value("config_last_reload_success") == 1
    assert h.value("config_reloads_total", result="success") == 1
    assert h.value("config_last_reload_success_timestamp_seconds") >= started


async def test_lag_probe_observes_each_interval(h: Harness, autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: h.metrics.run_lag_probe(interval=0.5, task_status=task_status)
        )
        await trio.sleep(5.1)
        nursery.cancel_scope.cancel()
    assert h.value("event_loop_lag_seconds_count") == 10
    assert h.value("event_loop_lag_seconds_bucket", le="0.0001") == 10


def test_private_registries_and_close() -> None:
    a, b = Harness(), Harness()
    a.emit(ev.ConnectionOpened("c1", "unix"))
    assert a.value("client_connections_opened_total", transport="unix") == 1
    assert b.value("client_connections_opened_total", transport="unix") is None
    a.metrics.close()
    a.emit(ev.ConnectionOpened("c2", "unix"))
    assert a.value("client_connections_opened_total", transport="unix") == 1


def test_openmetrics_negotiation(h: Harness) -> None:
    body, ctype = h.metrics.exposition(
        "application/openmetrics-text; version=1.0.0,text/plain;q=0.5"
    )
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")
    names = {f.name for f in parse_openmetrics(body.decode())}
    assert {"mcp_gateway_requests", "mcp_gateway_backend_up"} <= names
    _, ctype = h.metrics.exposition("text/plain;version=1.0.0")
    assert ctype.startswith("text/plain; version=1.0.0")
    _, ctype = h.metrics.exposition(None)
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"


def test_rss_without_procfs_is_omitted() -> None:
    assert process_group_rss([1], os.devnull + "/proc") is None


def _group_members(pgid: int) -> dict[int, tuple[str, str]]:
    """``{pid: (comm, state)}`` of every process in process group ``pgid``."""
    members = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            state, _, pgrp = stat[stat.rindex(b")") + 2 :].split()[:3]
            if int(pgrp) == pgid:
                comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode()
                members[int(name)] = (comm, state.decode())
        except (OSError, ValueError):
            continue
    return members


def _settled(pgid: int) -> bool:
    """Both sleeps exec'd and every member asleep (the loader is done: RSS is stable)."""
    members = list(_group_members(pgid).values())
    return members.count(("sleep", "S")) == 2 and all(state == "S" for _, state in members)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _wait_for(predicate: Callable[[], bool]) -> None:
    """Until ``predicate()`` holds, for at most 10 s (other processes seen through /proc)."""
    async def look() -> bool:
        return predicate()

    with trio.fail_after(10):
        await poll(look, 0.01)


@pytest.mark.system
async def test_rss_sums_every_process_in_the_group(h: Harness) -> None:
    proc = await trio.lowlevel.open_process(
        ["sh", "-c", "sleep 30 & sleep 30"], start_new_session=True
    )
    loner = await trio.lowlevel.open_process(["sleep", "30"])  # in our group: not a leader
    try:
        await _wait_for(lambda: _settled(proc.pid) and _state(loner.pid) == "S")
        single: dict[int, int] = {}
        loner_rss = 0
        totals: dict[int, int] | None = None

        def measured_while_nothing_moved() -> bool:
            nonlocal single, loner_rss, totals
            single = {pid: _rss(pid) for pid in _group_members(proc.pid)}
            loner_rss = _rss(loner.pid)
            totals = process_group_rss([proc.pid, loner.pid])
            again = {pid: _rss(pid) for pid in _group_members(proc.pid)}
            return single == again and loner_rss == _rss(loner.pid)

        await _wait_for(measured_while_nothing_moved)
        assert len(single) >= 2 and all(single.values())
        assert totals is not None
        assert totals[proc.pid] == sum(single.values())
        assert totals[proc.pid] > max(single.values())
        assert totals[loner.pid] == loner_rss > 0
        h.snapshot = GatewayStatus(
            "1.2.3", (backend("npx", instance("npx/0", "RUNNING", proc.pid)),), {}, True
        )
        scraped = h.value("backend_resident_memory_bytes", backend="npx")
        assert scraped is not None and scraped > max(single.values())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        loner.kill()
        await proc.wait()
        await loner.wait()


# The exposition is a contract with dashboards and alerts: issue 8 moved the event-fed series
# off prometheus_client's metric objects, and the scrape must not have changed by a byte.  The
# golden files were written by the implementation before that change from the same traffic;
# a family added since (tool_call_duration_seconds) only added its own lines to them.

GOLDEN = Path(__file__).parent / "golden"
_VOLATILE = (
    (re.compile(r"^(mcp_gateway_build_info)\{.*\}", re.M), r"\1{...}"),
    (
        re.compile(r"^(mcp_gateway_config_last_reload_success_timestamp_seconds) \S+$", re.M),
        r"\1 T",
    ),
)


def _every_event_once_or_more() -> list[ev.Event]:
    ok, error, cancelled = (ev.RequestOutcome.OK, ev.RequestOutcome.ERROR,
                            ev.RequestOutcome.CANCELLED)
    answered, timeout = ev.ServerRequestOutcome.ANSWERED, ev.ServerRequestOutcome.TIMEOUT
    return [
        ev.ConnectionOpened("c1", "websocket"),
        ev.ConnectionOpened("c2", "unix"),
        ev.ConnectionRefused("unix", "max_connections"),
        ev.RequestStarted("c1", "tools/call", "time"),
        ev.RequestStarted("c1", "tools/call", "time"),
        ev.RequestStarted("c2", "resources/read", "fs"),
        ev.QueueWaited("time", 0.0042),
        ev.RequestFinished("c1", "tools/call", "time", ok, None, 0.0001, 0.00005, "time__now"),
        ev.RequestFinished("c1", "ping", "", ok, None, 0.00002, None),
        ev.RequestFinished("c2", "resources/read", "fs", error, errors.METHOD_NOT_FOUND, 0.1, 0.2),
        ev.RequestFinished("c1", "tools/call", "time", error, 42, 75.0, 74.9, "time__slow"),
        ev.RequestStarted("c1", "tools/call", "time"),
        ev.RequestFinished("c1", "tools/call", "time", cancelled, None, 0.3, 0.1, "x" * 300),
        ev.RequestStarted("c1", "tools/call", "time"),
        ev.RequestStarted("c1", "tools/call", "time"),
        ev.RequestFinished("c1", "tools/call", "time", ok, None, 0.0031, 0.0011, "time__later"),
        ev.RequestFinished("c1", "tools/call", "time", ok, None, 0.0025, 0.001, "time__now"),
        ev.RequestFinished("c2", "tools/list", "", ok, None, 60.0, None),
        ev.RequestFinished("c3", "tools/list", "", ok, None, 0.001, None, principal="alice"),
        ev.RequestStarted("c2", "resources/read", "fs"),  # still in flight at the scrape
        ev.BackendStarted("time", "time/0", 100, 0.4),
        ev.BackendStateChanged("time", "time/0", "STARTING", "RUNNING", 100, "ready"),
        ev.BackendExited("time", "time/0", 100, ev.ExitKind.CRASHED, 1),
        ev.BackendExited("fs", "fs/0", 101, ev.ExitKind.RECYCLED, None),
        ev.BackendProtocolError("time", "time/0", "not_json"),
        ev.BackendStderr("time", "time/0", 3, 0),
        ev.BackendStderr("fs", "fs/0", 0, 7),
        ev.BackendStderr("time", "time/0", 2, 4),
        ev.CatalogChanged(("tools", "prompts")),
        ev.CatalogChanged(("tools",)),
        ev.ServerRequestRouted("time", "elicitation/create", "c1"),
        ev.ServerRequestRefused("time", "sampling/createMessage", "no_capability"),
        ev.ServerRequestFinished("", "elicitation/create", timeout, 60.0),
        ev.ServerRequestFinished("time", "elicitation/create", answered, 2.5),
        ev.AnswerRefused("c1", "unknown_id"),
        ev.InputRequired("time"),
        ev.RequestStateRefused("tampered"),
        ev.ConnectionClosed("c1", "websocket", "client_closed", 3.0),
        ev.ReloadFinished(False, "bad toml"),
        ev.ReloadFinished(True, None, added=("fs",)),
        ev.AuditRecordsDropped(2),
        ev.AuditRecordsDropped(1),
    ]


def _gateway_lines(body: bytes) -> str:
    lines = [
        line
        for line in body.decode().splitlines(keepends=True)
        if line.startswith(("mcp_gateway_", "# HELP mcp_gateway_", "# TYPE mcp_gateway_", "# EOF"))
    ]
    text = "".join(lines)
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


@pytest.mark.parametrize(
    ("accept", "golden"),
    [(None, "metrics.prom"), ("application/openmetrics-text; version=1.0.0", "metrics.om")],
)
async def test_8_exposition_is_unchanged(
    accept: str | None, golden: str, autojump_clock: object
) -> None:
    h = Harness(max_tool_series=2)
    h.emit(*_every_event_once_or_more())
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: h.metrics.run_lag_probe(interval=0.5, task_status=task_status)
        )
        await trio.sleep(1.1)
        nursery.cancel_scope.cancel()
    body, _ = h.metrics.exposition(accept)
    assert _gateway_lines(body) == (GOLDEN / golden).read_text()


def test_a_failing_subscriber_is_logged_and_the_others_still_run(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    def broken(event: ev.Event) -> None:
        raise RuntimeError("observer bug")

    h.bus.subscribe(broken, ev.RequestStarted)
    h.bus.subscribe(lambda e: seen.append(type(e).__name__))
    h.emit(ev.RequestStarted("c1", "tools/call", "time"), ev.ConnectionOpened("c1", "unix"))
    assert h.value("inflight_requests", backend="time") == 1
    assert seen == ["RequestStarted", "ConnectionOpened"]
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [RuntimeError]


def test_subscriptions_by_type_keep_their_order_and_unsubscribe() -> None:
    bus, seen = ev.EventBus(), []
    bus.subscribe(lambda e: seen.append("any"))
    stop = bus.subscribe(lambda e: seen.append("opened"), ev.ConnectionOpened)
    bus.subscribe(lambda e: seen.append("either"), ev.ConnectionOpened, ev.ConnectionClosed)
    bus.emit(ev.ConnectionOpened("c1", "unix"))
    bus.emit(ev.ConnectionClosed("c1", "unix", "client_closed", 1.0))
    assert seen == ["any", "opened", "either", "any", "either"]
    seen.clear()
    stops = [stop]
    bus.subscribe(lambda e: stops and stops.pop()(), ev.ConnectionOpened)  # effective next event
    bus.emit(ev.ConnectionOpened("c1", "unix"))
    bus.emit(ev.ConnectionOpened("c2", "unix"))
    assert seen == ["any", "opened", "either", "any", "either"]


def test_finished_requests_folded_at_a_scrape_are_the_same_as_one_by_one() -> None:
    """Finished requests are held and folded in by label set (every ``FOLD_EVERY``, and before
    a scrape): the exposition is the one of counting each at once, bit for bit, the tool series
    cap and its overflow count included."""
    def workload() -> list[ev.Event]:
        out: list[ev.Event] = []
        for i in range(2 * FOLD_EVERY + 37):
            tool = f"time__t{i % 5}" if i % 7 else None  # 5 tools: 2 series, then overflow
            backend = "" if i % 11 == 0 else "time"
            if backend:
                out.append(ev.RequestStarted(f"c{i % 3}", "tools/call", backend))
            outcome = ev.RequestOutcome.ERROR if i % 13 == 0 else ev.RequestOutcome.OK
            out.append(ev.RequestFinished(
                f"c{i % 3}", "tools/call" if tool else "ping", backend, outcome,
                -32001 if outcome is ev.RequestOutcome.ERROR else None,
                0.0001 * (i % 17) + 1e-7 * i, 0.0001 * (i % 5) if backend else None, tool,
                "alice" if i % 2 else "_none"))
        return out

    held, at_once = Harness(max_tool_series=2), Harness(max_tool_series=2)
    held.emit(*workload())
    for event in workload():
        at_once.emit(event)
        at_once.metrics.exposition(None)  # a scrape folds what is held: nothing waits
    assert _gateway_lines(held.metrics.exposition(None)[0]) == _gateway_lines(
        at_once.metrics.exposition(None)[0])
    first_two = {("time", "time__t1"), ("time", "time__t2")}  # the cap's two series
    assert held.value("tool_series_overflow_total") == sum(
        1 for e in workload() if isinstance(e, ev.RequestFinished) and e.tool is not None
        and (e.backend, e.tool) not in first_two)
