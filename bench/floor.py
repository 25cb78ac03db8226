#!/usr/bin/env python3
"""The bench's *floor* forwarder: the transport work of a trio gateway with no logic at all.

    python bench/floor.py --ws 127.0.0.1:PORT --unix /path/to.sock

It accepts WebSocket connections (RFC 6455, server side, text/binary frames) and unix-socket
connections (one message per line) and writes every message it receives, unchanged and followed by
a newline, to the stdin of one shared ``cat`` child. ``cat`` echoes each line; the forwarder sends
it back, unchanged, to the connection it came from (a WebSocket text frame, or the line). Which
connection a line belongs to is known without reading it: ``cat`` keeps the order, so a FIFO of
connections, one entry per line written, is enough. Nothing is decoded (no JSON), nothing is
validated beyond the framing itself.

It is written the lean way, so that its CPU per call is the floor of what any trio program pays
for the transport on this machine: non-blocking sockets and pipes driven by
``trio.lowlevel.wait_readable``/``wait_writable``, a direct ``send``/``os.write`` when nothing is
queued, 64 KiB reads, hand-written minimal framing, one task per connection (plus one to flush a
connection's backlog, only ever needed when the socket is full), no task per message.

Only for the bench: it binds 127.0.0.1 only, has no limits, no origin checks, no timeouts.
"""

from __future__ import annotations

import argparse
import base64
import collections
import errno
import hashlib
import os
import signal
import socket
import subprocess
import sys

import trio

READ = 65536
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_HEAD = 16384


