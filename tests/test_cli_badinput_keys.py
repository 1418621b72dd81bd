"""Key files and lists that are not files: a pipe (whose open waits for a writer) or one far
too large is one line naming it and exit 2, never a wait."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

RUN = ["run", "--stub", "--stage", "0", "--stages", "1", "--dashboard", "off"]


def meshd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (RUN + ["--key-file"], "meshd: error: cannot read key file {}: "),
    (RUN + ["--mesh-key-file"], "meshd: error: --mesh-key-file: cannot read mesh key file {}: "),
    (RUN + ["--allow-nodes"], "meshd: error: cannot read node id list {}: "),
    (["relay", "--mesh-key-file"], "meshd: error: --mesh-key-file: cannot read mesh key file {}: "),
    (["keys", "install", "--url", "http://127.0.0.1:9"],
     "meshd keys install: cannot read mesh key file {}: "),
])
def test_a_pipe_given_as_a_key_file_or_list_is_refused_not_waited_on(tmp_path, args, says):
    pipe = tmp_path / "key"
    os.mkfifo(pipe)
    line = one_line(meshd(*args, str(pipe)))
    assert line == says.format(pipe) + "not a regular file (a pipe or a device)"


def test_a_key_file_of_many_megabytes_is_refused_from_its_size(tmp_path):
    big = tmp_path / "node.key"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk used
    line = one_line(meshd(*RUN, "--key-file", str(big)))
    assert line == f"meshd: error: cannot read key file {big}: larger than 1048576 bytes"
