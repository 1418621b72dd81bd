"""smoke-run given what it cannot use: one line naming the option, exit 2, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys


def meshd(*args: str | bytes, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


def test_a_prompt_that_is_not_utf8_is_named_as_the_prompt(tmp_path):
    """Bytes that are not UTF-8 on the command line are the prompt's fault, not the checkpoint's."""
    r = meshd("smoke-run", "--stages", "2", "--prompt", b"ab\xffc", "--run-dir", str(tmp_path / "runs"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == "meshd smoke-run: error: argument --prompt: not valid UTF-8 (byte 2)"
    assert not (tmp_path / "runs").exists()


def test_a_relay_killed_during_the_run_fails_it_as_meshd_ps_records_it(tmp_path):
    """The generation passes over direct paths, but the relay job died on its own: the report,
    its exit code and `meshd ps` all say the run failed, naming the relay."""
    import json

    runs = tmp_path / "runs"
    r = meshd("smoke-run", "--stages", "1", "--stub", "--max-tokens", "4", "--fault", "kill:relay@token-1",
              "--json", "--run-dir", str(runs), timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 1 and report["ok"] is False, report
    assert report["status"] == "exited (-9)" and report["reason"] == "relay exited (-9) during the run"
    assert report["run_status"] == "failed" and report["leftovers"] == 0
    ps = json.loads(meshd("ps", "--run-dir", str(runs), "--json").stdout)
    assert [run["status"] for run in ps["runs"]] == ["failed"]


def test_a_node_that_died_while_its_dashboard_is_read_fails_the_run_naming_it():
    """A stage crashing while smoke-run converges: its dashboard refuses, and the run fails as
    that job exited (name, peer prefix, exit code), not with the HTTP client's traceback."""
    import socket
    from types import SimpleNamespace

    import httpx
    import pytest

    from meshd.launch.drive import Dashboard, job_snapshot
    from meshd.launch.failure import RunFailed

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    dead.wait()
    proc = SimpleNamespace(name="stage-1", proc=dead, boot=SimpleNamespace(prefix="2b91108e"),
                           lines=["meshd stage-map 2b91108e=stage-1"])
    with httpx.Client(timeout=5) as client, pytest.raises(RunFailed) as failed:
        job_snapshot(client, Dashboard(f"http://127.0.0.1:{port}", {}), proc)  # type: ignore[arg-type]
    failure = failed.value.failure
    assert failure.status == "exited (-9)" and failure.job == "stage-1"
    assert failure.reason.startswith("stage-1 (2b91108e) exited")


def test_a_default_run_dir_that_cannot_be_made_is_refused_before_anything_starts(tmp_path):
    """$XDG_STATE_HOME under a file (a read-only or odd home): one line naming the run dir and
    the way out, exit 2, before a checkpoint is written or a job starts."""
    (tmp_path / "afile").write_text("x")
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "afile" / "state")}
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--stages", "1", "--stub"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"meshd: error: smoke-run: cannot make the run dir "
                                f"{tmp_path / 'afile' / 'state' / 'meshd' / 'runs'}: Not a directory "
                                "(give --run-dir DIR)")
    assert r.stdout == ""


def test_a_hangup_tears_the_run_down_as_ctrl_c_does(tmp_path):
    """SIGHUP (the terminal closed, an ssh session dropped) while the run converges: every job
    stopped, the temp dir gone, the run recorded as interrupted, not left running."""
    import json
    import signal
    import time

    runs, tmp = tmp_path / "runs", tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "meshd", "smoke-run", "--stages", "2", "--stub",
                             "--max-tokens", "200", "--run-dir", str(runs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    try:
        deadline = time.monotonic() + 60
        while not list(tmp.glob("meshd-smoke-*/snapshots/*")) and time.monotonic() < deadline:
            time.sleep(0.05)  # nodes are up once they write snapshots
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Traceback" not in err, err
    assert proc.returncode == 130, (out, err)
    assert "smoke-run: stopped (interrupted by SIGHUP)" in out and "leftovers: 0" in out
    assert list(tmp.iterdir()) == []
    ps = json.loads(subprocess.run([sys.executable, "-m", "meshd", "ps", "--run-dir", str(runs), "--json"],
                                   capture_output=True, text=True, timeout=30).stdout)
    assert [run["status"] for run in ps["runs"]] == ["terminated"]


def test_a_node_cut_off_from_the_mesh_is_named_with_its_peer_prefix(tmp_path):
    """The prefix is what every node's log calls it: the report gives both names."""
    import json
    import re

    r = meshd("smoke-run", "--stages", "2", "--stub", "--fault", "isolate:stage-1", "--timeout", "20",
              "--json", "--run-dir", str(tmp_path / "runs"), timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 1 and report["status"] == "unreachable: stage-1", report
    cut = re.search(r"; cut off: stage-1 \(([0-9a-f]{8})\)$", report["reason"])
    assert cut, report["reason"]
    with open(os.path.join(report["logs"], "stage-1.log")) as log:  # its boot line
        assert f"prefix={cut.group(1)} role=stage stage=1 " in log.read()


def test_the_timeout_help_says_it_bounds_the_start_too():
    """A short --timeout on a loaded host fails as "not started within S": the help says so."""
    r = meshd("smoke-run", "--help")
    assert "--timeout S" in r.stdout
    assert "the jobs starting, convergence, the generation" in " ".join(r.stdout.split())
