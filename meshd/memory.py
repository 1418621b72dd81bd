"""What a node remembers across a restart: the members it knew and its name clock.

A seed restarted without ``--seed`` knows nobody, and the mesh would wait for
someone to introduce it.  With this file, written beside the key file as
``<key-file>.state.json``, it asks the members it knew last instead, and its
name claims continue past the clock its last process used (DESIGN "Names"):
a new claim must beat the entries the old process left behind.

The file is a hint, never a source of trust: what it names is only asked to
join, exactly as a ``--seed`` would be.  So loading never fails: a missing
file is a first start, and a corrupt, oversized or ill-typed one gives an
empty memory and one warning line.  Writes are atomic (a temporary file,
then ``os.replace``), so a crash mid-write leaves the old file whole.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .net.udp import AddressError, parse_addr
from .swim.state import Member, State
from .wire import COUNTER_MAX

log = logging.getLogger("meshd.memory")

FORMAT_VERSION = 1

# Members remembered at most: a handful that answers is enough to rejoin, and a
# restart sends each of them a join every retry interval until one does.
MAX_REMEMBERED = 64

# 64 members at well under 200 bytes each, with room to spare; anything bigger
# was not written by us and is not parsed.
MAX_FILE_BYTES = 64 * 1024

MAX_NAME_CHARS = 64
MAX_ADDR_CHARS = 262  # "[" + the longest IPv6 text with a zone + "]:65535", and then some


def state_file_for(key_file: str) -> str:
    """Where the memory of the node whose key is ``key_file`` lives."""
    return f"{key_file}.state.json"


class StateFileError(ValueError):
    """The bytes are not a state file this version can use."""


@dataclass(frozen=True, slots=True)
class RememberedMember:
    id: bytes
    addr: str  # its gossip address, HOST:PORT
    name: str  # its run name, for the reader of the file


@dataclass(frozen=True, slots=True)
class NodeMemory:
    name_clock: int = 0  # the highest clock our own name claims used
    members: tuple[RememberedMember, ...] = ()  # most recently seen alive first

    def addrs(self, own_id: bytes, own_addr: str) -> list[str]:
        """The remembered members' addresses to join through, in order, ours left out."""
        out: list[str] = []
        for m in self.members:
            if m.id != own_id and m.addr != own_addr and m.addr not in out:
                out.append(m.addr)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "name_clock": self.name_clock,
            "members": [{"id": m.id.hex(), "addr": m.addr, "name": m.name} for m in self.members],
        }


def remember(members: Iterable[Member], own_id: bytes, name_clock: int,
             previous: NodeMemory = NodeMemory()) -> NodeMemory:
    """What to remember of the core's member list.

    Live members first (by name, so the file changes only when membership
    does), then the dead, most recently died first, then members of
    ``previous`` this process has not heard of (a restart that found nobody
    yet must not forget whom to ask next time).  A member that left said
    goodbye and is not remembered.
    """
    live: list[Member] = []
    dead: list[Member] = []
    known: set[bytes] = {own_id}
    for m in members:
        known.add(m.id)
        if m.id == own_id or not _valid_addr(m.addr):
            continue
        if m.state.live:
            live.append(m)
        elif m.state is State.DEAD:
            dead.append(m)
    picked = heapq.nsmallest(MAX_REMEMBERED, live, key=lambda m: (m.name, m.id))
    room = MAX_REMEMBERED - len(picked)
    picked += heapq.nsmallest(room, dead, key=lambda m: (-m.state_change, m.id))
    kept = tuple(RememberedMember(m.id, m.addr, m.name[:MAX_NAME_CHARS]) for m in picked)
    older = tuple(r for r in previous.members if r.id not in known)
    return NodeMemory(name_clock, (kept + older)[:MAX_REMEMBERED])


def parse(data: bytes) -> NodeMemory:
    """A state file's bytes as a memory; raises StateFileError naming what is wrong."""
    if len(data) > MAX_FILE_BYTES:
        raise StateFileError(f"{len(data)} bytes, more than the {MAX_FILE_BYTES} a state file takes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise StateFileError(f"not JSON ({exc.__class__.__name__})") from None
    if not isinstance(doc, dict):
        raise StateFileError("not a JSON object")
    version = doc.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise StateFileError(f"version {version!r}, not {FORMAT_VERSION}")
    clock = doc.get("name_clock")
    if type(clock) is not int or not 0 <= clock <= COUNTER_MAX:
        raise StateFileError("name_clock is not a counter")
    entries = doc.get("members")
    if not isinstance(entries, list):
        raise StateFileError("members is not a list")
    members = tuple(_member(entry, i) for i, entry in enumerate(entries[:MAX_REMEMBERED]))
    return NodeMemory(clock, members)


def _member(entry: Any, index: int) -> RememberedMember:
    where = f"members[{index}]"
    if not isinstance(entry, dict):
        raise StateFileError(f"{where} is not an object")
    node, addr, name = entry.get("id"), entry.get("addr"), entry.get("name")
    if not isinstance(node, str) or len(node) != 64:
        raise StateFileError(f"{where}.id is not 64 hex digits")
    try:
        node_id = bytes.fromhex(node)
    except ValueError:
        raise StateFileError(f"{where}.id is not 64 hex digits") from None
    if not isinstance(addr, str) or not _valid_addr(addr):
        raise StateFileError(f"{where}.addr is not HOST:PORT")
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        raise StateFileError(f"{where}.name is not a name")
    return RememberedMember(node_id, addr, name)


def _valid_addr(addr: str) -> bool:
    if len(addr) > MAX_ADDR_CHARS:
        return False
    try:
        parse_addr(addr)
    except AddressError:
        return False
    return True


def load(path: str | os.PathLike[str]) -> NodeMemory:
    """The memory in ``path``: empty when it is missing (a first start), and empty with
    one warning when it cannot be read or used."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return NodeMemory()
    except OSError as exc:
        log.warning("state file %s not read (%s); starting with no remembered members", path, exc.strerror)
        return NodeMemory()
    try:
        return parse(data)
    except StateFileError as exc:
        log.warning("state file %s ignored: %s; starting with no remembered members", path, exc)
        return NodeMemory()


def save(path: str | os.PathLike[str], memory: NodeMemory) -> None:
    """Write ``memory`` to ``path`` atomically (mode 0600, as the key beside it); raises OSError."""
    path = Path(path)
    data = json.dumps(memory.to_json(), indent=1).encode() + b"\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
