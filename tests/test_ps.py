"""`meshd ps` from another process, against run files written by meshd.launch.state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from meshd.launch.model import Exited, Lost, Running, Start, Started, new_run, step
from meshd.launch.state import (
    default_run_dir,
    load_run_dir,
    next_run_name,
    read_run,
    save_run,
)


def ps(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshd", "ps", *args],
        capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})},
    )


def lost_run(run_dir, name="smoke-1"):
    now = time.time() - 90
    run = new_run(name, 3, now=now, relay=True)
    names = [j.name for j in run.jobs]
    obs: list = []
    for _ in range(3):
        obs = [o for a in step(run, obs, now) if isinstance(a, Start)
               for i in [names.index(a.job)]
               for o in (Started(a.job, 4000 + i), Running(a.job, f"127.0.0.1:{7000 + i}", f"2b91108{i}"))]
    step(run, [Lost("stage-2", "peer 2b911085 dead")], now + 10)
    step(run, [Exited(j.name, -15) for j in run.jobs], now + 11)
    save_run(run, run_dir)
    return run


def done_run(run_dir, name="smoke-2"):
    now = time.time() - 5
    run = new_run(name, 2, now=now, stop_criteria="master-done")
    step(run, [], now)
    step(run, [Running(j.name, f"127.0.0.1:{7100 + i}") for i, j in enumerate(run.jobs)], now)
    step(run, [Exited("orchestrator", 0)], now + 1)
    step(run, [Exited("stage-0", -15), Exited("stage-1", -15)], now + 2)
    save_run(run, run_dir)
    return run


def test_table_shows_runs_and_jobs_with_readable_statuses(tmp_path):
    lost_run(tmp_path)
    done_run(tmp_path)
    out = ps("--run-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ROLE/STAGE", "PEER", "ADDRESS", "STATUS", "REASON", "SUBMITTED"]
    text = out.stdout
    assert "lost: stage-2 (peer 2b911085 dead)" in text
    assert "127.0.0.1:7003" in text and "2b911083" in text
    # newest run first; its workers were stopped by master-done and read exited (0)
    assert text.index("smoke-2") < text.index("smoke-1")
    stage_rows = [line for line in lines if line.strip().startswith("stage-")]
    assert any("exited (0)" in r and "master_done" in r for r in stage_rows)
    assert any("stopped" in r and "terminated_by_server" in r for r in stage_rows)
    assert "1 min ago" in text and "sec ago" in text
    # jobs are indented under their run
    assert any(line.startswith("  orchestrator") for line in lines)


def test_json_parses_and_carries_jobs(tmp_path):
    lost_run(tmp_path)
    out = ps("--run-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    [run] = data["runs"]
    assert run["name"] == "smoke-1" and run["status"] == "failed"
    assert run["message"] == "lost: stage-2 (peer 2b911085 dead)"
    jobs = {j["name"]: j for j in run["jobs"]}
    assert list(jobs) == ["relay", "orchestrator", "stage-0", "stage-1", "stage-2"]
    assert jobs["stage-2"]["status_message"] == "lost: stage-2 (peer 2b911085 dead)"
    assert jobs["stage-1"]["pid"] == 4003 and jobs["stage-1"]["stage"] == 1
    assert data["errors"] == []


def test_a_corrupt_file_is_one_line_naming_it_and_the_rest_still_shows(tmp_path):
    done_run(tmp_path)
    (tmp_path / "broken.json").write_text('{"name": "broken", "jobs": [')
    (tmp_path / "other.json").write_text('{"hello": 1}')
    out = ps("--run-dir", str(tmp_path))
    assert out.returncode == 1
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 2
    assert "Traceback" not in out.stderr
    assert any("broken.json" in e and "not valid JSON" in e for e in errors)
    assert any("other.json" in e and "not a meshd run file" in e for e in errors)
    assert "smoke-2" in out.stdout
    data = json.loads(ps("--run-dir", str(tmp_path), "--json").stdout)
    assert len(data["runs"]) == 1 and len(data["errors"]) == 2


def test_empty_or_missing_run_dir_is_one_clear_line(tmp_path):
    out = ps("--run-dir", str(tmp_path / "nothing-here"))
    assert out.returncode == 0
    assert out.stdout.strip() == f"No runs in {tmp_path / 'nothing-here'}"
    assert json.loads(ps("--run-dir", str(tmp_path), "--json").stdout)["runs"] == []


def test_default_run_dir_follows_xdg_state_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_run_dir() == tmp_path / "meshd" / "runs"
    done_run(default_run_dir())
    out = ps(env={"XDG_STATE_HOME": str(tmp_path)})
    assert "smoke-2" in out.stdout


def test_a_run_whose_driver_died_says_so(tmp_path):
    run = new_run("smoke-1", 1, now=time.time())
    step(run, [], time.time())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    save_run(run, tmp_path, owner_pid=dead.pid)
    out = ps("--run-dir", str(tmp_path))
    assert f"provisioning (driver pid {dead.pid} gone)" in out.stdout
    # Its jobs died with it (PR_SET_PDEATHSIG): none is shown as still going.
    jobs = [line for line in out.stdout.splitlines() if line.startswith("  ")]
    assert jobs and all("killed with its driver (was " in line for line in jobs), out.stdout


def test_ps_reads_a_run_while_another_process_rewrites_it(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", f"""
import time
from meshd.launch.model import new_run, step, Running
from meshd.launch.state import save_run
run = new_run("live", 5, now=time.time())
step(run, [], time.time())
deadline = time.time() + 3
i = 0
while time.time() < deadline:
    run.jobs[i % 6].address = "127.0.0.1:%d" % (7000 + i)
    save_run(run, {str(tmp_path)!r})
    i += 1
