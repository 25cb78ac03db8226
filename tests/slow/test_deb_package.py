"""The Debian package end to end: build, install into a fresh bookworm root, boot it, purge.

Needs root and the tools from scripts/setup-test-extra (debhelper, dh-virtualenv, mmdebstrap,
systemd-container). The bookworm root (mmdebstrap, minbase + systemd) is made while the package
builds. The package is installed the way an operator would (`apt-get install ./x.deb`), the
root is booted with systemd-nspawn and the service is driven with systemctl through nsenter.
The tests share that one root and run in file order (the last one purges the package).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
VENV = "/opt/venvs/mcp-gateway"
CONF = "/etc/mcp-gateway/gateway.toml"
HOST_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
# systemd to boot the root; python3 and procps (Depends of the package, checked in
# test_deb_metadata) installed here already because this runs in parallel with the build.
BASE_PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "procps")


@dataclass
class Installed:
    deb: Path
    root: Path
    times: dict[str, float] = field(default_factory=dict)


def run(*cmd: str | Path, timeout: float = 300, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a command, failing the test with its output if it exits non-zero."""
    res = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if res.returncode != 0:
        argv = " ".join(map(str, cmd))
        pytest.fail(f"{argv} -> {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def in_root(
    root: Path, *cmd: str, user: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """chroot into ``root`` with /proc mounted in a private mount namespace (gone on exit)."""
    userspec = [f"--userspec={user}:{user}"] if user else []
    script = 'mount -t proc proc "$0/proc" && exec chroot "$@"'
    return run(
        "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
        root, *userspec, root, *cmd, timeout=timeout,
    )  # fmt: skip


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    inside = [p for p in points if p == str(path) or p.startswith(f"{path}/")]
    return sorted(set(inside), key=lambda p: p.count("/"), reverse=True)


def remove_root(root: Path) -> None:
    """Delete a root made here, after unmounting whatever mmdebstrap or a test left mounted.

    Never delete through a mount: /proc, /sys or /dev/pts of the host could be under it.
    """
    for point in mounts_under(root):
        subprocess.run(["umount", "--lazy", point], check=False)
    leftover = mounts_under(root)
    assert not leftover, f"not removing {root}: still mounted: {leftover}"
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)


