"""Faults injected in a node's own transport (``meshd run --fault``).

They behave as the same rule would in a real packet filter, so a test
in-process and a test on the netns testbed mean the same thing:

- ``drop:HOST:PORT``: our direct packets to that peer are lost, one direction
  only; its datagrams to us still arrive. A stream between us cannot complete
  either way, since its handshake needs both directions. The relay works.
- ``isolate``: we reach nobody and nobody reaches us, relay included.
- ``loss:P`` (0 <= P < 1) and ``delay:MS``: on our outgoing direct packets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .udp import AddressError, format_addr, parse_addr


class FaultSpecError(ValueError):
    """A ``--fault`` spec that cannot be understood; the message says why."""


@dataclass
class Faults:
    drop_to: set[str] = field(default_factory=set)
    isolate: bool = False
    loss: float = 0.0
    delay_s: float = 0.0
    rng: random.Random = field(default_factory=random.Random, repr=False)

    @classmethod
    def parse(cls, specs: list[str]) -> Faults:
        faults = cls()
        for spec in specs:
            kind, sep, arg = spec.partition(":")
            if kind == "isolate" and not sep:
                faults.isolate = True
            elif kind == "drop" and sep:
                try:
                    host, port = parse_addr(arg)
                except AddressError as exc:
                    raise FaultSpecError(f"--fault {spec}: {exc}") from None
                faults.drop_to.add(format_addr(host, port))
            elif kind == "loss" and sep:
                faults.loss = _number(spec, arg)
                if not 0 <= faults.loss < 1:
                    raise FaultSpecError(f"--fault {spec}: loss must be in [0, 1)")
            elif kind == "delay" and sep:
                ms = _number(spec, arg)
                if ms < 0:
                    raise FaultSpecError(f"--fault {spec}: delay must not be negative")
                faults.delay_s = ms / 1000
            else:
                raise FaultSpecError(
                    f"--fault {spec!r}: expected drop:HOST:PORT, isolate, loss:P or delay:MS"
                )
        return faults

    @property
    def active(self) -> bool:
        return bool(self.drop_to or self.isolate or self.loss or self.delay_s)

    def direct_out_lost(self, addr: str) -> bool:
        """True if a direct datagram we send to ``addr`` is to be lost."""
        if self.isolate or addr in self.drop_to:
            return True
        return self.loss > 0 and self.rng.random() < self.loss

    def direct_in_lost(self, addr: str) -> bool:
        return self.isolate

    def stream_blocked(self, addr: str) -> bool:
        """A stream to or from ``addr`` cannot complete its handshake."""
        return self.isolate or addr in self.drop_to

    def relay_blocked(self) -> bool:
        return self.isolate

    def describe(self) -> list[str]:
        out = [f"drop:{a}" for a in sorted(self.drop_to)]
        if self.isolate:
            out.append("isolate")
        if self.loss:
            out.append(f"loss:{self.loss:g}")
        if self.delay_s:
            out.append(f"delay:{self.delay_s * 1000:g}")
        return out


def _number(spec: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise FaultSpecError(f"--fault {spec}: {text!r} is not a number") from None