"""])
    try:
        seen = 0
        deadline = time.time() + 2.5
        while time.time() < deadline:
            found = load_run_dir(tmp_path)
            assert found.errors == []
            seen += len(found.runs)
        out = ps("--run-dir", str(tmp_path), "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["runs"][0]["name"] == "live"
        assert seen > 0
    finally:
        writer.wait(timeout=10)
    assert writer.returncode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["live.json"]  # no temp file left


def test_state_round_trips_and_names_are_checked(tmp_path):
    run = lost_run(tmp_path)
    back = read_run(tmp_path / "smoke-1.json")
    assert [j.status_message for j in back.jobs] == [j.status_message for j in run.jobs]
    assert next_run_name(tmp_path) == "smoke-2"
    with pytest.raises(ValueError):
        save_run(new_run("../escape", 1, now=0.0), tmp_path)


def test_every_relay_of_a_run_is_a_job_in_the_table_and_the_json(tmp_path):
    now = time.time() - 30
    run = new_run("smoke-1", 2, now=now, relay=2)
    step(run, [], now)
    step(run, [Started("relay", 4001), Running("relay", "127.0.0.1:9000"),
               Started("relay-2", 4002), Running("relay-2", "127.0.0.1:9004")], now)
    save_run(run, tmp_path)
    out = ps("--run-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    assert rows["relay-2"][:4] == ["relay-2", "relay", "127.0.0.1:9004", "running"]
    assert rows["relay"][:4] == ["relay", "relay", "127.0.0.1:9000", "running"]
    jobs = json.loads(ps("--run-dir", str(tmp_path), "--json").stdout)["runs"][0]["jobs"]
    assert [(j["name"], j["role"]) for j in jobs][:2] == [("relay", "relay"), ("relay-2", "relay")]


@pytest.mark.parametrize("field, value, says", [
    ("message", 1, "field message: expected str, got int"),
    ("timeout", "soon", "field timeout: expected a number, got str"),
    ("owner_pid", "me", "field owner_pid: expected int, got str"),
    ("jobs.0.pid", [1], "field pid: expected int, got list"),
    ("jobs.0.detail", {"a": 1}, "field detail: expected str, got dict"),
    ("submitted_at", float("nan"), "field submitted_at: expected a finite number from 0 up, got nan"),
    ("finished_at", -1e308, "field finished_at: expected a finite number from 0 up, got -1e+308"),
    pytest.param("jobs.0.submitted_at", 10**400, "field submitted_at: expected a finite number from 0 up",
                 id="jobs.0.submitted_at-past-a-float"),
    ("jobs.0.attempt", float("inf"), "field attempt: expected int, got float"),
    ("jobs.0.status_message", ["x"], "field status_message: expected str, got list"),
])
def test_a_run_file_with_a_field_of_the_wrong_type_is_one_line_and_the_rest_still_shows(
        tmp_path, field, value, says):
    done_run(tmp_path)
    run = lost_run(tmp_path / "x", "smoke-9")
    data = json.loads(next((tmp_path / "x").iterdir()).read_text())
    where, *path = field.split(".")
    target = data[where][int(path[0])] if path else data
    target[path[1] if path else where] = value
    (tmp_path / "smoke-9.json").write_text(json.dumps(data))
    out = ps("--run-dir", str(tmp_path))
    assert "Traceback" not in out.stderr and out.returncode == 1, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "smoke-9.json" in line and says in line, line
    assert "smoke-2" in out.stdout and run.name not in out.stdout


def test_a_driver_pid_no_process_can_have_reads_as_gone(tmp_path):
    run = new_run("smoke-1", 1, now=time.time())
    step(run, [], time.time())
    save_run(run, tmp_path, owner_pid=10**20)
    out = ps("--run-dir", str(tmp_path))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert f"(driver pid {10**20} gone)" in out.stdout


def test_markup_and_control_characters_in_a_run_file_are_shown_as_text(tmp_path):
    run = new_run("smoke-1", 1, now=time.time())
    step(run, [], time.time())
    run.message = "[/bold] stopped [red]by hand\x1b[2J"
    run.jobs[0].name = "relay[/]"
    save_run(run, tmp_path)
    out = ps("--run-dir", str(tmp_path))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "[/bold] stopped [red]by hand\ufffd[2J" in out.stdout and "  relay[/]" in out.stdout
