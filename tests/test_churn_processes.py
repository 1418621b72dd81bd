"""Churn with real ``meshd run`` processes on loopback (``--stub``): a stage or the
orchestrator killed or stopped and started again, with a new identity or its own key,
serves the next request with the same tokens; a replica stopped while requests run
back to back costs none of them; ``meshd doctor`` says when the pipeline cannot serve.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from meshd.launch.process import MeshProcess

pytestmark = pytest.mark.processes

PROMPT = "the quick brown fox"
SERVE_WITHIN_S = 10.0  # the bound: from the new node's boot line to a 200


def _dashboard(p: MeshProcess) -> str:
    line = p.wait_for(lambda s: s.startswith("meshd dashboard url="), 15, "dashboard url")
    return line.split()[2].split("=", 1)[1]


class Run:
    """An orchestrator and stages, each a ``meshd run --stub`` with its own key file."""

    def __init__(self, tmp: Path, stages: int = 3) -> None:
        self.tmp, self.stages = tmp, stages
        self.procs: list[MeshProcess] = []
        self.orch = self.node("orchestrator", ["--role", "orchestrator"], seeds=[])
        self.seed = self.orch.wait_boot().addr
        self.url = _dashboard(self.orch)

    def node(self, name: str, role: list[str], key: str | None = None, seeds: list[str] | None = None
             ) -> MeshProcess:
        key_file = self.tmp / f"{key or name}.key"
        args = ["run", *role, "--stages", str(self.stages), "--stub", "--profile", "local",
                "--bind", "127.0.0.1:0", "--key-file", str(key_file),
                *(f"--seed={s}" for s in (seeds if seeds is not None else [self.seed]))]
        p = MeshProcess(name, args)
        self.procs.append(p)
        p.wait_boot()
        return p

    def stage(self, k: int, key: str | None = None) -> MeshProcess:
        return self.node(f"stage-{k}", ["--role", "stage", "--stage", str(k)], key)

    def generate(self, max_tokens: int = 12, timeout: float = 30) -> httpx.Response:
        return httpx.post(f"{self.url}/api/generate", json={"prompt": PROMPT, "max_tokens": max_tokens},
                          timeout=timeout)

    def served_within(self, want: list[int], seconds: float) -> float:
        """Seconds until /api/generate answers 200 with ``want``; fails past ``seconds``."""
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < seconds:
            try:
                last = self.generate(timeout=max(0.5, seconds - (time.monotonic() - t0)))
            except httpx.HTTPError as exc:
                last = exc
            if isinstance(last, httpx.Response) and last.status_code == 200:
                assert last.json()["tokens"] == want
                return time.monotonic() - t0
            time.sleep(0.1)
        text = last.text if isinstance(last, httpx.Response) else repr(last)
        logs = "\n".join(f"--- {p.name}\n" + "\n".join(p.lines[-25:]) for p in self.procs)
        raise AssertionError(f"not served within {seconds:g}s; last answer: {text}\n{logs}")

    def doctor(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "meshd", "doctor", self.url], capture_output=True,
                              text=True, timeout=30)

    def doctor_says_ok(self, seconds: float = 30) -> None:
        """Doctor exits 0 within ``seconds``: once the replaced node is declared dead and the
        new one's path summary has arrived, nothing is wrong."""
        deadline = time.monotonic() + seconds
        while (out := self.doctor()).returncode != 0:
            assert time.monotonic() < deadline, out.stdout
            time.sleep(0.5)

    def close(self) -> None:
        for p in self.procs:
            p.stop(timeout=3)


@pytest.fixture
def run(tmp_path):
    runs: list[Run] = []

    def make(stages: int = 3) -> Run:
        runs.append(Run(tmp_path, stages))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def _ready(run: Run) -> list[int]:
    """The first answer of a settled run: the tokens every later answer must equal."""
    t0 = time.monotonic()
    while True:
        r = run.generate()
        if r.status_code == 200:
            return r.json()["tokens"]
        assert time.monotonic() - t0 < 30, r.text
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["kill, new identity", "term, same key"])
def test_a_stage_started_again_serves_the_next_request(run, how):
    r = run()
    stages = [r.stage(k) for k in range(3)]
    want = _ready(r)
    old = stages[1]
    if how == "kill, new identity":
        old.signal(signal.SIGKILL)
        old.proc.wait(5)
        new = r.stage(1, key="stage-1-new")  # boot line printed: the clock starts
        assert new.boot.id != old.boot.id
    else:
        assert old.stop(timeout=10) == 0
        new = r.stage(1)  # the same key file: the same node id, a new process
        assert new.boot.id == old.boot.id
    r.served_within(want, SERVE_WITHIN_S)
    r.doctor_says_ok()


def test_the_orchestrator_restarted_with_a_seed_serves_the_next_request(run):
    r = run()
    stages = [r.stage(k) for k in range(3)]
    want = _ready(r)
    r.orch.signal(signal.SIGKILL)
    r.orch.proc.wait(5)
    r.orch = r.node("orchestrator-2", ["--role", "orchestrator"], key="orchestrator",
                    seeds=[stages[0].boot.addr])
    r.url = _dashboard(r.orch)
    r.served_within(want, SERVE_WITHIN_S)


