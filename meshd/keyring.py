"""The mesh key: a keyring of shared secrets that admits members.

Every gossip datagram and relay payload is sealed with the keyring's primary
key (AES-256-GCM: a random 96-bit nonce per packet, a 128-bit tag), and a
packet opens with any key in the ring, so a mesh rotates its key with no
downtime, as memberlist's keyring does: install the new key everywhere, use
it, then remove the old one.  A packet that opens with no key is dropped.

A sealed packet is ``MAGIC | key id (4) | nonce (12) | ciphertext | tag (16)``.
The key id is a digest of the key, never the key: it only says which key to
try.  A key file holds one key per line, base64, the primary first; ``#``
starts a comment.

What it costs (``bench/seal.py``: medians per call, on the shared 2-core VM
the other figures in docs/performance.md come from): seal 3-6 µs and open
2-4 µs for a 200-byte or a 1200-byte packet (the spread is the VM's, not the
size's), against 40-55 µs to sign and 130-170 µs to check an ed25519
signature.  A node sealing and opening a few hundred packets a second spends
about a millisecond a second on it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .identity import read_small_file

KEY_BYTES = 32
KEY_ID_BYTES = 4
NONCE_BYTES = 12
TAG_BYTES = 16
MAGIC = b"\xa7"
SEAL_OVERHEAD = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES + TAG_BYTES
MAC_BYTES = 16
MAX_KEYS = 8  # as many as Meta.keyring carries


class KeyringError(Exception):
    """A key or key file that cannot be used; the message says why and where."""


def key_id(key: bytes) -> str:
    """The public name of ``key``: 8 hex digits of a digest, safe to log and gossip."""
    return _raw_id(key).hex()


def _raw_id(key: bytes) -> bytes:
    return hashlib.sha256(b"meshd mesh key id\0" + key).digest()[:KEY_ID_BYTES]


def generate_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode()


def decode_key(text: str) -> bytes:
    """A key as users pass it (base64 of 32 bytes); KeyringError says what is wrong."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KeyringError(f"a mesh key is base64 of {KEY_BYTES} bytes: {exc}") from None
    if len(key) != KEY_BYTES:
        raise KeyringError(f"a mesh key is {KEY_BYTES} bytes, this one is {len(key)}")
    return key


class Keyring:
    """The mesh keys a node holds; ``keys[0]`` seals, every key opens."""

    def __init__(self, keys: list[bytes]) -> None:
        if not keys:
            raise KeyringError("a keyring holds at least one key")
        self._keys: list[bytes] = []
        self._aead: dict[bytes, tuple[bytes, AESGCM]] = {}
        for key in keys:
            self.install(key)

    # --- what the ring holds

    @property
    def ids(self) -> list[str]:
        """Key ids, the primary first."""
        return [key_id(k) for k in self._keys]

    @property
    def primary_id(self) -> str:
        return key_id(self._keys[0])

    @property
    def primary_key(self) -> bytes:
        """The key that seals: what ``meshd keys install`` sends out of a key file."""
        return self._keys[0]

    def has(self, kid: str) -> bool:
        return kid in self.ids

    def install(self, key: bytes) -> bool:
        """Add ``key`` (not primary); False if it was there already."""
        if len(key) != KEY_BYTES:
            raise KeyringError(f"a mesh key is {KEY_BYTES} bytes, this one is {len(key)}")
        if key in self._keys:
            return False
        if len(self._keys) >= MAX_KEYS:
            raise KeyringError(f"a keyring holds at most {MAX_KEYS} keys; remove one first")
        raw = _raw_id(key)
        if raw in self._aead:
            # A packet names its key by id alone: two keys under one id cannot both open.
            raise KeyringError(f"key {raw.hex()} has the id of a key already held; generate another")
        self._keys.append(key)
        self._aead[raw] = (key, AESGCM(key))
        return True

    def use(self, kid: str) -> bool:
        """Make the key ``kid`` the one that seals; False if it already was."""
        key = self._find(kid)
        if key is self._keys[0]:
            return False
        self._keys.remove(key)
        self._keys.insert(0, key)
        return True

    def remove(self, kid: str) -> bool:
        """Drop the key ``kid``; the primary cannot go (use another first)."""
        key = self._find(kid)
        if key is self._keys[0]:
            raise KeyringError(f"key {kid} is the one in use; use another key before removing it")
        self._keys.remove(key)
        del self._aead[_raw_id(key)]
        return True

    def apply(self, op: str, kid: str, key: bytes = b"") -> bool:
        """One rotation step, as ``meshd keys`` and a KeyringChange name it: ``install`` the key
        ``key`` (whose id is ``kid``), ``use`` or ``remove`` the key ``kid``.  Whether the ring
        changed; KeyringError says why it cannot."""
        if op == "install":
            if key_id(key) != kid:
                raise KeyringError(f"the key to install is not key {kid}")
            return self.install(key)
        if op == "use":
            return self.use(kid)
        if op == "remove":
            if not self.has(kid):
                return False
            return self.remove(kid)
        raise KeyringError(f"unknown keyring operation {op!r}: install, use or remove")

    def _find(self, kid: str) -> bytes:
        for key in self._keys:
            if key_id(key) == kid:
                return key
        raise KeyringError(f"no key {kid} in the keyring (it holds {', '.join(self.ids)})")

    # --- sealing packets

    def seal(self, data: bytes, aad: bytes = b"") -> bytes:
        key = self._keys[0]
        nonce = os.urandom(NONCE_BYTES)
        raw = _raw_id(key)
        return MAGIC + raw + nonce + self._aead[raw][1].encrypt(nonce, data, MAGIC + raw + aad)

    def open(self, data: bytes, aad: bytes = b"") -> bytes | None:
        """The plaintext of a sealed packet, or None if no key of ours sealed it."""
        if len(data) < SEAL_OVERHEAD or data[:1] != MAGIC:
            return None
        raw = data[1 : 1 + KEY_ID_BYTES]
        held = self._aead.get(raw)
        if held is None:
            return None
        nonce = data[1 + KEY_ID_BYTES : 1 + KEY_ID_BYTES + NONCE_BYTES]
        try:
            return held[1].decrypt(nonce, data[1 + KEY_ID_BYTES + NONCE_BYTES :], MAGIC + raw + aad)
        except InvalidTag:
            return None

    # --- proving the key in a handshake

    def mac(self, data: bytes) -> bytes:
        """A proof that we hold the primary key: its raw id and a MAC of ``data`` under it."""
        return _proof(self._keys[0], data)

    def macs(self, data: bytes) -> list[bytes]:
        """One :meth:`mac` proof per key we hold, the primary's first: a peer (a relay) whose
        ring is behind a rotation still finds one it can check."""
        return [_proof(key, data) for key in self._keys]

    def check_mac(self, data: bytes, proof: bytes) -> bool:
        """Whether ``proof`` (from :meth:`mac`) was made with a key we hold."""
        if len(proof) != KEY_ID_BYTES + MAC_BYTES:
            return False
        held = self._aead.get(proof[:KEY_ID_BYTES])
        if held is None:
            return False
        return hmac.compare_digest(_proof(held[0], data), proof)

    # --- files

    def to_text(self) -> str:
        lines = ["# meshd mesh keyring: the first key seals, every key opens. Keep it secret."]
        lines += [encode_key(k) for k in self._keys]
        return "\n".join(lines) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write the ring to ``path`` (mode 0600), atomically: a restart comes back with it."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # a leftover temp file keeps its mode through O_CREAT
            with os.fdopen(fd, "w") as f:
                f.write(self.to_text())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise KeyringError(f"cannot write mesh key file {path}: {exc.strerror}") from exc


