"""The simulated network under ``meshd sim``: latency laws and one-way blocked links.

Built on :class:`meshd.sim.memnet.MemNet`, which runs the real SWIM core.
This module only decides how long a packet takes and which directions of
which links are blocked, and whether a relay carries what a blocked direction
cannot.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from .memnet import MemNet, SimNode


class SpecError(ValueError):
    """A latency spec that does not parse; the CLI turns it into a usage error."""


@dataclass(frozen=True)
class Latency:
    """One-way delay law, in seconds: ``fixed``, ``uniform`` or ``lognormal``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Latency:
        """``fixed:MS``, ``uniform:LO:HI`` (ms) or ``lognormal:MEDIAN:SIGMA`` (ms, shape)."""
        kind, _, rest = text.partition(":")
        try:
            nums = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            raise SpecError(f"latency {text!r}: numbers expected after the kind") from None
        if any(not math.isfinite(x) or x < 0 for x in nums):
            raise SpecError(f"latency {text!r}: values must be finite and >= 0")
        if kind == "fixed" and len(nums) == 1:
            return cls("fixed", nums[0] / 1000)
        if kind == "uniform" and len(nums) == 2 and nums[0] <= nums[1]:
            return cls("uniform", nums[0] / 1000, nums[1] / 1000)
        if kind == "lognormal" and len(nums) == 2 and nums[0] > 0:
            return cls("lognormal", nums[0] / 1000, nums[1])
        raise SpecError(
            f"latency {text!r}: expected fixed:MS, uniform:LO:HI (LO <= HI) or lognormal:MEDIAN:SIGMA"
        )

    def sampler(self) -> Callable[[random.Random], float]:
        a, b = self.a, self.b
        if self.kind == "fixed":
            return lambda rng: a
        if self.kind == "uniform":
            span = b - a
            return lambda rng: a + span * rng.random()
        mu = math.log(a)
        return lambda rng: rng.lognormvariate(mu, b)

    @property
    def median(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a * 1000:g}"
        if self.kind == "uniform":
            return f"uniform:{self.a * 1000:g}:{self.b * 1000:g}"
        return f"lognormal:{self.a * 1000:g}:{self.b:g}"


def block_one_way(net: MemNet, nodes: list[SimNode], fraction: float, rng: random.Random,
                  relay: bool, relay_delay: float, loss: float) -> int:
    """Block ``fraction`` of the ordered pairs among ``nodes``, one direction each.

    Without a relay every packet on a blocked direction is lost.  With one,
    it goes the long way round: two hops (so the loss applies twice) and
    ``relay_delay`` more.  Returns how many directions were blocked.
    """
    n = len(nodes)
    pairs = n * (n - 1)
    count = round(fraction * pairs)
    if count == 0:
        return 0
    for k in sorted(rng.sample(range(pairs), count)):
        i, j = divmod(k, n - 1)
        if j >= i:
            j += 1  # skip the diagonal
        fault = net.fault(nodes[i], nodes[j])
        if relay:
            fault.loss = 1 - (1 - loss) ** 2
            fault.delay += relay_delay
        else:
            fault.drop = True
    return count
