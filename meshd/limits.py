"""Process limits a long-running node or relay sets for itself at start."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("meshd")


def raise_open_files_limit() -> tuple[int, int]:
    """Lift this process's soft limit on open files to its hard limit, as Go's runtime does
    at start: a node holds a socket per peer stream, inbound stream, handshake in progress
    and relay connection, and a soft limit of 1024 (the usual default, under a hard limit
    of 512 Ki or more) is below what its own bounds on those admit.  Returns (soft, hard)
    as they are afterwards; a limit that cannot be raised stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.debug("open files limit stays %d: %s", soft, exc)
    return soft, hard
