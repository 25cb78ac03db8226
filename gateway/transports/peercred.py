"""The credentials of a unix socket's peer (``SO_PEERCRED``): who connected to ``listen.unix``."""

from __future__ import annotations

import socket
import struct

import trio

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(stream: trio.SocketStream) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of the process that connected ``stream``, as the kernel recorded them
    at ``connect()``; None when the socket is not a unix socket or the platform has no
    ``SO_PEERCRED``."""
    sock = stream.socket
    option = getattr(socket, "SO_PEERCRED", None)
    if sock.family != socket.AF_UNIX or option is None:
        return None
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, option, _CRED.size)
    except OSError:
        return None
    pid, uid, gid = _CRED.unpack(data)
    return pid, uid, gid
