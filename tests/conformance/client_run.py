"""Run the official conformance suite's client scenarios with the gateway as the client.

Each in-scope scenario of a revision is run on its own, `conformance client --scenario S
--spec-version REV --expected-failures client-baseline-REV.yaml` with `client_driver.py` as the
command (a few at once): every client scenario of the revision's requirement set, the
`auth/*` authorization code ones included (the driver plays the operator who authorizes), and
the extension (client credentials) and older (2025-03-26 back-compat) ones that fit a gateway.
`--requirements REV` is not used: it judges its baseline on the scored scenarios only, so the
extension and not-scored ones would go unchecked.

The baselines are the suite's own format (`client:` entries `scenario:check-id`), one file per
revision since a scenario is a different wire under each; the suite judges them: a failure not
listed, or a listed check that now passes, exits 1. Their `driver:` section (the suite ignores
it) lists the scenarios whose checks pass but whose driver fails (a step unanswered, the
remote's session restarted). After a fix, `--baseline` prints the entries matching what fails.

    python tests/conformance/client_run.py [--requirements REV] [--scenario S] [--baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from conformance.run import CLI, NODE, ROOT, SuiteError  # noqa: E402

DRIVER = os.path.join(HERE, "client_driver.py")
CLIENT_CREDENTIALS = ("auth/client-credentials-basic", "auth/client-credentials-jwt")
# The authorization code scenarios (the driver plays the operator who authorizes).
AUTH_CODE = ("auth/metadata-default", "auth/metadata-var1", "auth/metadata-var2",
             "auth/metadata-var3", "auth/basic-cimd", "auth/scope-from-www-authenticate",
             "auth/scope-from-scopes-supported", "auth/scope-omitted-when-undefined",
             "auth/scope-step-up", "auth/scope-retry-limit", "auth/token-endpoint-auth-basic",
             "auth/token-endpoint-auth-post", "auth/token-endpoint-auth-none",
             "auth/pre-registration")
AUTH_CODE_2026 = ("auth/resource-mismatch", "auth/offline-access-scope",
                  "auth/offline-access-not-supported", "auth/authorization-server-migration",
                  "auth/iss-supported", "auth/iss-not-advertised", "auth/iss-supported-missing",
                  "auth/iss-wrong-issuer", "auth/iss-unexpected", "auth/iss-normalized",
                  "auth/metadata-issuer-mismatch")
# The 2025-03-26 back-compat ones (no protected-resource metadata): run with --force.
BACK_COMPAT = ("auth/2025-03-26-oauth-metadata-backcompat",
               "auth/2025-03-26-oauth-endpoint-fallback")
# Per revision, the client scenarios its requirement set names (scored or not). Client
# credentials are an extension, the back-compat ones older: run with --force at the revision.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "2025-11-25": ("initialize", "tools_call", "elicitation-sep1034-client-defaults",
                   "sse-retry", "json-schema-2020-12-preservation", *CLIENT_CREDENTIALS,
                   *AUTH_CODE, *BACK_COMPAT),
    "2026-07-28": ("tools_call", "request-metadata", "sep-2322-client-request-state",
                   "http-standard-headers", "http-custom-headers", "http-invalid-tool-headers",
                   "json-schema-ref-no-deref", "json-schema-2020-12-preservation",
                   *CLIENT_CREDENTIALS, *AUTH_CODE, *AUTH_CODE_2026),
}
FORCED = (*CLIENT_CREDENTIALS, *BACK_COMPAT)
SCENARIO_TIMEOUT_MS = 30_000  # the suite's default; the driver's own steps end within 20 s
RUN_TIMEOUT = 90.0  # one scenario, the suite's start and stop included
WORKERS = 3
_RESULTS = re.compile(r"^Passed: \d+/\d+, \d+ failed, \d+ warnings$", re.M)
_CLIENT_EXIT = re.compile(r"^Client exited with code (-?\d+)$", re.M)
_SECTION = re.compile(r"^(\w+):")
_ENTRY = re.compile(r"^\s+-\s*([^\s#:]+)")


def baseline_path(revision: str) -> str:
    return os.path.join(HERE, f"client-baseline-{revision}.yaml")


def baselined(revision: str, section: str = "client") -> set[str]:
    """The scenarios with an entry in a section of the revision's baseline: ``client`` (the
    suite's) or ``driver`` (this runner's: the scenarios whose driver is known to fail)."""
    found: dict[str, set[str]] = {}
    current = ""
    with open(baseline_path(revision), encoding="utf-8") as f:
        for line in f:
            if m := _SECTION.match(line):
                current = m[1]
            elif m := _ENTRY.match(line):
                found.setdefault(current, set()).add(m[1])
    return found.get(section, set())


@dataclass(frozen=True)
class ScenarioRun:
    name: str
    exit_code: int  # the suite's: 0 when what fails is exactly what the baseline lists
    passed: int
    failed: int
    warnings: int
    failures: tuple[str, ...]  # "<check id>: <message>" of each FAILURE or WARNING check
    results_line: str  # the suite's own "Passed: a/b, f failed, w warnings"
    client_exit: int  # the driver's: 0 when every step got an answer
    output: str

    @property
    def summary(self) -> str:
        mark = "✓" if self.failed == 0 and self.warnings == 0 else "✗"
        judged = ("baseline ok" if self.exit_code == 0
                  else f"BASELINE MISMATCH (exit {self.exit_code})")
        client = "" if self.client_exit == 0 else f" [driver exited {self.client_exit}]"
        return f"{mark} {self.name}: {self.results_line} [{judged}]{client}"

    def baseline_entries(self) -> list[str]:
        return sorted({f"{self.name}:{f.split(':', 1)[0]}" for f in self.failures})


def read_checks(out_dir: str) -> list[dict[str, object]]:
    found = [os.path.join(root, "checks.json") for root, _, files in os.walk(out_dir)
             if "checks.json" in files]
    if len(found) != 1:
        raise SuiteError(f"expected one checks.json under {out_dir}, found {len(found)}")
    with open(found[0], encoding="utf-8") as f:
        checks: list[dict[str, object]] = json.load(f)
    return checks


def run_scenario(revision: str, scenario: str, baseline: str | None = None) -> ScenarioRun:
    """One scenario at `revision` with the gateway as the client, judged against `baseline`
    (the revision's file unless given)."""
    for path in (NODE, CLI):
        if not os.path.exists(path):
            raise SuiteError(f"{path} is missing: run scripts/setup --test")
    command = shlex.join([sys.executable, DRIVER])
    with tempfile.TemporaryDirectory(prefix="clientconf-") as out:
        argv = [NODE, CLI, "client", "--command", command, "--scenario", scenario,
                "--spec-version", revision, "--timeout", str(SCENARIO_TIMEOUT_MS), "-o", out,
                "--expected-failures", baseline or baseline_path(revision)]
        if scenario in FORCED:
            argv.append("--force")
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                                  stdin=subprocess.DEVNULL, check=False, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            raise SuiteError(f"{scenario} did not finish within {RUN_TIMEOUT:g}s") from e
        output = done.stdout + done.stderr
        if "SKIPPED:" in done.stdout:
            raise SuiteError(f"the suite skipped {scenario} at {revision}:\n{done.stdout}")
        checks = read_checks(out)
    bad = [c for c in checks if c.get("status") in ("FAILURE", "WARNING")]
    line = _RESULTS.search(output)
    client = _CLIENT_EXIT.search(output)
    return ScenarioRun(
        scenario, done.returncode,
        sum(c.get("status") == "SUCCESS" for c in checks),
        sum(c.get("status") == "FAILURE" for c in checks),
        sum(c.get("status") == "WARNING" for c in checks),
        tuple(" ".join(f"{c.get('id')}: {c.get('errorMessage') or c.get('description')}".split())
              for c in bad),
        line[0] if line else "(no results line)", int(client[1]) if client else 0, output)


def run_revision(revision: str, scenarios: tuple[str, ...] | None = None) -> list[ScenarioRun]:
    names = scenarios or SCENARIOS[revision]
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(lambda s: run_scenario(revision, s), names))


