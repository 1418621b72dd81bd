"""Faults injected in a node's own transport (``meshd run --fault``).

They behave as the same rule would in a real packet filter, so a test
in-process and a test on the netns testbed mean the same thing:

- ``drop:HOST:PORT``: our direct packets to that peer are lost, one direction
  only; its datagrams to us still arrive. A stream between us cannot complete
  either way, since its handshake needs both directions. The relay works.
- ``isolate``: we reach nobody and nobody reaches us, relay included.
- ``loss:P`` (0 <= P < 1) and ``delay:MS``: on everything we send directly,
  as tc netem on our interface holds it (the netns testbed puts netem on
  every job's).  Gossip datagrams are lost with probability P, and each
  leaves MS late.  Our data streams (dialled and accepted: data chunks and
  acks) run over a :class:`~.netem_socket.NetemSocket`: each write leaves MS
  late, and in order.  TCP loses no bytes: a lost segment is sent again after
  a retransmission timeout, and nothing written after it is delivered before
  it.  So with probability P a write is held back RTO_S (200 ms, Linux's
  minimum retransmission timeout; the kernel's own is that plus about a
  round trip) more, and everything behind it waits too.  A connect takes MS
  (our SYN's way there; the SYN-ACK is the peer's to delay, in-process it is
  not), and with probability P our SYN is lost and sent again after
  SYN_RTO_S (1 s, Linux's initial retransmission timeout), which outlasts the
  channel's dial timeout as it does on the testbed.  What we send over the
  relay is held the same way, each payload in order (the node queues it
  until it is due), as netem holds the relay connection's packets; the
  relay's own way back is not (on the testbed the relay's netem holds it
  too, so a relayed hop there costs two delays).

  The model is per write, not per segment: a write that netem would cut into
  many segments stalls with probability P, not with the chance that any one
  of them is lost, and a loss is never recovered faster than RTO_S (fast
  retransmit, which needs later segments in flight).  For a pipeline's
  one-frame activations that is what TCP does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .udp import AddressError, format_addr, parse_addr

RTO_S = 0.2  # Linux's minimum retransmission timeout (TCP_RTO_MIN)
SYN_RTO_S = 1.0  # Linux's initial retransmission timeout, a lost SYN's (TCP_TIMEOUT_INIT)
MAX_DELAY_MS = 60_000.0  # a minute each way: past every timeout of the mesh, so a test of any of them fits


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
                if not 0 <= ms <= MAX_DELAY_MS:
                    raise FaultSpecError(f"--fault {spec}: delay must be from 0 to {MAX_DELAY_MS:g} ms")
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
        return self._lost()

    @property
    def stream_faults(self) -> bool:
        """Whether our data streams' writes are held (see the module's doc)."""
        return bool(self.loss or self.delay_s)

    def stream_send_delay(self) -> float:
        """How long after it is made a write to a data stream leaves: the delay, and an RTO
        more when the write is lost."""
        return self.delay_s + (RTO_S if self._lost() else 0.0)

    def connect_delay(self) -> float:
        """How much longer than the network's own our connect takes: our SYN's delay, and
        SYN_RTO_S more when it is lost."""
        return self.delay_s + (SYN_RTO_S if self._lost() else 0.0)

    def _lost(self) -> bool:
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
        value = float(text)
    except ValueError:
        raise FaultSpecError(f"--fault {spec}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise FaultSpecError(f"--fault {spec}: {text!r} is not a finite number")
    return value
