"""The environment each job of a run starts with, as dstack's multi-node tasks have it.

    MESHD_NODE_RANK    0 for the orchestrator (the master), then the stage jobs in the run's order:
                       K + 1 for stage-K, and with R replicas (K + 1) + (j - 1) * N for stage-K.j
    MESHD_NODES_NUM    the orchestrator and the stages (the relay is not a node)
    MESHD_MASTER_ADDR  the orchestrator's HOST:PORT
    MESHD_NODES_ADDRS  every node's HOST:PORT, comma-separated, by rank
    MESHD_HOSTFILE     a file with one node address a line, by rank (like DSTACK_MPI_HOSTFILE)

The addresses must be known before the first job starts, which the local provider does by
choosing ports up front.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .model import Job, Role, Run
from .state import write_atomically


class EnvError(Exception):
    pass


def node_rank(run: Run, job: Job) -> int:
    """0 for the master; a worker's place among the workers, from 1 (the run lists them by rank)."""
    if job.role is Role.ORCHESTRATOR:
        return 0
    if job.role is Role.STAGE:
        return 1 + run.workers.index(job)
    raise EnvError(f"{job.name} is not a node of the pipeline and has no rank")


def node_addrs(run: Run, addrs: Mapping[str, str] | None = None) -> list[str]:
    """Every node's address by rank, from `addrs` (job name -> HOST:PORT) or the jobs' own."""
    nodes = sorted(run.main_jobs, key=lambda job: node_rank(run, job))
    out = []
    for job in nodes:
        addr = (addrs or {}).get(job.name) or job.address
        if not addr:
            raise EnvError(f"{job.name} has no address yet; choose every node's address before starting")
        out.append(addr)
    return out


def hostfile_path(run_dir: Path | str, run_name: str) -> Path:
    return Path(run_dir) / f"{run_name}.hosts"


def write_hostfile(run: Run, run_dir: Path | str, addrs: Mapping[str, str] | None = None) -> Path:
    """Write `<run_dir>/<run>.hosts`: one node address a line, by rank."""
    lines = "".join(f"{addr}\n" for addr in node_addrs(run, addrs))
    return write_atomically(hostfile_path(run_dir, run.name), lines)


def job_env(
    run: Run, job_name: str, hostfile: Path | str, addrs: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The MESHD_* variables for one job (the relay gets the node-independent ones only)."""
    nodes = node_addrs(run, addrs)
    env = {
        "MESHD_NODES_NUM": str(len(nodes)),
        "MESHD_MASTER_ADDR": nodes[0],
        "MESHD_NODES_ADDRS": ",".join(nodes),
        "MESHD_HOSTFILE": str(Path(hostfile).resolve()),
    }
    job = run.job(job_name)
    if not job.is_aux:
        env["MESHD_NODE_RANK"] = str(node_rank(run, job))
    return env


def prepare_env(
    run: Run, run_dir: Path | str, addrs: Mapping[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """Write the hostfile and return every job's environment, by job name."""
    hostfile = write_hostfile(run, run_dir, addrs)
    return {job.name: job_env(run, job.name, hostfile, addrs) for job in run.jobs}
