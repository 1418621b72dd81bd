"""Real `meshd run` processes on loopback: the boot line, convergence, SIGKILL, SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshd.argtypes import cpu_text
from meshd.launch.process import BOOT_RE, MeshProcess, parse_stage_map
from meshd.pipeline import threads
from meshd.snapshot import read_snapshots
from meshd.swim import LOCAL
from meshd.testing.processes import start_mesh, wait_converged

pytestmark = pytest.mark.processes


@pytest.fixture
def mesh(tmp_path):
    procs = start_mesh(2, snapshot_dir=str(tmp_path / "snap"), snapshot_interval=0.3)
    yield procs
    for p in procs:
        p.stop(timeout=2)


def _snapshot_states(path: Path, subject_prefix: str) -> list[str]:
    """Every state the node at ``path`` recorded for ``subject_prefix``, in order."""
    states = []
    for snap in read_snapshots(path):
        for m in snap["members"]:
            if m["prefix"] == subject_prefix:
                states.append(m["state"])
    return states


def _cpus_of(pid: int) -> set[str]:
    """The CPU list of every thread of process ``pid``, as /proc writes it."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc to read a thread's CPUs from")
def test_stages_sharing_a_host_each_run_on_cpus_of_their_own(mesh):
    cpus = threads.host_cpus()
    for k, proc in enumerate(mesh[1:]):
        want = cpu_text(threads.stage_cpus(k, 2) if len(cpus) > 1 else cpus)
        assert _cpus_of(proc.proc.pid) == {want}, proc.name  # every thread of it
    assert _cpus_of(mesh[0].proc.pid) == {cpu_text(cpus)}  # the orchestrator is not pinned


def test_boot_line_and_stage_map_follow_the_contract(mesh):
    stage_map = wait_converged(mesh)
    assert {p.boot.prefix: p.name for p in mesh} == stage_map
    orch = mesh[0]
    assert orch.boot.role == "orchestrator" and orch.boot.stage == "-" and orch.boot.relay == "-"
    assert [p.boot.stage for p in mesh[1:]] == ["0", "1"]
    for p in mesh:
        assert p.boot.id.startswith(p.boot.prefix)
        assert BOOT_RE.match(p.lines[0]), "the boot line comes first"


def test_sigkilled_node_is_declared_dead_by_the_others(mesh, tmp_path):
    wait_converged(mesh)
    victim = mesh[2]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(5)
    t_kill = time.monotonic()
    n = len(mesh)
    low, high = LOCAL.suspicion_bounds(n)
    bound = high + 2 * LOCAL.probe_interval
    for p in mesh[:2]:
        p.wait_for(
            lambda line: line.startswith(f"meshd member dead prefix={victim.boot.prefix} name=stage-1"),
            bound + 5,
            f"dead declaration of stage-1 ({victim.boot.prefix})",
        )
        # The next stage map no longer lists it.
        p.wait_for(
            lambda line: (m := parse_stage_map(line)) is not None and victim.boot.prefix not in m
            and len(m) == n - 1,
            5,
            "stage map without stage-1",
        )
    detected = time.monotonic() - t_kill
    print(f"\nSIGKILL of stage-1 known dead to both peers after {detected:.1f}s "
          f"({detected / LOCAL.probe_interval:.1f} protocol periods; suspicion bounds {low:.0f}-{high:.0f}s)")
    # Their snapshot files record it: alive first, dead at the end.
    time.sleep(1.0)
    for p in mesh[:2]:
        states = _snapshot_states(tmp_path / "snap" / f"{p.boot.prefix}.jsonl", victim.boot.prefix)
        assert states and states[0] == "alive"
        assert states[-1] == "dead", f"{p.name} snapshot still shows stage-1 as {states[-1]}"


def test_sigterm_leaves_gracefully_and_exits_zero_within_two_seconds(mesh, tmp_path):
    wait_converged(mesh)
    leaver = mesh[1]
    leaver.signal(signal.SIGTERM)
    assert leaver.proc.wait(2.0) == 0
    for p in (mesh[0], mesh[2]):
        p.wait_for(
            lambda line: line.startswith(f"meshd member left prefix={leaver.boot.prefix} name=stage-0"),
            5,
            "left announcement of stage-0",
        )
    assert not any(f"member dead prefix={leaver.boot.prefix}" in line for p in mesh for line in p.lines)
    # SIGINT (Ctrl-C) is as clean as SIGTERM.
    mesh[2].signal(signal.SIGINT)
    assert mesh[2].proc.wait(2.0) == 0
    assert not any("Traceback" in line for p in mesh for line in p.lines)


