"""One ``meshd sim`` run: a settled cluster of real SWIM cores on a MemNet, a
timeline of crashes, joins, metadata changes and churn, and what came of it.

Everything random comes from the seed: the network's draws from
``MemNet(seed)``, the scenario's choices (who crashes, who joins where) from
a second generator derived from the same seed.  So one seed gives one result,
byte for byte.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from ..identity import prefix
from ..swim import PROFILES, EventKind
from ..wire import STATE_ALIVE, MemberState, Meta
from .memnet import MemNet, RelayPath, SimNode
from .metrics import CrashTrack, Spread, median, rounded
from .network import Latency, block_one_way

# How often the spread of a join or metadata change is sampled, in periods.
POLL_PERIODS = 0.05
# Every member names the same home relay when there is one; the core then sends
# a second ping over it after the direct timeout (memberlist's TCP fallback ping).
RELAY_URL = "ws://relay.sim:3340"


@dataclass(frozen=True)
class Scenario:
    nodes: int = 100
    periods: int = 100
    loss: float = 0.0
    latency: str = "uniform:0.5:1.5"
    asym: float = 0.0  # fraction of directed links blocked one way
    relay: bool = True  # there is a relay: relayed pings, and blocked directions go through it
    crash: float = 0.0  # fraction of nodes crashed, all at crash_at
    churn: float = 0.0  # per period, this fraction of members leaves and as many join
    seed: int = 0
    profile: str = "lan"
    joins: int = 3  # joins whose spread is measured
    meta_changes: int = 3  # metadata changes whose spread is measured

    def config(self):
        return PROFILES[self.profile]

    def crash_at(self) -> float:
        """When the crashes happen, in periods: early, leaving time to detect them."""
        return float(max(1, round(0.05 * self.periods)))

    def probe_times(self) -> list[tuple[float, str]]:
        """(period, "join" | "meta"), spread over the first 70% of the run."""
        kinds = ["join"] * self.joins + ["meta"] * self.meta_changes
        # Alternate the kinds so both see the whole run.
        order = sorted(range(len(kinds)), key=lambda i: (i % max(1, self.joins), i))
        n = len(kinds)
        out = []
        for slot, i in enumerate(order):
            at = 0.1 * self.periods + slot * (0.6 * self.periods) / max(1, n)
            out.append((round(at, 2), kinds[i]))
        return out


@dataclass
class Result:
    scenario: Scenario
    bounds: tuple[float, float]
    crashes: list[CrashTrack]
    spreads: list[Spread]
    false_dead: int
    false_dead_declarations: int
    false_suspicions: int
    tx_packets: int
    tx_bytes: int
    member_periods: float
    counters: dict[str, int]
    cpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    setup_cpu_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------ summaries

    def detection(self) -> dict:
        # (crash, when the last member knew it) for every crash all members learnt of
        done = [(c, c.all_know) for c in self.crashes if c.all_know is not None]
        low, high = self.bounds
        all_know = [known - c.at for c, known in done]
        first_suspect = [c.first_suspect - c.at for c in self.crashes if c.first_suspect is not None]
        phase = [c.first_dead - c.first_suspect for c in self.crashes
                 if c.first_dead is not None and c.first_suspect is not None]
        spread = [known - c.first_dead for c, known in done if c.first_dead is not None]
        # Measured from the crash, all-know can never beat the min bound: the
        # suspicion timer alone lasts that long after the first suspicion.
        # From the first suspicion, it is the timer plus the death's spread.
        from_suspect = [known - c.first_suspect for c, known in done if c.first_suspect is not None]
        median_all_know, median_from_suspect = median(all_know), median(from_suspect)
        return {
            "crashes": len(self.crashes),
            "unresolved": len(self.crashes) - len(done),
            "first_suspect_median_s": median(first_suspect),
            "suspicion_phase_median_s": median(phase),
            "dead_spread_median_s": median(spread),
            "all_know_median_s": median_all_know,
            "all_know_max_s": max(all_know) if all_know else None,
            "all_know_from_first_suspect_median_s": median_from_suspect,
            "all_know_from_first_suspect_max_s": max(from_suspect) if from_suspect else None,
            "all_within_max_bound": bool(self.crashes) and len(done) == len(self.crashes)
            and max(all_know) <= high,
            "median_within_min_bound": median_all_know is not None and median_all_know <= low,
            "median_from_first_suspect_within_min_bound": median_from_suspect is not None
            and median_from_suspect <= low,
        }

    def dissemination(self) -> dict:
        out = {}
        for kind in ("join", "meta"):
            spreads = [s for s in self.spreads if s.kind == kind]
            p99 = [s.rounds(s.t99) for s in spreads]
            p100 = [s.rounds(s.t100) for s in spreads]
            out[kind] = {
                "count": len(spreads),
                "p99_rounds": p99,
                "p100_rounds": p100,
                "p99_rounds_median": median([r for r in p99 if r is not None]),
                "p100_rounds_median": median([r for r in p100 if r is not None]),
                "unfinished": sum(r is None for r in p100),
            }
        return out

    def load(self) -> dict:
        mp = self.member_periods or 1.0
        return {
            "messages_per_member_period": self.tx_packets / mp,
            "bytes_per_member_period": self.tx_bytes / mp,
        }

    def to_dict(self, timing: bool = False) -> dict:
        low, high = self.bounds
        out = {
            "params": asdict(self.scenario),
            "bounds": {"suspicion_min_s": low, "suspicion_max_s": high},
            "false_dead": self.false_dead,
            "false_dead_declarations": self.false_dead_declarations,
            "false_suspicions": self.false_suspicions,
            "detection": self.detection(),
            "crashes": [c.to_dict() for c in self.crashes],
            "dissemination": self.dissemination(),
            "load": self.load(),
            "counters": dict(sorted(self.counters.items())),
        }
        if timing:
            out["timing"] = self.timing()
        return rounded(out)

    def timing(self) -> dict:
        sc = self.scenario
        node_periods = sc.nodes * sc.periods
        return {
            "cpu_seconds": self.cpu_seconds,
            "wall_seconds": self.wall_seconds,
            "setup_cpu_seconds": self.setup_cpu_seconds,
            "cpu_us_per_node_period": 1e6 * self.cpu_seconds / node_periods,
        }


class _Run:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.cfg = sc.config()
        latency = Latency.parse(sc.latency)
        self.net = MemNet(seed=sc.seed, config=self.cfg, decode=False, sample_latency=latency.sampler())
        self.net.default_fault.loss = sc.loss
        if sc.relay:
            # Two stream hops: the loss on them costs resends (delay), not packets.
            self.net.relay = RelayPath(delay=2 * latency.median + 0.001, loss=sc.loss, rto=0.2)
        self.rng = random.Random(f"meshd-sim:{sc.seed}")
        self.period = self.cfg.probe_interval
        self.leaving: set[bytes] = set()  # left or leaving: neither false dead nor observers
        self.crashed: dict[bytes, CrashTrack] = {}
        self.spreads: list[Spread] = []
        self.active: list[Spread] = []
        self.stops: list[tuple[float, SimNode]] = []  # leavers to stop, after they said goodbye
        self.false_dead = 0
        self.false_declarations = 0
        self.false_suspicions = 0
        self.member_periods = 0.0

        nodes = [self._add_node() for _ in range(sc.nodes)]
        states = [MemberState(n.id, n.addr, 0, STATE_ALIVE, n.meta) for n in nodes]
        for n in nodes:
            n.swim.warm_start(states, 0.0)
        # Relay: a hop to the relay and one from it, at the median latency each.
        block_one_way(self.net, nodes, sc.asym, self.rng, sc.relay,
                      relay_delay=2 * latency.median, loss=sc.loss)
        self.tx0 = (0, 0)

    # ----------------------------------------------------------- helpers

    def _add_node(self, seeds: list[str] | None = None) -> SimNode:
        index = len(self.net.nodes)
        meta = Meta(role="stage", stage=index, relay_url=RELAY_URL if self.sc.relay else None)
        return self.net.add_node(meta=meta, seeds=seeds)

    def members(self) -> list[SimNode]:
        """Up, not leaving: who counts as a member now."""
        return [n for n in self.net.nodes.values() if n.up and n.id not in self.leaving]

    def _pick(self, exclude: set[bytes]) -> SimNode | None:
        pool = [n for n in self.members() if n.id not in exclude]
        return self.rng.choice(pool) if pool else None

    def _busy(self) -> set[bytes]:
        return {s.subject.id for s in self.active} | set(self.crashed)

    # ----------------------------------------------------------- actions

    def crash_nodes(self) -> None:
        members = self.members()
        count = round(self.sc.crash * len(members))
        busy = self._busy()
        now = self.net.now
        for n in self.rng.sample([m for m in members if m.id not in busy], count):
            self.net.crash(n)
            self.crashed[n.id] = CrashTrack(prefix(n.id), n.id, now)

    def join(self, track: bool) -> None:
        seed = self._pick(set())
        if seed is None:
            return
        node = self._add_node(seeds=[seed.addr])
        if track:
            self._track("join", node, lambda swim: _knows(swim, node.id))

    def change_meta(self) -> None:
        node = self._pick(self._busy())
        if node is None:
            return
        swim = node.swim
        swim.set_meta(replace(swim.me.meta, version=f"v{swim.me.meta.generation + 1}"), self.net.now)
        self.net.flush(node)
        gen = swim.me.meta.generation
        self._track("meta", node, lambda s: _has_generation(s, node.id, gen))

    def leave(self) -> None:
        node = self._pick(self._busy())
        if node is None:
            return
        self.leaving.add(node.id)
        node.swim.leave(self.net.now)
        self.net.flush(node)
        self.stops.append((self.net.now + self.period, node))

    def churn(self) -> None:
        expected = self.sc.churn * len(self.members())
        count = int(expected) + (self.rng.random() < expected - int(expected))
        for _ in range(count):
            self.leave()
        for _ in range(count):
            self.join(track=False)

    def _track(self, kind: str, node: SimNode, knows: Callable) -> None:
        s = Spread(kind, node, self.net.now, self.period, knows)
        self.spreads.append(s)
        self.active.append(s)

    # ----------------------------------------------------------- observing

    def observe(self) -> None:
        now = self.net.now
        if self.active:
            members = self.members()
            for s in list(self.active):
                if s.sample(members, now):
                    self.active.remove(s)
        log = self.net.log
        leaving = self.leaving
        crashed = self.crashed
        for o in log:
            ev = o.event
            # A death or a suspicion always names its member; other events may name none.
            if ev.kind is EventKind.DEAD and ev.node is not None:
                track = crashed.get(ev.node)
                if track is not None:
                    track.saw_dead(o.observer, o.at)
                elif ev.node not in leaving:
                    self.false_dead += 1
                    if ev.detail.get("by") == prefix(o.observer):
                        self.false_declarations += 1
            elif ev.kind is EventKind.SUSPECT and ev.node is not None:
                track = crashed.get(ev.node)
                if track is not None:
                    track.saw_suspect(o.at)
                elif ev.node not in leaving:
                    self.false_suspicions += 1
        log.clear()  # a thousand nodes log a lot; what matters is counted above

    def run(self, progress: Callable[[int], None] | None = None) -> Result:
        sc, net = self.sc, self.net
        actions: list[tuple[float, str]] = sorted(self.sc.probe_times())
        if sc.crash > 0:
            actions.append((sc.crash_at(), "crash"))
            actions.sort()
        poll = POLL_PERIODS * self.period
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for period in range(sc.periods):
            start = period * self.period
            if sc.churn > 0 and period > 0:
                self.churn()
            end = start + self.period
            t = start
            while t < end - 1e-9:
                while actions and actions[0][0] * self.period <= t + 1e-9:
                    _, kind = actions.pop(0)
                    {"crash": self.crash_nodes, "join": lambda: self.join(True),
                     "meta": self.change_meta}[kind]()
                while self.stops and self.stops[0][0] <= t + 1e-9:
                    net.crash(self.stops.pop(0)[1])
                step = poll if self.active else end - t
                if actions:
                    step = min(step, actions[0][0] * self.period - t)
                step = max(min(step, end - t), 1e-6)
                up = len(self.members())
                net.run_until(t + step)
                self.member_periods += up * step / self.period
                t += step
                self.observe()
            if progress is not None:
                progress(period + 1)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        return self.result(cpu, wall)

    def result(self, cpu: float, wall: float) -> Result:
        # "All members" of a crash: those up at the end, late joiners included;
        # one that never heard of the crashed node (push-pull does not add the
        # dead) holds no wrong view and is not waited for.
        members = self.members()
        now_members = {n.id for n in members}
        for track in self.crashed.values():
            never_knew = {n.id for n in members if track.id not in n.swim.members}
            track.finish(now_members, never_knew)
        counters: dict[str, int] = {}
        for n in self.net.nodes.values():
            for k, v in n.swim.counters.items():
                counters[k] = counters.get(k, 0) + v
        counters.update({f"net_{k}": v for k, v in self.net.counters.items()})
        return Result(
            scenario=self.sc,
            bounds=self.cfg.suspicion_bounds(self.sc.nodes),
            crashes=sorted(self.crashed.values(), key=lambda c: c.name),
            spreads=self.spreads,
            false_dead=self.false_dead,
            false_dead_declarations=self.false_declarations,
            false_suspicions=self.false_suspicions,
            tx_packets=sum(n.tx_packets for n in self.net.nodes.values()),
            tx_bytes=sum(n.tx_bytes for n in self.net.nodes.values()),
            member_periods=self.member_periods,
            counters=counters,
            cpu_seconds=cpu,
            wall_seconds=wall,
        )


def _knows(swim, node: bytes) -> bool:
    m = swim.members.get(node)
    return m is not None and m.state.live


def _has_generation(swim, node: bytes, generation: int) -> bool:
    m = swim.members.get(node)
    return m is not None and m.meta.generation >= generation


def simulate(sc: Scenario, progress: Callable[[int], None] | None = None) -> Result:
    """Run ``sc`` to the end; ``progress(period)`` is called after each period."""
    cpu0 = time.process_time()
    run = _Run(sc)
    setup = time.process_time() - cpu0
    result = run.run(progress)
    result.setup_cpu_seconds = setup
    return result


def analytic_bounds(profile: str, n: int) -> tuple[float, float]:
    """memberlist's suspicion (min, max) for ``n`` members under ``profile``."""
    return PROFILES[profile].suspicion_bounds(n)


def log_fit(ns: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + c·ln N``; returns (a, c)."""
    xs = [math.log(n) for n in ns]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - c * mx, c
