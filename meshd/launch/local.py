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
import random
import signal
import socket
import subprocess
from collections.abc import Sequence

from .process import MeshProcess

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child, before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# Where the run's ports are drawn from: below the kernel's ephemeral range, which every
# socket bound to port 0 (each node's dashboard) and every outgoing connection take ports
# from, so none of those can take a port handed out here before its node binds it.
LOW_PORT = 20000
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _port_pool() -> range | None:
    """The ports below the ephemeral range to draw from, or None to let the kernel pick."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(LOW_PORT, first) if first - LOW_PORT >= 1000 else None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free for both UDP and TCP right now, outside the ephemeral range
    where it leaves room (see LOW_PORT)."""
    pool = _port_pool()
    rng = random.Random()
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        tries = 64 * n + 256
        while len(ports) < n:
            if tries == 0:
                raise OSError(f"found {len(ports)} of {n} free ports on {host}")
            tries -= 1
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                udp.bind((host, 0 if pool is None else rng.choice(pool)))
                port = udp.getsockname()[1]
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
