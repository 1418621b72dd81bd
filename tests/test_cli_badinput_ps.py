"""`meshd ps` over a run dir holding something that is not a run file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from meshd.launch.model import new_run
from meshd.launch.state import save_run


def test_a_pipe_among_the_run_files_is_named_not_waited_on(tmp_path):
    """A FIFO named like a run file would block its reader until a writer came: ps names it
    and shows the other runs."""
    save_run(new_run("smoke-1", 1, now=time.time(), relay=True), tmp_path)
    os.mkfifo(tmp_path / "smoke-2.json")
    r = subprocess.run([sys.executable, "-m", "meshd", "ps", "--run-dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=30)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1
    assert r.stderr.strip() == f"meshd ps: {tmp_path / 'smoke-2.json'}: cannot read: not a regular file " \
                               "(a pipe or a device)"
    assert [run["name"] for run in json.loads(r.stdout)["runs"]] == ["smoke-1"]
