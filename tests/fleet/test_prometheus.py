"""Issue 11: the shipped Prometheus rules under `promtool`, and a real Prometheus (Debian's 2.42,
installed by `scripts/setup --test`) scraping two real gateway replicas on loopback.

The rules' behaviour (each alert firing and not firing, the recording rules' values) is pinned by
`packaging/prometheus/mcp-gateway-rules.test.yml`; here `promtool` runs it. The integration test
then checks what promtool cannot: that the rules' metric and label names are the ones the
gateway really exports (the recording rules evaluate to samples from live scrapes, every rule is
healthy), that every exported `mcp_gateway_*` series has the labels README "Metrics" documents,
and that `promtool check metrics` finds nothing to lint in a replica's `/metrics`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import FIXTURE, ROOT, connect, http_request, poll

RULES_DIR = Path(ROOT) / "packaging" / "prometheus"
RULES = RULES_DIR / "mcp-gateway-rules.yml"
DASHBOARD = Path(ROOT) / "packaging" / "grafana" / "mcp-gateway-dashboard.json"
JOB = "mcp-gateway"  # the job name the rules' `up{job=...}` alerts expect (README)
#: The labels Prometheus adds to every scraped series, and the histogram's bucket label.
TARGET_LABELS = {"job", "instance"}


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    assert shutil.which("promtool"), "no promtool: run scripts/setup --test (Debian prometheus)"
    return subprocess.run(["promtool", *args], input=stdin.decode() if stdin else None,
                          capture_output=True, text=True, timeout=60, check=False, cwd=RULES_DIR)


@pytest.mark.system
def test_promtool_checks_and_unit_tests_the_shipped_rules() -> None:
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 19 rules found" in checked.stdout
    tested = promtool("test", "rules", "mcp-gateway-rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def dashboard_queries(job: str = ".+", backend: str = ".+") -> dict[str, str]:
    """The Grafana dashboard's PromQL, by panel title and legend, its variables filled in."""
    doc = json.loads(DASHBOARD.read_text())
    return {f"{panel['title']} / {target['legendFormat']}":
            target["expr"].replace("$job", job).replace("$backend", backend)
            for panel in doc["panels"] for target in panel["targets"]}


