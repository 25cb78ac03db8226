"""The ``stdio`` connector: a child process speaking newline-delimited JSON-RPC on its pipes.

:class:`LineLink` frames lines over a pair of byte streams: a line goes straight into an idle
pipe with ``os.write`` (no task switch), else into a bounded write queue that :meth:`LineLink.run`
drains; the child's stdout is read with ``os.read`` and split by
:class:`~gateway.protocol.framing.LineFramer`.  With a process it also logs the child's stderr
(rate-limited, the last lines kept for ``/status``) and stops it in the spec's order
(:func:`gateway.backend.process.stop_process`) when closed.
"""

from __future__ import annotations

import logging
import math
import os

import trio

from gateway import errors
from gateway.auth.principal import Principal
from gateway.backend import credentials, process
from gateway.backend.connector import LinkContext, LinkEnd, OpenFailed, Receiver
from gateway.config import BackendConfig
from gateway.events import BackendStderr
from gateway.protocol.framing import LineFramer, Oversize, OversizeEnd
from gateway.protocol.stderr import LineSplitter, LineThrottle, printable

LOGGER = logging.getLogger(__name__)

#: Bytes read from the child's stdout at once (at most 64 KiB: larger buffers are above glibc's
#: mmap threshold, and every read would map and unmap one).
READ_CHUNK = 65536
#: Lines handled in one task step at most: a busy child's burst of replies must not hold the
#: other tasks (another client's reader, its writer) back for milliseconds (fair sharing).
SLICE = 8
#: A stderr line longer than this (bytes) is cut (also bounds the tail: 20 lines of 2 KiB).
STDERR_MAX_LINE = 2048
#: Bytes read from a child's stderr at once.
STDERR_CHUNK = 65536
#: Seconds after the first line held back by the stderr rate limit until its summary line.
STDERR_SUMMARY_WINDOW = 5.0
#: Pause between reads of a child's stderr while its lines are being held back: bounds what a
#: flood costs (at most one 64 KiB read per pause) and makes the child wait instead.
STDERR_FLOOD_PAUSE = 0.005


class StdioConnector:
    """Spawns the backend's ``command`` in its own process group, one child per generation."""

    kind = "stdio"
    origin = None

    def __init__(self, cfg: BackendConfig, principal: Principal | None = None) -> None:
        self.cfg = cfg
        # per-principal: whose child this starts (its env_files file read at each start)
        self.principal = principal

    def refresh(self) -> None:
        pass

    def for_principal(self, principal: Principal) -> StdioConnector:
        """The connector of ``principal``'s own child."""
        return StdioConnector(self.cfg, principal)

    async def open(self, ctx: LinkContext) -> LineLink:
        env = None
        if self.principal is not None and self.cfg.env_files:
            try:
                env = credentials.read_env_file(self.cfg.env_files, self.principal)
            except credentials.CredentialsUnavailable as exc:
                raise OpenFailed(exc.detail) from None
        try:
            proc = await process.spawn(self.cfg, env)
        except OSError as exc:
            if process.out_of_resources(exc):
                raise OpenFailed(str(exc), starved=True) from exc
            raise OpenFailed(f"cannot start {self.cfg.command!r}: {exc}") from exc
        assert proc.stdin is not None and proc.stdout is not None
        return LineLink(proc.stdin, proc.stdout, ctx, proc=proc, cfg=self.cfg)


