"""Logging setup: journald-aware stderr by default, the native journal protocol on request.

Structured fields go in ``extra`` with UPPERCASE ``MCP_`` names (journald drops lowercase field
names), e.g. ``log.info("started", extra={"MCP_BACKEND": "time"})``. The native journal handler
stores them as fields (``journalctl MCP_BACKEND=time``); the text formats append them as
``backend=time``.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

SYSLOG_IDENTIFIER = "mcp-gateway"
FIELD_PREFIX = "MCP_"
#: The values of ``[gateway] log_target`` (a test keeps this equal to the config's Literal).
TARGETS = ("auto", "stderr", "journal")

# logging level -> syslog priority (sd-daemon(3) prefixes, stored by journald as PRIORITY=)
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
#: The handlers setup_logging installed (a second call replaces them).
_INSTALLED: weakref.WeakSet[logging.Handler] = weakref.WeakSet()


def syslog_priority(levelno: int) -> int:
    """The syslog priority (0-7) for a :mod:`logging` level number."""
    for threshold, prio in _PRIORITIES:
        if levelno >= threshold:
            return prio
    return 7


def journal_stream_matches(environ: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """Whether ``fd`` is the journal stream systemd connected (``$JOURNAL_STREAM`` = dev:inode).

    Comparing with fstat matters: the variable is inherited by children whose stderr was
    redirected elsewhere, so merely being set proves nothing (systemd.exec(5)).
    """
    env = os.environ if environ is None else environ
    value = env.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(fd)
        return (int(dev), int(ino)) == (st.st_dev, st.st_ino)
    except (OSError, ValueError):
        return False


def _fields(record: logging.LogRecord) -> str:
    """`` backend=time conn=7`` for the record's ``MCP_*`` extras, or ``""``."""
    parts = [
        f"{key[len(FIELD_PREFIX) :].lower()}={value}"
        for key, value in record.__dict__.items()
        if key.startswith(FIELD_PREFIX) and value is not None
    ]
    return " " + " ".join(parts) if parts else ""


class PlainFormatter(logging.Formatter):
    """``2026-01-02 03:04:05,678 INFO gateway.hub: message backend=time`` for terminals/files."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record) + _fields(record)


class JournalStreamFormatter(logging.Formatter):
    """``<6>gateway.hub: message backend=time``: journald parses ``<N>`` as PRIORITY.

    journald timestamps entries itself. Every line gets the prefix, so a traceback's lines keep
    the record's priority instead of falling back to the stream default.
    """

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record) + _fields(record)

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


class RepeatFilter(logging.Filter):
    """Rate-limits WARNING records of one call site (logger, line, message template).

    Clients and backends cause warnings (an answer to an unknown id, a refused server→client
    request); one that repeats them must not flood the log.  Each call site may log ``burst``
    records, then one per ``interval`` seconds; what it holds back is counted and the count is
    added to the next record it lets through.  Other levels always pass (a backend's stderr,
    logged at INFO, has its own limit per backend; errors are never held back).  ``clock`` is
    passed in for tests.
    """

    def __init__(self, burst: int = 20, interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, max_sites: int = 1024) -> None:
        super().__init__()
        self._burst = burst
        self._interval = interval
        self._clock = clock
        self._max_sites = max_sites
        self._sites: dict[tuple[str, int, str], list[float]] = {}  # key -> [tokens, last, held]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        key = (record.name, record.lineno, str(record.msg))
        now = self._clock()
        site = self._sites.get(key)
        if site is None:
            if len(self._sites) >= self._max_sites:
                self._sites.clear()  # bounded: forget old sites rather than grow
            site = self._sites[key] = [float(self._burst), now, 0.0]
        tokens = min(float(self._burst), site[0] + (now - site[1]) / self._interval)
        site[1] = now
        if tokens < 1.0:
            site[0] = tokens
            site[2] += 1
            return False
        site[0] = tokens - 1.0
        if site[2]:
            record.msg = f"{record.msg} [{int(site[2])} more like this not logged]"
            site[2] = 0
        return True


def _journal_handler() -> logging.Handler | None:
    """systemd-python's JournalHandler (the package's ``systemd`` extra), if importable."""
    try:
        from systemd.journal import JournalHandler
    except ImportError:
        return None
    handler: logging.Handler = JournalHandler(SYSLOG_IDENTIFIER=SYSLOG_IDENTIFIER)
    return handler


def setup_logging(level: str = "info", target: str = "auto") -> None:
    """Configure the root logger once at startup (calling it again replaces the handler).

    ``target="auto"``: stderr, with ``<N>`` priority prefixes when stderr is the journal stream,
    timestamps and level names otherwise. ``target="stderr"``: stderr with timestamps and level
    names always (e.g. when stderr goes to a file or a collector that parses the plain format).
    ``target="journal"``: the native journal protocol (structured ``MCP_*`` fields), falling back to
    ``auto`` with a warning if systemd-python is not installed. Also enables :mod:`faulthandler`, so
    a watchdog SIGABRT or a crash leaves a Python traceback on stderr.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    if target not in TARGETS:
        raise ValueError(f"unknown log target {target!r} (expected one of {', '.join(TARGETS)})")

    handler = _journal_handler() if target == "journal" else None
    fallback = target == "journal" and handler is None
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        if target != "stderr" and journal_stream_matches():
            handler.setFormatter(JournalStreamFormatter())
        else:
            handler.setFormatter(PlainFormatter())
    _INSTALLED.add(handler)
    handler.addFilter(RepeatFilter())

    root = logging.getLogger()
    for old in [h for h in root.handlers if h in _INSTALLED]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)

    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=2, all_threads=True)  # fd 2: works whatever sys.stderr is
        except (OSError, ValueError) as exc:
            log.warning("faulthandler not enabled: %s", exc)
    if fallback:
        log.warning("log target 'journal' needs systemd-python (not installed); using stderr")
