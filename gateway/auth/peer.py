"""The principal of a unix socket peer: its user, from the credentials the kernel gives
(``SO_PEERCRED``, read by :func:`gateway.transports.peercred.peer_credentials`).

The name is the user's login name (``uid:N`` when the uid has no passwd entry); the groups are
the user's groups from the group database plus the peer process's own gid (``gid:N`` when a
gid has no name).  These are lookups in the system's user database (NSS): call
:func:`peer_principal` in a thread.
"""

from __future__ import annotations

import grp
import os
import pwd

from gateway.auth.labels import label_for
from gateway.auth.principal import Principal


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid:{gid}"


def peer_principal(uid: int, gid: int, configured: frozenset[str]) -> Principal:
    """The principal of a peer running as ``uid``/``gid``; ``configured``: the label set."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        name, gids = f"uid:{uid}", [gid]
    else:
        name = entry.pw_name
        try:
            gids = [*os.getgrouplist(name, entry.pw_gid), gid]
        except OSError:
            gids = [entry.pw_gid, gid]
    groups = frozenset(_group_name(g) for g in gids)
    return Principal(name, groups, via="peer", label=label_for(name, configured))