class LineLink:
    """Newline-delimited messages over a send and a receive stream (a child's stdin and stdout,
    or memory streams), with the child process behind them when there is one."""

    kind = "stdio"

    def __init__(self, send_stream: trio.abc.SendStream, receive_stream: trio.abc.ReceiveStream,
                 ctx: LinkContext, *, proc: trio.Process | None = None,
                 cfg: BackendConfig | None = None) -> None:
        self._send_stream = send_stream
        self._receive_stream = receive_stream
        self._ctx = ctx
        self._proc = proc
        self._cfg = cfg
        self._ended_by: process.Ended | None = None  # set by the first close
        self.buffers = ctx.buffers
        self.max_queued = ctx.max_queued
        self.closed: errors.GatewayError | None = None
        self.last_error: str | None = None
        self._outbox: list[tuple[bytes, int | None]] = []  # (bytes to write, gateway id)
        self._outbox_ready = trio.Event()
        self._writing = False
        # A real pipe (trio FdStream, non-blocking) can be written to directly when idle; its
        # number is read at each write (-1 once closed), never kept (see _read_loop).
        self._pipe = send_stream if isinstance(send_stream, trio.lowlevel.FdStream) else None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    @property
    def origin(self) -> str | None:
        return None

    def _stdin_closed(self) -> errors.GatewayError:
        backend = self._ctx.backend
        self.last_error = "the backend's stdin is closed"
        return errors.BackendExited(f"backend {backend!r} exited: the backend's stdin is closed",
                                    backend=backend, retryable=True)

    # ---- writing ----------------------------------------------------------------------------

    def send(self, data: bytes, gid: int | None = None) -> None:
        """Send one message without blocking: written right here when nothing is queued and the
        pipe has room, else queued for the writer (which keeps the order).

        Raises:
            NotDelivered: the child's stdin is already known to be gone.
        """
        if self.closed is not None:
            raise errors.NotDelivered(self.closed.message, **self.closed.data)
        data += b"\n"
        pipe = self._pipe
        if pipe is not None and not self._outbox and not self._writing:
            fd = pipe.fileno()
            if fd < 0:  # closed (the stop's stdin close): the number may be another file's now
                self.closed = self._stdin_closed()
                raise errors.NotDelivered(self.closed.message, **self.closed.data)
            try:
                written = os.write(fd, data)
            except BlockingIOError:
                written = 0
            except OSError:
                self.closed = self._stdin_closed()
                raise errors.NotDelivered(self.closed.message, **self.closed.data) from None
            if written == len(data):
                return
            data = data[written:]
        self._outbox.append((data, gid))
        self.buffers.charge(len(data))
        self._outbox_ready.set()

    def fits(self, size: int) -> bool:
        """Whether a new request of ``size`` bytes may be written: straight into an idle pipe,
        or within ``max_queued`` bytes of write queue (a child that stops reading its stdin must
        not hold the daemon's byte budget)."""
        if self._pipe is not None and not self._outbox and not self._writing:
            return True
        return self.buffers.held + size + 1 <= self.max_queued

    def fail(self, error: errors.GatewayError) -> None:
        if self.closed is None:
            self.closed = error
        self._outbox = []  # nobody will read it: dropped with its bytes
        self.buffers.close()

    async def _write_loop(self, receiver: Receiver) -> None:
        """Write queued messages, batching whatever piled up into one write.  If stdin breaks,
        the calls whose requests were in the failed write are undelivered (the child never read
        them: safe to retry)."""
        while True:
            if not self._outbox:
                self._outbox_ready = trio.Event()
                await self._outbox_ready.wait()
            batch, self._outbox = self._outbox, []
            self._writing = True
            try:
                chunk = b"".join([line for line, _ in batch])
                await self._send_stream.send_all(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                error = self._stdin_closed()
                if self.closed is None:
                    self.closed = error
                gids = [gid for _line, gid in batch + self._outbox if gid is not None]
                self._outbox = []
                self.buffers.close()
                receiver.undelivered(gids, error)
                return
            finally:
                self._writing = False
            self.buffers.release(len(chunk))

    # ---- reading ----------------------------------------------------------------------------

    async def run(self, receiver: Receiver) -> None:
        """Read the child's stdout (and stderr) and drain the write queue until cancelled;
        ``receiver.ended()`` once stdout closes."""
        async with trio.open_nursery() as nursery:
            if self._proc is not None and self._proc.stderr is not None and self._cfg is not None:
                nursery.start_soon(self._read_stderr, self._proc.stderr, self._cfg)
            nursery.start_soon(self._write_loop, receiver)
            await self._read_loop(receiver)
            receiver.ended()
            await trio.sleep_forever()  # stderr may still come while the child is stopped

    async def _read_some(self) -> bytes:
        """The next bytes of the child's stdout (b"" at its end), from a stream that is not a
        real pipe (:meth:`_read_loop` reads a pipe itself)."""
        return bytes(await self._receive_stream.receive_some(READ_CHUNK))  # no copy of bytes

    async def _read_loop(self, receiver: Receiver) -> None:
        """Read the child's stdout until EOF."""
        framer = LineFramer(self._ctx.max_line, report_end=True)
        message, oversize, oversize_end = receiver.message, receiver.oversize, receiver.oversize_end
        # A real pipe is read with ``os.read`` and waited on with ``wait_readable``: one task
        # step per wake-up (trio's FdStream adds a checkpoint to every read, a second step).
        # The stop closes the pipe from another task (process.stop_process), and the freed
        # number goes to the next file opened, a client's socket as likely as not: so the pipe
        # is looked at (fileno() is -1 once closed) right before each wait and each read, with
        # no checkpoint between the look and the use.
        stream = self._receive_stream
        pipe = stream if isinstance(stream, trio.lowlevel.FdStream) else None
        fd = -1 if pipe is None else pipe.fileno()
        more = True  # the last read filled its buffer: read before waiting
        while True:
            try:
                if pipe is None:
                    data = await self._read_some()
                else:
                    while True:
                        if not more:  # a short read emptied the pipe: no read to fail first
                            if pipe.fileno() != fd:
                                return
                            await trio.lowlevel.wait_readable(fd)
                        if pipe.fileno() != fd:  # closed while this task waited to run
                            return
                        try:
                            data = os.read(fd, READ_CHUNK)
                            break
                        except BlockingIOError:
                            more = False
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            more = len(data) == READ_CHUNK
            frames = framer.feed(data)
            for n, frame in enumerate(frames, 1):
                if type(frame) is bytes:
                    message(frame)
                elif isinstance(frame, Oversize):
                    oversize(frame)
                elif isinstance(frame, OversizeEnd):
                    oversize_end(frame)
                if not n % SLICE:  # a long run of replies: let the other tasks run meanwhile
                    await trio.lowlevel.checkpoint()
            if more and len(frames) % SLICE:  # more may be waiting
                await trio.lowlevel.checkpoint()

    async def _read_stderr(self, stream: trio.abc.ReceiveStream, cfg: BackendConfig) -> None:
        """Log the child's stderr line by line, within ``stderr_lines_per_second``/``stderr_burst``.

        Lines over the rate are counted, not logged; one summary line per
        :data:`STDERR_SUMMARY_WINDOW` says how many (also at end of stream), and
        ``BackendStderr`` events count both kinds.  While lines are held back a chunk is only
        counted and the pipe is left alone for :data:`STDERR_FLOOD_PAUSE` after each read.  The
        last lines are kept in the context's ``tail`` for ``/status``.
        """
        ctx = self._ctx
        log_extra = {"MCP_BACKEND": ctx.backend}
        splitter = LineSplitter(STDERR_MAX_LINE)
        throttle = LineThrottle(cfg.stderr_lines_per_second, cfg.stderr_burst,
                                STDERR_SUMMARY_WINDOW, trio.current_time())
        keep = ctx.tail.maxlen or 0

        def take(count: int, lines: list[bytes]) -> None:
            """``count`` new lines, of which ``lines`` are the last ones (all of them, unless
            the limit is already holding lines back)."""
            if not count:
                return
            logged = throttle.admit(trio.current_time(), count)
            for raw in lines[:logged]:
                LOGGER.info("[%s] %s", ctx.instance, printable(raw), extra=log_extra)
            ctx.tail.extend(printable(raw) for raw in lines[-keep:])
            ctx.bus.emit(BackendStderr(ctx.backend, ctx.instance, logged, count - logged))

        def summarise(final: bool = False) -> None:
            held = throttle.summary(trio.current_time(), final=final)
            if held is not None and held[0]:
                LOGGER.warning("backend %s: %d stderr lines not logged in the last %.1fs "
                               "(over stderr_lines_per_second = %g)", ctx.instance, held[0],
                               held[1], throttle.rate, extra=log_extra)

        try:
            while True:
                due = throttle.due()
                data: bytes | None = None
                with trio.move_on_at(due if due is not None else math.inf):
                    try:
                        data = bytes(await stream.receive_some(STDERR_CHUNK))
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        data = b""
                if data is None:  # the summary window ended while the child was quiet
                    summarise()
                    continue
                if not data:
                    break
                if throttle.due() is None:
                    lines = [raw for raw in splitter.feed(data) if raw.strip()]
                    take(len(lines), lines)
                else:  # holding back already: count, keep the tail, log what the rate allows
                    take(*splitter.feed_counted(data, keep))
                summarise()
                if throttle.due() is not None:
                    # Over the rate: let the pipe fill for a moment (the child's writes wait once
                    # it is full) instead of spending a core on lines that are only counted.
                    await trio.sleep(STDERR_FLOOD_PAUSE)
        finally:  # also when cancelled (the child is being stopped): nothing vanishes silently
            lines = [raw for raw in splitter.close() if raw.strip()]
            take(len(lines), lines)
            summarise(final=True)

    # ---- ending -----------------------------------------------------------------------------

    async def close(self) -> LinkEnd:
        """Stop the child in the spec's order (close stdin, SIGTERM, SIGKILL to its group;
        shielded, bounded) and kill what is left of its group.  Without a process: close the
        streams."""
        proc = self._proc
        if proc is None:
            with trio.CancelScope(shield=True):
                for stream in (self._send_stream, self._receive_stream):
                    with trio.move_on_after(1.0):
                        try:
                            await stream.aclose()
                        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                            pass
            return LinkEnd("streams closed", crashed=False)
        if self._ended_by is None:
            self._ended_by = await process.stop_process(proc)
        elif proc.returncode is None:
            with trio.CancelScope(shield=True):
                await process.stop_process(proc)
        process.kill_group(proc.pid)
        rc = proc.returncode
        detail = (f"exit code {rc}" if rc is not None and rc >= 0
                  else f"signal {-rc}" if rc else "unknown")
        how = self._ended_by
        return LinkEnd(detail, crashed=rc not in (0, None), returncode=rc,
                       ended_by=None if how is process.Ended.EXITED else str(how))