def parse_change(op: str, text: str) -> tuple[str, bytes]:
    """What a user's KEY names for ``op``: ``(key id, key)``.  ``install`` takes the key
    (base64); ``use`` and ``remove`` a key or its id, and the key stays b"" since only its
    id needs to travel."""
    if op not in ("install", "use", "remove"):
        raise KeyringError(f"unknown keyring operation {op!r}: install, use or remove")
    text = text.strip()
    if op != "install" and len(text) == 2 * KEY_ID_BYTES and all(c in "0123456789abcdefABCDEF" for c in text):
        return text.lower(), b""
    try:
        key = decode_key(text)
    except KeyringError as exc:
        if op == "install":
            raise
        raise KeyringError(f"not a key id ({2 * KEY_ID_BYTES} hex digits) nor a key: {exc}") from None
    return key_id(key), key if op == "install" else b""


def change_done(op: str, kid: str, ids: list[str] | tuple[str, ...]) -> bool:
    """Whether a member holding the keys ``ids`` (the sealing one first) has done ``op`` on
    key ``kid``: holds it (install), seals with it (use), no longer holds it (remove)."""
    if op == "install":
        return kid in ids
    if op == "use":
        return bool(ids) and ids[0] == kid
    return kid not in ids


def _proof(key: bytes, data: bytes) -> bytes:
    return _raw_id(key) + hmac.digest(key, b"meshd mesh proof\0" + data, "sha256")[:MAC_BYTES]


def load(path: str | os.PathLike) -> Keyring:
    """The keyring in ``path``; KeyringError names the file and what is wrong with it."""
    path = Path(path)
    try:
        text = read_small_file(path).decode()
    except FileNotFoundError:
        raise KeyringError(f"mesh key file {path} does not exist (make one with: meshd keys generate "
                           f"--out {path})") from None
    except OSError as exc:
        raise KeyringError(f"cannot read mesh key file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise KeyringError(f"cannot read mesh key file {path}: {exc}") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            keys.append(decode_key(line))
        except KeyringError as exc:
            raise KeyringError(f"{path} line {n}: {exc}") from None
    if not keys:
        raise KeyringError(f"mesh key file {path} holds no key")
    if len(keys) > MAX_KEYS:
        raise KeyringError(f"mesh key file {path} holds {len(keys)} keys; at most {MAX_KEYS}")
    return Keyring(keys)


def generate_file(path: str | os.PathLike) -> Keyring:
    """A new keyring of one fresh key at ``path``; refuses to overwrite a file."""
    path = Path(path)
    if path.exists():
        raise KeyringError(f"{path} exists; meshd will not overwrite a mesh key")
    ring = Keyring([generate_key()])
    ring.save(path)
    return ring
