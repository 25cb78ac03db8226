"""The audit log's writer: a bounded queue of records, sealed into the HMAC chain
(:mod:`gateway.protocol.audit`) and written by one thread, off the request path.

Theory of operation: :meth:`AuditLog.offer` (called where a call ends) queues a record; past
``[audit] queue`` records it drops it (``on_full = "drop"``: counted, and a gap record saying
how many were lost goes in before the next one) or says so (``"block"``: the caller waits in
:meth:`AuditLog.put`).  The task :meth:`AuditLog.run` owns the writer thread, which takes the
queue in batches (:class:`_File`: seal, write, rotate by size, fsync by policy; the journal
too) and tells the trio thread when places are free; no trio task waits for it.
:meth:`AuditLog.reload` (SIGHUP) re-reads the key and has the file reopened before the next
batch (logrotate's rename); a new key starts a new file; a file that cannot be reopened is
tried again at each batch (its records counted lost meanwhile).  On exit the queue is written.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from gateway import config
from gateway.auth.tokens import file_problem
from gateway.config import AuditSection
from gateway.errors import ConfigError
from gateway.events import AuditRecordsDropped, EventBus
from gateway.protocol import audit

LOGGER = logging.getLogger(__name__)

#: Records written at once at most.
BATCH = 512
#: Seconds the writer thread waits, once woken, for more records to write with the first.
GATHER = 0.005
#: Seconds the daemon's exit waits for the writer to write what is queued.
JOIN_TIMEOUT = 30.0
#: The key file is read up to this size.
MAX_KEY_FILE = 4096
#: The last line of an existing file is looked for within this many bytes of its end.
MAX_TAIL = 64 * 1024 * 1024


def load_key(path: str, *, create: bool = True, owner: int | None = None) -> bytes:
    """The HMAC key in ``path`` (hex), generated (32 random bytes, mode 0600) when absent and
    ``create``; the file must be owned by root or ``owner`` (default: this process's user) and
    not readable by others.

    Raises:
        ConfigError: unreadable, refused, or no usable key in it.
    """
    try:
        try:
            data = config.read_regular(
                path, MAX_KEY_FILE,
                problem=lambda st: file_problem(st.st_mode, st.st_uid,
                                                os.getuid() if owner is None else owner))
        except FileNotFoundError:
            if not create:
                raise
            key = secrets.token_bytes(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(key.hex() + "\n")
            LOGGER.info("generated the audit key %s", path)
            return key
        key = bytes.fromhex(data.decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError([f"audit.key_file: {path}: {exc}"]) from None
    if len(key) < 16:
        raise ConfigError([f"audit.key_file: {path}: the key must be at least 16 bytes "
                           "(32 hex digits)"])
    return key


def journal_sender() -> Any:
    """``systemd.journal.send`` (the ``systemd`` extra).

    Raises:
        ConfigError: the extra is not installed.
    """
    try:
        return importlib.import_module("systemd.journal").send
    except ImportError:
        raise ConfigError(["audit.journald: needs the systemd extra (python3-systemd, "
                           "pip install 'trio-mcp-gateway[systemd]'), which is not installed"]
                          ) from None


def _last_mac(fd: int, size: int) -> tuple[bytes | None, bool]:
    """The MAC of the last complete line of the file open at ``fd`` (None: none found), and
    whether the file ends with a complete line."""
    end = size
    tail = b""
    while end > 0 and size - end < MAX_TAIL:
        start = max(0, end - 65536)
        tail = os.pread(fd, end - start, start) + tail
        end = start
        lines = tail.split(b"\n")
        if len(lines) >= 3 or (end == 0 and len(lines) >= 2):
            break
    lines = tail.split(b"\n")
    complete = lines[-1] == b""
    candidates = lines[:-1]
    if not candidates:
        return None, complete
    m = audit.MAC_SUFFIX.search(candidates[-1])
    return (bytes.fromhex(m.group(1).decode()) if m else None), complete


def verify_files(key: bytes, paths: list[str]) -> tuple[bool, str]:
    """Verify the chain through ``paths`` (oldest first): (intact, a summary or where and why
    it breaks).

    Raises:
        OSError: a file cannot be read.
    """
    chain = audit.Chain(key)
    for path in paths:
        chain.file()
        n = 0
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    return False, (f"{path}:{n}: an incomplete last line (the writer stopped "
                                   "mid-line, or the file was cut)")
                why = chain.line(line[:-1])
                if why is not None:
                    return False, f"{path}:{n}: {why}"
        if n == 0:
            return False, f"{path}: empty (an audit file starts with a line carrying \"prev\")"
    start = "the very first line" if chain.start == audit.ZERO_MAC else (
        f"a line after earlier files (prev {(chain.start or b'').hex()[:16]}…)")
    return True, (f"intact: {chain.lines} lines in {len(paths)} file(s), chained from {start}; "
                  f"last MAC {(chain.mac or b'').hex()}")


class _File:
    """The file side, used only from the writer's thread (one call at a time)."""

    def __init__(self, cfg: AuditSection, journal: Any) -> None:
        self.cfg = cfg
        self.journal = journal
        self.fd: int | None = None
        self.size = 0
        self.prev = audit.ZERO_MAC
        self.first = True
        self.unsynced = False
        self.synced_at = time.monotonic()

    def open(self, *, starting: bool = False) -> None:
        """Open (or reopen) ``path`` for appending; an existing file continues its chain."""
        path = self.cfg.path
        if not path:
            return
        if self.fd is not None:
            self.sync()
            os.close(self.fd)
            self.fd = None
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.fd, self.size = fd, os.fstat(fd).st_size
        if self.size == 0:
            self.first = True
            return
        if not starting:  # the same file, reopened: the chain goes on
            return
        with open(path, "rb") as f:
            mac, complete = _last_mac(f.fileno(), self.size)
        if mac is not None:
            self.prev = mac
        if mac is None or not complete:  # its end is broken: a new file, chained to what was
            LOGGER.warning("audit: %s does not end with a complete line; starting a new file",
                           path)
            self.rotate()
        else:
            self.first = False

    def rotate(self) -> None:
        """path → path.1 → … → path.keep (the oldest dropped), and a new empty path."""
        path, keep = self.cfg.path, self.cfg.keep
        if self.fd is not None:
            self.sync()
            os.close(self.fd)
            self.fd = None
        for n in range(keep - 1, 0, -1):
            if os.path.exists(f"{path}.{n}"):
                os.replace(f"{path}.{n}", f"{path}.{n + 1}")
        if os.path.exists(path):
            os.replace(path, f"{path}.1")
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = 0
        self.first = True

    def sync(self) -> None:
        if self.fd is not None and self.unsynced and self.cfg.fsync != "never":
            os.fsync(self.fd)
        self.unsynced = False
        self.synced_at = time.monotonic()

    def _write(self, data: bytes) -> None:
        assert self.fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.size += len(data)
        self.unsynced = True

    def write(self, key: bytes, records: list[dict[str, Any]]) -> int:
        """Seal and write ``records``; returns how many could not be (logged).  With no file
        open (its reopen or rotation failed) it is opened first: records are never sealed into
        the chain without a file to hold them (they are counted lost, a gap record follows)."""
        out: list[bytes] = []
        size = self.size  # with what ``out`` holds
        written = 0
        chained = self.prev, self.first  # as the file's last complete line leaves the chain
        try:
            if self.fd is None and self.cfg.path:  # a reopen or rotation failed: try again
                self.open()
            for record in records:
                line, mac = audit.seal(key, self.prev, record, first=self.first)
                if (self.fd is not None and self.cfg.max_bytes and size
                        and size + len(line) > self.cfg.max_bytes):
                    self._write(b"".join(out))
                    written += len(out)
                    out = []
                    chained = self.prev, self.first
                    self.rotate()
                    chained = self.prev, self.first
                    size = 0
                    line, mac = audit.seal(key, self.prev, record, first=True)
                out.append(line)
                size += len(line)
                self.prev, self.first = mac, False
                if self.journal is not None:
                    self._journal(record, line)
            if self.fd is not None:
                self._write(b"".join(out))
                written = len(records)
                chained = self.prev, self.first
                if self.cfg.fsync == "always" or (
                        self.cfg.fsync == "interval"
                        and time.monotonic() - self.synced_at >= self.cfg.fsync_interval):
                    self.sync()
        except (OSError, ValueError) as exc:
            LOGGER.error("audit: %d records not written: %s", len(records) - written, exc)
            # the chain goes on from the last line on disk, not from lines never written; a
            # line written in part (disk full) is cut off
            self.prev, self.first = chained
            if self.fd is not None:
                try:
                    os.ftruncate(self.fd, self.size)
                except OSError as cut:
                    LOGGER.error("audit: %s: %s", self.cfg.path, cut)
            return len(records) - written
        return 0

    def _journal(self, record: dict[str, Any], line: bytes) -> None:
        fields = {f"MCP_AUDIT_{k.upper()}": v if isinstance(v, str)
                  else audit.canonical(v).decode() for k, v in record.items() if v is not None}
        self.journal(MESSAGE=f"audit: {record.get('method', record.get('type'))} "
                     f"{record.get('name') or record.get('uri') or ''} {record.get('outcome', '')}",
                     MCP_AUDIT_LINE=line.decode().rstrip("\n"), SYSLOG_IDENTIFIER="mcp-gateway",
                     **fields)

    def close(self) -> None:
        if self.fd is not None:
            self.sync()
            os.close(self.fd)
            self.fd = None


class AuditLog:
    """The audit log ``[audit]`` describes (an :class:`gateway.core.audit.AuditSink`).

    Raises (constructor):
        ConfigError: the key file, the journal, or the file cannot be used.
    """

    def __init__(self, cfg: AuditSection, bus: EventBus, *, journal: Any = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.key_file = cfg.key_file
        self.key = load_key(cfg.key_file)
        if cfg.journald and journal is None:
            journal = journal_sender()
        self.redact_keys = frozenset(k.lower() for k in cfg.redact_keys)
        self.argument_globs = tuple(cfg.log_arguments)
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._space = trio.lowlevel.ParkingLot()  # callers waiting for a place (block)
        self._work = threading.Event()  # wakes the writer thread
        self._stopping = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._lost = 0  # since the last gap record
        # records the writer thread took off the queue (it alone counts them), and of those the
        # ones the trio thread heard are written: the difference is being written
        self._taken = 0
        self._done = 0
        self._reopen = False
        self._new_key: bytes | None = None
        self._file = _File(cfg, journal)
        try:
            self._file.open(starting=True)
        except OSError as exc:
            raise ConfigError([f"audit.path: {cfg.path}: {exc}"]) from None

    # ---- the request side (trio thread, never waits unless put) ----------------------------

    def _append(self, record: dict[str, Any]) -> None:
        if self._lost:
            self._queue.append(self._gap())
        self._queue.append(record)
        self._work.set()

    def _gap(self) -> dict[str, Any]:
        lost, self._lost = self._lost, 0
        return {"time": audit.timestamp(time.time()), "type": "gap", "lost": lost}

    def offer(self, record: dict[str, Any]) -> bool:
        if len(self._queue) < self.cfg.queue:
            self._append(record)
            return True
        if self.cfg.on_full == "drop":
            self.lost()
            return True
        return False

    async def put(self, record: dict[str, Any]) -> None:
        while len(self._queue) >= self.cfg.queue:
            await self._space.park()
        self._append(record)

    def lost(self) -> None:
        self._lost += 1
        self.bus.emit(AuditRecordsDropped(1))

    @property
    def queued(self) -> int:
        return len(self._queue)

    def reload(self) -> None:
        """SIGHUP: reopen the file before the next batch and re-read the key (a bad key file
        keeps the key in use, logged)."""
        try:
            key = load_key(self.key_file)
        except ConfigError as exc:
            LOGGER.error("audit: keeping the key in use: %s", "; ".join(exc.errors))
        else:
            if key != self.key:
                self._new_key = key
        self._reopen = True
        self._work.set()

    # ---- the writer ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the writer thread until cancelled; then let it write what is queued and join it
        (bounded by :data:`JOIN_TIMEOUT`)."""
        self._token = trio.lowlevel.current_trio_token()
        thread = threading.Thread(target=self._worker, name="mcp-gateway-audit", daemon=True)
        thread.start()
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            if self._lost:
                self._queue.append(self._gap())
            self._stopping = True
            self._work.set()
            thread.join(JOIN_TIMEOUT)  # at exit: the loop has nothing else to do
            if thread.is_alive():
                LOGGER.error("audit: the writer did not finish within %ss; %d records not "
                             "written", JOIN_TIMEOUT, len(self._queue))

    async def flushed(self) -> None:
        """Return once every record queued before is written (or counted lost)."""
        while self._queue or self._taken != self._done:
            await self._space.park()

    def _written(self, count: int, lost: int) -> None:
        """(In the trio thread) a batch is written: places for callers that wait."""
        self._done += count
        self._space.unpark_all()
        if lost:
            self._lost += lost
            self.bus.emit(AuditRecordsDropped(lost))

    def _worker(self) -> None:
        """The writer thread: batches from the queue, sealed and written (see :class:`_File`)."""
        f, cfg = self._file, self.cfg
        while True:
            timeout = None
            if f.unsynced and cfg.fsync == "interval":
                timeout = max(0.0, f.synced_at + cfg.fsync_interval - time.monotonic())
            if self._work.wait(timeout) and not self._stopping:
                time.sleep(GATHER)  # more records join the batch: fewer writes and wake-ups
            self._work.clear()
            while self._queue or self._reopen or self._new_key is not None:
                self._batch()
            if f.unsynced and cfg.fsync == "interval" and (
                    time.monotonic() - f.synced_at >= cfg.fsync_interval):
                self._guarded(f.sync)
            if self._stopping and not self._queue:
                self._guarded(f.close)
                return

    def _guarded(self, action: Callable[[], None]) -> None:
        try:
            action()
        except OSError as exc:
            LOGGER.error("audit: %s: %s", self.cfg.path, exc)

    def _batch(self) -> None:
        reopen, self._reopen = self._reopen, False
        new_key, self._new_key = self._new_key, None
        f = self._file
        if reopen:
            self._guarded(f.open)
        if new_key is not None:
            self.key = new_key
            if f.fd is not None and f.size:
                self._guarded(f.rotate)  # one key per file
        batch: list[dict[str, Any]] = []
        while self._queue and len(batch) < BATCH:
            self._taken += 1  # before it leaves the queue: never counted nowhere
            batch.append(self._queue.popleft())
        try:
            lost = f.write(self.key, batch) if batch else 0
        except Exception:  # the thread goes on: a blocked caller must not wait forever
            LOGGER.exception("audit: %d records not written", len(batch))
            lost = len(batch)
        assert self._token is not None
        try:
            self._token.run_sync_soon(self._written, len(batch), lost)
        except trio.RunFinishedError:
            pass
