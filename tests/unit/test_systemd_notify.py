"""gateway.ops.systemd against a fake service manager: notify, watchdog, socket activation."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gateway.backend.process import child_environment
from gateway.ops import systemd

#: Variables that belong to the gateway's own unit (sd_notify, watchdog, socket activation).
SYSTEMD_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS",
                    "LISTEN_FDNAMES")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["path", "abstract"])
def notify_socket(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's notify socket, exported as $NOTIFY_SOCKET."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tmpdir = None
    if request.param == "path":
        tmpdir = tempfile.TemporaryDirectory(prefix="gw-notify-")  # short: sun_path is 108 bytes
        addr = env = os.path.join(tmpdir.name, "notify.sock")
    else:
        name = f"mcp-gateway-test-{uuid.uuid4().hex}"
        addr, env = "\0" + name, "@" + name
    sock.bind(addr)
    sock.settimeout(2)
    for key in SYSTEMD_ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NOTIFY_SOCKET", env)
    yield sock
    sock.close()
    if tmpdir is not None:
        tmpdir.cleanup()


def drain(sock: socket.socket) -> list[bytes]:
    """Every datagram already queued on ``sock``, without waiting."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(2)
    return out


async def datagrams(sock: socket.socket, n: int) -> list[bytes]:
    """At least ``n`` datagrams, each waited for (the caller bounds the wait)."""
    got: list[bytes] = []
    while len(got) < n:
        await trio.lowlevel.wait_readable(sock)
        got += drain(sock)
    return got


# --- notify ------------------------------------------------------------------------------------


def test_notify_sends_one_exact_datagram(notify_socket: socket.socket) -> None:
    assert systemd.notify("READY=1", "STATUS=serving; 2/2 backends up") is True
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving; 2/2 backends up"
    assert systemd.notify("STOPPING=1") is True
    assert notify_socket.recv(4096) == b"STOPPING=1"
    assert drain(notify_socket) == []


def test_reloading_carries_monotonic_usec_in_the_same_datagram(
    notify_socket: socket.socket,
) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    systemd.notify("RELOADING=1", f"MONOTONIC_USEC={systemd.monotonic_usec()}")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = notify_socket.recv(4096).decode().split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_notify_off_systemd_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # not a unix socket: unsupported, ignored
    assert systemd.notify("READY=1") is False


def test_notify_to_a_vanished_socket_does_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/mcp-gateway/notify")
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", f"@mcp-gateway-nobody-{uuid.uuid4().hex}")
    assert systemd.notify("READY=1") is False


# --- watchdog ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("", None, None),
        ("30000000", None, 15.0),
        ("200000", "self", 0.1),
        ("200000", "1", None),  # meant for another process
        ("0", None, None),
        ("soon", None, None),
        ("200000", "me", None),
    ],
)
def test_watchdog_interval(usec: str | None, pid: str | None, expected: float | None) -> None:
    env = {}
    if usec is not None:
        env["WATCHDOG_USEC"] = usec
    if pid is not None:
        env["WATCHDOG_PID"] = str(os.getpid()) if pid == "self" else pid
    assert systemd.watchdog_interval(env) == expected


