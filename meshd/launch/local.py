"""The `local` provider: every job is a process on loopback.

Ports are chosen before any process starts, so a fault like
``drop:orchestrator->stage-2`` can name an address that does not exist yet,
and every node can list every other node as a seed (a node whose direct
path to the first seed is filtered still joins through another).  Children
die with us (PR_SET_PDEATHSIG) even if we are SIGKILLed, and ``stop_all``
terminates, then kills, whatever is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
from collections.abc import Sequence

from .process import MeshProcess

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child, before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free for both UDP and TCP right now."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(ports) < n:
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((host, 0))
            port = udp.getsockname()[1]
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                tcp.bind((host, port))
            except OSError:
                udp.close()
                tcp.close()
                continue
            held += [udp, tcp]
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


class LocalProcess(MeshProcess):
    """A `meshd` child that dies with us."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 prefix: list[str] | None = None) -> None:
        super().__init__(name, args, env, prefix=prefix, preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc.poll() is None


def stop_all(procs: Sequence[MeshProcess], timeout: float = 5.0) -> int:
    """SIGTERM every process, wait, SIGKILL stragglers; returns how many were still alive after."""
    for p in procs:
        p.signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(2)
    return sum(1 for p in procs if p.proc.poll() is None)
