"""``meshd sim``: the real SWIM core on a simulated network, at scale."""

from .scenario import Result, Scenario, simulate

__all__ = ["Result", "Scenario", "simulate"]
