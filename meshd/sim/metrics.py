"""What ``meshd sim`` measures: per-crash detection, per-fact spread, and
helpers that keep the printed numbers stable (rounded, sorted)."""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass, field


@dataclass
class CrashTrack:
    """One crashed node: when it went down and when the others noticed."""

    name: str
    id: bytes
    at: float
    first_suspect: float | None = None
    dead_at: dict[bytes, float] = field(default_factory=dict)  # observer -> first DEAD
    first_dead: float | None = None
    all_know: float | None = None  # every member still up knows it dead
    missing: int = 0

    def saw_suspect(self, at: float) -> None:
        if self.first_suspect is None or at < self.first_suspect:
            self.first_suspect = at

    def saw_dead(self, observer: bytes, at: float) -> None:
        if observer not in self.dead_at:
            self.dead_at[observer] = at
            if self.first_dead is None or at < self.first_dead:
                self.first_dead = at

    def finish(self, members: Set[bytes], never_knew: Set[bytes] = frozenset()) -> None:
        """Members = nodes up at the end; the crashed node itself is not one.

        A member in ``never_knew`` (a late joiner that never heard of the node:
        push-pull does not add the dead, as memberlist's does not) holds no
        wrong view, so it is not missing; it adds no time either.
        """
        times = [self.dead_at.get(m) for m in members
                 if m != self.id and not (m in never_knew and m not in self.dead_at)]
        self.missing = sum(t is None for t in times)
        known = [t for t in times if t is not None]
        self.all_know = max(known) if known and not self.missing else None

    def to_dict(self) -> dict:
        def rel(t: float | None) -> float | None:
            return None if t is None else t - self.at

        return {
            "node": self.name,
            "crashed_at_s": self.at,
            "first_suspect_s": rel(self.first_suspect),
            "first_dead_s": rel(self.first_dead),
            "all_know_s": rel(self.all_know),
            "all_know_from_first_suspect_s": None if self.all_know is None or self.first_suspect is None
            else self.all_know - self.first_suspect,
            "missing": self.missing,
        }


class Spread:
    """How far one fact (a join, a metadata change) has spread, sampled over time."""

    def __init__(self, kind: str, subject, start: float, period: float,
                 knows: Callable[[object], bool]) -> None:
        self.kind = kind
        self.subject = subject
        self.start = start
        self.period = period
        self.knows = knows
        self.t99: float | None = None
        self.t100: float | None = None

    def sample(self, members: list, now: float) -> bool:
        """Count who knows; True once everyone does (stop sampling)."""
        others = [m for m in members if m is not self.subject]
        if not others:
            return True
        knows = self.knows
        count = sum(1 for m in others if knows(m.swim))
        frac = count / len(others)
        if self.t99 is None and frac >= 0.99:
            self.t99 = now
        if count == len(others):
            self.t100 = now
            return True
        return False

    def rounds(self, t: float | None) -> float | None:
        return None if t is None else (t - self.start) / self.period


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def rounded(obj, digits: int = 4):
    """Round every float in a JSON-able tree, so the text is short and stable."""
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [rounded(v, digits) for v in obj]
    return obj
