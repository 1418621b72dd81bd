"""The MESHD_* environment each job starts with, and the hostfile."""

from __future__ import annotations

import pytest

from meshd.launch.env import EnvError, prepare_env
from meshd.launch.model import new_run


def test_every_job_gets_rank_count_master_and_a_hostfile(tmp_path):
    run = new_run("smoke-1", 3, now=0.0, relay=True)
    addrs = {"orchestrator": "127.0.0.1:7000", "stage-0": "127.0.0.1:7001",
             "stage-1": "127.0.0.1:7002", "stage-2": "127.0.0.1:7003"}
    envs = prepare_env(run, tmp_path, addrs)

    hostfile = tmp_path / "smoke-1.hosts"
    assert hostfile.read_text().splitlines() == list(addrs.values())
    assert envs["orchestrator"] == {
        "MESHD_NODE_RANK": "0",
        "MESHD_NODES_NUM": "4",
        "MESHD_MASTER_ADDR": "127.0.0.1:7000",
        "MESHD_NODES_ADDRS": "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003",
        "MESHD_HOSTFILE": str(hostfile.resolve()),
    }
    assert [envs[f"stage-{k}"]["MESHD_NODE_RANK"] for k in range(3)] == ["1", "2", "3"]
    assert "MESHD_NODE_RANK" not in envs["relay"]
    assert envs["relay"]["MESHD_MASTER_ADDR"] == "127.0.0.1:7000"


def test_addresses_come_from_the_jobs_when_not_given(tmp_path):
    run = new_run("r", 1, now=0.0)
    run.job("orchestrator").address = "10.0.0.1:7946"
    with pytest.raises(EnvError, match="stage-0 has no address"):
        prepare_env(run, tmp_path)
    run.job("stage-0").address = "10.0.0.2:7946"
    envs = prepare_env(run, tmp_path)
    assert envs["stage-0"]["MESHD_NODES_ADDRS"] == "10.0.0.1:7946,10.0.0.2:7946"


def test_replicas_rank_after_every_stages_first_node(tmp_path):
    run = new_run("smoke-1", 2, now=0.0, replicas=2, relay=True)
    names = ["orchestrator", "stage-0", "stage-1", "stage-0.2", "stage-1.2"]
    addrs = {n: f"127.0.0.1:{7000 + i}" for i, n in enumerate(names)}
    envs = prepare_env(run, tmp_path, addrs)
    assert [envs[n]["MESHD_NODE_RANK"] for n in names] == ["0", "1", "2", "3", "4"]
    assert envs["stage-1.2"]["MESHD_NODES_NUM"] == "5"
    assert (tmp_path / "smoke-1.hosts").read_text().splitlines() == list(addrs.values())
