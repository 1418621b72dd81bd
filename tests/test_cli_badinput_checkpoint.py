"""A checkpoint whose tensors contradict its config.json: every command that takes it says so
in one line, before anything runs, naming the file and the tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshd.pipeline.checkpoint import init_checkpoint


def meshd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


@pytest.fixture
def wider_config(tmp_path):
    """A tiny checkpoint whose config.json says hidden_size 128 over weights of width 64."""
    model = tmp_path / "model"
    init_checkpoint(model, "tiny")
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = 128
    (model / "config.json").write_text(json.dumps(config))
    return model


def _refused(r: subprocess.CompletedProcess, model) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr, r.stdout)
    assert f"{model}/model.safetensors: tensor model.embed_tokens.weight has shape (258, 64), " \
           f"expected (258, 128)" in lines[0], lines[0]
    return lines[0]


def test_model_inspect_refuses_tensors_of_another_shape_than_the_config_says(wider_config):
    r = meshd("model", "inspect", str(wider_config))
    assert _refused(r, wider_config).startswith("meshd: error: model inspect: ")
    assert r.stdout == ""


def test_an_orchestrator_refuses_tensors_of_another_shape_than_the_config_says(wider_config):
    """The orchestrator never loads the weights; it checks their headers before it joins."""
    r = meshd("run", "--role", "orchestrator", "--stages", "2", "--model", str(wider_config),
              "--dashboard", "off")
    _refused(r, wider_config)
    assert "meshd node id=" not in r.stdout


def test_smoke_run_refuses_tensors_of_another_shape_before_any_job_starts(wider_config, tmp_path):
    r = meshd("smoke-run", "--stages", "2", "--model", str(wider_config),
              "--run-dir", str(tmp_path / "runs"))
    assert _refused(r, wider_config).startswith(f"meshd: error: smoke-run: --model {wider_config}: ")
    assert "starting" not in r.stderr and not (tmp_path / "runs").exists()


def test_smoke_run_refuses_a_truncated_weights_file_before_any_job_starts(tmp_path):
    model = tmp_path / "model"
    init_checkpoint(model, "tiny")
    with open(model / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    r = meshd("smoke-run", "--stages", "2", "--model", str(model), "--run-dir", str(tmp_path / "runs"))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{model}/model.safetensors: not a safetensors file" in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", [
    ["run", "--stage", "0", "--stages", "1", "--dashboard", "off", "--model"],
    ["smoke-run", "--stages", "1", "--model"],
    ["generate", "--prompt", "a", "--max-tokens", "2", "--model"],
    ["model", "inspect"],
])
def test_a_file_given_for_the_checkpoint_folder_is_named_as_not_a_folder(tmp_path, command):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    r = meshd(*command, str(weights))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{weights}: not a directory (a checkpoint is a folder holding config.json and the weights)" \
        in lines[0]
    assert "Errno" not in lines[0]


def test_model_init_into_a_path_under_a_file_says_what_it_cannot_write(tmp_path):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "model"
    r = meshd("model", "init", "--out", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"meshd: error: model init: cannot write {out}: Not a directory"


@pytest.mark.parametrize("fifo", ["config.json", "model.safetensors", "byte_tokenizer.json"])
@pytest.mark.parametrize("command", [
    ["run", "--stage", "0", "--stages", "1", "--dashboard", "off", "--model"],
    ["generate", "--prompt", "a", "--max-tokens", "2", "--model"],
    ["model", "inspect"],
])
def test_a_pipe_in_place_of_a_checkpoint_file_is_refused_not_waited_on(tmp_path, fifo, command):
    """Opening a FIFO blocks until a writer comes: the command names it and exits instead."""
    model = tmp_path / "model"
    init_checkpoint(model, "tiny")
    (model / fifo).unlink()
    os.mkfifo(model / fifo)
    r = meshd(*command, str(model), timeout=30)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].endswith(f"{model / fifo}: not a regular file (a pipe or a device)"), lines[0]


def test_a_pipe_named_as_a_shard_is_refused_not_waited_on(tmp_path):
    model = tmp_path / "model"
    init_checkpoint(model, "tiny", shards=2)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = "weights-pipe"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    os.mkfifo(model / "weights-pipe")
    r = meshd("generate", "--prompt", "a", "--max-tokens", "2", "--model", str(model), timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith(f"{model / 'weights-pipe'}: not a regular file (a pipe or a device)")
