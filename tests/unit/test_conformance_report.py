"""tests/conformance/run.py reads the official conformance suite's verdict (captured output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conformance.run import Report, Scenario, SuiteError, parse_summary, read_failures

# Abridged from `conformance server --requirements 2025-11-25` (0.2.0-alpha.12) against
# supergateway 4.0.0 with tests/fixtures/conformance_server.py behind it.
OUTPUT_2025 = """Running requirements 2025-11-25 (33 scenarios) against http://127.0.0.1:18931/mcp


=== Running scenario: server-initialize ===
Running client scenario 'server-initialize' against server: http://127.0.0.1:18931/mcp
✓ looks-like-a-summary-line: 1 passed, 0 failed

=== SUMMARY ===
✓ server-initialize: 3 passed, 0 failed
✓ logging-set-level: 2 passed, 0 failed
✗ dns-rebinding-protection: 1 passed, 1 failed
✓ server-session-lifecycle: 3 passed, 0 failed
✗ json-schema-2020-12: 7 passed, 1 failed
✓ server-sse-polling: 0 passed, 0 failed
✗ tools-list: 3 passed, 0 failed, 1 warnings
- tools-call-audio: skipped

Total: 19 passed, 2 failed, 1 warnings, 1 skipped

Not scored for 2025-11-25: 3 scenario(s) run, 1 failing. These do not affect conformance.
  ✓ server-session-lifecycle (added-after-release)
  ✗ json-schema-2020-12 (pending)
  ✓ server-sse-polling (pending)
"""


def test_parse_summary_per_scenario() -> None:
    report = parse_summary(OUTPUT_2025, "2025-11-25", exit_code=1)
    assert set(report.scenarios) == {
        "server-initialize", "logging-set-level", "dns-rebinding-protection",
        "server-session-lifecycle", "json-schema-2020-12", "server-sse-polling", "tools-list"}
    assert report.scenarios["server-initialize"] == Scenario("server-initialize", 3, 0)
    assert report.scenarios["dns-rebinding-protection"].failed == 1
    assert report.scenarios["tools-list"].warnings == 1
    assert report.scenarios["tools-list"].ok  # the suite scores FAILURE checks only
    assert report.skipped == ("tools-call-audio",)
    assert report.exit_code == 1


def test_parse_summary_scored_and_not_scored() -> None:
    report = parse_summary(OUTPUT_2025, "2025-11-25")
    pending = report.scenarios["json-schema-2020-12"]
    assert (pending.scored, pending.reason, pending.ok) == (False, "pending", False)
    assert report.scenarios["server-session-lifecycle"].reason == "added-after-release"
    assert [s.name for s in report.scored_failures] == ["dns-rebinding-protection"]
    assert report.summary_line() == (
        "2025-11-25: 3/4 scored scenarios pass (failing: dns-rebinding-protection); "
        "not scored: 2/3 pass")


def test_parse_summary_all_pass() -> None:
    output = ("=== SUMMARY ===\n✓ ping: 2 passed, 0 failed\n\n"
              "Total: 2 passed, 0 failed, 0 warnings\n")
    report = parse_summary(output, "2026-07-28", exit_code=0)
    assert report.scored_failures == []
    assert report.summary_line() == "2026-07-28: 1/1 scored scenarios pass"


@pytest.mark.parametrize("output", [
    "",  # the suite died before running anything
    "Error: fs.globSync is not a function\n",  # node 20
    "=== SUMMARY ===\n✓ ping: 2 passed, 0 failed\n",  # cut short: no Total line
])
def test_parse_summary_rejects_output_without_a_summary(output: str) -> None:
    with pytest.raises(SuiteError):
        parse_summary(output, "2025-11-25")


def test_read_failures_from_checks_files(tmp_path: Path) -> None:
    checks = [
        {"id": "localhost-host-valid-accepted", "status": "SUCCESS"},
        {"id": "localhost-host-rebinding-rejected", "status": "FAILURE",
         "errorMessage": "Expected HTTP 4xx for invalid Host/Origin headers,\n got 200"},
        {"id": "wire-schema-valid", "status": "FAILURE", "description": "x" * 500},
    ]
    scenario_dir = tmp_path / "server-dns-rebinding-protection-2026-12-01T02-03-06-957Z"
    scenario_dir.mkdir()
    (scenario_dir / "checks.json").write_text(json.dumps(checks))
    (tmp_path / "server-ping-2026-12-01T02-03-06-001Z").mkdir()  # no checks file: ignored
    (tmp_path / "summary.txt").write_text("")
    found = read_failures(str(tmp_path))
    assert list(found) == ["dns-rebinding-protection"]
    first, second = found["dns-rebinding-protection"]
    assert first == ("localhost-host-rebinding-rejected: Expected HTTP 4xx for invalid "
                     "Host/Origin headers, got 200")
    assert second.startswith("wire-schema-valid: xxx") and len(second) == 300


def test_explain_lists_failing_checks() -> None:
    report = Report("2025-11-25", {
        "a": Scenario("a", 1, 1, failures=("c1: bad",)),
        "b": Scenario("b", 0, 2, scored=False, reason="pending", failures=("c2: worse",)),
        "c": Scenario("c", 2, 0),
    })
    assert report.explain().splitlines() == [
        "2025-11-25: 1/2 scored scenarios pass (failing: a); not scored: 0/1 pass",
        "  a: 1 failed", "    c1: bad",
        "  b (not scored: pending): 2 failed", "    c2: worse",
    ]
