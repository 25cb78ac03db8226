"""The open-files limit (``RLIMIT_NOFILE``): raised at start, and what it leaves for client
connections (:func:`gateway.limits.fit_connections` decides; this module does the I/O).

Outside systemd the soft limit is often 1024 while the hard limit is far higher; systemd's own
advice (systemd.exec(5), ``LimitNOFILE=``) is that a program that does not use ``select()``
raises its soft limit to the hard limit itself.  trio waits with epoll, so the gateway does,
once at start.  Backends inherit the raised limit.
"""

from __future__ import annotations

import logging
import resource

LOGGER = logging.getLogger(__name__)

#: Used for an unlimited hard limit when /proc/sys/fs/nr_open cannot be read (its usual value).
NR_OPEN_DEFAULT = 1 << 20


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return NR_OPEN_DEFAULT


def _finite(value: int) -> int:
    return _nr_open() if value == resource.RLIM_INFINITY else value


def soft_limit() -> int:
    """The soft open-files limit now (an unlimited one as the kernel's ``nr_open``)."""
    return _finite(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def raise_soft_limit() -> int:
    """Raise the soft open-files limit to the hard limit (``nr_open`` when that is unlimited);
    returns the soft limit in force afterwards (unchanged when the raise is refused)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _finite(hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            LOGGER.warning("open-files limit: cannot raise the soft limit from %d to %d: %s",
                           soft, target, exc)
            return soft
        LOGGER.info("open-files limit: soft limit raised from %d to %d (the hard limit)",
                    soft, target)
        return target
    return _finite(soft)
