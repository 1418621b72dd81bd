"""A deterministic in-memory network for the sans-IO SWIM core.

Discrete events on a virtual clock: packets are delivered after a seeded
delay, lost with a per-direction probability, dropped one way, or
duplicated; nodes crash and restart.  The same seed gives the same run,
packet for packet.  Tests, the lossy-network checks and ``meshd sim`` drive
the real :class:`meshd.swim.Swim` through it.

It lives in ``meshd.sim`` and not in ``meshd.swim``: it is a driver of the
core (a clock, an event queue and a network model), the counterpart of the
trio driver in ``meshd.node``, not a part of the state machine.  The core
takes bytes and time as arguments and has no transport of its own to stand
in for, and ``meshd sim`` ships it to users, so it is product code.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..identity import prefix
from ..swim import Config, Event, EventKind, State, Swim
from ..wire import MAX_PACKET_BYTES, MAX_STREAM_BYTES, Meta, WireError, encode, packet_size


@dataclass
class LinkFault:
    """What happens to packets on one direction of one link."""

    loss: float = 0.0  # probability a packet is lost
    drop: bool = False  # every packet is lost (a one-way firewall)
    delay: float = 0.0  # extra one-way delay, seconds
    duplicate: float = 0.0  # probability a packet arrives twice


@dataclass
class RelayPath:
    """How packets a node sends ``via="relay"`` travel: two stream hops through a relay.

    A stream does not lose packets, it resends them: each hop pays ``rto``
    once more for every loss (probability ``loss``) before it gets through.
    """

    delay: float = 0.002  # both hops and the relay, before any resend
    loss: float = 0.0
    rto: float = 0.2


@dataclass
class SimNat:
    """A NAT in front of one node, as home routers do it (and the netns testbed's ``nat:X``).

    Its packets leave from ``public_ip`` and a port: one port whoever they go to
    (endpoint-independent mapping), or a new one per destination (``symmetric``).
    A packet from outside gets in only to a port mapped towards its sender, within
    ``timeout`` of the last packet out on that mapping (address-and-port-dependent
    filtering); the node's own address does not route from outside.
    """

    public_ip: str
    symmetric: bool = False
    timeout: float = 30.0
    ports: dict[str, int] = field(default_factory=dict)  # remote addr ("*": any) -> public port
    allowed: dict[tuple[int, str], float] = field(default_factory=dict)  # (port, remote) -> until
    next_port: int = 40000

    def out(self, remote: str, now: float) -> str:
        """The source address a packet to ``remote`` leaves with; opens the way back."""
        key = remote if self.symmetric else "*"
        port = self.ports.get(key)
        if port is None:
            port = self.ports[key] = self.next_port
            self.next_port += 1
        self.allowed[(port, remote)] = now + self.timeout
        return f"{self.public_ip}:{port}"

    def lets_in(self, port: int, remote: str, now: float) -> bool:
        """Whether a packet from ``remote`` to ``port`` gets in; one that does keeps the mapping
        open, as Linux's conntrack counts packets either way."""
        if self.allowed.get((port, remote), -1.0) < now:
            return False
        self.allowed[(port, remote)] = now + self.timeout
        return True


@dataclass
class SimNode:
    index: int
    id: bytes
    addr: str
    meta: Meta
    swim: Swim
    up: bool = True
    scheduled: float | None = None
    tx_packets: int = 0
    tx_bytes: int = 0
    nat: SimNat | None = None

    @property
    def prefix(self) -> str:
        return prefix(self.id)


# Heap entries are plain tuples, compared by (at, seq) in C:
# (at, seq, kind, addr, payload, src, stream), kind 0 deliver, 1 timer,
# 2 deliver what came through the relay (the receiver is told, via="relay").
_DELIVER, _TIMER, _RELAYED = 0, 1, 2


@dataclass(frozen=True)
class Observed:
    """One membership event, as one node saw it."""

    at: float
    observer: bytes
    event: Event


class MemNet:
    def __init__(
        self,
        seed: int = 0,
        config: Config | None = None,
        latency: float = 0.0005,
        jitter: float = 0.0005,
        decode: bool = True,
        sample_latency: Callable[[random.Random], float] | None = None,
    ) -> None:
        """``decode=False`` hands each receiver the sent Packet object instead of
        decoding the bytes again: the same run (decode is a pure inverse of
        encode), a good deal faster, for the large simulations."""
        self.rng = random.Random(seed)
        self.config = config or Config()
        self.latency = latency
        self.jitter = jitter
        self.decode = decode
        self.sample_latency = sample_latency
        self.now = 0.0
        self.nodes: dict[str, SimNode] = {}
        self.by_id: dict[bytes, SimNode] = {}
        self.default_fault = LinkFault()
        # None: "via relay" packets take the direct link like any other.
        self.relay: RelayPath | None = None
        self.faults: dict[tuple[str, str], LinkFault] = {}
        self.log: list[Observed] = []
        self._nat_ips: dict[str, SimNode] = {}  # a NAT's public ip -> the node behind it
        self.counters: Counter[str] = Counter()
        self._heap: list[tuple] = []
        self._seq = 0

    # ------------------------------------------------------------ topology

    def add_node(self, meta: Meta | None = None, seeds: list[str] | None = None,
                 node_id: bytes | None = None) -> SimNode:
        """A node at a new address; ``node_id`` gives it another's id (a twin process)."""
        index = len(self.nodes)
        node_id = node_id or self.rng.randbytes(32)
        addr = f"10.{index // 65536}.{index // 256 % 256}.{index % 256}:7946"
        meta = meta or Meta(role="stage", stage=index)
        swim = Swim(node_id, addr, meta, self.config, random.Random(self.rng.random()), self.now)
        node = SimNode(index, node_id, addr, meta, swim)
        self.nodes[addr] = node
        self.by_id.setdefault(node_id, node)
        if seeds:
            swim.join(seeds, self.now)
        self._after(node)
        return node

    def flush(self, node: SimNode) -> None:
        """Send what a command outside receive/tick queued (leave, set_meta), and re-arm."""
        if node.up:
            self._after(node)

    def crash(self, node: SimNode) -> None:
        """Stop the node where it stands: no more packets, no more timers."""
        node.up = False
        node.scheduled = None

    def restart(self, node: SimNode, seeds: list[str], meta: Meta | None = None,
                incarnation: int = 0) -> None:
        """Bring a crashed node back with the same id and a fresh state (and ``meta``, if given:
        a new process says so with a new epoch)."""
        if meta is not None:
            node.meta = meta
        rng = random.Random(self.rng.random())
        node.swim = Swim(node.id, node.addr, node.meta, self.config, rng, self.now, incarnation=incarnation)
        node.up = True
        node.swim.join(seeds, self.now)
        self._after(node)

    def put_behind_nat(self, node: SimNode, *, symmetric: bool = False) -> SimNat:
        """Put ``node`` behind a NAT of its own (see SimNat) from now on."""
        ip = f"198.51.{node.index // 256 % 256}.{node.index % 256}"
        node.nat = SimNat(ip, symmetric)
        self._nat_ips[ip] = node
        return node.nat

    def stun(self, node: SimNode, server: str = "192.0.2.1:3478") -> str:
        """``node``'s address as a STUN server at ``server`` sees it (its mapping towards it)."""
        return node.nat.out(server, self.now) if node.nat is not None else node.addr

    def fault(self, src: SimNode, dst: SimNode) -> LinkFault:
        """The (mutable) fault on packets from ``src`` to ``dst``."""
        key = (src.addr, dst.addr)
        if key not in self.faults:
            self.faults[key] = LinkFault(**vars(self.default_fault))
        return self.faults[key]

    def set_loss(self, loss: float) -> None:
        """Loss on every link, existing and future."""
        self.default_fault.loss = loss
        for f in self.faults.values():
            f.loss = loss

    # --------------------------------------------------------------- clock

    def run_until(self, t: float) -> None:
        heap = self._heap
        nodes = self.nodes
        pop = heapq.heappop
        while heap and heap[0][0] <= t:
            at, _, kind, addr, payload, src, stream = pop(heap)
            self.now = at
            node = nodes.get(addr)
            if node is None or not node.up:
                continue
            if kind != _TIMER:
                via = "relay" if kind == _RELAYED else None
                if self.decode:
                    node.swim.receive_datagram(payload, src, at, stream=stream, via=via)
                else:
                    node.swim.receive(payload, src, at, via)
            else:
                if node.scheduled != at:
                    continue  # superseded by a later schedule
                node.scheduled = None
                node.swim.tick(at)
            self._after(node)
        self.now = max(self.now, t)

    def run_for(self, dt: float) -> None:
        self.run_until(self.now + dt)

    def run_periods(self, periods: float) -> None:
        self.run_for(periods * self.config.probe_interval)

    # ------------------------------------------------------------ plumbing

    def _after(self, node: SimNode) -> None:
        """Collect what the node wants to send and log, and re-arm its timer."""
        swim = node.swim
        for ev in swim.events():
            self.log.append(Observed(self.now, node.id, ev))
        for out in swim.outbox():
            self._transmit(node, out.addr, out.packet, out.reliable, out.via, out.node)
        # A deadline a delivery moved into the past fires now; scheduling the raw
        # value would never match the queued entry and stall the node.
        deadline = max(swim.next_deadline(), self.now)
        if deadline != node.scheduled:
            node.scheduled = deadline
            self._push((deadline, self._next(), _TIMER, node.addr, None, "", False))

    def _transmit(self, src: SimNode, addr: str, packet, reliable: bool, via: str | None = None,
                  node: bytes | None = None) -> None:
        limit = MAX_STREAM_BYTES if reliable else MAX_PACKET_BYTES
        if self.decode:
            try:
                data = encode(packet, limit)
            except WireError:
                self.counters["tx_too_big"] += 1
                return
            size = len(data)
        else:
            size = packet_size(packet)  # the same number, without building the bytes
            if size > limit:
                self.counters["tx_too_big"] += 1
                return
        src.tx_packets += 1
        src.tx_bytes += size
        payload = data if self.decode else packet
        if via == "relay" and self.relay is not None:
            relay = self.relay
            delay = relay.delay
            for _hop in range(2):
                while relay.loss and self.rng.random() < relay.loss:
                    delay += relay.rto
            self.counters["relayed"] += 1
            # The relay forwards by node id: whatever address the sender wrote, it reaches the node.
            to = self.by_id[node].addr if node in self.by_id else addr
            self._push((self.now + delay, self._next(), _RELAYED, to, payload, src.addr, reliable))
            return
        fault = self.faults.get((src.addr, addr), self.default_fault)
        if fault.drop or (fault.loss and self.rng.random() < fault.loss):
            self.counters["lost"] += 1
            return
        source, dest = src.addr, addr
        if src.nat is not None:
            source = src.nat.out(addr, self.now)
        host, _, port = addr.rpartition(":")
        behind = self._nat_ips.get(host)
        if behind is not None:  # to a NAT's public address: in only where a mapping allows
            nat = behind.nat
            if nat is None or not nat.lets_in(int(port), source, self.now):
                self.counters["nat_filtered"] += 1
                return
            dest = behind.addr
        elif (dst := self.nodes.get(addr)) is not None and dst.nat is not None and dst is not src:
            self.counters["nat_unroutable"] += 1  # its private address, from outside
            return
        copies = 2 if fault.duplicate and self.rng.random() < fault.duplicate else 1
        for _ in range(copies):
            if self.sample_latency is None:
                delay = self.latency + fault.delay + self.rng.random() * self.jitter
            else:
                delay = self.sample_latency(self.rng) + fault.delay
            self._push((self.now + delay, self._next(), _DELIVER, dest, payload, source, reliable))

    def _push(self, entry: tuple) -> None:
        heapq.heappush(self._heap, entry)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------- queries

    def up_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.up]

    def view(self, observer: SimNode, subject: SimNode) -> State | None:
        m = observer.swim.members.get(subject.id)
        return m.state if m is not None else None

    def converged(self) -> bool:
        """Every up node sees every other up node alive, and each down node not alive."""
        up = self.up_nodes()
        for a in up:
            for b in self.nodes.values():
                state = self.view(a, b)
                if b.up and state is not State.ALIVE:
                    return False
                if not b.up and state is State.ALIVE and a is not b:
                    return False
        return True

    def run_until_converged(self, max_periods: float, step_periods: float = 0.5) -> float:
        """Run until :meth:`converged`; returns the time it took, or raises TimeoutError."""
        start = self.now
        while not self.converged():
            if self.now - start > max_periods * self.config.probe_interval:
                raise TimeoutError(f"not converged after {max_periods} protocol periods")
            self.run_periods(step_periods)
        return self.now - start

    def events(self, kind: EventKind, subject: SimNode | None = None) -> list[Observed]:
        return [
            o for o in self.log if o.event.kind is kind and (subject is None or o.event.node == subject.id)
        ]
