"""One datagram to a unix socket address (sd_notify's transport; ``gateway.ops.systemd``)."""

from __future__ import annotations

import socket


def send_unix_datagram(address: str, data: bytes) -> None:
    """Send ``data`` as one datagram to the unix socket ``address`` (``\\0…``: abstract).

    Never blocks: a full receive queue drops the message.

    Raises:
        OSError: the socket cannot be created, or the datagram not sent.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.setblocking(False)
        sock.sendto(data, address)