async def test_watchdog_pings_every_half_period(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # WatchdogSec=2s -> a ping every second
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    async with trio.open_nursery() as nursery:
        await nursery.start(systemd.run_watchdog)
        await trio.sleep(10.5)
        nursery.cancel_scope.cancel()
    assert drain(notify_socket) == [b"WATCHDOG=1"] * 11  # at t = 0, 1, ..., 10


async def test_watchdog_stops_pinging_while_the_loop_is_blocked(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "40000")  # real clock: a ping every 20 ms
    async with trio.open_nursery() as nursery:
        await nursery.start(systemd.run_watchdog)
        with trio.fail_after(5):
            await datagrams(notify_socket, 3)
        # real-clock: a stuck event loop is what the test makes (systemd would now see no pings)
        time.sleep(0.2)  # noqa: ASYNC251 - the stuck event loop is what the test makes
        assert drain(notify_socket) == []
        with trio.fail_after(5):
            await datagrams(notify_socket, 1)  # the loop runs again: so do the pings
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("env", [{}, {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}])
async def test_watchdog_returns_at_once_when_not_wanted(
    env: dict[str, str],
    notify_socket: socket.socket,
    monkeypatch: pytest.MonkeyPatch,
    autojump_clock: trio.abc.Clock,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            await nursery.start(systemd.run_watchdog)
    await trio.sleep(10)
    assert drain(notify_socket) == []


# --- socket activation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {"LISTEN_PID": "1", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "websocket:admin"},  # other pid
        {"LISTEN_FDS": "2", "LISTEN_FDNAMES": "websocket:admin"},  # no LISTEN_PID at all
        {"LISTEN_PID": "SELF", "LISTEN_FDS": "0"},
        {"LISTEN_PID": "SELF", "LISTEN_FDS": "two"},
        {"LISTEN_PID": "SELF"},
        {},
    ],
)
def test_listen_fds_ignored_unless_meant_for_us(env: dict[str, str]) -> None:
    environ = {k: v.replace("SELF", str(os.getpid())) for k, v in env.items()}
    environ["PATH"] = "/usr/bin"
    assert systemd.listen_fds_with_names(environ) == {}
    assert environ == {"PATH": "/usr/bin"}  # like sd_listen_fds(1): always unset


def test_listen_fds_pid_argument_overrides_getpid() -> None:
    environ = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "1"}
    assert systemd.listen_fds_with_names(environ, pid=os.getpid() + 1) == {}


# The child is what systemd would exec: listening sockets at fds 3, 4 (inheritable), LISTEN_*.
CHILD = textwrap.dedent(
    """
    import fcntl, json, os, sys
    high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 100) for fd in sys.argv[1:]]
    for i, fd in enumerate(high):
        os.dup2(fd, 3 + i, inheritable=True)
        os.close(fd)
    os.environ["LISTEN_PID"] = str(os.getpid())
    import trio
    from gateway.ops import systemd
    from gateway.transports.listeners import adopt_listener

    async def main():
        fds = systemd.listen_fds_with_names()
        result = {
            "fds": {str(k): v for k, v in fds.items()},
            "inheritable": [os.get_inheritable(fd) for fd in fds],
            "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
            "echo": [],
        }
        for fd in fds:
            listener = adopt_listener(fd)
            stream = await listener.accept()
            data = await stream.receive_some(100)
            await stream.send_all(data.upper())
            await stream.aclose()
            result["echo"].append(data.decode())
        print(json.dumps(result))

    trio.run(main)
    """
)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ("websocket:admin", ["websocket", "admin"]),
        ("websocket", ["websocket", "unknown"]),
        (None, ["unknown", "unknown"]),
    ],
)
def test_listen_fds_adopted_as_trio_listeners(names: str | None, expected: list[str]) -> None:
    import json

    listeners = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        listeners.append(s)
    env = {k: v for k, v in os.environ.items()
           if k not in SYSTEMD_ENV_VARS} | {"LISTEN_FDS": "2", "PYTHONPATH": str(REPO)}
    if names is not None:
        env["LISTEN_FDNAMES"] = names
    fds = [s.fileno() for s in listeners]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *map(str, fds)],
        pass_fds=fds,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for i, s in enumerate(listeners):
            with socket.create_connection(s.getsockname(), timeout=10) as c:
                c.sendall(f"hello {i}".encode())
                assert c.recv(100) == f"HELLO {i}".encode()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        for s in listeners:
            s.close()
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result == {
        "fds": {"3": expected[0], "4": expected[1]},
        "inheritable": [False, False],
        "env_left": [],
        "echo": ["hello 0", "hello 1"],
    }


# --- backend environment -----------------------------------------------------------------------


def test_backends_never_get_the_units_variables() -> None:
    env = {
        "PATH": "/usr/bin",
        "HOME": "/var/lib/mcp-gateway",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "42",
        "LISTEN_PID": "42",
        "LISTEN_FDS": "2",
        "LISTEN_FDNAMES": "websocket:admin",
    }
    assert child_environment({}, base=env) == {"PATH": "/usr/bin", "HOME": "/var/lib/mcp-gateway"}
