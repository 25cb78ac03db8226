"""A backend flooding stderr: its lines are rate-limited and summarised, counted in a metric,
and a bystander backend's calls keep a low latency (issue 7).  Numbers print with ``pytest -s``."""

from __future__ import annotations

import logging
import re
import statistics
import time
from collections.abc import Iterator

import pytest
import trio
from helpers import (
    connect,
    fixture_backend,
    http_json,
    http_request,
    make_config,
    run_gateway,
    text_of,
)
from prometheus_client.parser import text_string_to_metric_families

from gateway.backend import instance, stdio

pytestmark = pytest.mark.system

RATE, BURST = 50, 20
SUMMARY = re.compile(r"backend noisy/0: (\d+) stderr lines not logged in the last [\d.]+s")


class Records(logging.Handler):
    """Every record of the backend logger, with a trio event per arrival to wait on."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.changed = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:  # noqa: ASYNC109 - a helper's own deadline (trio.fail_after inside), passed by keyword
        with trio.fail_after(timeout):
            while True:
                for message in self.messages:
                    if m := pattern.search(message):
                        return m
                await self.changed.wait()


@pytest.fixture
def records(monkeypatch: pytest.MonkeyPatch) -> Iterator[Records]:
    monkeypatch.setattr(stdio, "STDERR_SUMMARY_WINDOW", 0.5)
    handler = Records()
    logger = logging.getLogger("gateway.backend.stdio")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def stderr_lines(metrics_text: str) -> dict[str, float]:
    return {s.labels["logged"]: s.value for f in text_string_to_metric_families(metrics_text)
            for s in f.samples if s.name == "mcp_gateway_backend_stderr_lines_total"
            and s.labels["backend"] == "noisy"}


async def test_stderr_flood_is_summarised_counted_and_spares_bystanders(records: Records) -> None:
    noisy = fixture_backend("noisy", env={"FIXTURE_STDERR_FLOOD": "1"},
                            stderr_lines_per_second=RATE, stderr_burst=BURST)
    cfg = make_config(fixture_backend("fx") + noisy)
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            started = time.monotonic()
            for _ in range(10):
                await c.call("fx__echo", {"message": "warm-up"})
            latencies = []
            for i in range(200):
                t0 = time.perf_counter()
                assert text_of(await c.call("fx__echo", {"message": str(i)})) == str(i)
                latencies.append(time.perf_counter() - t0)
            p50 = statistics.median(latencies)
            summary = await records.wait_for(SUMMARY, timeout=10)
            status, body = await http_request(gw.bound.admin_port, "/metrics")
            elapsed = time.monotonic() - started
            counted = stderr_lines(body.decode())
            logged_lines = sum(m.startswith("[noisy/0] ") for m in records.messages)
            print(f"\nbystander p50 {p50 * 1e3:.2f} ms; noisy: {counted.get('false', 0):.0f} lines "
                  f"held back, {counted.get('true', 0):.0f} logged in {elapsed:.1f}s")
            assert p50 < 0.020, f"bystander p50 {p50 * 1e3:.1f} ms during a stderr flood"
            assert status == 200
            assert counted["false"] >= int(summary.group(1)) > 0
            allowed = BURST + RATE * (elapsed + 1)  # +1 s: the admin scrape came after `elapsed`
            assert 0 < counted["true"] <= allowed
            assert logged_lines <= allowed
            doc = await http_json(gw.bound.admin_port, "/status")
            (tail,) = [b["instances"][0]["stderr_tail"] for b in doc["backends"]
                       if b["name"] == "noisy"]
            assert len(tail) == instance.STDERR_TAIL  # the running child's tail, bounded
            assert all(line.startswith("fixture: flood line ") for line in tail)