def note(request: pytest.FixtureRequest, key: str, value: object) -> None:
    """A measurement: printed (see with -rP / -s) and kept as a test property."""
    request.node.user_properties.append((key, value))
    print(f"{key} = {value}")


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    if os.geteuid() != 0:
        pytest.fail("the package tier needs root (mmdebstrap --mode=root, chroot, nspawn)")
    # Not under pytest's basetemp: pytest deletes old basetemps itself, and a run killed while
    # mmdebstrap had /proc, /sys and /dev/pts mounted inside the root must not be rm -rf'ed.
    base = Path(tempfile.mkdtemp(prefix="mcp-gateway-deb-", dir="/var/tmp"))
    root = base / "root"
    sources = [str(HOST_SOURCES)] if HOST_SOURCES.exists() else []
    t0 = time.monotonic()
    # Make the root while the package builds: both take ~30-50 s, mostly on different resources.
    strap_log = open(base / "mmdebstrap.log", "w+")  # closed below
    strap = subprocess.Popen(
        ["mmdebstrap", "--mode=root", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
         "--skip=cleanup/apt/lists", "bookworm", str(root), *sources],
        stdout=strap_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        try:
            out = run(REPO / "packaging/build-deb", timeout=600).stdout.strip().splitlines()
            t_build = time.monotonic() - t0
            rc = strap.wait(timeout=600)
            t_strap = time.monotonic() - t0
        finally:
            if strap.poll() is None:
                strap.terminate()  # mmdebstrap unmounts and cleans up on SIGTERM; never SIGKILL
                strap.wait(timeout=120)
            strap_log.seek(0)
            strap_output = strap_log.read()
            strap_log.close()
        assert rc == 0, f"mmdebstrap failed:\n{strap_output[-3000:]}"
        deb = Path(out[-1])
        assert deb.parent == REPO / "packaging/out" and deb.name.startswith("mcp-gateway_"), out

        shutil.copy(deb, root / "tmp" / deb.name)
        t1 = time.monotonic()
        in_root(
            root, "env", "DEBIAN_FRONTEND=noninteractive",
            "apt-get", "install", "-y", "-q", "--no-install-recommends", f"/tmp/{deb.name}",
        )  # fmt: skip
        times = {
            "build_deb_s": round(t_build, 1),
            "mmdebstrap_s_in_parallel": round(t_strap, 1),
            "apt_install_s": round(time.monotonic() - t1, 1),
        }
        yield Installed(deb, root, times)
    finally:
        remove_root(root)
        shutil.rmtree(base, ignore_errors=True)


def test_deb_metadata(installed: Installed, request: pytest.FixtureRequest) -> None:
    for key, value in installed.times.items():
        note(request, key, value)
    note(request, "deb_size_mb", round(installed.deb.stat().st_size / 1e6, 1))
    fields = {
        f: run("dpkg-deb", "-f", installed.deb, f).stdout.strip()
        for f in ("Package", "Architecture", "Depends")
    }
    assert fields["Package"] == "mcp-gateway"
    depends = [d.strip() for d in fields["Depends"].split(",")]
    # the venv's python3 is a symlink to /usr/bin/python3: pinned to the minor it was built for
    assert {"python3 (>= 3.11~)", "python3 (<< 3.12)", "procps"} <= set(depends)
    assert (
        installed.deb.name
        == f"mcp-gateway_{installed.deb.name.split('_')[1]}_{fields['Architecture']}.deb"
    )


def test_files_in_place(installed: Installed) -> None:
    r = installed.root
    assert os.readlink(r / "usr/bin/mcp-gateway") == f"{VENV}/bin/mcp-gateway"
    assert (r / VENV.lstrip("/") / "bin/mcp-gateway").read_text().startswith(f"#!{VENV}/bin/python")
    assert os.access(r / VENV.lstrip("/") / "bin/mcp-server-time", os.X_OK)
    for unit in ("mcp-gateway.service", "mcp-gateway-ws.socket", "mcp-gateway-http.socket",
                 "mcp-gateway-admin.socket"):
        assert (r / "lib/systemd/system" / unit).read_text() == (
            REPO / "systemd" / unit
        ).read_text()
    assert (r / "usr/lib/sysusers.d/mcp-gateway.conf").is_file()
    assert (r / "usr/lib/tmpfiles.d/mcp-gateway.conf").is_file()
    assert (r / CONF.lstrip("/")).read_text() == (REPO / "packaging/gateway.toml").read_text()
    status = in_root(r, "dpkg-query", "-W", "-f=${Conffiles}", "mcp-gateway").stdout
    assert CONF in status
    # the service is enabled on install; the socket units are opt-in
    wants = r / "etc/systemd/system/multi-user.target.wants/mcp-gateway.service"
    assert os.readlink(wants) == "/lib/systemd/system/mcp-gateway.service"
    assert not list((r / "etc/systemd/system").glob("sockets.target.wants/mcp-gateway*"))


def test_system_user_and_home(installed: Installed) -> None:
    r = installed.root
    entry = in_root(r, "getent", "passwd", "mcp-gateway").stdout.strip().split(":")
    assert entry[5:] == ["/var/lib/mcp-gateway", "/usr/sbin/nologin"]
    uid = int(entry[2])
    assert uid < 1000
    st = (r / "var/lib/mcp-gateway").stat()
    assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o750)


def test_check_config_in_the_root(installed: Installed) -> None:
    # as root (an operator), and as the service user (what ExecReload= runs)
    in_root(installed.root, "/usr/bin/mcp-gateway", "check-config", CONF)
    in_root(installed.root, "/usr/bin/mcp-gateway", "check-config", CONF, user="mcp-gateway")
    in_root(
        installed.root, f"{VENV}/bin/python", "-c", "import gateway.demo_server, systemd.journal"
    )


def test_installed_unit_verifies(installed: Installed, request: pytest.FixtureRequest) -> None:
    """The unit as installed, with the real binaries of the root (ops-notes §1)."""
    root = f"--root={installed.root}"
    res = run("systemd-analyze", "verify", "--man=no", root, "mcp-gateway.service")
    assert (res.stdout, res.stderr) == ("", "")
    res = run(
        "systemd-analyze", "security", "--offline=true", root, "--threshold=20", "--no-pager",
        "mcp-gateway.service",
    )  # fmt: skip
    match = re.search(r"Overall exposure level for mcp-gateway\.service: (\d+\.\d+)", res.stdout)
    assert match, res.stdout
    note(request, "installed_unit_exposure", float(match[1]))
    assert float(match[1]) <= 2.0


