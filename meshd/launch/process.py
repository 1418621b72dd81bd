"""One ``meshd`` child process and what it prints: the wrapper every provider starts jobs with.

Each process's stdout is read by a thread into a list of lines, so a caller
can wait for a line with a timeout and get an error that says which node was
waited on, for what, and what it printed last.  The boot line, the stage-map
line, the relay-move line and a relay's url line are parsed here, as the
contract and docs/usage.md spell them.  A restart (the
``restart:`` fault) runs the same command again in the same wrapper: its output
goes on in the same list, and waits look from where the new process began.
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
# meshd relay-move stage-1->stage-2 prefix=2b91108e from=ws://A to=ws://B (why it moved)
RELAY_MOVE_RE = re.compile(
    r"^meshd relay-move (?P<node>\S+?)->(?P<to_node>\S+) prefix=(?P<peer>[0-9a-f]{8}) "
    r"from=(?P<old>\S+) to=(?P<new>\S+) \((?P<why>.*)\)$"
)
RELAY_URL_RE = re.compile(r"^meshd relay url=(?P<url>ws://(?P<addr>\S+?))(?: |$)")


@dataclass(frozen=True)
class Boot:
    id: str
    prefix: str
    role: str
    stage: str
    addr: str
    relay: str


@dataclass(frozen=True)
class RelayMove:
    """A ``meshd relay-move`` line: the relay carrying ``node``'s frames to ``peer`` changed."""

    node: str  # the run name the printing node gives itself: orchestrator, stage-K
    to_node: str  # the peer's run name as that node knows it (``unknown`` before it has one)
    peer: str  # the peer's id prefix, 8 hex
    old: str  # the relay URL that carried the pair
    new: str  # the relay URL that carries it now
    why: str


def parse_relay_move(line: str) -> RelayMove | None:
    """The relay-move line's fields, or None for any other line."""
    m = RELAY_MOVE_RE.match(line)
    return RelayMove(**m.groupdict()) if m is not None else None


def parse_relay_url(line: str) -> str | None:
    """``meshd relay url=ws://HOST:PORT stun=...`` (a relay's first line) -> ``ws://HOST:PORT``."""
    m = RELAY_URL_RE.match(line)
    return m["url"] if m is not None else None


def parse_stage_map(line: str) -> dict[str, str] | None:
    """``meshd stage-map a=orchestrator b=stage-0`` -> ``{"a": "orchestrator", ...}``."""
    m = STAGE_MAP_RE.match(line)
    if m is None:
        return None
    return dict(pair.split("=", 1) for pair in m.group(1).split())


def parse_boot(line: str) -> Boot | None:
    """The boot line's fields, or None for any other line."""
    m = BOOT_RE.match(line)
    return Boot(**m.groupdict()) if m is not None else None


class MeshProcess:
    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None, *,
                 prefix: list[str] | None = None, preexec_fn: Callable[[], None] | None = None) -> None:
        """``prefix`` runs the command through e.g. ``ip netns exec NS`` (which execs: same pid)."""
        self.name = name
        self.args = args
        self._command = [*(prefix or []), sys.executable, "-m", "meshd", *args]
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._preexec_fn = preexec_fn
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.first_line = 0  # where the current process's output begins in ``lines``
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            self._command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=self._env,
            preexec_fn=self._preexec_fn,
        )
        self.boot: Boot | None = None
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()

    def restart(self, timeout: float = 10.0) -> None:
        """SIGKILL the process, wait until it is reaped and all it printed is read, then start the
        same command again (same arguments, environment and namespace)."""
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout)
        self._reader.join(timeout)
        with self._cond:
            self.first_line = len(self.lines)
        self._spawn()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None  # Popen was given stdout=PIPE
        for raw in proc.stdout:
            with self._cond:
                self.lines.append(raw.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float, what: str,
                 start: int | None = None) -> str:
        """The first line (from index ``start``, by default the current process's first) matching
        ``pred``, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        seen = self.first_line if start is None else start
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
        boot = parse_boot(line)
        assert boot is not None  # the line matched BOOT_RE
        self.boot = boot
        return boot

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
