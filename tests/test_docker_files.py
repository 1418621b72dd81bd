"""docker/: the image, the compose file, and docker-e2e.sh's one line when no engine runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _engine_running() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0


@pytest.mark.skipif(_engine_running(), reason="a Docker engine runs here; the no-engine line cannot show")
def test_docker_e2e_without_an_engine_is_one_clear_line():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "docker-e2e.sh"), "2"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("docker-e2e: no Docker engine ") and lines[0].endswith("nothing was started")


def test_docker_e2e_refuses_a_bad_count():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "docker-e2e.sh"), "x"], capture_output=True,
                       text=True, timeout=10)
    assert r.returncode == 2 and r.stderr.startswith("usage: ")


def test_the_image_is_slim_python_non_root_with_the_package_installed():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert "RUN pip install ." in text
    user = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")


def test_compose_has_a_relay_an_orchestrator_and_scalable_stages():
    text = (ROOT / "docker" / "compose.yaml").read_text()
    services = text.split("\nservices:\n", 1)[1]
    names = [line.strip().rstrip(":") for line in services.splitlines()
             if line.startswith("  ") and not line.startswith("   ")]
    assert names == ["relay", "orchestrator", "stage"]
    assert "replicas: ${MESHD_STAGES:-3}" in text and "dockerfile: docker/Dockerfile" in text
