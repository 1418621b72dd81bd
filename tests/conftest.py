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



@pytest.fixture(scope="session")
def with_dockerd():
    """``scripts/with-dockerd.py`` as a module: starting and stopping a Docker engine around a
    command, and the host firewall's state before and after."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "with-dockerd.py"
    spec = importlib.util.spec_from_file_location("with_dockerd", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

