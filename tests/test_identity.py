"""Node identity: the key file on disk, and signatures made with it."""

from __future__ import annotations

import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from meshd import identity
from meshd.identity import Identity, IdentityError, load_or_create, verify


def _pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


# --- creating and loading ---


def test_creates_missing_key_with_mode_0600_in_missing_dir(tmp_path):
    path = tmp_path / "state" / "nested" / "node.key"
    assert not path.parent.exists()

    ident = load_or_create(path)

    assert path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert isinstance(ident, Identity)


def test_loading_again_yields_same_node_id(tmp_path):
    path = tmp_path / "node.key"
    first = load_or_create(path)
    contents = path.read_bytes()

    second = load_or_create(path)

    assert second.node_id == first.node_id
    assert path.read_bytes() == contents  # loading does not rewrite the file


def test_accepts_str_path(tmp_path):
    path = tmp_path / "node.key"
    assert load_or_create(str(path)).node_id == load_or_create(path).node_id


def test_distinct_files_give_distinct_identities(tmp_path):
    assert load_or_create(tmp_path / "a.key").node_id != load_or_create(tmp_path / "b.key").node_id


def test_loads_a_key_written_elsewhere(tmp_path):
    key = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / "node.key"
    path.write_bytes(_pem(key))
    expected = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert load_or_create(path).node_id == expected


def test_node_id_is_32_bytes_and_prefix_is_first_8_hex(tmp_path):
    ident = load_or_create(tmp_path / "node.key")
    assert type(ident.node_id) is bytes
    assert len(ident.node_id) == 32
    assert ident.prefix == ident.node_id.hex()[:8]
    assert len(ident.prefix) == 8
    assert identity.prefix(ident.node_id) == ident.prefix
    assert identity.prefix(bytes.fromhex("0123456789abcdef") + b"\0" * 24) == "01234567"


def test_does_not_clobber_a_key_written_concurrently(tmp_path, monkeypatch):
    """Another process creates the key between our read and our create: we must adopt its key."""
    path = tmp_path / "node.key"
    theirs = ed25519.Ed25519PrivateKey.generate()
    real_generate = Identity.generate.__func__

    def generate_after_the_other_process_wrote(cls):
        path.write_bytes(_pem(theirs))
        return real_generate(cls)

    monkeypatch.setattr(Identity, "generate", classmethod(generate_after_the_other_process_wrote))

    ident = load_or_create(path)

    assert ident.node_id == Identity(theirs).node_id
    assert path.read_bytes() == _pem(theirs)


# --- signatures ---


def test_sign_verify_round_trip():
    ident = Identity.generate()
    data = b"probe 42"
    sig = ident.sign(data)
    assert len(sig) == 64
    assert verify(ident.node_id, sig, data) is True


def test_verify_rejects_wrong_data():
    ident = Identity.generate()
    assert verify(ident.node_id, ident.sign(b"probe 42"), b"probe 43") is False


def test_verify_rejects_wrong_signature():
    ident = Identity.generate()
    sig = bytearray(ident.sign(b"data"))
    sig[0] ^= 1
    assert verify(ident.node_id, bytes(sig), b"data") is False


@pytest.mark.parametrize("sig", [b"", b"\0" * 63, b"\0" * 65, b"\0" * 64], ids=["empty", "63", "65", "zeros"])
def test_verify_rejects_malformed_signature_without_raising(sig):
    assert verify(Identity.generate().node_id, sig, b"data") is False


def test_verify_rejects_wrong_key():
    signer, other = Identity.generate(), Identity.generate()
    assert verify(other.node_id, signer.sign(b"data"), b"data") is False


@pytest.mark.parametrize("length", [0, 1, 31, 33, 64])
def test_verify_rejects_wrong_length_node_id_without_raising(length):
    ident = Identity.generate()
    sig = ident.sign(b"data")
    node_id = (ident.node_id * 2)[:length]  # starts with the real key, so only the length is wrong
    assert verify(node_id, sig, b"data") is False


def test_verify_rejects_node_id_that_is_not_a_curve_point():
    ident = Identity.generate()
    assert verify(b"\xff" * 32, ident.sign(b"data"), b"data") is False


# --- unusable key files ---


@pytest.mark.parametrize(
    "contents",
    [
        b"",
        b"not a key at all\n",
        b"\x00\xff" * 100,
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    ],
    ids=["empty", "text", "binary", "bad-pem-body"],
)
def test_garbage_key_file_raises_identity_error_with_path(tmp_path, contents):
    path = tmp_path / "node.key"
    path.write_bytes(contents)

    with pytest.raises(IdentityError) as info:
        load_or_create(path)

    assert str(path) in str(info.value)
    assert path.read_bytes() == contents  # a bad key is reported, never replaced


def test_public_key_pem_raises_identity_error(tmp_path):
    path = tmp_path / "node.key"
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    path.write_bytes(
        public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(IdentityError) as info:
        load_or_create(path)
    assert str(path) in str(info.value)


def test_encrypted_key_raises_identity_error(tmp_path):
    path = tmp_path / "node.key"
    key = ed25519.Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    ))
    with pytest.raises(IdentityError) as info:
        load_or_create(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("make_key", "type_name"),
    [
        (lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048), "RSA"),
        (lambda: ec.generate_private_key(ec.SECP256R1()), "EC"),
        (ed448.Ed448PrivateKey.generate, "Ed448"),
    ],
    ids=["rsa", "ec", "ed448"],
)
def test_non_ed25519_key_raises_identity_error_naming_the_type(tmp_path, make_key, type_name):
    path = tmp_path / "node.key"
    path.write_bytes(_pem(make_key()))

    with pytest.raises(IdentityError) as info:
        load_or_create(path)

    message = str(info.value)
    assert type_name in message
    assert str(path) in message
    assert "ed25519" in message


def test_unreadable_key_path_raises_identity_error_with_path(tmp_path):
    # A directory where the key file should be: reading fails with an OSError other than
    # FileNotFoundError. (chmod 000 would not do: the tests may run as root.)
    path = tmp_path / "node.key"
    path.mkdir()

    with pytest.raises(IdentityError) as info:
        load_or_create(path)

    assert str(path) in str(info.value)
    assert path.is_dir()


def test_uncreatable_key_path_raises_identity_error_with_path(tmp_path):
    # The parent "directory" is a regular file, so the key can be neither read nor created.
    parent = tmp_path / "not-a-dir"
    parent.write_bytes(b"")
    path = parent / "node.key"

    with pytest.raises(IdentityError) as info:
        load_or_create(path)

    assert str(path) in str(info.value)
