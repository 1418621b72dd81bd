"""How many threads a node's numpy compute (its BLAS) may use.

A BLAS starts one worker per core and has the caller spin while they work.
Several nodes on one host (a smoke run, a test) then hold more spinning
threads than there are cores: a prefill that needs 5 ms of CPU takes ten
times that, whenever a worker is scheduled out.  One node per host keeps the
BLAS default; nodes that share a host get a share each (``--compute-threads``).
"""

from __future__ import annotations

import os


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def share(jobs: int) -> int:
    """Threads for each of ``jobs`` compute-heavy processes on this host: the cores split
    between them, at least one each."""
    return max(1, host_cores() // max(1, jobs))


def shared_host_args(jobs: int) -> list[str]:
    """``meshd run`` flags for one of ``jobs`` stage nodes on this host: its share of the
    cores (``--compute-threads``), so its BLAS does not spin against the others'."""
    return ["--compute-threads", str(share(jobs))]


def set_compute_threads(threads: int) -> None:
    """Limit every BLAS numpy uses in this process to ``threads`` threads from now on."""
    if threads < 1:
        raise ValueError(f"compute threads must be at least 1, got {threads}")
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")


def compute_threads() -> int | None:
    """The threads numpy's BLAS uses now (None when it reports none)."""
    from threadpoolctl import threadpool_info

    counts = [info["num_threads"] for info in threadpool_info() if info.get("user_api") == "blas"]
    return max(counts) if counts else None
