"""systemd integration without libsystemd: sd_notify, the watchdog, socket activation.

Everything here is a no-op off systemd, so the gateway runs unchanged in a terminal or a container.
Protocols: sd_notify(3), sd_watchdog_enabled(3), sd_listen_fds(3).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, MutableMapping

import trio

from gateway.transports.datagram import send_unix_datagram

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
"""The first file descriptor passed by socket activation."""


def notify(*assignments: str) -> bool:
    """Send ``KEY=VALUE`` assignments to the service manager as one datagram.

    ``notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}")`` sends both in one message, as
    the protocol requires. Returns False (and does nothing) when ``$NOTIFY_SOCKET`` is unset or is
    not a unix socket address; returns True once the datagram is sent. Send errors are logged,
    never raised: a daemon must not die because its supervisor's socket is gone.
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]  # abstract namespace
    elif addr[0] != "/":
        log.debug("unsupported NOTIFY_SOCKET address %r", addr)
        return False
    data = "\n".join(assignments).encode()
    try:
        # Never blocks the event loop: a full receive queue drops this one message.
        send_unix_datagram(addr, data)
    except OSError as exc:
        log.warning("sd_notify to %r failed: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, for ``MONOTONIC_USEC=`` next to ``RELOADING=1``."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec=``), or None if not wanted.

    None when ``$WATCHDOG_USEC`` is unset or invalid, or when ``$WATCHDOG_PID`` names another
    process (the watchdog is then meant for someone else, e.g. a parent shell).
    """
    env = os.environ if environ is None else environ
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec:
        return None
    try:
        period = int(usec)
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        log.warning("ignoring invalid WATCHDOG_USEC=%r / WATCHDOG_PID=%r", usec, pid)
        return None
    if period <= 0:
        return None
    return period / 2e6


async def run_watchdog(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Send ``WATCHDOG=1`` every :func:`watchdog_interval` seconds, forever.

    Runs inside the trio loop on purpose: a blocked event loop stops the pings and systemd
    aborts the process (SIGABRT; ``faulthandler`` then logs the stuck stack). Returns at once
    when no watchdog is configured. Start with ``await nursery.start(run_watchdog)``.
    """
    interval = watchdog_interval()
    task_status.started()
    if interval is None:
        return
    log.debug("watchdog enabled: pinging every %.3f s", interval)
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)


def listen_fds_with_names(
    environ: MutableMapping[str, str] = os.environ, pid: int | None = None
) -> dict[int, str]:
    """Sockets passed by systemd socket activation, as ``{fd: name}``.

    Names come from ``FileDescriptorName=`` (default: the socket unit's name); missing names
    are ``"unknown"``. Returns ``{}`` unless ``$LISTEN_PID`` is ``pid`` (default: this process).
    The fds are made close-on-exec so backends do not inherit them. Like ``sd_listen_fds(1)``,
    the ``LISTEN_*`` variables are always removed from ``environ``.
    """
    pid = os.getpid() if pid is None else pid
    listen_pid, listen_fds, raw_names = (
        environ.pop(key, None) for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
    )
    if not listen_pid or listen_pid.strip() != str(pid):
        return {}
    try:
        count = int(listen_fds or "0")
    except ValueError:
        log.warning("ignoring invalid LISTEN_FDS=%r", listen_fds)
        return {}
    if count <= 0:
        return {}
    names = raw_names.split(":") if raw_names else []
    names += ["unknown"] * (count - len(names))
    fds: dict[int, str] = {}
    for i in range(count):
        fd = SD_LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        fds[fd] = names[i] or "unknown"
    log.info("socket activation: %s", ", ".join(f"fd {fd}={n}" for fd, n in fds.items()))
    return fds
