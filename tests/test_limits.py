"""A node or relay lifts its soft limit on open files to the hard limit at start."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest


def _limits_after(soft: int, hard: int) -> str:
    code = ("import resource\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
            "from meshd.limits import raise_open_files_limit\n"
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_the_soft_open_files_limit_rises_to_the_hard_one():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"this host's hard limit on open files is {hard}, below the test's 512")
    top = 512 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    assert _limits_after(256, top) == f"({top}, {top}) ({top}, {top})"


def test_a_soft_limit_already_at_the_hard_one_stays():
    assert _limits_after(300, 300) == "(300, 300) (300, 300)"
