"""Node identity: an ed25519 key per node. The NodeId is the public key.

Logs name peers by the 8-hex prefix of their id; the boot line ties each
prefix to a stage.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PREFIX_HEX = 8


class IdentityError(Exception):
    """The key file cannot be used; the message says why and where."""


def prefix(node_id: bytes) -> str:
    return node_id.hex()[:PREFIX_HEX]


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey

    @cached_property
    def node_id(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def prefix(self) -> str:
        return prefix(self.node_id)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    def to_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def verify(node_id: bytes, signature: bytes, data: bytes) -> bool:
    """True if ``signature`` over ``data`` was made by the key behind ``node_id``."""
    try:
        Ed25519PublicKey.from_public_bytes(node_id).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def read_small_file(path: str | os.PathLike, limit: int = 1 << 20) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes, for the key files and
    lists meshd reads whole.  A pipe would block the read until a writer came and a device
    such as /dev/zero never ends, so both raise OSError, as a file past ``limit`` does; its
    strerror says which."""
    with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a pipe or a device)", str(path))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data


def load_or_create(path: str | os.PathLike) -> Identity:
    """Load the node key at ``path``, creating it (mode 0600) if it is missing."""
    path = Path(path)
    try:
        data = read_small_file(path)
    except FileNotFoundError:
        return _create(path)
    except OSError as exc:
        raise IdentityError(f"cannot read key file {path}: {exc.strerror}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(
            f"key file {path} is not an unencrypted PEM ed25519 private key; "
            "move it away to create a new identity"
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"key file {path} holds a {type(key).__name__}, not an ed25519 key")
    return Identity(key)


def _create(path: Path) -> Identity:
    identity = Identity.generate()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_pem())
            f.flush()
            os.fsync(f.fileno())
        try:
            # link() is atomic and never clobbers: a key another process wrote
            # in the meantime wins, and nobody ever reads a half-written file.
            os.link(tmp, path)
        except FileExistsError:
            return load_or_create(path)
    except OSError as exc:
        raise IdentityError(f"cannot create key file {path}: {exc.strerror}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return identity


def hold_key_file(path: str | os.PathLike) -> int | None:
    """Take the lock beside the key file (``<key-file>.lock``) for this process's life: a
    second ``meshd run`` with the same key on this host is an error, not a twin that fights
    ours for the node id (swim/twin.py finds twins on other hosts).  Returns the lock's file
    descriptor, None where no lock file can be made (a read-only directory).  The lock goes
    with the process however it ends."""
    import fcntl

    lock = Path(f"{path}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip()
        os.close(fd)
        if holder == str(os.getpid()):
            return None  # this process holds it already
        who = f"another meshd run (pid {holder})" if holder.isdigit() else "another meshd run"
        raise IdentityError(f"{who} uses the key file {path} on this host: stop it, or give this "
                            "node a key file of its own") from None
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.set_inheritable(fd, False)
    return fd


def load_node_ids(path: str | os.PathLike) -> frozenset[bytes]:
    """The node ids listed in ``path`` (``--allow-nodes``): one full id (64 hex digits, as the
    boot line prints it) per line; ``#`` starts a comment.  IdentityError says what is wrong."""
    path = Path(path)
    try:
        text = read_small_file(path, 64 << 20).decode()
    except OSError as exc:
        raise IdentityError(f"cannot read node id list {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise IdentityError(f"cannot read node id list {path}: {exc}") from None
    ids = set()
    for n, line in enumerate(text.splitlines(), 1):
        word = line.split("#", 1)[0].strip()
        if not word:
            continue
        try:
            node_id = bytes.fromhex(word)
        except ValueError:
            node_id = b""
        if len(node_id) != 32:
            raise IdentityError(f"{path} line {n}: expected a node id of 64 hex digits, got {word[:70]!r}")
        ids.add(node_id)
    if not ids:
        raise IdentityError(f"node id list {path} names no node")
    return frozenset(ids)
