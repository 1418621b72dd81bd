"""A stage restarted with a ``--seed`` that no longer answers (its orchestrator came back at
another address, as on a rented host's new IP) joins through the members its state file
remembers (here the stage that stayed up, which the restarted orchestrator found), and
the pipeline serves again with no command line changed.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from meshd.launch.process import MeshProcess, parse_stage_map

pytestmark = pytest.mark.processes


def _node(tmp_path, name: str, role: list[str], seeds: list[str]) -> MeshProcess:
    p = MeshProcess(name, ["run", *role, "--stages", "2", "--stub", "--profile", "local",
                           "--bind", "127.0.0.1:0", "--key-file", str(tmp_path / f"{name}.key"),
                           *(f"--seed={s}" for s in seeds)])
    p.wait_boot()
    return p


def _sees(p: MeshProcess, prefixes: set[str], timeout: float = 30) -> None:
    p.wait_for(lambda s: set(parse_stage_map(s) or {}) == prefixes, timeout, f"a stage map of {prefixes}")


def _remembers(tmp_path, name: str, addr: str) -> None:
    state = tmp_path / f"{name}.key.state.json"
    deadline = time.monotonic() + 15  # written within a second of a change
    while addr not in (state.read_text() if state.exists() else ""):
        assert time.monotonic() < deadline, f"{name} never wrote {addr} into its state file"
        time.sleep(0.2)


def test_a_stage_whose_seed_moved_rejoins_through_the_members_it_remembers(tmp_path):
    procs: list[MeshProcess] = []
    try:
        orch = _node(tmp_path, "orchestrator", ["--role", "orchestrator"], [])
        procs.append(orch)
        stale_seed = orch.wait_boot().addr
        stage = _node(tmp_path, "stage-0", ["--role", "stage", "--stage", "0"], [stale_seed])
        other = _node(tmp_path, "stage-1", ["--role", "stage", "--stage", "1"], [stale_seed])
        procs += [stage, other]
        _sees(stage, {orch.boot.prefix, stage.boot.prefix, other.boot.prefix})
        # The restarted orchestrator finds stage-1 through its own state file, and stage-0
        # through its own: both must have been written before the kills.
        _remembers(tmp_path, "stage-0", other.boot.addr)
        _remembers(tmp_path, "orchestrator", other.boot.addr)
        orch.signal(signal.SIGKILL)
        orch.proc.wait(5)
        orch = _node(tmp_path, "orchestrator", ["--role", "orchestrator"], [])  # a new port, its key
        procs.append(orch)
        assert orch.boot.addr != stale_seed
        stage.signal(signal.SIGKILL)
        stage.proc.wait(5)
        stage = _node(tmp_path, "stage-0", ["--role", "stage", "--stage", "0"], [stale_seed])
        procs.append(stage)
        stage.wait_for(lambda s: s.startswith("meshd rejoin trying 1 remembered members"), 30,
                       "the rejoin line")
        _sees(stage, {orch.boot.prefix, stage.boot.prefix, other.boot.prefix})
        url = orch.wait_for(lambda s: s.startswith("meshd dashboard url="), 15, "dashboard url"
                            ).split()[2].split("=", 1)[1]
        deadline = time.monotonic() + 30
        while (r := httpx.post(f"{url}/api/generate", json={"prompt": "hi", "max_tokens": 4},
                               timeout=30)).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.3)
    finally:
        for p in procs:
            p.stop(timeout=3)
