"""The mesh runtime: one trio nursery that drives the SWIM core over UDP and the relay,
the per-direction path table and the data channel.

Services (the pipeline, the dashboard) see it through :class:`meshd.mesh.Mesh`,
which :class:`Node` implements; ``meshd.daemon`` builds a node and the services
of a role.  Shutdown is a graceful SWIM leave followed by cancelling the nursery.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from . import __version__
from . import memory as node_memory
from .identity import Identity
from .keyring import Keyring
from .logs import Quieted
from .mesh import Handler, MemberInfo
from .net.amplification import AmplificationGuard
from .net.channel import DataChannel
from .net.faults import Faults
from .net.path_table import NONE, RELAY, UNKNOWN, VOUCHED_ONLY, PathTable
from .net.udp import MAX_DATAGRAM, AddressError, format_addr, open_udp_and_tcp, parse_addr
from .relay.client import RelayClient
from .relay.pool import Move, RelayPool
from .rotation import KeyRotation
from .snapshot import SnapshotWriter, snapshot, stage_sort_key
from .swim import PROFILES, EventKind, State, Swim
from .swim.facts import SignedFacts
from .swim.state import Member
from .swim.twin import Twin
from .wire import (
    RELAY_DATA,
    Ack,
    Meta,
    Nack,
    Packet,
    Ping,
    Punch,
    PunchAck,
    PushPull,
    WireError,
    encode,
    next_counter,
    packet_sender,
)

log = logging.getLogger("meshd.node")

# Where a packet came over the relay from a node we do not know yet.
RELAY_ADDR_PREFIX = "relay:"

# After a leave, how long to keep answering and re-sending before we go.
LEAVE_LINGER_S = 0.3

# Our outbound path summary is gossiped when a path changes, and at least this often.
PATH_SUMMARY_CHECK_S = 0.5
PATH_SUMMARY_REFRESH_S = 5.0

@dataclass(frozen=True, slots=True)
class _DownReport:
    """A report that a member's process is down (``Node.report_down``)."""

    epoch: int  # the process reported
    when: float  # time.monotonic() then
    seen_here: bool  # our own stream with it ended (not a stage's word)
    no_path_from: bytes | None  # the node that found no path to it (it being alive), if that is the report
    at: float  # trio time then (the clock paths are timed by)


class TwinError(Exception):
    """Another process runs under our node id, started before us: it keeps the id."""


def start_incarnation() -> int:
    """Where a process's incarnation starts: the clock in milliseconds.  An earlier process
    under our key counted up from its own start by one per refutation, a few a minute at
    most, so it ends far below ours: a recorded word of it, replayed, is older than ours
    and can neither be refuted nor pass for a live twin's answer (swim/twin.py)."""
    return time.time_ns() // 1_000_000


def _when(started: int) -> str:
    """A process's start time (seconds since 1970) as UTC text; "at an unknown time" for 0."""
    if not started:
        return "at an unknown time"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))


# What failure detection needs, sent bare even past an unproven address's budget.
PROBES = (Ping, Ack, Nack, Punch, PunchAck)  # one small packet each, at the protocol's own pace

# Push-pull answers held for addresses that have not proven themselves yet.
MAX_HELD_ANSWERS = 64

# A handler's unexpected error is logged with its traceback this many times, then counted only.
MAX_LOGGED_HANDLER_ERRORS = 20
# A process a stage reported down is not routed to for this long, unless a new one replaces
# it; past it failure detection has had its say, and the member is as it says.  A report of
# a direction with no path (``report_down(no_path_from=...)``) holds instead as long as the
# mesh sees that direction with no path, and ends when a path carries it again.
REPORTED_DOWN_S = 30.0
MAX_SEND_FAILURES = 64  # addresses whose last send failed, remembered to say why a join waits
MAX_REPORTED_DOWN = 1024

# A join no seed answered within this long (or this many probe timeouts, if longer) is said
# in a log line, again at twice the wait each time, and the relays are asked for members.
JOIN_QUIET_S = 3.0
JOIN_QUIET_PROBES = 3
JOIN_POLL_S = 0.25
# Relay payloads that delay:/loss: faults may hold at once; past it, senders wait.
RELAY_HELD_MAX = 4096

# Members a joiner asks in at once through a relay's peer list.
JOIN_VIA_RELAY = 4

# The state file is rewritten at most this often, and only when what it holds changed.
MEMORY_SAVE_INTERVAL_S = 1.0

# Packets that do not open with our mesh key: one log line per source this often at most,
# and this many sources remembered for it (spoofed sources must not grow it without bound).
UNSEALED_LOG_INTERVAL_S = 60.0
MAX_UNSEALED_SOURCES = 1024


@dataclass
class NodeOptions:
    role: str = "stage"
    stage: int | None = None
    stages: int | None = None
    bind: str = "127.0.0.1:0"
    advertise: str | None = None
    seeds: list[str] = field(default_factory=list)
    profile: str = "lan"
    snapshot_dir: str | None = None
    snapshot_interval: float = 5.0
    faults: Faults = field(default_factory=Faults)
    relay: str | None = None  # home relay URL, ws://HOST:PORT: the first of ``relays``
    relays: list[str] = field(default_factory=list)  # every relay this node holds (--relay, repeated)
    # Read by the daemon, which starts the services of this node's role:
    model: str | None = None  # checkpoint dir: this node serves its share of the pipeline
    max_batch: int = 16  # a stage's decode steps per forward pass (--max-batch; 1: no batching)
    max_running: int = 64  # the orchestrator's requests running at once (--max-running)
    max_queued: int = 256  # and waiting for a slot; past it, 503 with Retry-After (--max-queued)
    kv_budget_mb: int = 1024  # KV cache per stage, MiB (--kv-budget-mb)
    poll_ms: float = 0.0  # a stage polls this long after each message instead of sleeping (--poll-ms)
    dashboard: str | None = None  # HOST:PORT for the HTTP app; None = no dashboard
    checkpoint: str = ""  # fingerprint of the checkpoint this node serves (set by the daemon)
    # Beside the key file: the members we knew and our name clock, for the next restart
    # (see meshd.memory); None remembers nothing.
    state_file: str | None = None
    # Node ids that may claim stage names (``--allow-nodes``); None lets every member.
    allow_nodes: frozenset[bytes] | None = None
    # The mesh key: every datagram and relay payload is sealed with it, and what does not
    # open is dropped unread.  None (--insecure, or on loopback) sends packets as they are.
    mesh_key: Keyring | None = None
    mesh_key_file: str | None = None  # where a rotation saves the ring, so a restart has it

    def __post_init__(self) -> None:
        urls = [self.relay] if self.relay else []
        self.relays = list(dict.fromkeys([*urls, *self.relays]))
        self.relay = self.relays[0] if self.relays else None

    @property
    def name(self) -> str:
        """This node's run name: ``orchestrator`` or ``stage-K``."""
        return f"stage-{self.stage}" if self.role == "stage" and self.stage is not None else self.role

    def names(self) -> list[str]:
        """Registry names this node owns."""
        if self.role == "orchestrator":
            return ["pp-orchestrator"]
        out = [f"pp-stage-{self.stage}"]
        if self.stage == 0:
            out.append("pp-entry")
        if self.stages is not None and self.stage == self.stages - 1:
            out.append("pp-exit")
        return out