def test_doctor_names_the_stage_that_cannot_serve_and_clears_when_it_is_back(run):
    r = run()
    stages = [r.stage(k) for k in range(3)]
    _ready(r)
    r.doctor_says_ok()  # once every node's path summary has arrived
    stages[2].signal(signal.SIGKILL)
    stages[2].proc.wait(5)
    deadline = time.monotonic() + 30  # suspect first (it may refute), then dead: not ready
    while not (out := r.doctor()).stdout.startswith("not ready"):
        assert time.monotonic() < deadline, out.stdout
        time.sleep(0.5)
    assert out.returncode == 1 and "stage-2" in out.stdout.split("Why", 1)[1], out.stdout
    assert r.generate().status_code == 503
    r.stage(2, key="stage-2-new")
    r.doctor_says_ok()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_stopping_a_stage_0_replica_mid_request_fails_none_of_50_requests(run, sig):
    import threading

    r = run(stages=2)
    replicas = [r.stage(0), r.stage(0, key="stage-0b")]
    r.stage(1)
    _ready(r)
    # Long enough to be seen running: the orchestrator hears a request's tokens after the
    # first in batches of up to 20 ms, and a short one on the stub can end inside one.
    tokens = 96
    want = r.generate(max_tokens=tokens).json()["tokens"]
    deadline = time.monotonic() + 20
    while len(httpx.get(f"{r.url}/api/snapshot", timeout=5).json()["names"]["pp-stage-0"]["live"]) < 2:
        assert time.monotonic() < deadline, "the second replica never joined the live set"
        time.sleep(0.2)
    answers: list[httpx.Response | Exception] = []

    def back_to_back() -> None:
        for _ in range(50):
            try:
                answers.append(r.generate(max_tokens=tokens))
            except httpx.HTTPError as exc:
                answers.append(exc)

    worker = threading.Thread(target=back_to_back)
    worker.start()
    try:
        # Once 10 have been served, stop the replica serving the request in flight.
        victim = None
        deadline = time.monotonic() + 60
        while victim is None:
            assert time.monotonic() < deadline, f"none in flight to stop a replica ({len(answers)} served)"
            running = httpx.get(f"{r.url}/api/requests", timeout=5).json()["requests"]
            if len(answers) >= 10 and running and running[0]["tokens"] >= 2:
                prefix = running[0]["route"]["stage-0"]
                victim = next(p for p in replicas if p.boot.prefix == prefix)
                victim.signal(sig)
            time.sleep(0.005)
    finally:
        worker.join(300)
    bad = [a if isinstance(a, Exception) else a.text for a in answers
           if isinstance(a, Exception) or a.status_code != 200 or a.json()["tokens"] != want]
    assert len(answers) == 50 and bad == []


def test_a_second_run_with_the_same_key_file_on_one_host_is_refused_at_start(run, tmp_path):
    r = run(2)
    first = r.stage(1)
    second = subprocess.run(
        [sys.executable, "-m", "meshd", *first.args], capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stdout + second.stderr
    assert (f"another meshd run (pid {first.proc.pid}) uses the key file {tmp_path / 'stage-1.key'}"
            in second.stderr), second.stderr
    assert "Traceback" not in second.stderr
    assert first.proc.poll() is None, "the running process is untouched"


def test_a_twin_with_a_copy_of_the_key_stops_and_the_first_keeps_serving(run, tmp_path):
    """The same key file copied to a second host: the process started later gives the node id
    up and exits with an error naming the first one's address; the first serves on."""
    r = run(2)
    r.stage(0)
    first = r.stage(1)
    want = _ready(r)
    (tmp_path / "copy.key").write_bytes((tmp_path / "stage-1.key").read_bytes())
    twin = r.node("stage-1 copy", ["--role", "stage", "--stage", "1"], key="copy")
    assert twin.proc.wait(timeout=60) == 2, "\n".join(twin.lines)
    said = "\n".join(twin.lines)
    assert (f"another process runs as stage-1 (node {first.boot.prefix}, the same key) at "
            f"{first.boot.addr}") in said, said
    assert "it keeps the node id" in said and "Traceback" not in said, said
    line = first.wait_for(lambda s: s.startswith("meshd twin "), 10, "the twin line")
    assert f"other_addr={twin.boot.addr}" in line and "keep=yes" in line, line
    assert first.proc.poll() is None
    r.served_within(want, 30)
    doctor = subprocess.run([sys.executable, "-m", "meshd", "doctor", _dashboard(first)],
                            capture_output=True, text=True, timeout=30)
    assert doctor.returncode != 0, doctor.stdout
    assert "another process signs as stage-1" in doctor.stdout, doctor.stdout
    assert f"stop the one at {twin.boot.addr}" in doctor.stdout.replace("\n", " "), doctor.stdout


def test_a_stage_started_for_another_split_is_not_routed_to_and_doctor_says_why(run):
    r = run()
    r.stage(0), r.stage(2)
    r.stages = 2  # stage-1 of a 2-stage split: other layers under the same stage number
    odd = r.node("stage-1-split", ["--role", "stage", "--stage", "1"])
    r.stages = 3
    split = "runs a 2-stage split (--stages 2), but this run has 3 stages"
    why = f"{odd.boot.prefix} {split}"
    deadline = time.monotonic() + 30
    while not ((answer := r.generate()).status_code == 503 and f"({odd.boot.prefix}) {split}" in answer.text):
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.3)
    out = r.doctor()
    assert out.returncode == 1 and f"stage-1: {why}" in out.stdout, out.stdout
    r.stage(1)  # a replica of this run's split: it serves, the other stays unused
    _ready(r)
    out = r.doctor()
    assert f"stage-1: {why}; not used" in out.stdout, out.stdout
