"""A tiny built-in model for fast tests and ``--stub`` runs: the ``tiny`` preset, seed 0.

Written once per user, to ``$XDG_CACHE_HOME/meshd`` (``~/.cache/meshd``), in a
folder named by the hash of what it holds, so every process (and every run)
shares one copy and a killed process leaves nothing behind.  The folder is
written aside and renamed into place: a reader never sees half of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .checkpoint import fingerprint, init_checkpoint, preset_config, random_weights
from .model import StageModel

STUB_PRESET, STUB_SEED = "tiny", 0


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshd"


def stub_checkpoint() -> Path:
    """The stub checkpoint in the user's cache, written on first use."""
    config = preset_config(STUB_PRESET)
    name = hashlib.sha256(json.dumps([STUB_PRESET, STUB_SEED, config.to_dict()], sort_keys=True).encode())
    path = cache_root() / f"stub-{name.hexdigest()[:16]}"
    if (path / "model.safetensors").exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".stub-", dir=path.parent))
    except OSError:  # no writable cache (a read-only home): this process's own copy
        return _private_copy()
    try:
        init_checkpoint(tmp, STUB_PRESET, seed=STUB_SEED, force=True)
        fingerprint(tmp)  # readable as a whole before it is published
        try:
            os.rename(tmp, path)
        except OSError:  # another process published it first: theirs is the same bytes
            if not (path / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


_private: Path | None = None


def _private_copy() -> Path:
    global _private
    if _private is None:
        import atexit

        _private = Path(tempfile.mkdtemp(prefix="meshd-stub-"))
        atexit.register(shutil.rmtree, _private, ignore_errors=True)
        init_checkpoint(_private, STUB_PRESET, seed=STUB_SEED, force=True)
    return _private


def stub_model(layers: range | None = None, *, embed: bool | None = None, head: bool | None = None,
               seed: int = 0) -> StageModel:
    """The same tiny model, in memory, without touching the disk."""
    config = preset_config("tiny")
    return StageModel(config, random_weights(config, seed), layers, embed=embed, head=head)