def _info(m: Member) -> MemberInfo:
    return MemberInfo(m.id, m.prefix, m.name, m.state.name.lower(), m.meta.epoch, m.meta.checkpoint,
                      m.meta.draining, m.state_change, m.meta.stages)


class _Infos:
    """Each member's MemberInfo, made again only once its state, metadata or time of change
    moved: the services ask for a route's members at every message they handle."""

    def __init__(self) -> None:
        self._made: dict[bytes, tuple[State, Meta, float, MemberInfo]] = {}

    def of(self, m: Member, known: int) -> MemberInfo:
        """``m``'s info; ``known``: how many members the table holds (bounds what is kept)."""
        held = self._made.get(m.id)
        if held is not None and held[0] is m.state and held[1] is m.meta and held[2] == m.state_change:
            return held[3]
        if len(self._made) > 2 * known + 64:  # of members reaped since
            self._made.clear()
        info = _info(m)
        self._made[m.id] = (m.state, m.meta, m.state_change, info)
        return info


class Node:
    def __init__(
        self,
        identity: Identity,
        options: NodeOptions,
        out: Callable[[str], None] | None = None,
    ) -> None:
        self.identity = identity
        self.options = options
        self.out = out or _print_line
        self.swim: Swim | None = None
        self.addr: str | None = None
        self._sock: trio.socket.SocketType | None = None
        self._wake = trio.Event()
        self._twin_kept = trio.Event()  # a twin started before us keeps our id: we stop
        self._last_map: str | None = None
        self._snapshots: SnapshotWriter | None = None
        self._nursery: trio.Nursery | None = None
        self.paths = PathTable()
        self._infos = _Infos()
        self.guard = AmplificationGuard()
        # Push-pull answers cut to fit an unproven address's budget, whole, to send once it
        # proves itself (answers our ping); oldest dropped first.
        self._held_answers: dict[str, bytes] = {}
        self._handler_errors_logged = 0
        self._reported_down: dict[bytes, _DownReport] = {}
        self._memory = node_memory.NodeMemory()  # as loaded, then as last saved
        self._memory_error: str | None = None  # the last save error, logged once
        self._memory_lock = trio.Lock()  # the loop and leave() write the same file
        # Changed in place by a rotation, so every holder (the relay client) sees the change.
        self.mesh_key = options.mesh_key
        self._unsealed = Quieted(UNSEALED_LOG_INTERVAL_S, MAX_UNSEALED_SOURCES)  # logged per source
        self._join_watched = False  # a task watches the join under way
        self._join_said = False  # the log said no seed answers: our status says so too
        self._send_failed: dict[str, str] = {}  # address -> why our last datagram there was not sent
        self._join_started = 0.0
        # Relay payloads held back by delay:/loss: faults, and when the last one is due.
        self._relay_held: trio.MemorySendChannel[tuple[float, bytes, bytes]] | None = None
        self._relay_due = 0.0
        self._asked_via_relay: set[bytes] = set()  # members asked to let us in over a relay
        self.rotation = KeyRotation(self)
        self.relays: RelayPool | None = None
        if options.relays:
            self.relays = RelayPool(options.relays, identity, mesh_key=self.mesh_key,
                                    on_move=self._relay_moved, blocked=options.faults.relay_blocked)
        self._listeners: list[trio.SocketListener] | None = None
        self.data = DataChannel(
            identity.node_id,
            addr_of=self._addr_of,
            describe=self.describe,
            relay_send=self._relay_send if self.relays is not None else None,
            relay_reaches=self._relay_reaches,
            datagram_path=self.paths.out_path,
            punched_addr=self._punched_addr,
            datagram_send=self._send_datagram,
            sign=identity.sign,
            faults=options.faults,
            keyring=self.mesh_key,
            member=self._is_member,
        )

    # ---------------------------------------------------------------- serve

    async def bind(self) -> None:
        """Open the gossip socket and the data listener; raises BindError naming the address."""
        if self._sock is None:
            self._sock, self._listeners = await open_udp_and_tcp(self.options.bind)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled; reports the bound gossip address via task_status."""
        opts = self.options
        await self.bind()
        with self._socket as sock:
            host, port = sock.getsockname()[:2]
            self.addr = opts.advertise or format_addr(host, port)
            self.candidates = [self.addr]
            nat = ""
            if self.relays is not None:
                reflexive, nat = await self._stun()
                if reflexive is not None and reflexive not in self.candidates:
                    self.candidates.append(reflexive)
            meta = Meta(
                role=opts.role,
                stage=opts.stage,
                stages=opts.stages,
                addrs=tuple(self.candidates),
                relay_url=opts.relay,
                relays=tuple(opts.relays),
                version=__version__,
                epoch=self.data.epoch,
                dh=self.data.public_key,
                checkpoint=opts.checkpoint,
                keyring=tuple(self.mesh_key.ids) if self.mesh_key is not None else (),
                nat=nat,
                started=int(time.time()),
            )
            now = trio.current_time()
            self.swim = swim = Swim(
                self.identity.node_id, self.addr, meta, PROFILES[opts.profile], random.Random(), now,
                facts=SignedFacts(self.identity), allow_nodes=opts.allow_nodes,
                incarnation=start_incarnation(),
            )
            self.out(
                f"meshd node id={self.identity.node_id.hex()} prefix={self.identity.prefix} "
                f"role={opts.role} stage={'-' if opts.stage is None else opts.stage} "
                f"addr={self.addr} relay={opts.relay or '-'}"
            )
            if len(opts.relays) > 1:
                self.out(f"meshd relays {' '.join(opts.relays)}")
            self.out(f"meshd candidates {' '.join(self.candidates)}")
            if self.mesh_key is not None:
                self.out(f"meshd mesh-key keys={','.join(self.mesh_key.ids)}")
            if opts.faults.active:
                self.out(f"meshd faults {' '.join(opts.faults.describe())}")
            if opts.state_file:
                self._memory = node_memory.load(opts.state_file)
                if self._memory.name_clock:
                    # Our claims must beat what our last process left in the registry: its
                    # claims, and the tombstones the others wrote for them one past its clock.
                    clock = next_counter(self._memory.name_clock)
                    swim.registry.own_clock = max(swim.registry.own_clock, clock)
            # Our names go out with the join's push-pull.  A service that serves them was
            # built before this (the daemon loads the model first); anything a peer sends it
            # before its handler runs waits in the data channel's queue.
            refused = [name for name in opts.names() if not swim.may_hold(name)]
            if refused:
                log.warning("this node (id %s) is not in its --allow-nodes list: every node that "
                            "reads that list ignores its claim on %s, so it serves nothing; add the "
                            "id to the list of every node", self.identity.node_id.hex(), ", ".join(refused))
            for name in opts.names():
                swim.register_name(name, now)
            swim.anchors = tuple(opts.seeds)  # asked back while nobody answers there
            if opts.seeds:
                swim.join(opts.seeds, now)
            else:
                self._rejoin_remembered(now)
            if opts.snapshot_dir:
                self._snapshots = SnapshotWriter(opts.snapshot_dir, self.identity.prefix)
            self._after()
            await self._flush()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._watch_join()
                if self.relays is not None:
                    await nursery.start(self.relays.run)
                    for client in self.relays.clients:
                        nursery.start_soon(self._relay_receive_loop, client)
                listeners = self._listeners or []
                # Closed when we stop, as a process's are when it exits: a peer's next dial is
                # refused at once, which is how it learns we are gone (DataChannel.is_down).
                nursery.start_soon(_close_on_exit, listeners)
                await nursery.start(self.data.serve, listeners)
                nursery.start_soon(self._receive_loop)
                nursery.start_soon(self._timer_loop)
                if self.relays is not None and opts.faults.stream_faults:
                    held_send, held = trio.open_memory_channel[tuple[float, bytes, bytes]](RELAY_HELD_MAX)
                    self._relay_held, self._relay_due = held_send, 0.0
                    nursery.start_soon(self._relay_held_loop, held)
                nursery.start_soon(self._path_summary_loop)
                if self.mesh_key is not None:
                    nursery.start_soon(self.rotation.resend_loop)
                if self._snapshots is not None:
                    nursery.start_soon(self._snapshot_loop)
                if opts.state_file:
                    nursery.start_soon(self._memory_loop)
                nursery.start_soon(self._stop_for_twin)
                task_status.started(self.addr)

    async def _stop_for_twin(self) -> None:
        """End the node when a twin that started first keeps our id (swim/twin.py)."""
        await self._twin_kept.wait()
        twin = self.core.twins.yielded
        assert twin is not None
        raise TwinError(
            f"another process runs as {self.core.me.name} (node {self.identity.prefix}, the same key) "
            f"at {twin.addr}, started {_when(twin.started)}, before this one; it keeps the node id. "
            "Stop it first, or give this node a key file of its own (--key-file)")

    def _rejoin_remembered(self, now: float, seeds: tuple[str, ...] = ()) -> bool:
        """Join through the members the state file remembers (a restarted seed, or a node
        whose ``seeds`` do not answer: kept, and asked on with them).  Whether any was."""
        addrs = [a for a in self._memory.addrs(self.identity.node_id, self.core.me.addr) if a not in seeds]
        if addrs:
            self.out(f"meshd rejoin trying {len(addrs)} remembered members from {self.options.state_file}")
            self.core.join([*seeds, *addrs], now)
        return bool(addrs)

    async def _stun(self) -> tuple[str | None, str]:
        """Our address as the relays' STUN sees this gossip socket (the first answer), and what
        that says of our NAT (``Meta.nat``): the same mapping seen by two of them is one a
        peer can punch; a different one per server is a symmetric NAT's; our own address, none."""
        from .relay.client import RelayError, parse_relay_url, stun_query

        seen: list[str] = []
        for url in dict.fromkeys(self.options.relays):
            host, port, _path, _tls = parse_relay_url(url)
            try:
                ip, mapped = await stun_query(host, port, timeout=1.0, sock=self._sock)
            except (RelayError, OSError) as exc:
                log.warning("no reflexive address from the relay's STUN at %s:%d: %s", host, port, exc)
                continue
            seen.append(format_addr(ip, mapped))
            if len(seen) == 2:
                break
        if not seen:
            return None, ""
        if all(a == self.addr for a in seen):
            kind = "none"
        elif len(seen) < 2:
            kind = ""  # one server cannot tell an endpoint-independent mapping from a symmetric one
        else:
            kind = "endpoint-independent" if seen[0] == seen[1] else "symmetric"
        self.out(f"meshd nat kind={kind or 'unknown'} mapped={','.join(seen)}")
        return seen[0], kind

    async def leave(self) -> None:
        """Tell the cluster we are going, so peers mark us left, not dead."""
        swim = self.swim
        if swim is None or swim.leaving:
            return
        swim.leave(trio.current_time())
        await self._flush()
        # UDP may lose the first announcement; say it again once, briefly.
        await trio.sleep(LEAVE_LINGER_S / 2)
        swim.tick(trio.current_time())
        await self._flush()
        self.write_snapshot()
        await self.save_memory()

    @property
    def core(self) -> Swim:
        """The membership core; it exists once ``serve`` has started."""
        if self.swim is None:
            raise RuntimeError("the node is not serving yet")
        return self.swim

    @property
    def _socket(self) -> trio.socket.SocketType:
        if self._sock is None:
            raise RuntimeError("the node is not bound yet")
        return self._sock

    # ------------------------------------------------- the services' interface (Mesh)

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id

    @property
    def name(self) -> str:
        return self.options.name

    def resolve(self, name: str) -> bytes | None:
        return self.swim.resolve(name) if self.swim is not None else None

    def member(self, name: str) -> MemberInfo | None:
        swim = self.swim
        m = swim.member_by_name(name) if swim is not None else None
        return None if m is None or swim is None else self._infos.of(m, len(swim.members))

    def member_by_id(self, node: bytes) -> MemberInfo | None:
        swim = self.swim
        m = swim.members.get(node) if swim is not None else None
        return None if m is None or swim is None else self._infos.of(m, len(swim.members))

    def owners(self, name: str) -> list[MemberInfo]:
        swim = self.swim
        if swim is None:
            return []
        return [self._infos.of(swim.members[owner], len(swim.members)) for owner in swim.live_owners(name)]

    def rtt(self, node: bytes) -> float | None:
        m = self.swim.members.get(node) if self.swim is not None else None
        return self._path_rtt(m) if m is not None else None

    def _path_rtt(self, m: Member) -> float | None:
        """The last round trip to ``m`` over the path our datagrams to it take now."""
        return m.relay_rtt if self.paths.out_path(m.id) == RELAY else m.rtt

    def members(self) -> list[MemberInfo]:
        swim = self.swim
        if swim is None:
            return []
        return [self._infos.of(m, len(swim.members)) for m in swim.members.values() if m.id != swim.id]

    def register_name(self, name: str) -> None:
        self.core.register_name(name, trio.current_time())
        self._after()

    def set_draining(self) -> None:
        core, now = self.core, trio.current_time()
        core.withdraw_names(now)
        core.set_meta(replace(core.me.meta, draining=True), now)
        self._after()

    def peer_down(self, node: bytes) -> bool:
        return self.data.is_down(node)

    def down_since(self, node: bytes) -> float | None:
        return self.data.down_since(node)

    def peer_epoch(self, node: bytes) -> int | None:
        return self.data.peer_epoch(node)

    def _is_member(self, node: bytes) -> bool:
        """Whether ``node`` is a live member (its data streams go last when they must)."""
        m = self.swim.members.get(node) if self.swim is not None else None
        return m is not None and m.state.live

    def report_down(self, node: bytes, epoch: int, *, seen_here: bool = False,
                    no_path_from: bytes | None = None) -> None:
        """Take ``node``'s process ``epoch`` as down for ``REPORTED_DOWN_S``: a stage said so,
        or (``seen_here``) this node's own stream with it ended and its dial was refused, in
        which case a stream it proves again clears it at once.  ``no_path_from``: the report
        is of that node finding no path to ``node``, which is alive; it holds while the mesh
        sees that direction with no path, and ends once a path carries it again."""
        held = self._reported_down.get(node)
        if (seen_here and held is not None and held.epoch == epoch and not held.seen_here
                and time.monotonic() - held.when < REPORTED_DOWN_S):
            return  # a stage's report stands: our own link proving itself says nothing of its link
        self._reported_down.pop(node, None)  # the newest report goes last, evicted last
        self._reported_down[node] = _DownReport(epoch, time.monotonic(), seen_here, no_path_from,
                                                trio.current_time())
        while len(self._reported_down) > MAX_REPORTED_DOWN:
            self._reported_down.pop(next(iter(self._reported_down)))

    def reported_down(self, node: bytes) -> bool:
        """Whether a report holds ``node``'s current process out of new routes.  A report of
        one direction with no path does not while another node of the sender's stage has a
        path to it: a route through that one serves (``no_path_report`` keeps the pair)."""
        seen = self._held_report(node)
        return seen is not None and not (seen.no_path_from is not None
                                         and self._reached_otherwise(seen.no_path_from, node))

    def no_path_report(self, node: bytes) -> tuple[bytes, float] | None:
        """(the node that found no path to ``node``, when: trio time) while such a report of
        ``node``'s current process holds, whether or not another node reaches it."""
        seen = self._held_report(node)
        if seen is None or seen.no_path_from is None:
            return None
        return seen.no_path_from, seen.at

    def _held_report(self, node: bytes) -> _DownReport | None:
        """The report of ``node`` that still holds (see ``report_down``), dropping one that ended."""
        seen = self._reported_down.get(node)
        if seen is None:
            return None
        m = self.swim.members.get(node) if self.swim is not None else None
        cut = self._still_cut(node, seen) if m is not None and seen.epoch == m.meta.epoch else None
        if (m is None or seen.epoch != m.meta.epoch or cut is False
                or (cut is None and time.monotonic() - seen.when >= REPORTED_DOWN_S)
                or (seen.seen_here and not self.data.is_down(node))):
            del self._reported_down[node]
            return None
        return seen

    def _reached_otherwise(self, sender: bytes, node: bytes) -> bool:
        """Whether another live node of ``sender``'s stage (its checkpoint and split), not
        draining, has a path to ``node`` as far as the mesh knows (a probe's verdict, not a
        guess)."""
        if self.swim is None:
            return False
        m = self.swim.members.get(sender)
        if m is None or m.meta.role != "stage" or m.meta.stage is None:
            return False  # the orchestrator, or a node that says no stage: none stands in for it
        me = self.swim.id
        for other, o in [*self.swim.members.items(), (me, self.swim.members.get(me))]:
            if (other in (sender, node) or o is None or o.meta.role != "stage"
                    or o.meta.stage != m.meta.stage or o.meta.draining
                    or (o.meta.checkpoint, o.meta.stages) != (m.meta.checkpoint, m.meta.stages)
                    or (other != me and not o.state.live)):
                continue
            way = self._direction(other, node)
            if way is not None and way[0] not in (NONE, UNKNOWN):
                return True
        return False

    def _direction(self, sender: bytes, node: bytes) -> tuple[str, float | None] | None:
        """The path the mesh knows from ``sender`` to ``node`` and since when (trio time, None
        when not said): ours from our path table, another's from the summary it gossips; None
        when nobody has a verdict on that direction."""
        assert self.swim is not None
        if sender == self.swim.id:
            peer = self.paths.peers.get(node)
            if peer is None or peer.out.unprobed:
                return None
            return peer.out.path, peer.out.since or None
        m = self.swim.members.get(sender)
        held = self.swim.path_summaries.get(sender)
        if m is None or not m.state.live or held is None:
            return None
        summary, at = held
        entry = next((e for e in summary.entries if e.peer == node), None)
        if entry is None:
            return None
        # When the path took this value, on our clock: as long ago as the summary said
        # when it was made, before it came in.
        return entry.path, (at - entry.since_ms / 1000 if entry.since_ms else None)

    def _still_cut(self, node: bytes, report: _DownReport) -> bool | None:
        """For a report of a direction with no path (``report_down(no_path_from=...)``): True
        while the mesh sees that direction with no path, False once a path has carried it
        since the report; None when the mesh cannot say (not such a report, its sender gone,
        the direction not reported, or a path it shows from before the report)."""
        sender = report.no_path_from
        if sender is None or self.swim is None:
            return None
        known = self._direction(sender, node)
        if known is None:
            return None
        way, since = known
        if way == NONE:
            return True
        if since is not None and since > report.at:
            return False  # a path has carried the direction since the report
        return None

    def probe_soon(self, node: bytes) -> None:
        self.core.probe_soon(node, trio.current_time())
        self._wake.set()

    async def send(self, node: bytes, data: bytes, timeout: float = 30.0) -> str:
        """Deliver ``data`` to ``node`` reliably and in order; returns the path used.

        Raises DeliveryError naming the peer and the paths tried.
        """
        return await self.data.send(node, data, timeout)

    async def post(self, node: bytes, data: bytes, timeout: float,
                   on_error: Callable[[Exception], Awaitable[None]] | None = None) -> Any:
        return await self.data.post(node, data, timeout, on_error)

    async def loopback(self, data: bytes) -> None:
        await self.data.loopback(data)

    async def dispatch(self, handler: Handler, *, inline: bool = False) -> None:
        await self.data.dispatch(handler, inline=inline)

    def path(self, node: bytes) -> str:
        return self.data.path(node)

    def join(self, addrs: list[str]) -> None:
        """Join (again) through ``addrs`` (HOST:PORT each): the dashboard's add-peer."""
        self.core.join(list(addrs), trio.current_time())
        self._watch_join()
        self._wake.set()

    def join_status(self) -> dict[str, Any]:
        """Whether we are in the mesh: ``joined``, the seeds asked, and what went wrong if not."""
        swim = self.core
        if not swim.joining:
            return {"joined": True, "seeds": [], "attempts": 0, "waiting_s": None, "problem": None}
        waited = trio.current_time() - self._join_started
        problem = None
        if self._join_said:  # said in the log already: say it as of now
            problem = f"no answer from {', '.join(map(self._seed_words, swim.seeds))} after {waited:.0f} s"
        return {"joined": False, "seeds": list(swim.seeds), "attempts": swim.join_attempts,
                "waiting_s": round(waited, 1), "problem": problem}

    def _watch_join(self) -> None:
        swim = self.swim
        if swim is not None and swim.joining and not self._join_watched and self._nursery is not None:
            self._join_watched = True
            self._join_started = trio.current_time()
            self._nursery.start_soon(self._join_watch)

    async def _join_watch(self) -> None:
        """Never join in silence: name the seeds that do not answer, with a growing wait between
        lines, and ask the relays for members to join through (a seed we cannot reach directly
        may still share a relay with us)."""
        swim, started = self.core, self._join_started
        quiet = max(JOIN_QUIET_S, JOIN_QUIET_PROBES * swim.config.probe_timeout)
        say_at = started + quiet
        self._asked_via_relay.clear()
        remembered = False  # asked the members the state file remembers, besides the seeds
        try:
            while swim.joining:
                await trio.sleep(JOIN_POLL_S)
                now = trio.current_time()
                if not swim.joining or now < say_at:
                    continue
                waited = now - started
                seeds = ", ".join(self._seed_words(addr) for addr in swim.seeds)
                self._join_said = True
                tail = ", asking the relays for members to join through" if self.relays is not None else ""
                self.out(f"meshd join: no answer from {seeds} after {waited:.0f} s, retrying{tail}")
                say_at = started + 2 * (say_at - started)
                if not remembered:
                    # A seed restarted elsewhere (a rented host's new address) leaves our
                    # command line naming nobody; the members we knew may still be there.
                    remembered = True
                    self._rejoin_remembered(now, swim.seeds)
                if self.relays is not None:
                    await self.relays.list_peers()
            if self._join_said:
                answered = [n for n in self._asked_via_relay if n in swim.members]
                how = (f" through the relay (answered by {len(answered)} of the members asked there)"
                       if answered else "")
                self.out(f"meshd join: joined{how} after {trio.current_time() - started:.1f} s")
        finally:
            self._join_said = self._join_watched = False

    def _seed_words(self, addr: str) -> str:
        """A seed as the join lines name it: its address, and why nothing could be sent there."""
        why = self._send_failed.get(addr)
        return f"{addr} (cannot send there: {why})" if why else addr

    def _join_through_relay(self, url: str, nodes: tuple[bytes, ...]) -> None:
        """A relay's peer list, while no seed answers us: ask a few of them to let us in."""
        swim, pool = self.core, self.relays
        if not swim.joining or pool is None:
            return
        picks = [n for n in nodes if n != swim.id]
        random.shuffle(picks)
        picks = picks[:JOIN_VIA_RELAY]
        for node in picks:
            pool.heard(url, node)  # reachable there: our join goes over that relay
        asked = swim.join_via_relay(picks, trio.current_time())
        self._asked_via_relay.update(picks)
        if asked:
            self.out(f"meshd join: asking {asked} of the {len(nodes)} members at relay {url} to let us in")

    def describe(self, node: bytes) -> str:
        """``stage-2 (2b91108e)``: how logs and errors name a peer."""
        m = self.swim.members.get(node) if self.swim is not None else None
        return f"{m.name if m is not None else 'unknown'} ({node.hex()[:8]})"

    def _addr_of(self, node: bytes) -> str | None:
        m = self.swim.members.get(node) if self.swim is not None else None
        return m.addr if m is not None else None

    def write_snapshot(self) -> None:
        if self._snapshots is not None and self.swim is not None:
            self._snapshots.write(self.snapshot())

    def snapshot(self) -> dict:
        assert self.swim is not None
        relays = self.relays.snapshot() if self.relays is not None else None
        snap = snapshot(self.swim, trio.current_time(), self.paths, relays[0] if relays else None,
                        self.reported_down)
        snap["relays"] = relays or []
        snap["join"] = self.join_status()
        for view in snap["members"]:
            node = bytes.fromhex(view["id"])
            view.update(self.data.view(node))
            # The relay our frames to it took last (datagrams or data), if any did.
            view["relay_via"] = self.relays.via(node) if self.relays is not None else None
        snap["data"] = dict(self.data.counters)
        return snap

    # ---------------------------------------------------------------- loops

    async def _receive_loop(self) -> None:
        sock, swim = self._socket, self.core
        while True:
            try:
                data, addr = await sock.recvfrom(MAX_DATAGRAM)
            except OSError as exc:  # e.g. ICMP port unreachable surfacing on Linux
                swim.counters["rx_socket_errors"] += 1
                log.debug("recvfrom: %s", exc)
                continue
            if self.options.faults.direct_in_lost(addr):
                swim.counters["rx_fault_dropped"] += 1
                continue
            now = trio.current_time()
            source = format_addr(addr[0], addr[1])
            opened = self._open(data, source, now)
            if opened is None:
                continue  # not a member's: it earns no budget and gets no answer
            self.guard.received(source, len(data), now)
            if opened[:1] == RELAY_DATA:  # data-channel chunks or acks through a punched NAT
                try:
                    await self.data.on_datagram(source, opened)
                except Exception:
                    self.handler_error("data datagram", source)
                continue
            sender = self._receive(opened, source, now)
            if sender is not None:
                self.paths.received(sender, "direct", now)
            await self._proven()
            self._after()
            await self._flush()

    def _receive(self, data: bytes, addr: str, now: float, via: str | None = None) -> bytes | None:
        """The core's receive boundary, made total: bad bytes are counted by the core, and
        anything else a handler raises is counted and logged here, never fatal."""
        try:
            return self.core.receive_datagram(data, addr, now, via=via)
        except Exception:
            self.handler_error("gossip packet", addr)
            return None

    def handler_error(self, what: str, source: str) -> None:
        """Count (and log, the first few times) an error raised while handling ``what``."""
        self.core.counters["rx_handler_errors"] += 1
        if self._handler_errors_logged < MAX_LOGGED_HANDLER_ERRORS:
            self._handler_errors_logged += 1
            log.exception("error handling a %s from %s (dropped; the node carries on)", what, source)

    async def _relay_receive_loop(self, client: RelayClient) -> None:
        """What one relay hands us: peers' frames, its "not here" notices, its peer lists."""
        from .relay.protocol import PeerNotHere, Peers, Recv

        swim, pool = self.core, self.relays
        assert pool is not None
        async for item in client.received:
            if isinstance(item, PeerNotHere):
                pool.not_here(client.url, item.node_id)  # the next frame to it tries another relay
                continue
            if isinstance(item, Peers):
                self._join_through_relay(client.url, item.node_ids)
                await self._flush()
                continue
            if not isinstance(item, Recv):
                continue
            if self.options.faults.relay_blocked():
                swim.counters["rx_fault_dropped"] += 1
                continue
            source = f"{RELAY_ADDR_PREFIX}{item.src.hex()[:8]}"
            payload = self._open(item.payload, source, trio.current_time())
            if payload is None:
                continue
            pool.heard(client.url, item.src)
            if payload[:1] == RELAY_DATA:
                try:
                    await self.data.on_relay_payload(item.src, payload)
                except Exception:
                    self.handler_error("relayed data frame", item.src.hex()[:8])
                continue
            try:
                claimed = packet_sender(payload)
            except WireError:
                swim.counters["rx_bad_packet"] += 1
                continue
            if claimed != item.src:
                # The relay vouches only for the connection that sent it.
                swim.counters["rx_relay_sender_mismatch"] += 1
                continue
            now = trio.current_time()
            m = swim.members.get(item.src)
            addr = m.addr if m is not None else f"{RELAY_ADDR_PREFIX}{item.src.hex()[:8]}"
            sender = self._receive(payload, addr, now, via=RELAY)  # answered the same way
            if sender is not None:
                self.paths.received(item.src, RELAY, now)
            await self._proven()
            self._after()
            await self._flush()

    async def _timer_loop(self) -> None:
        swim = self.core
        while True:
            with trio.move_on_at(swim.next_deadline()):
                await self._wake.wait()
            self._wake = trio.Event()
            swim.tick(trio.current_time())
            self._after(wake=False)  # waking ourselves would spin this loop
            await self._flush()

    async def _path_summary_loop(self) -> None:
        """Gossip our outbound paths, so any node can draw the whole mesh."""
        swim, version, last, last_at = self.core, time.time_ns() // 1000, None, -PATH_SUMMARY_REFRESH_S
        while True:
            now = trio.current_time()
            via = self.relays.via if self.relays is not None else (lambda node: None)
            peers = [(m.id, self._path_rtt(m), via(m.id)) for m in swim.members.values()
                     if m.id != swim.id and m.state.live]
            shape = [(node, self.paths.shown_path(node), relay) for node, _, relay in peers]
            if shape != last or now - last_at >= PATH_SUMMARY_REFRESH_S:
                # Wall-clock versions: a restarted node's summaries still supersede its old ones.
                version = max(version + 1, time.time_ns() // 1000)
                swim.publish_paths(self.paths.summary(swim.id, version, peers, now), now)
                last, last_at = shape, now
            await trio.sleep(PATH_SUMMARY_CHECK_S)

    async def _snapshot_loop(self) -> None:
        while True:
            self.write_snapshot()
            await trio.sleep(self.options.snapshot_interval)

    async def _memory_loop(self) -> None:
        """Keep the state file current: checked every second, written when it changed."""
        while True:
            await self.save_memory()
            await trio.sleep(MEMORY_SAVE_INTERVAL_S)

    async def save_memory(self) -> None:
        """Write the state file if what it should hold changed; a failure is one log line."""
        path, swim = self.options.state_file, self.swim
        if not path or swim is None:
            return
        async with self._memory_lock:
            memory = node_memory.remember(swim.members.values(), swim.id, swim.registry.own_clock,
                                          self._memory)
            if memory == self._memory:
                return
            try:
                await trio.to_thread.run_sync(node_memory.save, path, memory)
            except OSError as exc:
                error = f"{exc.strerror or exc}"
                if error != self._memory_error:
                    log.warning("state file %s not written: %s", path, error)
                self._memory_error = error
                return
            self._memory, self._memory_error = memory, None

    # ------------------------------------------------------------- plumbing

    def _after(self, wake: bool = True) -> None:
        """React to what the core decided: log membership changes, wake the timer."""
        changed = False
        for ev in self.core.events():
            if ev.node is None:
                continue  # every event a driver reacts to names a member
            if ev.kind is EventKind.KEYRING:
                self.rotation.changed_by(ev.node, ev.detail["change"])
                continue
            if ev.kind is EventKind.PATH:
                self._path_changed(ev.node, ev.detail["direct"], ev.detail["rtt"], ev.at)
                continue
            if ev.kind is EventKind.MISSED:
                self.paths.missed(ev.node)
                continue
            if ev.kind is EventKind.PUNCHED:
                self._punched(ev.node, ev.detail["addr"], ev.detail["seen"])
                continue
            if ev.kind is EventKind.TWIN:
                self._twin(ev.detail["twin"], ev.detail["keep"])
                continue
            if not ev.membership:
                continue
            m = self.core.members.get(ev.node)
            if m is not None and ev.node != self.core.id:
                detail = f" by={ev.detail['by']}" if "by" in ev.detail else ""
                self.out(f"meshd member {ev.kind.value} prefix={m.prefix} name={m.name} "
                         f"incarnation={m.incarnation}{detail}")
            if ev.kind is not EventKind.SUSPECT and ev.kind is not EventKind.ALIVE:
                changed = True
            if (ev.kind in (EventKind.JOIN, EventKind.UPDATE, EventKind.RESTART) and m is not None
                    and ev.node != self.core.id and m.meta.epoch):
                # Its own signed word on its process: a new epoch restarts our sessions with it,
                # and its X25519 key is what data to and from that process is sealed with.
                self.data.note_epoch(ev.node, m.meta.epoch, m.meta.dh)
            if ev.kind is EventKind.RESTART:
                # Its new process may sit at a new address that has yet to prove itself:
                # probe it first, so what we hold back for that address goes at once.
                self.core.probe_soon(ev.node, ev.at)
                # What our probes showed of the old process is no verdict on the new one.
                self.paths.restarted(ev.node, ev.at)
            if ev.kind in (EventKind.DEAD, EventKind.LEFT):
                self.paths.unreachable(ev.node, ev.at, f"member {ev.kind.value}: no path answered")
            elif ev.kind is EventKind.JOIN:
                self.paths.revived(ev.node, ev.at)
        if changed:
            self._print_stage_map()
        if wake:
            self._wake.set()  # the core's next deadline may have moved

    def _path_changed(self, node: bytes, direct: bool | None, rtt: float, now: float) -> None:
        """A probe's verdict on ``node``: direct answered (True), only the relayed ping was
        answered (False), or neither, only other members vouched for it (None)."""
        if direct is None:
            reason = VOUCHED_ONLY
        else:
            reason = "direct ping unanswered within the probe timeout; the relayed ping was answered"
        if not direct and (why := self.core.punch.status(node)):
            reason = f"{why}; {reason}"  # first: a gossiped summary keeps only the start
        self.paths.set_punched(node, self.core.punch.address(node))
        if self.paths.probe_verdict(node, direct, now, reason):
            m = self.core.members.get(node)
            name = m.name if m is not None else "?"
            path = self.paths.out_path(node)
            detail = "" if direct else f" ({reason})"
            # The RTT of the path that answered, from its own ping's send.
            self.out(f"meshd path {self.core.me.name}->{name} prefix={node.hex()[:8]} "
                     f"out={path} rtt_ms={rtt * 1000:.1f}{detail}")

    def _twin(self, twin: Twin, keep: bool) -> None:
        """Another live process signs as us: say so; the one started later stops."""
        me = self.core.me
        self.out(f"meshd twin name={me.name} prefix={self.identity.prefix} other_addr={twin.addr} "
                 f"other_started={_when(twin.started)} keep={'yes' if keep else 'no'}")
        if keep:
            log.warning("another process runs as %s (node %s, the same key) at %s, started %s, after "
                        "this one: it gives the node id up and stops; two processes must not share a "
                        "key file", me.name, self.identity.prefix, twin.addr, _when(twin.started))
        else:
            self._twin_kept.set()

    def _punched(self, node: bytes, addr: str, seen: str) -> None:
        """A punch through ``node``'s NAT was answered at ``addr``: its probes go there now."""
        m = self.core.members.get(node)
        self.paths.set_punched(node, addr)  # the guard trusts addr already: the core lists it as answered
        self.out(f"meshd punched {self.core.me.name}->{m.name if m is not None else '?'} "
                 f"prefix={node.hex()[:8]} addr={addr} seen_as={seen}")

    def _print_stage_map(self) -> None:
        live = [m for m in self.core.members.values() if m.state in (State.ALIVE, State.SUSPECT)]
        live.sort(key=lambda m: stage_sort_key(m.name))
        line = "meshd stage-map " + " ".join(f"{m.prefix}={m.name}" for m in live)
        if line != self._last_map:
            self._last_map = line
            self.out(line)

    async def _flush(self) -> None:
        swim, faults = self.core, self.options.faults
        for out in swim.outbox():
            try:
                data = encode(out.packet)
            except WireError as exc:
                swim.counters["tx_too_big"] += 1
                log.warning("not sent to %s: %s", out.addr, exc)
                continue
            except Exception:  # a value no codec takes: never the end of the node
                swim.counters["tx_encode_errors"] += 1
                log.exception("not sent to %s: the packet does not encode", out.addr)
                continue
            via = out.via or self.paths.out_path(out.node)
            if out.addr.startswith(RELAY_ADDR_PREFIX):
                via = RELAY  # we only know this peer through the relay so far
            if via == RELAY and self.relays is not None and out.node is not None:
                await self._send_relay(out.node, data)
                continue
            within = self._within_budget(out.addr, out.packet, data)
            if out.addr in self._held_answers and out.node is not None:
                # Our answer waits for the address to prove itself: ask it now (a ping always
                # goes), so a node joining from a new address learns the mesh in a round trip.
                swim.probe_soon(out.node, trio.current_time())
            if within is None:
                continue
            data = within
            if faults.direct_out_lost(out.addr):
                swim.counters["tx_fault_dropped"] += 1
                continue
            if faults.delay_s and self._nursery is not None:
                self._nursery.start_soon(self._send_later, data, out.addr, faults.delay_s)
            else:
                await self._sendto(data, out.addr, out.node)

    def _within_budget(self, addr: str, packet: Packet, data: bytes) -> bytes | None:
        """What the amplification guard lets us send to ``addr`` now.

        To an address that has proven itself, ``data``.  To any other, ``data``
        while it fits the guard's budget; past it, only the packet's first
        message (a ping, an ack: no piggybacked gossip), and a push-pull cut to
        the members that fit, its whole kept until the address proves itself;
        None when not even that fits.  A bare probe (ping, ack, nack) always
        goes: failure detection must not depend on the budget, and the protocol
        sends those at its own slow rate.
        """
        now = trio.current_time()
        if self.guard.may_send(addr, len(data), now):
            return data
        first = packet.messages[0]
        if isinstance(first, PushPull):
            self._held_answers.pop(addr, None)
            self._held_answers[addr] = data
            if len(self._held_answers) > MAX_HELD_ANSWERS:
                del self._held_answers[next(iter(self._held_answers))]
            smaller = _cut_push_pull(packet.sender, first, self.guard.room(addr, now))
        elif len(packet.messages) > 1:
            smaller = encode(Packet(packet.sender, (first,), packet.version))
        else:
            smaller = data if isinstance(first, PROBES) else None
        if smaller is None or not (isinstance(first, PROBES) or self.guard.may_send(addr, len(smaller), now)):
            self.core.counters["tx_amplification_limited"] += 1
            return None
        if smaller is not data:
            self.core.counters["tx_cut_for_unproven"] += 1
        return smaller

    async def _proven(self) -> None:
        """Addresses that answered our pings may have all we send, and what we held for them."""
        for addr in self.core.answered_addrs():
            self.guard.verified(addr)
            held = self._held_answers.pop(addr, None)
            if held is not None:
                await self._sendto(held, addr)

    async def _send_relay(self, node: bytes, data: bytes) -> None:
        from .relay.client import RelayError

        swim = self.core
        if self.options.faults.relay_blocked():
            swim.counters["tx_fault_dropped"] += 1
            return
        self.paths.sent(node)
        try:
            await self._relay_send(node, data)
        except (RelayError, ValueError) as exc:
            swim.counters["tx_relay_errors"] += 1
            log.debug("relay send to %s: %s", node.hex()[:8], exc)
        else:
            swim.counters["tx_relay_bytes"] += len(data)

    def _punched_addr(self, node: bytes) -> str | None:
        """Where our datagrams to ``node`` go through its NAT, while probes say they arrive."""
        return self.core.punch.address(node) if self.paths.punched(node) else None

    async def _send_datagram(self, addr: str, data: bytes) -> None:
        """A data-channel datagram to ``addr`` on the gossip socket, under our faults as gossip is."""
        faults = self.options.faults
        if faults.direct_out_lost(addr):
            self.core.counters["tx_fault_dropped"] += 1
            return
        if faults.delay_s and self._nursery is not None:
            self._nursery.start_soon(self._send_later, data, addr, faults.delay_s)
            return
        await self._sendto(data, addr)

    async def _send_later(self, data: bytes, addr: str, delay: float) -> None:
        await trio.sleep(delay)
        await self._sendto(data, addr)

    async def _sendto(self, data: bytes, addr: str, node: bytes | None = None) -> None:
        swim = self.core
        self.paths.sent(node)
        data = self._seal(data)
        try:
            await self._socket.sendto(data, parse_addr(addr))
        except AddressError as exc:
            swim.counters["tx_bad_address"] += 1
            log.warning("not sent: %s", exc)
        except OSError as exc:
            swim.counters["tx_socket_errors"] += 1
            log.debug("sendto %s: %s", addr, exc)
            self._send_failed[addr] = exc.strerror or str(exc)  # a name that does not resolve, say
            while len(self._send_failed) > MAX_SEND_FAILURES:
                self._send_failed.pop(next(iter(self._send_failed)))
        else:
            swim.counters["tx_bytes"] += len(data)
            self._send_failed.pop(addr, None)

    # ------------------------------------------------------------ the mesh key

    def _seal(self, data: bytes) -> bytes:
        """``data`` as it goes on the wire: sealed with our mesh key, if we have one."""
        return self.mesh_key.seal(data) if self.mesh_key is not None else data

    def _open(self, data: bytes, source: str, now: float) -> bytes | None:
        """What a received datagram or relay payload holds, or None (counted, and logged once a
        minute per source) if it does not open with our mesh key."""
        if self.mesh_key is None:
            return data
        opened = self.mesh_key.open(data)
        if opened is not None:
            return opened
        self.core.counters["rx_unsealed_dropped"] += 1
        held = self._unsealed.due(source, now)
        if held is not None:
            log.warning("dropped packets from %s: not sealed with our mesh key (%d since the last line)",
                        source, held + 1)
        return None

    async def _relay_send(self, node: bytes, data: bytes) -> None:
        """``data`` to ``node`` over a relay we both hold, sealed like every other payload: the
        one place relay payloads are sent (gossip and the data channel alike).

        With ``delay:`` or ``loss:`` faults the payload waits in a queue until it is due, as
        netem on our interface holds the relay connection's packets too (see ``Faults``).
        """
        assert self.relays is not None
        sealed = self._seal(data)
        if self._relay_held is not None:
            due = max(self._relay_due, trio.current_time() + self.options.faults.stream_send_delay())
            self._relay_due = due  # in order, as a TCP stream delivers
            await self._relay_held.send((due, node, sealed))
            return
        await self.relays.send(node, sealed, self._peer_relays(node))

    def _peer_relays(self, node: bytes) -> tuple[str, ...]:
        """The relays ``node``'s metadata lists (none while we know it only by id)."""
        m = self.swim.members.get(node) if self.swim is not None else None
        return m.meta.relay_urls if m is not None else ()

    async def _relay_held_loop(self, held: trio.MemoryReceiveChannel[tuple[float, bytes, bytes]]) -> None:
        """Send what ``delay:``/``loss:`` held back, each when due; a send that fails is lost, as
        one the relay dropped would be (its sender sends it again)."""
        from .relay.client import RelayError

        assert self.relays is not None
        async for due, node, sealed in held:
            await trio.sleep_until(due)
            try:
                await self.relays.send(node, sealed, self._peer_relays(node))
            except (RelayError, ValueError) as exc:
                log.debug("held relay payload to %s lost: %s", node.hex()[:8], exc)

    def _relay_reaches(self, node: bytes) -> bool:
        """Whether a relay we are connected to reaches ``node`` now."""
        if self.relays is None:
            return False
        return self.relays.route(node, self._peer_relays(node), trio.current_time()) is not None

    def _relay_moved(self, move: Move) -> None:
        """Say which relay carries a pair now, and why it moved (``meshd relay-move`` lines)."""
        name = self.describe(move.node)
        self.out(f"meshd relay-move {self.name}->{name.split(' ')[0]} prefix={move.node.hex()[:8]} "
                 f"from={move.old} to={move.new} ({move.why})")

    def change_keyring(self, op: str, key: str) -> dict[str, Any]:
        """A step of a mesh-key rotation, here and on every member (see meshd.rotation)."""
        return self.rotation.change(op, key)

async def _close_on_exit(listeners: list[trio.SocketListener]) -> None:
    try:
        await trio.sleep_forever()
    finally:
        for listener in listeners:
            listener.socket.close()


def _cut_push_pull(sender: bytes, push_pull: PushPull, room: float) -> bytes | None:
    """The push-pull with its names and as many of its members (ourselves first) as fit
    in ``room`` bytes, encoded; None if not even one fits."""
    members = push_pull.members

    def encoded(k: int) -> bytes:
        return encode(Packet(sender, (replace(push_pull, members=members[:k]),)))

    low, high = 0, len(members)  # encoded(low) fits or low == 0; encoded(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        if len(encoded(mid)) <= room:
            low = mid
        else:
            high = mid
    if low == 0:
        return None
    return encoded(low)


def _print_line(line: str) -> None:
    from .logs import event

    event(line)
