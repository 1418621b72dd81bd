"""smoke-run given what it cannot use: one line naming the option, exit 2, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys


def meshd(*args: str | bytes, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


def test_a_prompt_that_is_not_utf8_is_named_as_the_prompt(tmp_path):
    """Bytes that are not UTF-8 on the command line are the prompt's fault, not the checkpoint's."""
    r = meshd("smoke-run", "--stages", "2", "--prompt", b"ab\xffc", "--run-dir", str(tmp_path / "runs"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == "meshd smoke-run: error: argument --prompt: not valid UTF-8 (byte 2)"
    assert not (tmp_path / "runs").exists()
