"""Fixtures shared by the test files."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.pipeline.checkpoint import init_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the tiny preset (seed 0), written once per run; files that need
    another shape define their own ``checkpoint``."""
    path = tmp_path_factory.mktemp("tiny")
    init_checkpoint(path, "tiny", seed=0)
    return path
