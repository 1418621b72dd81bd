"""Rotating the mesh key of a running mesh: one node takes a step, every member follows.

A step (install a key, use it, remove one) is applied where it is asked for,
saved to that node's key file (a restart comes back with the new ring),
published in its metadata (``Meta.keyring``: which keys it holds, the one it
seals with first) and gossiped as its signed KeyringChange; every member
applies it the same way.  Gossip sends a fact only a few times, so the asking
node sends its change again every second until every live member's metadata
shows the step done.  The order install, use, remove is enforced where the
step is asked for, so no member is ever sent a packet it cannot open.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from .keyring import KeyringError, change_done, parse_change
from .swim.facts import keyring_change_data
from .swim.state import Member
from .wire import KeyringChange, next_counter

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger("meshd.node")

# A keyring change we made is gossiped again this often (gossip sends each fact only a few
# times, and push-pull does not carry these) until every live member's metadata shows it
# done, or for this long at most.
KEYRING_RESEND_S = 1.0
KEYRING_RESEND_FOR_S = 120.0


class KeyRotation:
    """A node's part in rotating the mesh key: the steps it asks for and those it follows."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._sent: tuple[KeyringChange, float] | None = None  # our last change, until when

    def change(self, op: str, key: str) -> dict[str, Any]:
        """Change the mesh keyring here and on every member: ``install`` the key ``key``
        (base64), ``use`` or ``remove`` the key ``key`` (the key or its id).  Applied here at
        once, then gossiped as our signed KeyringChange.  KeyringError says what is wrong,
        including a step taken out of order: a ``use`` before every live member holds the
        key (they could not open what we send), a ``remove`` while one still seals with it."""
        ring = self.node.mesh_key
        if ring is None:
            raise KeyringError("this node runs without a mesh key (it was started without --mesh-key-file): "
                               "it has no keyring to change")
        kid, raw = parse_change(op, key)
        if op == "use" and not ring.has(kid):
            raise KeyringError(f"no key {kid} in the keyring here (it holds {', '.join(ring.ids)}): "
                               "install it first")
        core = self.node.core
        others = [m for m in core.members.values() if m.id != core.id and m.state.live]
        if op == "use" and (behind := [m for m in others if kid not in m.meta.keyring]):
            raise KeyringError(f"not every member holds key {kid} yet ({_named(behind)}): install it "
                               "everywhere first")
        if op == "remove" and (users := [m for m in others if m.meta.keyring[:1] == (kid,)]):
            raise KeyringError(f"key {kid} still seals at {_named(users)}: use another key everywhere first")
        changed = self._apply(op, kid, raw, self.node.identity.prefix)
        # Wall-clock microseconds: a restarted node's changes still come after its last ones.
        clock = max(next_counter(core.keyring_clock), time.time_ns() // 1000)
        change = KeyringChange(self.node.node_id, clock, op, kid, raw)
        change = replace(change, sig=self.node.identity.sign(keyring_change_data(change)))
        now = trio.current_time()
        core.keyring_change(change, now)
        self._sent = (change, now + KEYRING_RESEND_FOR_S)
        self.node._after()
        return {"op": op, "key_id": kid, "changed": changed, "keyring": ring.ids}

    async def resend_loop(self) -> None:
        """Gossip our last keyring change again until every live member shows it done: a
        member that missed it would otherwise never hear of it."""
        core = self.node.core
        while True:
            await trio.sleep(KEYRING_RESEND_S)
            if self._sent is None:
                continue
            change, until = self._sent
            behind = [m for m in core.members.values() if m.id != core.id and m.state.live
                      and not change_done(change.op, change.key_id, m.meta.keyring)]
            if not behind or trio.current_time() > until:
                self._sent = None
                continue
            core.keyring_change(change, trio.current_time())  # the same change: applied once each
            self.node._wake.set()

    def changed_by(self, issuer: bytes, change: KeyringChange) -> None:
        """A member's signed KeyringChange: applied here too, unless it would cut us off (a key
        we do not hold cannot seal; our primary cannot go).  Logged, never raised."""
        who = issuer.hex()[:8]
        ring = self.node.mesh_key
        if ring is None:
            log.warning("mesh keyring change %s %s from %s ignored: this node runs without a mesh key",
                        change.op, change.key_id, who)
            return
        if change.op == "use" and not ring.has(change.key_id):
            log.warning("mesh keyring change from %s ignored: use key %s, which we do not hold "
                        "(install it here first)", who, change.key_id)
            return
        if change.op == "remove" and change.key_id == ring.primary_id:
            log.warning("mesh keyring change from %s ignored: remove key %s, the one we seal with "
                        "(use another key here first)", who, change.key_id)
            return
        try:
            self._apply(change.op, change.key_id, change.key, who)
        except KeyringError as exc:
            log.warning("mesh keyring change %s %s from %s not applied: %s", change.op, change.key_id, who,
                        exc)

    def _apply(self, op: str, kid: str, key: bytes, by: str) -> bool:
        """Apply one change to our ring; when it changed, save the key file (a restart comes
        back with it) and tell the members which keys we hold.  KeyringError if it cannot."""
        ring = self.node.mesh_key
        assert ring is not None
        if not ring.apply(op, kid, key):
            return False
        path = self.node.options.mesh_key_file
        if path:
            try:
                ring.save(path)
            except KeyringError as exc:
                log.warning("%s; a restart would come back with the keys the file holds", exc)
        core = self.node.core
        core.set_meta(replace(core.me.meta, keyring=tuple(ring.ids)), trio.current_time())
        self.node.out(f"meshd keyring {op} key={kid} by={by} keys={','.join(ring.ids)}")
        return True


def _named(members: list[Member]) -> str:
    """``stage-1 (2b91108e), stage-2 (91d0a3c4)``: members as an error names them."""
    return ", ".join(f"{m.name} ({m.prefix})" for m in members)