class Container:
    """A booted systemd-nspawn container of the root, driven through nsenter."""

    def __init__(self, root: Path, log: Path) -> None:
        self.log = open(log, "w+")  # closed in stop()
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "-D", str(root), f"--machine=mcp-gateway-test-{os.getpid()}",
             "--register=no", "--keep-unit",
             "--private-network", "--console=pipe", "-b"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.pid = 0

    def wait_booted(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            if not self.pid:
                children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
                self.pid = int((children.read_text().split() or ["0"])[0])
            if self.pid:
                res = self.run("systemctl", "is-system-running", check=False)
                state = res.stdout.strip()
                if state in ("running", "degraded"):
                    return state
            time.sleep(0.25)
        pytest.fail(f"container did not boot ({state!r}):\n{self.output()}")

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = ["nsenter", "-t", str(self.pid), "-a", *cmd]
        if check:
            return run(*argv, timeout=60)
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None and self.pid:
            self.run("systemctl", "poweroff", check=False)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()  # nspawn shuts the container down on SIGTERM
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def test_boots_and_serves(
    installed: Installed, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    t0 = time.monotonic()
    box = Container(installed.root, tmp_path / "nspawn.log")
    try:
        state = box.wait_booted()
        props = ("ActiveState", "SubState", "StatusText", "User", "WatchdogUSec", "NRestarts")
        svc = box.show("mcp-gateway.service", *props)
        assert svc["ActiveState"] == "active", (
            state,
            svc,
            box.run("journalctl", "-b", "--no-pager").stdout[-3000:],
        )
        assert (
            svc["User"] == "mcp-gateway"
            and svc["WatchdogUSec"] == "30s"
            and svc["NRestarts"] == "0"
        )
        assert svc["StatusText"], "the gateway sends STATUS="
        note(request, "boot_to_active_s", round(time.monotonic() - t0, 1))

        probe = (
            "import urllib.request as u;"
            "print(u.urlopen('http://127.0.0.1:9477/readyz', timeout=5).status)"
        )
        assert box.run(f"{VENV}/bin/python", "-c", probe).stdout.strip() == "200"
        mode = box.run("stat", "-c", "%a %U", "/run/mcp-gateway/mcp.sock").stdout.split()
        assert mode == ["660", "mcp-gateway"]

        pid = box.show("mcp-gateway.service", "MainPID")["MainPID"]
        box.run("systemctl", "reload", "mcp-gateway.service")  # check-config, then SIGHUP
        # systemd 252 ends the reload job when `kill` exits; the daemon's RELOADING=1 may come
        # after it, and its READY=1 when the reload is done (notify-reload, 253+, would wait)
        deadline = time.monotonic() + 30
        while (after := box.show("mcp-gateway.service", "ActiveState", "MainPID"))[
                "ActiveState"] == "reloading" and time.monotonic() < deadline:
            time.sleep(0.1)  # real-clock: systemd's state in a container, polled
        assert after == {"ActiveState": "active", "MainPID": pid}

        box.run("systemctl", "stop", "mcp-gateway.service")
        end = box.show("mcp-gateway.service", "ActiveState", "Result", "ExecMainStatus")
        assert end == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}

        journal = box.run(
            "journalctl", "-b", "-o", "json", "--no-pager", "SYSLOG_IDENTIFIER=mcp-gateway"
        )
        entries = [json.loads(line) for line in journal.stdout.splitlines()]
        assert entries, "nothing logged under SyslogIdentifier=mcp-gateway"
        errors = [e["MESSAGE"] for e in entries if int(e.get("PRIORITY", 6)) <= 3]
        assert not errors, errors
        # e.g. a syscall the sandbox refuses with EPERM shows up here: reported, not fatal
        note(
            request, "journal_warnings", [e["MESSAGE"] for e in entries if e.get("PRIORITY") == "4"]
        )
        assert {e.get("PRIORITY") for e in entries} >= {"6"}  # <6> prefixes parsed by journald
    finally:
        box.stop()
    note(request, "nspawn_total_s", round(time.monotonic() - t0, 1))


def test_purge_removes_the_package(installed: Installed, request: pytest.FixtureRequest) -> None:
    r = installed.root
    t0 = time.monotonic()
    in_root(r, "dpkg", "--purge", "mcp-gateway")
    note(request, "purge_s", round(time.monotonic() - t0, 1))
    for path in (
        VENV,
        "/etc/mcp-gateway",
        "/usr/bin/mcp-gateway",
        "/lib/systemd/system/mcp-gateway.service",
    ):
        assert not (r / path.lstrip("/")).exists(), path
    assert not (r / "etc/systemd/system/multi-user.target.wants/mcp-gateway.service").is_symlink()
