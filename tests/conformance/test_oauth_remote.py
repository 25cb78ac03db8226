"""The official client scenarios for OAuth client credentials, with the gateway as the client
of a protected remote backend (``tests/conformance/oauth_remote_client.py``)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from conformance.run import CLI, NODE, ROOT

pytestmark = [pytest.mark.conformance, pytest.mark.system]

CLIENT = os.path.join(ROOT, "tests", "conformance", "oauth_remote_client.py")


@pytest.mark.parametrize("scenario", ["auth/client-credentials-basic",
                                      "auth/client-credentials-jwt"])
def test_client_credentials_scenario_passes(scenario: str, tmp_path: object) -> None:
    if not os.path.exists(NODE) or not os.path.exists(CLI):
        pytest.fail(f"the conformance suite is not installed ({CLI}): scripts/setup --test")
    proc = subprocess.run(
        [NODE, CLI, "client", "--command", f"{sys.executable} {CLIENT}", "--scenario", scenario,
         "-o", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT})
    said = proc.stdout + proc.stderr  # the verdict is written to stderr
    assert "OVERALL: PASSED" in said, said[-4000:]
    (checks_file,) = glob.glob(os.path.join(str(tmp_path), "auth", "*", "checks.json"))
    with open(checks_file) as f:
        checks = {c["id"]: c["status"] for c in json.load(f)}
    kind = scenario.rsplit("-", 1)[1]
    verified = "client-credentials-basic-auth" if kind == "basic" \
        else "client-credentials-jwt-verified"
    assert checks[verified] == checks["token-request"] == checks["valid-bearer-token"] == \
        "SUCCESS"
    assert checks["prm-pathbased-requested"] == checks["authorization-server-metadata"] == \
        "SUCCESS"
    assert "FAILURE" not in checks.values()
