"""Signed facts: what each member says about itself, and who accuses whom.

A member's own facts (Alive with its incarnation, address and metadata; its
name claims; its leave; its path summary) carry its ed25519 signature, and
accusations (Suspect, Dead) carry the accuser's, so no member can speak for
another: a `left` is only ever the member's own word, Lifeguard's
confirmations count distinct signed accusers, and a live member's signed
refutation always wins.

The core signs and checks through :class:`Facts`.  A node fills it with its
identity (:class:`SignedFacts`); the simulator with :class:`Unsigned`, which
signs nothing and takes everything, because an ed25519 check costs about
100 µs and a thousand simulated nodes would spend minutes on them.

Each kind of fact signs its own label, so a signature over one kind never
passes for another.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import msgpack

from ..identity import Identity, verify
from ..wire import KeyringChange, Meta, NameClaim, PathSummary

# Checks we remember: a fact travels to each member several times (gossip, push-pull).
VERIFIED_CACHE = 8192


class Facts(Protocol):
    signing: bool  # False: nothing is signed and every fact is taken (the simulator)

    def sign(self, data: bytes) -> bytes: ...

    def verify(self, node: bytes, sig: bytes, data: bytes) -> bool: ...


class Unsigned:
    """No signatures: for the simulator, where every node is ours."""

    signing = False

    def sign(self, data: bytes) -> bytes:
        return b""

    def verify(self, node: bytes, sig: bytes, data: bytes) -> bool:
        return True


class SignedFacts:
    """Signs with a node's identity; checks with the signer's node id (its public key)."""

    signing = True

    def __init__(self, identity: Identity) -> None:
        self._identity = identity
        self._checked: OrderedDict[tuple[bytes, bytes, bytes], bool] = OrderedDict()

    def sign(self, data: bytes) -> bytes:
        return self._identity.sign(data)

    def verify(self, node: bytes, sig: bytes, data: bytes) -> bool:
        if not sig:
            return False
        key = (node, sig, data)
        held = self._checked.get(key)
        if held is None:
            held = self._checked[key] = verify(node, sig, data)
            if len(self._checked) > VERIFIED_CACHE:
                self._checked.popitem(last=False)
        return held


def _pack(label: str, *fields: object) -> bytes:
    return msgpack.packb(["meshd fact v1", label, *fields], use_bin_type=True)


def alive_data(node: bytes, incarnation: int, addr: str, meta: Meta) -> bytes:
    """What a member signs to say it lives at ``addr`` with ``meta`` in ``incarnation``."""
    return _pack("alive", node, incarnation, addr, meta.to_body())


def accusation_data(kind: str, node: bytes, incarnation: int, accuser: bytes) -> bytes:
    """What ``accuser`` signs to say ``node`` is suspect or dead (``kind``); a leave is the
    member's own ``dead``."""
    return _pack(kind, node, incarnation, accuser)


def claim_data(claim: NameClaim) -> bytes:
    return _pack("name", claim.name, claim.owner, claim.clock, claim.tombstone)


def paths_data(summary: PathSummary) -> bytes:
    return _pack("paths", summary.node, summary.version, [e.to_body() for e in summary.entries])


def keyring_change_data(change: KeyringChange) -> bytes:
    return _pack("keyring", change.issuer, change.clock, change.op, change.key_id, change.key)
