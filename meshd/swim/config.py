"""Protocol timings, as memberlist's three profiles (LAN, WAN, local)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ..wire import GOSSIP_BUDGET_BYTES


@dataclass(frozen=True)
class Config:
    """Defaults are memberlist's DefaultLANConfig; times are in seconds."""

    probe_interval: float = 1.0
    probe_timeout: float = 0.5
    indirect_checks: int = 3
    retransmit_mult: int = 4
    suspicion_mult: int = 4
    suspicion_max_timeout_mult: int = 6
    push_pull_interval: float = 30.0
    gossip_interval: float = 0.2
    gossip_nodes: int = 3
    gossip_to_the_dead_time: float = 30.0
    awareness_max_multiplier: int = 8
    # meshd's own, not memberlist's (see Swim._gossip): a gossip tick sends only
    # while some queued fact has gone out fewer than gossip_fresh_transmits times,
    # and each packet is paid from a token bucket that refills at
    # gossip_per_period packets per probe interval and holds gossip_burst.  The
    # rest of the dissemination rides on probe traffic.
    gossip_per_period: float = 0.5
    gossip_burst: int = 24
    gossip_fresh_transmits: int = 6
    gossip_budget: int = GOSSIP_BUDGET_BYTES
    # Until a seed answers, the join is retried this often.
    join_retry_interval: float = 1.0
    # Serf's reconnect: every reconnect_interval the mesh asks each member declared
    # dead (not left) in the last reconnect_timeout back, at its last address, so a
    # restarted node that knows nobody (a seed restarted without seeds) is found
    # again; one answered ask brings it back (see Swim._reconnect).  Serf asks every
    # 30 s for 24 h, for agents that come back whenever; a run's nodes restart within
    # seconds, and an ask is one small packet per dead member and interval for the
    # whole mesh, so meshd asks far sooner and gives up after an hour.
    reconnect_interval: float = 2.0
    reconnect_timeout: float = 3600.0

    def with_(self, **changes: Any) -> Config:
        return replace(self, **changes)

    def suspicion_bounds(self, n: int) -> tuple[float, float]:
        """(min, max) suspicion timeout for a cluster of ``n`` members."""
        low = suspicion_timeout(self.suspicion_mult, n, self.probe_interval)
        return low, self.suspicion_max_timeout_mult * low

    def retransmit_limit(self, n: int) -> int:
        """How often a fact is piggybacked: retransmit_mult · ceil(log10(n+1))."""
        return self.retransmit_mult * math.ceil(math.log10(n + 1))

    def push_pull_interval_for(self, n: int) -> float:
        """memberlist's pushPullScale: back off push-pull beyond 32 members."""
        if n <= 32:
            return self.push_pull_interval
        return self.push_pull_interval * (math.ceil(math.log2(n) - math.log2(32)) + 1)


def suspicion_timeout(mult: int, n: int, interval: float) -> float:
    """memberlist's suspicionTimeout: mult · max(1, log10(n)) · interval."""
    return mult * max(1.0, math.log10(max(1.0, n))) * interval


LAN = Config()
WAN = Config(
    probe_interval=5.0,
    probe_timeout=3.0,
    suspicion_mult=6,
    push_pull_interval=60.0,
    gossip_interval=0.5,
    gossip_nodes=4,
    gossip_to_the_dead_time=60.0,
    join_retry_interval=5.0,
    reconnect_interval=10.0,
)
LOCAL = Config(
    probe_interval=1.0,
    probe_timeout=0.2,
    indirect_checks=1,
    retransmit_mult=2,
    suspicion_mult=3,
    push_pull_interval=15.0,
    gossip_interval=0.1,
    gossip_to_the_dead_time=15.0,
    # A restarted seed is found within about a second, well within the 5 s a restart may take.
    reconnect_interval=1.0,
)
PROFILES = {"lan": LAN, "wan": WAN, "local": LOCAL}
