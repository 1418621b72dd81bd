"""`meshd run` on a dstack multi-node task: role, stage count and seed from dstack's environment.

dstack gives every node of a task ``DSTACK_NODE_RANK`` (0 is the master), ``DSTACK_NODES_NUM``
and ``DSTACK_MASTER_NODE_IP`` (and ``DSTACK_NODES_IPS``, one a line, by rank). meshd's mapping:

    rank 0      orchestrator; also runs the relay (docker/dstack.yml starts it)
    rank K + 1  stage K of ``DSTACK_NODES_NUM - 1`` stages, seeded through the master

Flags always win: only what the command line left out is filled in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..net.udp import format_addr

GOSSIP_PORT = 7946
RELAY_PORT = 3478
DEFAULT_BIND = "127.0.0.1:0"


@dataclass(frozen=True)
class DstackNode:
    role: str
    stage: int | None
    stages: int
    seeds: list[str] = field(default_factory=list)
    relay: str | None = None
    bind: str = f"0.0.0.0:{GOSSIP_PORT}"
    advertise: str | None = None


def from_env(env: Mapping[str, str]) -> DstackNode | None:
    """The node dstack's variables describe, or None outside dstack; ValueError names a bad one."""
    if "DSTACK_NODE_RANK" not in env:
        return None

    def number(key: str, low: int) -> int:
        try:
            value = int(env[key])
        except KeyError:
            raise ValueError(f"{key} is not set (DSTACK_NODE_RANK is)") from None
        except ValueError:
            raise ValueError(f"{key}={env[key]!r} is not a whole number") from None
        if value < low:
            raise ValueError(f"{key}={value} must be at least {low}")
        return value

    rank, nodes = number("DSTACK_NODE_RANK", 0), number("DSTACK_NODES_NUM", 2)
    if rank >= nodes:
        raise ValueError(f"DSTACK_NODE_RANK={rank} is outside 0..{nodes - 1}")
    master = _bare_host(env.get("DSTACK_MASTER_NODE_IP", "").strip())
    if not master:
        raise ValueError("DSTACK_MASTER_NODE_IP is not set")
    ips = [_bare_host(ip) for ip in env.get("DSTACK_NODES_IPS", "").split()]
    advertise = None
    if len(ips) == nodes:
        advertise = format_addr(ips[rank], GOSSIP_PORT)
    relay = f"ws://{format_addr(master, RELAY_PORT)}"  # an IPv6 master in brackets
    seed = format_addr(master, GOSSIP_PORT)
    if rank == 0:
        return DstackNode("orchestrator", None, nodes - 1, [], relay, advertise=advertise or seed)
    return DstackNode("stage", rank - 1, nodes - 1, [seed], relay, advertise=advertise)


def _bare_host(text: str) -> str:
    """An address without the brackets an IPv6 one may come in (``[fd00::5]``): ``format_addr``
    adds them where a port follows, and a second pair makes a URL nothing can parse."""
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def apply(args, env: Mapping[str, str]) -> None:
    """Fill the `meshd run` flags left out (role, stage, stages, seed, relay, bind) from dstack's env."""
    node = from_env(env)
    if node is None:
        if args.role is None:
            args.role = "stage"
        return
    if args.role is None:
        args.role = node.role
        if args.stage is None:
            args.stage = node.stage
    if args.stages is None:
        args.stages = node.stages
    if not args.seed:
        args.seed = list(node.seeds)
    if not args.relay and node.relay is not None:
        args.relay = [node.relay]
    if args.bind == DEFAULT_BIND:
        args.bind = node.bind
        if args.advertise is None:
            args.advertise = node.advertise
