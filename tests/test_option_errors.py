"""Options and files a node or a run cannot use: refused in one line with exit 2 before
anything starts, never a traceback from deep inside, and never a node that runs on and
fails later (a NaN wait, a snapshot directory that is a file)."""

from __future__ import annotations

import argparse
import logging
import shutil

import pytest
from test_cli_errors import meshd, one_line

from meshd.argtypes import finite_float, float_between, writable_dir
from meshd.net.faults import Faults, FaultSpecError
from meshd.pipeline.checkpoint import init_checkpoint
from meshd.snapshot import SnapshotWriter

STAGE = ("run", "--stage", "0", "--stages", "1", "--profile", "local", "--dashboard", "off")


@pytest.fixture
def tiny(tmp_path):
    init_checkpoint(tmp_path / "ck")
    return tmp_path / "ck"


def test_a_node_whose_weights_are_cut_short_names_the_file_and_exits_2(tmp_path, tiny):
    data = (tiny / "model.safetensors").read_bytes()
    (tiny / "model.safetensors").write_bytes(data[:len(data) // 3])
    r = meshd(*STAGE, "--model", str(tiny), env={"XDG_CACHE_HOME": str(tmp_path)})
    line = one_line(r.stderr)
    assert r.returncode == 2 and line.startswith(f"meshd: error: --model {tiny}:"), r.stderr
    assert "model.safetensors" in line and "meshd node id=" not in r.stdout


def test_an_orchestrator_whose_tokenizer_is_broken_names_the_file_and_exits_2(tmp_path, tiny):
    (tiny / "byte_tokenizer.json").write_text('{"x')
    r = meshd("run", "--role", "orchestrator", "--stages", "1", "--profile", "local", "--dashboard", "off",
              "--model", str(tiny), env={"XDG_CACHE_HOME": str(tmp_path)})
    line = one_line(r.stderr)
    assert r.returncode == 2 and "byte_tokenizer.json" in line, r.stderr


@pytest.mark.parametrize("stages", ["0", "-3"])
def test_a_stage_count_below_one_is_named_as_such(tmp_path, stages):
    r = meshd("run", "--stub", "--stage", "0", "--stages", stages, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and f"--stages must be from 1 to 4096, not {stages}" in r.stderr, r.stderr
    assert "outside" not in r.stderr


@pytest.mark.parametrize("what", ["a file", "under a file"])
def test_a_snapshot_dir_that_cannot_be_one_is_refused_before_the_node_starts(tmp_path, what):
    (tmp_path / "f").write_text("")
    where = tmp_path / "f" if what == "a file" else tmp_path / "f" / "sub"
    r = meshd("run", "--stub", *STAGE[1:], "--snapshot-dir", str(where),
              env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--snapshot-dir" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "meshd node id=" not in r.stdout


@pytest.mark.parametrize("interval", ["nan", "inf", "1e-9", "0"])
def test_a_snapshot_interval_that_is_no_wait_or_no_number_is_refused(tmp_path, interval):
    r = meshd("run", "--stub", *STAGE[1:], "--snapshot-dir", str(tmp_path / "sd"), "--snapshot-interval",
              interval, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--snapshot-interval" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_snapshot_that_cannot_be_written_is_one_warning_and_the_node_serves_on(tmp_path, caplog):
    writer = SnapshotWriter(tmp_path / "sd", "abcd1234")
    shutil.rmtree(tmp_path / "sd")
    (tmp_path / "sd").write_text("")  # the directory gone, a file in its place
    with caplog.at_level(logging.INFO, logger="meshd.snapshot"):
        writer.write({"n": 1})
        writer.write({"n": 2})
        (tmp_path / "sd").unlink()
        (tmp_path / "sd").mkdir()
        writer.write({"n": 3})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "cannot write the snapshot" in messages[0] and "again" in messages[1]
    assert writer.path.read_text() == '{"n":3}\n'


@pytest.mark.parametrize("spec", ["delay:nan", "delay:inf", "delay:1e12", "delay:-1", "loss:nan"])
def test_a_fault_delay_or_loss_that_is_no_number_or_no_bound_is_refused(spec):
    with pytest.raises(FaultSpecError, match="--fault"):
        Faults.parse([spec])


def test_a_node_refuses_a_nan_delay_fault_in_one_line(tmp_path):
    r = meshd("run", "--stub", *STAGE[1:], "--fault", "delay:nan", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "delay:nan" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(("spec", "says"), [
    ("bogus", "expected drop:A->B"),
    ("loss:abc", "'abc' is not a number"),
    ("delay:nan", "not a finite number"),
    ("kill:stage-9@token-2", "no node named 'stage-9'"),
    ("kill:stage-1@token-99", "generates only 4 tokens"),
])
def test_smoke_run_refuses_a_bad_fault_as_a_usage_error_before_any_job_starts(tmp_path, spec, says):
    r = meshd("smoke-run", "--stub", "--stages", "2", "--max-tokens", "4", "--fault", spec,
              "--run-dir", str(tmp_path / "runs"), env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "starting" not in r.stderr and not (tmp_path / "runs").exists()


def test_smoke_run_refuses_a_fault_due_after_the_orchestrators_restart_before_any_job_starts(tmp_path):
    r = meshd("smoke-run", "--stub", "--stages", "2", "--max-tokens", "16",
              "--fault", "restart:orchestrator@token-4", "--fault", "kill:stage-1@token-12",
              "--run-dir", str(tmp_path / "runs"),
              env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "a fault after token 4 would never be carried out" in r.stderr, r.stderr
    assert "starting" not in r.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("timeout", ["nan", "-1", "0", "inf"])
def test_smoke_run_refuses_a_timeout_that_is_no_wait(tmp_path, timeout):
    r = meshd("smoke-run", "--stub", "--stages", "1", "--timeout", timeout,
              "--run-dir", str(tmp_path / "runs"), env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sim_refuses_a_plot_dir_it_cannot_write_before_it_simulates(tmp_path):
    (tmp_path / "f").write_text("")
    r = meshd("sim", "--nodes", "8", "--periods", "5", "--plot", str(tmp_path / "f"))
    assert r.returncode == 2 and "not a directory" in r.stderr and "load:" not in r.stdout, r


def test_the_number_parsers_refuse_what_is_not_a_finite_number_in_range(tmp_path):
    for text in ("nan", "inf", "-inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            finite_float(text)
    within = float_between(0.1, 10, "seconds")
    assert within("0.1") == 0.1 and within("10") == 10
    with pytest.raises(argparse.ArgumentTypeError, match="from 0.1 to 10 seconds"):
        within("11")
    made = tmp_path / "a" / "b"
    assert writable_dir(str(made)) == str(made) and made.is_dir()


@pytest.mark.parametrize("damage", ["junk-weights", "too-many-stages"])
def test_an_orchestrator_refuses_a_checkpoint_no_stage_of_its_run_could_serve(tmp_path, tiny, damage):
    """It never loads the weights, but it checks them as a stage would: a broken weights file,
    or a split its --stages cannot make, is one line and exit 2 at start, not a run whose
    stages are blamed for serving another checkpoint."""
    stages = "1"
    if damage == "junk-weights":
        (tiny / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    else:
        stages = "5"  # the tiny preset has 4 layers
    r = meshd("run", "--role", "orchestrator", "--stages", stages, "--profile", "local", "--dashboard", "off",
              "--model", str(tiny), env={"XDG_CACHE_HOME": str(tmp_path)})
    line = one_line(r.stderr)
    assert r.returncode == 2 and line.startswith(f"meshd: error: --model {tiny}: "), r.stderr
    says = "model.safetensors" if damage == "junk-weights" else "cannot split 4 layers"
    assert says in line, line


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0,2", {0, 2}), ("0-3", {0, 1, 2, 3}),
                                            (" 1-2 , 5", {1, 2, 5}), ("4095", {4095})])
def test_a_cpu_list_reads_as_taskset_writes_it_and_back(text, cpus):
    from meshd.argtypes import cpu_list, cpu_text

    assert cpu_list(text) == cpus
    assert cpu_list(cpu_text(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "2-1", "4096", "0,,1", "1.5"])
def test_a_cpu_list_that_is_none_is_refused_in_one_line(text):
    import argparse

    from meshd.argtypes import cpu_list

    with pytest.raises(argparse.ArgumentTypeError):
        cpu_list(text)


def test_stages_get_runs_of_cpus_in_order_and_the_head_sharing_ends_never_share():
    from meshd.pipeline.threads import stage_cpus

    for n_cpus in range(1, 9):
        cpus = list(range(10, 10 + n_cpus))
        for stages in range(1, 9):
            runs = [stage_cpus(k, stages, cpus) for k in range(stages)]
            flat = [c for run in runs for c in run]
            assert all(runs) and flat == sorted(flat)  # in stage order, each at least one CPU
            assert set().union(*map(set, runs)) == set(cpus)  # every CPU serves a stage
            if n_cpus > 1 and stages > 1:
                assert not set(runs[0]) & set(runs[-1]), (n_cpus, stages, runs)
            if n_cpus >= stages:
                assert sum(map(len, runs)) == n_cpus  # no two stages share a CPU