class Sink:
    """A non-blocking fd (socket or pipe) with a backlog: write directly when the backlog is empty,
    else queue and let one flusher task drain it when the fd is writable."""

    def __init__(self, obj: socket.socket | int) -> None:
        self.obj = obj
        self.fd = obj if isinstance(obj, int) else obj.fileno()
        self.backlog = bytearray()
        self.wake = trio.Event()
        self.dead = False
        if isinstance(obj, socket.socket):
            self._write = obj.send
        else:
            self._write = lambda data: os.write(self.fd, data)

    def write(self, data: bytes) -> None:
        if self.dead:
            return
        if self.backlog:
            self.backlog += data
            return
        try:
            n = self._write(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.dead = True
            return
        if n < len(data):
            self.backlog += data[n:]
            self.wake.set()

    async def flusher(self) -> None:
        while not self.dead:
            await self.wake.wait()
            self.wake = trio.Event()
            while self.backlog and not self.dead:
                await trio.lowlevel.wait_writable(self.obj)
                try:
                    n = self._write(self.backlog)
                except BlockingIOError:
                    continue
                except OSError:
                    self.dead = True
                    return
                del self.backlog[:n]


class Conn:
    """A client connection: ``reply(line)`` sends one line from cat back in this transport's
    framing."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = Sink(sock)

    def frame(self, payload: bytes) -> bytes:
        return payload + b"\n"


class WsConn(Conn):
    def frame(self, payload: bytes) -> bytes:
        n = len(payload)
        if n < 126:
            return b"\x81" + bytes((n,)) + payload
        if n < 65536:
            return b"\x81\x7e" + n.to_bytes(2, "big") + payload
        return b"\x81\x7f" + n.to_bytes(8, "big") + payload


class Floor:
    def __init__(self) -> None:
        self.cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    bufsize=0)
        assert self.cat.stdin is not None and self.cat.stdout is not None
        self.cat_in_fd = self.cat.stdin.fileno()
        self.cat_out_fd = self.cat.stdout.fileno()
        os.set_blocking(self.cat_in_fd, False)
        os.set_blocking(self.cat_out_fd, False)
        self.to_cat = Sink(self.cat_in_fd)
        # one entry per line given to cat
        self.owners: collections.deque[Conn] = collections.deque()

    def forward(self, conn: Conn, lines: bytes, count: int) -> None:
        """``lines``: ``count`` complete newline-terminated messages from ``conn``."""
        if count == 1:
            self.owners.append(conn)
        else:
            self.owners.extend([conn] * count)
        self.to_cat.write(lines)

    async def cat_reader(self) -> None:
        buf = b""
        fd = self.cat_out_fd
        owners = self.owners
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                data = os.read(fd, READ)
            except BlockingIOError:
                continue
            if not data:
                raise SystemExit("floor: cat ended")
            buf += data
            end = buf.rfind(b"\n")
            if end < 0:
                continue
            lines = buf[:end].split(b"\n")
            buf = buf[end + 1:]
            # Coalesce what this read brought per connection: one send per connection per read.
            batch: dict[Conn, list[bytes]] = {}
            for line in lines:
                conn = owners.popleft()
                if conn.out.dead:
                    continue
                framed = conn.frame(line)
                parts = batch.get(conn)
                if parts is None:
                    batch[conn] = [framed]
                else:
                    parts.append(framed)
            for conn, parts in batch.items():
                conn.out.write(parts[0] if len(parts) == 1 else b"".join(parts))

    # ---- unix socket: lines in -------------------------------------------------------------------

    async def serve_lines(self, sock: socket.socket) -> None:
        conn = Conn(sock)
        buf = b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.out.flusher)
            try:
                while True:
                    await trio.lowlevel.wait_readable(sock)
                    try:
                        data = sock.recv(READ)
                    except BlockingIOError:
                        continue
                    except OSError:
                        break
                    if not data:
                        break
                    buf += data
                    end = buf.rfind(b"\n")
                    if end < 0:
                        continue
                    chunk = buf[:end + 1]
                    buf = buf[end + 1:]
                    self.forward(conn, chunk, chunk.count(b"\n"))
            finally:
                conn.out.dead = True
                conn.out.wake.set()
                sock.close()

    # ---- WebSocket: upgrade, then frames in ------------------------------------------------------

    async def serve_ws(self, sock: socket.socket) -> None:
        conn = WsConn(sock)
        buf = b""
        async with trio.open_nursery() as nursery:
            try:
                # The HTTP upgrade.
                while b"\r\n\r\n" not in buf:
                    await trio.lowlevel.wait_readable(sock)
                    data = sock.recv(READ)
                    if not data or len(buf) > MAX_HEAD:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                headers = {}
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    headers[k.strip().lower()] = v.strip()
                key = headers.get(b"sec-websocket-key")
                if key is None:
                    sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    return
                accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest())
                resp = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                        b"Connection: Upgrade\r\n"
                        b"Sec-WebSocket-Accept: " + accept + b"\r\n")
                offered = [p.strip()
                           for p in headers.get(b"sec-websocket-protocol", b"").split(b",")]
                if b"mcp" in offered:
                    resp += b"Sec-WebSocket-Protocol: mcp\r\n"
                conn.out.write(resp + b"\r\n")
                nursery.start_soon(conn.out.flusher)
                await self._ws_frames(conn, sock, buf)
            except OSError:
                pass
            finally:
                conn.out.dead = True
                conn.out.wake.set()
                sock.close()

    async def _ws_frames(self, conn: WsConn, sock: socket.socket, buf: bytes) -> None:
        fragments: list[bytes] = []
        while True:
            # Parse every complete frame in buf; collect the messages to hand to cat in one write.
            out: list[bytes] = []
            pos = 0
            n = len(buf)
            while n - pos >= 2:
                b0, b1 = buf[pos], buf[pos + 1]
                length = b1 & 0x7F
                hdr = 2
                if length == 126:
                    if n - pos < 4:
                        break
                    length = int.from_bytes(buf[pos + 2:pos + 4], "big")
                    hdr = 4
                elif length == 127:
                    if n - pos < 10:
                        break
                    length = int.from_bytes(buf[pos + 2:pos + 10], "big")
                    hdr = 10
                masked = b1 & 0x80
                if masked:
                    hdr += 4
                if n - pos < hdr + length:
                    break
                payload = buf[pos + hdr:pos + hdr + length]
                if masked and length:
                    mask = buf[pos + hdr - 4:pos + hdr]
                    full = mask * (length // 4 + 1)
                    payload = (int.from_bytes(payload,
                                              "little") ^ int.from_bytes(full[:length], "little")
                               ).to_bytes(length, "little")
                pos += hdr + length
                opcode = b0 & 0x0F
                if opcode in (0x1, 0x2, 0x0):
                    if b0 & 0x80:  # FIN
                        if fragments:
                            fragments.append(payload)
                            payload = b"".join(fragments)
                            fragments = []
                        out.append(payload)
                    else:
                        fragments.append(payload)
                elif opcode == 0x8:  # close: answer it and end
                    conn.out.write(b"\x88\x02\x03\xe8")
                    if out:
                        self.forward(conn, b"\n".join(out) + b"\n", len(out))
                    return
                elif opcode == 0x9:  # ping -> pong
                    conn.out.write(b"\x8a" + bytes((len(payload),)) + payload)
            buf = buf[pos:]
            if out:
                self.forward(conn, b"\n".join(out) + b"\n", len(out))
            await trio.lowlevel.wait_readable(sock)
            try:
                data = sock.recv(READ)
            except BlockingIOError:
                continue
            if not data:
                return
            buf += data


async def accept_loop(listener: socket.socket, handler, nursery: trio.Nursery) -> None:
    while True:
        await trio.lowlevel.wait_readable(listener)
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            continue
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                await trio.sleep(0.1)
                continue
            raise
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nursery.start_soon(handler, sock)


async def main(args: argparse.Namespace) -> None:
    floor = Floor()
    host, _, port = args.ws.rpartition(":")
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit("floor: --ws must be on 127.0.0.1")
    ws = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ws.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ws.bind(("127.0.0.1", int(port)))
    ws.listen(1024)
    ws.setblocking(False)
    ux = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ux.bind(args.unix)
    os.chmod(args.unix, 0o600)
    ux.listen(1024)
    ux.setblocking(False)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(floor.to_cat.flusher)
            nursery.start_soon(floor.cat_reader)
            nursery.start_soon(accept_loop, ws, floor.serve_ws, nursery)
            nursery.start_soon(accept_loop, ux, floor.serve_lines, nursery)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break
    finally:
        floor.cat.kill()
        floor.cat.wait()
        try:
            os.unlink(args.unix)
        except OSError:
            pass


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ws", required=True, help="127.0.0.1:PORT for WebSocket")
    p.add_argument("--unix", required=True, help="unix socket path")
    trio.run(main, p.parse_args(sys.argv[1:]))
    sys.exit(0)
