"""Spawning and stopping backend children, and reaping what they leave behind.

Each child runs in its own session and process group (``start_new_session``), so the whole
group can be signalled.  Stop order (MCP lifecycle, stdio): close stdin → wait → SIGTERM to the
group → wait → SIGKILL to the group; shielded, every wait bounded.  Processes that escape the
group (a grandchild that calls ``setsid``) are re-parented to the gateway when it is a child
subreaper (``PR_SET_CHILD_SUBREAPER``) and :func:`reap_orphans` kills and reaps them.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import os
import signal
import subprocess

import trio

from gateway import procfs
from gateway.config import BackendConfig

LOGGER = logging.getLogger(__name__)

#: After stdin closes, a well-behaved server exits at once; give it this long.
STDIN_GRACE = 2.0
#: After SIGTERM to the group: time to clean up before SIGKILL.
TERM_GRACE = 3.0
#: After SIGKILL: the kernel needs no more than this to let us reap.
KILL_WAIT = 2.0
#: Without pidfds (Linux < 5.3): how often to look whether a group member has exited.
EXIT_POLL_FALLBACK = 0.05

#: Variables a child inherits from the gateway's own environment (everything else is dropped).
ENV_ALLOW = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
    "SHELL", "SYSTEMROOT", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
)  # fmt: skip

PR_SET_CHILD_SUBREAPER = 36


class Ended(enum.StrEnum):
    """How :func:`stop_process` found a child ended (a ``StrEnum``: logged by value)."""

    EXITED = "exited"  # already, before the stop began
    STDIN = "stdin"  # after its stdin closed
    SIGTERM = "sigterm"
    SIGKILL = "sigkill"


def child_environment(extra: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """A minimal allow-listed environment plus the backend's own ``env`` table.

    Never includes systemd's NOTIFY_SOCKET / WATCHDOG_* / LISTEN_* (not on the allow-list).
    """
    source = os.environ if base is None else base
    env = {k: source[k] for k in ENV_ALLOW if k in source}
    env.setdefault("PATH", os.defpath)
    env.update(extra)
    return env


#: errnos of a spawn that failed for lack of resources (file descriptors, memory, processes):
#: not the backend's fault (see :func:`out_of_resources`).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOBUFS})


def out_of_resources(exc: OSError) -> bool:
    """Whether a failed :func:`spawn` ran out of a resource of the gateway's or the system's
    (retry later) rather than failing for the backend's own reasons (command not found, …)."""
    return exc.errno in RESOURCE_ERRNOS


#: Spawns under way: a child exists before its instance knows its pid, so no reaping meanwhile.
_spawning = 0


async def spawn(cfg: BackendConfig, env: dict[str, str] | None = None) -> trio.Process:
    """Start a backend child with stdin/stdout/stderr pipes in its own process group (``env``:
    variables set over the backend's own ``env``, a principal's).  The caller records ``proc``
    before its next checkpoint (:func:`reap_orphans` relies on it)."""
    global _spawning
    _spawning += 1
    try:
        return await trio.lowlevel.open_process(
            [cfg.command, *cfg.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cfg.cwd,
            env=child_environment(cfg.env if env is None else {**cfg.env, **env}),
            start_new_session=True,
        )
    finally:
        _spawning -= 1


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process remains in group ``pgid``.

    One ``killpg(pgid, 0)`` answers the common case (nothing left) without scanning /proc.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(procfs.group_members(pgid))


async def stop_process(proc: trio.Process, *, stdin_grace: float = STDIN_GRACE,
                       term_grace: float = TERM_GRACE) -> Ended:
    """Stop ``proc`` and its process group in the spec's order.  Never raises, never hangs.

    Returns how it ended (:class:`Ended`).
    """
    pgid = proc.pid
    how = Ended.EXITED if proc.returncode is not None else Ended.STDIN
    with trio.CancelScope(shield=True):
        if proc.stdin is not None:
            with trio.move_on_after(1.0):
                try:
                    await proc.stdin.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
        with trio.move_on_after(stdin_grace):
            await proc.wait()
        if proc.returncode is None or group_alive(pgid):
            if proc.returncode is None:
                how = Ended.SIGTERM
            _signal_group(pgid, signal.SIGTERM)
            with trio.move_on_after(term_grace):
                await proc.wait()
                await wait_group_gone(pgid)
        if proc.returncode is None or group_alive(pgid):
            if proc.returncode is None:
                how = Ended.SIGKILL
            _signal_group(pgid, signal.SIGKILL)
            with trio.move_on_after(KILL_WAIT):
                await proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                with trio.move_on_after(0.5):
                    await stream.aclose()
    return how


async def wait_group_gone(pgid: int) -> None:
    """Return once no live process is left in group ``pgid``; the caller bounds the wait.

    Members are not our children (but for the leader), so each one's exit is awaited on a pidfd
    (readable once the process has exited); the group is looked at again after each exit, as a
    member may have forked meanwhile.
    """
    while members := _live_members(pgid):
        for pid in members:
            await _wait_exit(pid)


def _live_members(pgid: int) -> list[int]:
    try:
        os.killpg(pgid, 0)  # nothing left (the common case): no scan of /proc
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    return procfs.group_members(pgid)


async def _wait_exit(pid: int) -> None:
    """Return when ``pid`` has exited (at once if there is no such process)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds on this kernel: look again in a moment
        await trio.sleep(EXIT_POLL_FALLBACK)
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)


def kill_group(pgid: int) -> None:
    """SIGKILL whatever is left in a dead child's process group (e.g. an npx wrapper's server)."""
    _signal_group(pgid, signal.SIGKILL)


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux ≥ 3.4)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        done: int = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        return done == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(known: set[int]) -> list[int]:
    """Kill and reap re-parented descendants: our children that are not live backend leaders.

    Only meaningful when this process is a subreaper and spawns nothing but backends (the
    ``mcp-gateway run`` daemon); returns the pids handled.
    """
    handled: list[int] = []
    if _spawning:  # a new child's pid is not in ``known`` yet: reap at the next stop instead
        return handled
    for pid in sorted(procfs.children() - known):
        st = procfs.stat(pid)
        if st is None:
            continue
        if st.state != "Z":
            LOGGER.warning("killing orphaned backend descendant pid %d", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        handled.append(pid)
    return handled