def test_sighup_leaves_gracefully_unless_started_under_nohup(mesh):
    """A closed terminal (SIGHUP) is a leave, as SIGTERM is; a node started ignoring SIGHUP
    (``nohup meshd run``) keeps running through one."""
    wait_converged(mesh)
    orch = mesh[0]
    kept = MeshProcess("stage-1", ["run", "--role", "stage", "--stage", "1", "--stages", "2", "--bind",
                                   "127.0.0.1:0", "--seed", orch.boot.addr, "--profile", "local"],
                       preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        kept.wait_boot()
        leaver = mesh[1]
        leaver.signal(signal.SIGHUP)
        assert leaver.proc.wait(5.0) == 0
        orch.wait_for(lambda line: line.startswith(f"meshd member left prefix={leaver.boot.prefix}"), 5,
                      "left announcement of stage-0")
        kept.signal(signal.SIGHUP)
        time.sleep(1.0)
        assert kept.proc.poll() is None, "a node started under nohup must outlive a SIGHUP"
    finally:
        kept.stop(timeout=2)
    assert not any("Traceback" in line for p in (*mesh, kept) for line in p.lines)


def test_a_node_whose_stdout_is_gone_goes_on_serving_and_leaves_cleanly(mesh):
    """Event lines to a stdout whose reader left (EPIPE; a closed terminal gives EIO) are
    lost, not fatal: the node sees the next member join, then leaves on SIGTERM, exit 0."""
    wait_converged(mesh)
    orch = mesh[0]
    proc = subprocess.Popen([sys.executable, "-m", "meshd", "run", "--role", "stage", "--stage", "1",
                             "--stages", "2", "--bind", "127.0.0.1:0", "--seed", orch.boot.addr,
                             "--profile", "local"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:  # its boot line, then it reads no more
            if BOOT_RE.match(line.rstrip("\n")):
                break
        proc.stdout.close()  # its reader is gone: every event line from now on meets EPIPE
        late = MeshProcess("stage-0.2", ["run", "--role", "stage", "--stage", "0", "--stages", "2", "--bind",
                                         "127.0.0.1:0", "--seed", orch.boot.addr, "--profile", "local"])
        try:
            late.wait_boot()
            late.wait_for(lambda line: line.startswith("meshd member join") and "name=stage-1" in line, 10,
                          "the stage-1 whose stdout is gone, seen joined")
            time.sleep(1.0)  # stage-1 prints the join of stage-0.2 into the closed pipe meanwhile
            assert proc.poll() is None, "a node must outlive the loss of its stdout"
        finally:
            late.stop(timeout=2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5.0) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _meshd(*args: str, timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bad_key_file_is_a_clear_error(tmp_path):
    key = tmp_path / "node.key"
    key.write_text("not a key\n")
    result = _meshd("run", "--role", "orchestrator", "--key-file", str(key))
    assert result.returncode == 2
    assert str(key) in result.stderr and "Traceback" not in result.stderr
    assert key.read_text() == "not a key\n", "a bad key file must never be overwritten"


def test_key_file_gives_a_stable_identity(tmp_path):
    key = tmp_path / "keys" / "node.key"
    ids = []
    for _ in range(2):
        p = MeshProcess("orchestrator", ["run", "--role", "orchestrator", "--key-file", str(key)])
        try:
            ids.append(p.wait_boot().id)
        finally:
            assert p.stop(timeout=5) == 0
    assert ids[0] == ids[1]
    assert key.stat().st_mode & 0o777 == 0o600


def test_port_in_use_is_a_clear_error():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = _meshd("run", "--role", "orchestrator", "--bind", f"127.0.0.1:{port}")
    assert result.returncode == 2
    assert f"cannot bind UDP 127.0.0.1:{port}: address already in use" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--role", "stage"], "needs --stage K and --stages N"),
        ([], "a stage (the default --role) needs --stage K and --stages N; the orchestrator takes "
             "--role orchestrator"),
        (["--key-file", ""], "argument --key-file: an empty path"),
        (["--role", "orchestrator", "--stages", "1", "--mesh-key-file", ""],
         "argument --mesh-key-file: an empty path"),
        (["--role", "stage", "--stage", "3", "--stages", "3"], "outside 0..2"),
        (["--bind", "nonsense"], "is not HOST:PORT"),
        (["--seed", "127.0.0.1:0"], "out of range"),
        (["--role", "orchestrator", "--stage", "1"], "only for --role stage"),
        (["--cpus", "1-0"], "argument --cpus: '1-0': '1-0' is not CPUs from 0 to 4095, the lower first"),
        (["--cpus", "two"], "argument --cpus: 'two' is not a CPU list"),
        (["--role", "orchestrator", "--stages", "1", "--cpus", "4095"],
         "--cpus 4095: CPU 4095 is not one this process may run on"),
    ],
)
def test_bad_run_flags_are_refused_with_a_message(args, message):
    result = _meshd("run", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_one_way_drop_never_makes_a_live_peer_dead(tmp_path):
    """stage-1's direct packets to the orchestrator are lost; indirect probes carry it.

    Without a relay, stage-1 can only join through a seed it reaches (stage-0).
    """
    procs = start_mesh(
        2,
        snapshot_dir=str(tmp_path / "snap"),
        stage_extra=lambda k, addrs: ["--fault", f"drop:{addrs[0]}", "--seed", addrs[1]] if k == 1 else [],
    )
    try:
        wait_converged(procs)
        assert procs[2].wait_for(lambda s: s.startswith("meshd faults "), 1, "faults line") == (
            f"meshd faults drop:{procs[0].boot.addr}"
        )
        # Well past the suspicion timeout (3 s at N=3 on the local profile).
        time.sleep(4 * LOCAL.suspicion_bounds(3)[0])
        dead = [line for p in procs for line in p.lines if line.startswith("meshd member dead")]
        assert dead == []
        assert all(set(p.latest_stage_map()) == {q.boot.prefix for q in procs} for p in procs)
        snap = read_snapshots(tmp_path / "snap" / f"{procs[2].boot.prefix}.jsonl")[-1]
        assert snap["counters"]["tx_fault_dropped"] > 0, "the fault must really have dropped packets"
    finally:
        for p in procs:
            p.stop(timeout=2)
