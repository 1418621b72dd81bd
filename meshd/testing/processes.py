"""Real ``meshd run`` processes on loopback, for tests and the demo.

Each process's stdout is read by a thread into a list of lines, so a caller
can wait for a line with a timeout and get an error that says which node was
waited on, for what, and what it printed last.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

BOOT_RE = re.compile(
    r"^meshd node id=(?P<id>[0-9a-f]{64}) prefix=(?P<prefix>[0-9a-f]{8}) role=(?P<role>\S+) "
    r"stage=(?P<stage>\S+) addr=(?P<addr>\S+) relay=(?P<relay>\S+)$"
)
STAGE_MAP_RE = re.compile(r"^meshd stage-map((?: [0-9a-f]{8}=\S+)+)$")


def parse_stage_map(line: str) -> dict[str, str] | None:
    """``meshd stage-map a=orchestrator b=stage-0`` -> ``{"a": "orchestrator", ...}``."""
    m = STAGE_MAP_RE.match(line)
    if m is None:
        return None
    return dict(pair.split("=", 1) for pair in m.group(1).split())


@dataclass(frozen=True)
class Boot:
    id: str
    prefix: str
    role: str
    stage: str
    addr: str
    relay: str


class MeshProcess:
    def __init__(self, name: str, args: list[str], env: dict | None = None, *,
                 prefix: list[str] | None = None, preexec_fn=None) -> None:
        """``prefix`` runs the command through e.g. ``ip netns exec NS`` (which execs: same pid)."""
        self.name = name
        self.args = args
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "meshd", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            preexec_fn=preexec_fn,
        )
        self._start_reader()

    def _start_reader(self) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.boot: Boot | None = None

    def _read(self) -> None:
        for raw in self.proc.stdout:
            with self._cond:
                self.lines.append(raw.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float, what: str, start: int = 0) -> str:
        """The first line (from index ``start``) matching ``pred``, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        seen = start
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if pred(line):
                        return line
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(
                        f"{self.name} exited ({self.proc.returncode}) before printing {what}; "
                        f"last lines: {self.lines[-5:]}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self.name}: no {what} within {timeout:.0f}s; last lines: {self.lines[-5:]}"
                    )
                self._cond.wait(min(left, 0.2))

    def wait_boot(self, timeout: float = 15.0) -> Boot:
        line = self.wait_for(lambda s: BOOT_RE.match(s) is not None, timeout, "boot line")
        self.boot = Boot(**BOOT_RE.match(line).groupdict())
        return self.boot

    def latest_stage_map(self) -> dict[str, str] | None:
        with self._cond:
            for line in reversed(self.lines):
                parsed = parse_stage_map(line)
                if parsed is not None:
                    return parsed
        return None

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL if it does not go within ``timeout``; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


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
                                               "--seed", addrs[0], *common,
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
    want = {p.boot.prefix for p in procs}
    deadline = time.monotonic() + timeout
    for p in procs:
        left = max(deadline - time.monotonic(), 0.1)
        p.wait_for(
            lambda line: set((parse_stage_map(line) or {}).keys()) == want,
            left,
            f"stage map with all {len(want)} nodes",
        )
    return procs[0].latest_stage_map()
