"""What a service sees of the mesh: the one interface the pipeline and the dashboard use.

The services never reach into the node's protocol objects: they resolve
names, look members up by run name, move bytes over the data channel, and
read the node's snapshot, through :class:`Mesh`.  ``meshd.node.Node``
implements it; tests may give a service any object that does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """One member as a service needs it: who, under which run name, in which state."""

    id: bytes
    prefix: str
    name: str  # "orchestrator" or "stage-K"
    state: str  # "alive", "suspect", "dead" or "left"
    epoch: int = 0  # its process: a new epoch under the same id is a restart
    checkpoint: str = ""  # fingerprint of the checkpoint it serves
    draining: bool = False  # leaving: takes no new requests
    changed: float = 0.0  # when its state last changed (trio time)
    stages: int | None = None  # the stage count it was started with (--stages); None: not said

    @property
    def live(self) -> bool:
        return self.state in ("alive", "suspect")


Handler = Callable[[bytes, bytes], Awaitable[None]]


class Mesh(Protocol):
    @property
    def node_id(self) -> bytes: ...

    @property
    def name(self) -> str:
        """Our own run name: ``orchestrator`` or ``stage-K``."""
        ...

    def resolve(self, name: str) -> bytes | None:
        """The live owner of a registered name (``pp-stage-1``), or None."""
        ...

    def member(self, name: str) -> MemberInfo | None:
        """The live member with this run name (``stage-1``), or None."""
        ...

    def member_by_id(self, node: bytes) -> MemberInfo | None:
        """What we know of ``node`` (ourselves included), in any state; None for a stranger."""
        ...

    def owners(self, name: str) -> list[MemberInfo]:
        """The live set of a registered name: its owners alive or suspect (replicas when
        more than one), alive first."""
        ...

    def rtt(self, node: bytes) -> float | None:
        """Our last measured round trip to ``node`` in seconds, or None."""
        ...

    def members(self) -> list[MemberInfo]:
        """Every member we know of, ourselves excluded, in any state."""
        ...

    def register_name(self, name: str) -> None: ...

    def set_draining(self) -> None:
        """Say we are leaving soon: our names are withdrawn (tombstoned) and our metadata
        says ``draining``, so no new request picks us."""
        ...

    def peer_down(self, node: bytes) -> bool:
        """Whether ``node``'s process looks gone: a data stream with it ended and its port
        refused a dial since (known in a round trip, before failure detection says so)."""
        ...

    def report_down(self, node: bytes, epoch: int, *, seen_here: bool = False,
                    no_path_from: bytes | None = None) -> None:
        """``node``'s process ``epoch`` looks gone to a node that sends to it (a stage whose
        sends failed, or the orchestrator, which saw its stream end and a dial refused) before
        failure detection says so: no new request is routed to it, and the snapshot (so
        readiness) says why, for ``REPORTED_DOWN_S`` or until another process replaces it.
        ``seen_here``: this node's own stream ended, so a stream it proves again clears it.
        ``no_path_from``: that node found no path to ``node``, alive: the report holds while
        the mesh sees that direction with no path, and ends once a path carries it again."""
        ...

    def reported_down(self, node: bytes) -> bool:
        """Whether ``node``'s current process was reported down lately (``report_down``), so no
        new request goes to it.  A report of one direction with no path does not count while
        another node of the sender's stage has a path to ``node``."""
        ...

    def no_path_report(self, node: bytes) -> tuple[bytes, float] | None:
        """(the node that found no path to ``node``, when: trio time) while a report of such a
        direction holds for ``node``'s current process; None otherwise."""
        ...

    def down_since(self, node: bytes) -> float | None:
        """When ``node`` started to look down (trio time), or None."""
        ...

    def peer_epoch(self, node: bytes) -> int | None:
        """The process of ``node`` our data with it is sealed for now (the last one a stream
        handshake proved or its signed metadata said); None before either."""
        ...

    def probe_soon(self, node: bytes) -> None:
        """Have failure detection probe ``node`` next (a request through it stalls)."""
        ...

    def describe(self, node: bytes) -> str:
        """``stage-2 (2b91108e)``: how logs and errors name a peer."""
        ...

    async def send(self, node: bytes, data: bytes, timeout: float) -> str:
        """Deliver ``data`` and wait for its ack; returns the path that carried it."""
        ...

    async def post(self, node: bytes, data: bytes, timeout: float,
                   on_error: Callable[[Exception], Awaitable[None]] | None = None) -> Any:
        """Write ``data`` towards ``node`` without waiting for its ack; ``on_error`` hears of a
        failure to deliver it within ``timeout``."""
        ...

    async def loopback(self, data: bytes) -> None:
        """Hand ``data`` to our own ``dispatch`` handler, as if a peer had sent it."""
        ...

    async def dispatch(self, handler: Handler, *, inline: bool = False) -> None:
        """Hand every data-channel message to ``handler(sender, data)`` until cancelled."""
        ...

    def path(self, node: bytes) -> str:
        """The path our data to ``node`` takes now: ``direct`` or ``relay``."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """The JSON view of the node (what the snapshot dumper writes)."""
        ...

    def join(self, addrs: list[str]) -> None:
        """Join (again) through ``addrs`` (HOST:PORT each)."""
        ...

    def change_keyring(self, op: str, key: str) -> dict[str, Any]:
        """Change the mesh keyring here and on every member: ``install`` the key ``key``
        (base64), ``use`` or ``remove`` the key ``key`` (the key or its id).  Returns what was
        done; raises ``meshd.keyring.KeyringError`` saying why it cannot be."""
        ...