@pytest.mark.system
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 12
    wrapped = [{"record": f"dashboard:query{i}", "expr": expr}
               for i, expr in enumerate(queries.values())]
    rules = {"groups": [{"name": "dashboard", "rules": wrapped}]}
    (tmp_path / "dashboard-rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    checked = subprocess.run(["promtool", "check", "rules", "dashboard-rules.yml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and it reads only what the gateway exports or the shipped rules record
    recorded = set(re.findall(r"record: (\S+)", RULES.read_text()))
    exported = set(documented_labels())
    for title, expr in queries.items():
        names = re.findall(r"\b[a-z_:]*mcp_gateway_[a-z0-9_:]+", expr)
        assert names or expr.startswith("count(up{"), (title, expr)
        for name in names:
            assert name in recorded or name in exported, (title, name)


# Series a dashboard query may lack in the fleet run: the gateway exports them on an event.
NO_DATA_WITHOUT_EVENTS = {"Backend exits per reason (15 min) / {{backend}} {{reason}}"}


async def dashboard_has_data(port: int) -> None:
    """Every dashboard query returns data from the replicas (but those that need an event)."""
    for title, expr in dashboard_queries(JOB).items():
        if title not in NO_DATA_WITHOUT_EVENTS:
            assert await query(port, expr), f"dashboard query {title!r} has no data: {expr}"


# ---- a real Prometheus scraping two replicas --------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def documented_labels() -> dict[str, set[str]]:
    """README "Metrics": metric name -> its documented label names."""
    text = (Path(ROOT) / "README.md").read_text()
    table = text.split("#### Metrics", 1)[1].split("\n\n", 2)[1]
    labels = {}
    for row in table.splitlines()[2:]:
        name, _kind, names = (c.strip() for c in row.strip("|").split("|")[:3])
        labels[name.strip("`")] = {n.strip() for n in names.split(",") if n.strip()}
    return labels


class Replica:
    def __init__(self, tmp: Path, rid: str) -> None:
        self.ws, self.admin = free_port(), free_port()
        self.cfg = tmp / f"{rid}.toml"
        self.cfg.write_text(
            f'[gateway]\nreplica_id = "{rid}"\n'
            f'[listen]\nwebsocket = "127.0.0.1:{self.ws}"\nhttp = ""\n'
            f'[admin]\nlisten = "127.0.0.1:{self.admin}"\n'
            f"[backends.fx]\ncommand = {json.dumps(sys.executable)}\n"
            f"args = [{json.dumps(FIXTURE)}]\nrequired = true\n"
        )
        self.log = (tmp / f"{rid}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(self.cfg)],
            env={**os.environ, "PYTHONPATH": ROOT}, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.ws}/"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[Replica]]:
    started = [Replica(tmp_path, "r1"), Replica(tmp_path, "r2")]
    try:
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.fixture
def prometheus(tmp_path: Path, replicas: list[Replica]) -> Iterator[int]:
    port = free_port()
    config = tmp_path / "prometheus.yml"
    targets = ", ".join(f'"127.0.0.1:{r.admin}"' for r in replicas)
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: [{json.dumps(str(RULES))}]\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: [{targets}]\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


async def query(port: int, promql: str) -> list[dict[str, Any]]:
    data = await trio.to_thread.run_sync(lambda: api(port, "/api/v1/query", query=promql))
    return data["result"]


async def until(port: int, promql: str, count: int,
                meanwhile: Callable[[], Awaitable[None]] | None = None) -> list[dict[str, Any]]:
    """Poll an instant query until it has ``count`` series (each with a finite value); before
    each look, ``meanwhile`` (traffic spread over the scrapes)."""
    async def look() -> list[dict[str, Any]] | None:
        if meanwhile is not None:
            await meanwhile()
        try:
            got = [s for s in await query(port, promql) if math.isfinite(float(s["value"][1]))]
        except OSError:  # Prometheus still starting
            got = []
        return got if len(got) == count else None

    with trio.fail_after(30):
        return await poll(look, 0.25)


#: The backend answers this tools/call with a JSON-RPC error (fixture tool `raw`).
ERROR_LINE = b'{"jsonrpc":"2.0","id":{ID},"error":{"code":-32000,"message":"boom"}}'.hex()


@pytest.mark.fleet
async def test_prometheus_scrapes_two_replicas_and_evaluates_the_rules(
    replicas: list[Replica], prometheus: int
) -> None:
    for r in replicas:
        await wait_ready(r.admin)
    up = await until(prometheus, f'up{{job="{JOB}"}} == 1', 2)
    assert {s["metric"]["instance"] for s in up} == {f"127.0.0.1:{r.admin}" for r in replicas}

    # Traffic through both replicas, spread over several scrapes so the rates are not 0: calls
    # that succeed and calls the backend fails, until the recording rules see both.
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(connect(r.url)) for r in replicas]

        async def traffic() -> None:
            for c in clients:
                assert "result" in await c.call("fx__echo", {"message": "hi"})
                assert "error" in await c.call("fx__raw", {"lines": [ERROR_LINE]})

        rate = await until(prometheus, 'backend:mcp_gateway_requests:rate5m{backend="fx"} > 0', 1,
                           traffic)
        ratio = await until(
            prometheus, 'backend:mcp_gateway_requests_errors:ratio_rate5m{backend="fx"} > 0', 1,
            traffic)
        p99 = await until(
            prometheus, 'backend:mcp_gateway_request_duration_seconds:p99_rate5m{backend="fx"}', 1,
            traffic)
        await until(prometheus, 'backend_tool:mcp_gateway_tool_call_duration_seconds:p50_rate5m'
                    '{tool="fx__echo"}', 1, traffic)
        await dashboard_has_data(prometheus)
    # Aggregated over the replicas: only the job and the backend remain.
    for series in (rate, ratio, p99):
        assert set(series[0]["metric"]) == {"__name__", "job", "backend"}, series
    assert 0.3 < float(ratio[0]["value"][1]) < 0.7  # one call in two fails
    assert 0 < float(p99[0]["value"][1]) < 60

    # The gauges the alerts read, per replica, with the labels the rules select on.
    await until(prometheus, "mcp_gateway_ready == 1", 2)
    await until(prometheus, 'mcp_gateway_backend_up{backend="fx",required="true"} == 1', 2)
    await until(prometheus, 'mcp_gateway_backend_state{backend="fx",state="FATAL"} == 0', 2)
    # Half the calls failing is an error ratio alert on live data: pending (for: 10m), and the
    # only alert not inactive. Every rule evaluates without error.
    pending = await until(prometheus, 'ALERTS{alertname="MCPGatewayHighErrorRatio"}', 1)
    assert pending[0]["metric"]["alertstate"] == "pending"
    assert pending[0]["metric"]["backend"] == "fx"
    assert [s["metric"]["alertname"] for s in await query(prometheus, "ALERTS")] == [
        "MCPGatewayHighErrorRatio"]
    groups = (await trio.to_thread.run_sync(lambda: api(prometheus, "/api/v1/rules")))["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    assert len(rules) == 19
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []

    # Every scraped mcp_gateway_* series carries exactly the labels README documents.
    documented = documented_labels()
    seen: dict[str, set[str]] = {}
    for s in await query(prometheus, f'{{__name__=~"mcp_gateway_.+",job="{JOB}"}}'):
        name = s["metric"]["__name__"]
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in documented else name
        labels = set(s["metric"]) - {"__name__"} - TARGET_LABELS
        if name.endswith("_bucket"):
            labels.discard("le")
        assert family in documented, f"{name} is not in README Metrics"
        assert labels == documented[family], (name, labels, documented[family])
        seen[family] = labels
    assert {"mcp_gateway_requests_total", "mcp_gateway_request_duration_seconds",
            "mcp_gateway_backend_up", "mcp_gateway_ready"} <= set(seen)

    # promtool's linter on what a replica exports (the Prometheus text format).
    status, body = await http_request(replicas[0].admin, "/metrics")
    assert status == 200
    linted = promtool("check", "metrics", stdin=body)
    problems = linted.stdout + linted.stderr
    assert linted.returncode == 0 and problems == "", problems


async def wait_ready(port: int) -> None:
    async def ready() -> bool:
        try:
            return (await http_request(port, "/readyz"))[0] == 200
        except OSError:  # not listening yet
            return False

    with trio.fail_after(30):
        await poll(ready, 0.05)
