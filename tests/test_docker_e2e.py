"""scripts/docker-e2e.sh for real: the image built with no network, the compose mesh on an
internal network with a firewalled pair, the reference tokens, and nothing of the run left.

Needs a Docker engine: the one that runs, or a dockerd started here just for this module and
stopped after it, the host's firewall checked to be as it was (scripts/with-dockerd.py), so
tests/test_netns.py passes in the same run. Skipped, with the reason, only where no engine can
start (not root, or docker.io not installed). The first run on a machine makes the base image
with debootstrap (about 1.5 min; .ci/run starts it early, in the background); later runs reuse
it and the wheels.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "scripts" / "docker-e2e.sh"

pytestmark = [pytest.mark.docker, pytest.mark.processes, pytest.mark.host_network]


@pytest.fixture(scope="module")
def engine(with_dockerd):
    around = with_dockerd
    started = None
    if not around.engine_running():
        try:
            started = around.StartedEngine()
        except around.NoEngine as exc:
            pytest.skip(str(exc))
    yield
    if started is not None:
        left = started.stop()
        assert not left, "the host's firewall differs from before dockerd started: " + "; ".join(left)


def _of_the_run(project: str) -> list[str]:
    """Containers, networks and volumes of a compose project, by label and by name."""
    label = f"label=com.docker.compose.project={project}"
    found = []
    for kind, cmd in (("container", ["docker", "ps", "-a", "--format", "{{.Names}}"]),
                      ("network", ["docker", "network", "ls", "--format", "{{.Name}}"]),
                      ("volume", ["docker", "volume", "ls", "--format", "{{.Name}}"])):
        names = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.split()
        labelled = subprocess.run([*cmd[:-2], "--filter", label, "--format", cmd[-1]], capture_output=True,
                                  text=True, timeout=30, check=True).stdout.split()
        named = {name for name in names if name.startswith(project)}
        found += [f"{kind} {name}" for name in sorted(set(labelled) | named)]
    return found


def _start(stages: int) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(E2E), str(stages)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_three_stages_match_the_reference_report_the_one_way_pair_and_leave_nothing(engine):
    proc = _start(3)
    out, _ = proc.communicate(timeout=900)  # the first run on a machine makes the base image
    assert proc.returncode == 0, out
    assert "docker-e2e: tokens equal meshd generate's: yes (16 tokens through 3 stage(s))" in out
    assert "internal" in out and "stage-0→stage-1: dropped by " in out
    [pair] = [line for line in out.splitlines() if line.startswith("docker-e2e: asymmetric pair reported: ")]
    assert "stage-0→stage-1: direct fails" in pair and "stage-1→stage-0: direct" in pair, pair
    assert "asymmetric  stage-0→stage-1" in out  # doctor's own table, as a user sees it
    assert _of_the_run(f"meshd-e2e-{proc.pid}") == []


@pytest.mark.parametrize("after_s", [0, 2])  # while compose up creates the containers; once nodes start
def test_sigterm_mid_run_tears_everything_down(engine, after_s):
    proc = _start(2)
    project = f"meshd-e2e-{proc.pid}"
    deadline = time.monotonic() + 600  # the image is built by the test above; at most a rebuild here
    while not any(item.startswith("container ") for item in _of_the_run(project)):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no container of the run came up"
        time.sleep(0.5)
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert f"docker-e2e: torn down: no container, network or volume of {project} is left" in out
    assert _of_the_run(project) == []


# --- meshd smoke-run --provider docker: a container per job, driven from the host ---


def _smoke_containers() -> list[str]:
    """Containers and networks any `smoke-run --provider docker` made, by its label."""
    found = []
    for kind, cmd in (("container", ["docker", "ps", "-a"]), ("network", ["docker", "network", "ls"])):
        field = "{{.Names}}" if kind == "container" else "{{.Name}}"
        found += [f"{kind} {name}" for name in subprocess.run(
            [*cmd, "--filter", "label=meshd.smoke", "--format", field],
            capture_output=True, text=True, timeout=30, check=True).stdout.split()]
    return found


def _smoke(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "TMPDIR": str(tmp_path)}
    env.pop("MESHD_IMAGE", None)  # the image built from this checkout, as a user's run would
    return subprocess.Popen([sys.executable, "-m", "meshd", "smoke-run", "--provider", "docker", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def test_smoke_run_in_containers_matches_the_reference_through_a_restart_and_leaves_nothing(engine, tmp_path):
    proc = _smoke(tmp_path, "--stages", "2", "--replicas", "2", "--max-tokens", "24", "--json",
                  "--fault", "restart:stage-1@token-8", "--fault", "drop:stage-0->stage-1")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["ok"] and report["matches_reference"], err
    assert report["testbed"]["network"].startswith("meshd-smoke-")
    assert report["testbed"]["subnet"].startswith("10.215.")
    assert [d["action"] for d in report["disruptions"]] == ["restart"]
    assert [(a["from"], a["to"]) for a in report["asymmetric"]] == [("stage-0", "stage-1")]
    assert report["leftovers"] == 0
    assert _smoke_containers() == []
    assert list(tmp_path.glob("meshd-smoke-*")) == []


def test_smoke_run_in_containers_stopped_by_ctrl_c_removes_its_containers(engine, tmp_path):
    proc = _smoke(tmp_path, "--stages", "2", "--stub")
    deadline = time.monotonic() + 600  # a rebuild of the image at most
    while not any(item.startswith("container ") for item in _smoke_containers()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no container of the run came up"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert "interrupted by SIGINT" in out + err and "Traceback" not in err, (out, err)
    assert _smoke_containers() == []


def test_containers_a_killed_smoke_run_left_are_removed_by_the_next(engine, tmp_path):
    first = _smoke(tmp_path, "--stages", "1", "--stub")
    deadline = time.monotonic() + 600
    while sum(item.startswith("container ") for item in _smoke_containers()) < 2:
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "no container of the run came up"
        time.sleep(0.2)
    first.kill()  # no teardown: its containers go on running
    first.communicate(timeout=30)
    left = _smoke_containers()
    assert left, "a SIGKILLed smoke-run's containers were expected to outlive it"
    # A --model relative to where smoke-run runs: the containers' working directory is not that.
    subprocess.run([sys.executable, "-m", "meshd", "model", "init", "--out", "model", "--preset", "tiny"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    second = _smoke(tmp_path, "--stages", "1", "--model", "model")
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0, (out, err)
    assert f"left by a smoke-run (pid {first.pid}) killed before its teardown" in err
    assert _smoke_containers() == []
