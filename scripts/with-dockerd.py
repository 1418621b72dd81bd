#!/usr/bin/env python3
"""Run a command with a Docker engine: the one that runs, or a dockerd started just around it.

    scripts/with-dockerd.py CMD [ARG ...]      e.g. scripts/with-dockerd.py scripts/docker-e2e.sh 3

Where no engine answers and this is root with dockerd installed, it starts
``dockerd --ip-forward=false --bridge=none`` (Docker's own store, so images stay cached
between runs), runs CMD, stops that dockerd and what it started, and puts the host's firewall
back as it found it: the iptables and nftables rulesets (FORWARD's policy among them),
br_netfilter, the bridge-nf-call and forwarding sysctls. That dockerd still writes the rules
that keep an internal network's traffic in (and leaves them when it stops), but neither turns
forwarding on nor sets FORWARD's policy to DROP, and makes no default bridge: while it runs,
traffic that is not Docker's passes as before (the netns testbed's bridges, say). After it, the
tables it made are deleted and those that were there are put back as they were; what could not
be is named.

Exit: CMD's status; 3 with one line when no engine runs or can start here; 1 when the
firewall could not be put back as it was. tests/test_docker_e2e.py uses the same functions.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOCKERD_FLAGS = ["--ip-forward=false", "--bridge=none"]
START_WAIT_S = 60.0
STOP_WAIT_S = 30.0
SYSCTLS = [
    "/proc/sys/net/bridge/bridge-nf-call-iptables",
    "/proc/sys/net/bridge/bridge-nf-call-ip6tables",
    "/proc/sys/net/bridge/bridge-nf-call-arptables",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/net/ipv6/conf/all/forwarding",
]
# Packet counters change by themselves; they are not what a ruleset is.
_COUNTERS = re.compile(r"\[\d+:\d+\]|counter packets \d+ bytes \d+")


class NoEngine(Exception):
    """No Docker engine runs here and none can be started; the message says why."""


def engine_running() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _run(cmd: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)


def _normal(text: str) -> str:
    """A ruleset as compared: no comments, counters or blank lines, single spaces."""
    lines = [" ".join(_COUNTERS.sub("", line).split()) for line in text.splitlines()]
    return "\n".join(line for line in lines if line and not line.startswith("#"))


def firewall_state() -> dict[str, str | None]:
    """What dockerd may change on the host: rulesets, br_netfilter and the sysctls. Keys that
    start with ``_`` are kept to put things back, not compared."""
    state: dict[str, str | None] = {}
    for cmd in (["iptables-save"], ["ip6tables-save"], ["nft", "list", "ruleset"]):
        raw = _run(cmd).stdout if shutil.which(cmd[0]) else None
        state[" ".join(cmd)] = None if raw is None else _normal(raw)
        state["_" + cmd[0]] = raw
    modules = Path("/proc/modules").read_text() if Path("/proc/modules").exists() else ""
    loaded = Path("/sys/module/br_netfilter").exists() or "br_netfilter " in modules
    state["br_netfilter"] = "loaded" if loaded else "not loaded"
    for path in SYSCTLS:
        try:
            state[path] = Path(path).read_text().strip()
        except OSError:
            state[path] = None
    return state


def differences(before: dict[str, str | None], after: dict[str, str | None]) -> list[str]:
    return [f"{key}: {before[key]!r} before, {after.get(key)!r} now" for key in before
            if not key.startswith("_") and before[key] != after.get(key)]


_TABLE = re.compile(r"^table (\S+) (\S+) \{$", re.M)


def _nft_tables(ruleset: str) -> dict[tuple[str, str], str]:
    """``nft list ruleset`` as its tables: (family, name) -> that table's text."""
    starts = list(_TABLE.finditer(ruleset))
    ends = [m.start() for m in starts[1:]] + [len(ruleset)] * bool(starts)
    return {(m[1], m[2]): ruleset[m.start():end].strip() + "\n" for m, end in zip(starts, ends, strict=True)}


def _iptables_tables(dump: str) -> dict[str, list[str]]:
    """An iptables-save dump as its tables: name -> lines from ``*name`` to ``COMMIT``."""
    tables: dict[str, list[str]] = {}
    current: list[str] = []
    for line in dump.splitlines():
        if line.startswith("#"):
            continue
        if line.startswith("*"):
            current = tables.setdefault(line[1:], [])
        current.append(line)
    return tables


def _emptied(table: list[str]) -> list[str]:
    """The same table with no rule and no chain of its own, the built-in chains accepting."""
    builtin = [line.split()[0] for line in table if line.startswith(":") and line.split()[1] != "-"]
    return [table[0], *(f"{chain} ACCEPT" for chain in builtin), "COMMIT"]