def explain(revision: str, runs: list[ScenarioRun]) -> str:
    ok = sum(r.failed == 0 and r.warnings == 0 for r in runs)
    lines = [f"client {revision}: {ok}/{len(runs)} scenarios pass; baseline "
             + ("matches" if all(r.exit_code == 0 for r in runs) else "DOES NOT MATCH")]
    for r in runs:
        lines.append("  " + r.summary)
        lines.extend(f"      {f[:300]}" for f in r.failures)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requirements", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--scenario", action="append", help="only these (default: all in scope)")
    parser.add_argument("--baseline", action="store_true",
                        help="print the baseline entries matching what fails now")
    parser.add_argument("--verbose", action="store_true", help="the suite's whole output")
    args = parser.parse_args(argv)
    code = 0
    for revision in args.requirements or sorted(SCENARIOS):
        names = tuple(s for s in SCENARIOS[revision] if not args.scenario or s in args.scenario)
        runs = run_revision(revision, names)
        if args.verbose:
            for r in runs:
                print(f"===== {r.name}\n{r.output}")
        print(explain(revision, runs))
        if args.baseline:
            print(f"# {baseline_path(revision)}\nclient:")
            print("\n".join(f"  - {e}" for r in runs for e in r.baseline_entries()))
            print("driver:")
            print("\n".join(f"  - {r.name}" for r in runs
                            if r.client_exit and not r.baseline_entries()))
        code |= any(r.exit_code for r in runs)
    return code


if __name__ == "__main__":
    sys.exit(main())
