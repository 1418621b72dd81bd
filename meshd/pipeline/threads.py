"""How many threads a node's numpy compute (its BLAS) may use, and on which CPUs it runs.

A BLAS starts one worker per core and has the caller spin while they work.
Several nodes on one host (a smoke run, a test) then hold more spinning
threads than there are cores: a prefill that needs 5 ms of CPU takes ten
times that, whenever a worker is scheduled out.  One node per host keeps the
BLAS default; nodes that share a host get a share each (``--compute-threads``).

Stages that share a host also get CPUs of their own (``--cpus``, see
``stage_cpus``), as on hosts of their own: left to the scheduler, each
stage's step wakes the next stage on whichever CPU is idle, and every hop
then starts with an idle CPU woken and caches another process filled.
Measured on a 2-CPU VM (3 stages, a single stream's latency against one
process's, meshes in turn, 6 rounds of 8 pairs): 1.393 with stages 0 and 1
on one CPU and the last stage on the other, 1.575 unpinned, 1.537 with
stages 1 and 2 sharing; 16 streams made 741 tokens/s against 727 unpinned.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..argtypes import cpu_text


def host_cores() -> int:
    """The cores this process may run on."""
    return len(host_cpus())


def host_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def stage_cpus(stage: int, stages: int, cpus: Iterable[int] | None = None) -> list[int]:
    """The CPUs of ``cpus`` (default: this host's) for stage ``stage`` of ``stages`` that
    share a host: the CPUs cut into ``stages`` runs in stage order, each at least one CPU.

    With fewer CPUs than stages, neighbouring stages share one: a stage waits for the
    one before it anyway, and the hand-over then stays on one CPU.  Stage 0 and the last
    stage, which compute their shares of the LM head at once, never share a CPU on a
    host of two or more."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of {stages}")
    pool = sorted(set(host_cpus() if cpus is None else cpus))
    first = stage * len(pool) // stages
    return pool[first:max(first + 1, (stage + 1) * len(pool) // stages)]


def pin(cpus: Iterable[int]) -> None:
    """Run this process, every thread it has and every one it starts, on ``cpus`` only.
    Raises ValueError naming what is wrong: CPUs this process may not run on, or a
    system that cannot pin."""
    wanted = set(cpus)
    allowed = set(host_cpus())
    if not wanted or not wanted <= allowed:
        raise ValueError(f"CPU {cpu_text(wanted - allowed or wanted)} is not one this process may run "
                         f"on ({cpu_text(allowed)})")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("this system cannot pin a process to CPUs")
    threads = [int(tid) for tid in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in threads:  # the BLAS's workers too, started before this
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def share(jobs: int) -> int:
    """Threads for each of ``jobs`` compute-heavy processes on this host: the cores split
    between them, at least one each."""
    return max(1, host_cores() // max(1, jobs))


def shared_host_args(jobs: int, stage: int | None = None, stages: int | None = None) -> list[str]:
    """``meshd run`` flags for one of ``jobs`` stage nodes on this host: its share of the
    cores (``--compute-threads``), so its BLAS does not spin against the others'; and, for
    a node of stage ``stage`` of ``stages`` on a host of two CPUs or more, that stage's
    CPUs (``--cpus``, see ``stage_cpus``; a stage's replicas share them)."""
    args = ["--compute-threads", str(share(jobs))]
    cpus = host_cpus()
    if stage is not None and stages is not None and len(cpus) > 1 and hasattr(os, "sched_setaffinity"):
        args += ["--cpus", cpu_text(stage_cpus(stage, stages, cpus))]
    return args


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