def restore_firewall(before: dict[str, str | None]) -> list[str]:
    """Puts back what differs from ``before``; returns what still differs.

    Tables that were not there go; tables that were are put back as they were, each in one
    transaction, so a rule the host had stays and one dockerd added does not.
    """
    now = firewall_state()
    if not differences(before, now):
        return []
    for path in SYSCTLS:
        value = before[path]
        if value is not None and now[path] != value:
            try:
                Path(path).write_text(value + "\n")
            except OSError:
                pass
    if (before["br_netfilter"], now["br_netfilter"]) == ("not loaded", "loaded") and shutil.which("modprobe"):
        _run(["modprobe", "-r", "br_netfilter"])
    if before["_nft"] is not None and now["_nft"] is not None:
        had, has = _nft_tables(before["_nft"]), _nft_tables(now["_nft"])
        for family, name in sorted(set(has) - set(had)):
            _run(["nft", "delete", "table", family, name])
        for (family, name), text in sorted(had.items()):
            if (family, name) in has and _normal(has[(family, name)]) != _normal(text):
                _run(["nft", "-f", "-"], f"delete table {family} {name}\n{text}")  # all or nothing
    for save in ("iptables-save", "ip6tables-save"):  # iptables-legacy keeps its tables elsewhere
        dump = before["_" + save]
        current = _run([save]).stdout if dump is not None else None
        if current is None or _normal(current) == _normal(dump or ""):
            continue
        had_tables = _iptables_tables(dump or "")
        lines = [line for table in had_tables.values() for line in table]
        lines += [line for name, table in _iptables_tables(current).items() if name not in had_tables
                  for line in _emptied(table)]
        _run([save.replace("-save", "-restore")], "\n".join(lines) + "\n")
    return differences(before, firewall_state())


class StartedEngine:
    """A dockerd this process started, and the host's firewall as it was before."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise NoEngine("no Docker engine runs here, and only root can start one")
        dockerd = shutil.which("dockerd")
        if dockerd is None or shutil.which("docker") is None:
            raise NoEngine("no Docker engine runs here, and none is installed (apt-get install docker.io)")
        self.firewall = firewall_state()
        self.log = Path(tempfile.mkstemp(prefix="meshd-dockerd-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([dockerd, *DOCKERD_FLAGS], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_WAIT_S
        try:
            while not engine_running():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = (self.log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                    raise NoEngine(f"dockerd did not answer within {START_WAIT_S:g} s: {tail}")
                time.sleep(0.5)
        except BaseException:  # it did not answer, or a signal came meanwhile: nothing stays
            self.stop()
            raise

    def _children(self) -> list[int]:
        """Processes dockerd started (containerd and its shims), to stop them with it."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                out.append(int(stat.parent.name))
        return out

    def stop(self) -> list[str]:
        """Stops dockerd and what it started; puts the firewall back. Returns what still differs."""
        children = self._children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_WAIT_S)
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.log.unlink(missing_ok=True)
        return restore_firewall(self.firewall)


class _Stopped(Exception):
    """A signal came before the command ran: stop what was started, run nothing."""


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    proc: subprocess.Popen | None = None

    def on_signal(signum: int, frame: object) -> None:
        if proc is None:  # still starting dockerd: stop it, and the firewall goes back
            raise _Stopped(signal.Signals(signum).name)
        proc.send_signal(signum)  # the command's to handle; we stop dockerd when it ends

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = None
    try:
        if not engine_running():
            try:
                engine = StartedEngine()
            except NoEngine as exc:
                print(f"with-dockerd: {exc}; nothing was run", file=sys.stderr)
                return 3
            print(f"with-dockerd: started dockerd {' '.join(DOCKERD_FLAGS)} (pid {engine.proc.pid}) for "
                  "this command", file=sys.stderr)
        try:
            proc = subprocess.Popen(argv)
        except OSError as exc:
            print(f"with-dockerd: cannot run {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 127
        rc = proc.wait()
    except _Stopped as exc:
        print(f"with-dockerd: {exc} before the command ran; nothing was run", file=sys.stderr)
        rc = 143 if str(exc) == "SIGTERM" else 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not skip the restore
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if engine is not None:
            left = engine.stop()
            for line in left:
                print(f"with-dockerd: the firewall differs from before dockerd: {line}", file=sys.stderr)
            if not left:
                print("with-dockerd: stopped dockerd; the host's firewall is as it was", file=sys.stderr)
            else:
                rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
