"""A tiny built-in model for fast tests and ``--stub`` runs: the ``tiny`` preset, seed 0."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from .checkpoint import init_checkpoint, preset_config, random_weights
from .model import StageModel

_stub_dir: Path | None = None


def stub_checkpoint() -> Path:
    """The tiny preset written once per process to a temporary directory (removed at exit)."""
    global _stub_dir
    if _stub_dir is None or not (_stub_dir / "model.safetensors").exists():
        path = Path(tempfile.mkdtemp(prefix="meshd-stub-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        init_checkpoint(path, "tiny", seed=0, force=True)
        _stub_dir = path
    return _stub_dir


def stub_model(layers: range | None = None, *, embed: bool | None = None, head: bool | None = None,
               seed: int = 0) -> StageModel:
    """The same tiny model, in memory, without touching the disk."""
    config = preset_config("tiny")
    return StageModel(config, random_weights(config, seed), layers, embed=embed, head=head)
