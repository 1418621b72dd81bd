"""Real ``meshd run`` meshes on loopback, for tests and benchmarks.

The process wrapper itself is :class:`meshd.launch.process.MeshProcess`;
this module starts a whole mesh with it and waits for the mesh to settle.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

from ..launch.process import MeshProcess, parse_stage_map
from ..pipeline.threads import shared_host_args


def start_mesh(
    stages: int,
    *,
    profile: str = "local",
    snapshot_dir: str | None = None,
    snapshot_interval: float = 0.5,
    extra: list[str] | None = None,
    stage_extra: Callable[[int, list[str]], list[str]] | None = None,
) -> list[MeshProcess]:
    """An orchestrator on a free loopback port, then ``stages`` stage nodes seeded through it.

    ``stage_extra(k, addrs)`` gives more flags for stage ``k``; ``addrs`` holds the
    gossip addresses of the nodes started before it, the orchestrator first.

    Each stage gets its share of this host's cores and CPUs of its own, as smoke-run gives
    its stages (``meshd.pipeline.threads.shared_host_args``); a ``--compute-threads`` or
    ``--cpus`` in ``extra`` or ``stage_extra`` overrides it.
    """
    common = ["--profile", profile, *(extra or [])]
    if snapshot_dir:
        common += ["--snapshot-dir", snapshot_dir, "--snapshot-interval", str(snapshot_interval)]
    procs: list[MeshProcess] = []
    try:
        orch = MeshProcess("orchestrator", ["run", "--role", "orchestrator", "--stages", str(stages),
                                            "--bind", "127.0.0.1:0", *common])
        procs.append(orch)
        addrs = [orch.wait_boot().addr]
        for k in range(stages):
            stage = MeshProcess(f"stage-{k}", ["run", "--role", "stage", "--stage", str(k),
                                               "--stages", str(stages), "--bind", "127.0.0.1:0",
                                               "--seed", addrs[0], *shared_host_args(stages, k, stages),
                                               *common,
                                               *(stage_extra(k, list(addrs)) if stage_extra else [])])
            procs.append(stage)
            addrs.append(stage.wait_boot().addr)
    except BaseException:
        for p in procs:
            p.stop(timeout=2)
        raise
    return procs


def wait_converged(procs: list[MeshProcess], timeout: float = 20.0) -> dict[str, str]:
    """Wait until every process's latest stage map lists every process; returns that map."""
    want = {p.wait_boot().prefix for p in procs}
    deadline = time.monotonic() + timeout
    for p in procs:
        left = max(deadline - time.monotonic(), 0.1)
        p.wait_for(
            lambda line: set((parse_stage_map(line) or {}).keys()) == want,
            left,
            f"stage map with all {len(want)} nodes",
        )
    stage_map = procs[0].latest_stage_map()
    assert stage_map is not None  # it was just waited for
    return stage_map


def smoke_signalled_at(phase: str, *args: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """A 3-stage ``meshd smoke-run --json`` of 200 tokens (``args`` added) sent SIGTERM as soon as
    it says it entered ``phase``: (its exit code, its stdout, its stderr)."""
    argv = [sys.executable, "-m", "meshd", "smoke-run", "--stages", "3", "--max-tokens", "200", "--json",
            *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        if line.startswith(f"smoke-run: {phase}"):
            break
    if proc.poll() is not None:
        raise AssertionError(f"the run ended before {phase!r}:\n{''.join(said)}")
    proc.send_signal(signal.SIGTERM)
    stdout, rest = proc.communicate(timeout=timeout)
    return proc.returncode, stdout, "".join(said) + rest
