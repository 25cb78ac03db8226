"""The official MCP conformance suite's client scenarios with the gateway as the client: each
in-scope scenario's test server is the gateway's one remote backend, driven through the gateway
by tests/conformance/client_driver.py (see tests/conformance/client_run.py for the scenarios
and why not ``--requirements``).

What fails today is listed per revision in client-baseline-<revision>.yaml, the suite's own
expected-failures format, judged by the suite: an unlisted failure or a listed check that now
passes fails the test. The suite does not judge the client's exit status when given a baseline:
here a scenario with no entry must also have had every step of the driver answered (its checks
alone can pass with the gateway down, or be all skipped), and one listed under ``driver:`` must
not have.
"""

from __future__ import annotations

import os

import pytest
from conformance.client_run import SCENARIOS, baselined, run_revision, run_scenario

pytestmark = [pytest.mark.conformance, pytest.mark.system]


@pytest.mark.parametrize("revision", sorted(SCENARIOS))
def test_client_scenarios_fail_exactly_as_listed(revision: str) -> None:
    runs = run_revision(revision)
    for r in runs:
        print(r.summary)
    assert [r.name for r in runs] == list(SCENARIOS[revision])
    assert all(r.exit_code == 0 for r in runs), "\n".join(
        f"{r.summary}\n" + "\n".join(f"    {f}" for f in r.failures)
        + "\n" + r.output[-3000:] for r in runs if r.exit_code)
    listed, driver = baselined(revision), baselined(revision, "driver")
    incomplete = [r for r in runs if r.name not in listed | driver and r.client_exit != 0]
    assert not incomplete, "\n".join(f"{r.summary}\n{r.output[-3000:]}" for r in incomplete)
    stale = [r.name for r in runs if r.name in driver and r.client_exit == 0]
    assert not stale, f"listed under driver: in the baseline, but the driver succeeded: {stale}"


def test_a_listed_check_that_passes_fails_the_run(tmp_path: object) -> None:
    """The suite itself rejects a stale baseline: tools_call passes at 2025-11-25, so listing
    its check as an expected failure must fail the run."""
    baseline = os.path.join(str(tmp_path), "stale.yaml")
    with open(baseline, "w", encoding="utf-8") as f:
        f.write("client:\n  - tools_call:tool-add-numbers\n")
    run = run_scenario("2025-11-25", "tools_call", baseline)
    assert (run.passed, run.failed, run.warnings) == (2, 0, 0), run.output[-3000:]
    assert run.exit_code == 1
    assert "Stale baseline entries" in run.output
