"""One logging style: the contract's event lines on stdout as they are, everything else
with time, level, node and prefix on stderr; --log-format json for machines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                      r"(\S+) (\S+) (meshd[\w.]*): ")


def run_briefly(*args: str, until: Callable[[str, str], bool], env: dict,
                timeout: float = 60) -> tuple[str, str]:
    """Run ``meshd *args`` until its (stdout, stderr) so far satisfy ``until``, then stop it with
    SIGTERM; its whole output.  Waits for the output, not a fixed time: a loaded machine can
    take seconds just to import the modules."""
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen([sys.executable, "-m", "meshd", *args], stdout=out_f, stderr=err_f,
                                text=True, env={**os.environ, **env})
        deadline = time.monotonic() + timeout
        try:
            while not until(_read(out_f), _read(err_f)):
                assert proc.poll() is None, f"meshd {' '.join(args)} exited: {_read(err_f)}"
                assert time.monotonic() < deadline, f"meshd {' '.join(args)}: not seen in {timeout:g}s"
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        return _read(out_f), _read(err_f)


def _read(f) -> str:
    f.seek(0)
    return f.read()


def test_text_format(tmp_path):
    relay_out, relay_err = run_briefly("relay", "--bind", "127.0.0.1:0", env={},
                                       until=lambda out, err: "meshd.relay" in err)
    assert relay_out.startswith("meshd relay url=ws://127.0.0.1:")  # the event line, as the contract has it
    logged = [LOG_LINE.match(line) for line in relay_err.splitlines() if line.strip()]
    assert logged and all(logged), relay_err
    assert ("INFO", "relay", "-", "meshd.relay") in [m.groups() for m in logged if m]


def test_json_format_for_machines(tmp_path):
    # A relay where nothing listens: the node says so on stderr.
    out, err = run_briefly("--log-format", "json", "run", "--stub", "--role", "stage", "--stage", "0",
                           "--stages", "1", "--dashboard", "off", "--relay", "ws://127.0.0.1:1",
                           env={"XDG_CACHE_HOME": str(tmp_path)},
                           until=lambda out, err: '"event":"node"' in out.replace(" ", "") and "\n" in err)
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    node = next(e for e in events if e["event"] == "node")
    assert node["line"].startswith("meshd node id=") and node["role"] == "stage" and len(node["prefix"]) == 8
    assert all({"ts", "event", "line"} <= set(e) for e in events)
    records = [json.loads(line) for line in err.splitlines()]  # every line one JSON object
    assert records
    for record in records:
        assert {"ts", "level", "node", "prefix", "logger", "message"} <= set(record)
        assert record["node"] == "stage-0" and record["prefix"] == node["prefix"]
    assert any(r["logger"] == "meshd.relay.client" and "ws://127.0.0.1:1" in r["message"] for r in records)


def test_a_nodes_log_lines_name_its_stage_and_prefix(tmp_path):
    relay = subprocess.Popen([sys.executable, "-m", "meshd", "relay", "--bind", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = relay.stdout.readline().split("url=")[1].split()[0]
        out, err = run_briefly("run", "--stub", "--role", "stage", "--stage", "0", "--stages", "1",
                               "--relay", url, "--dashboard", "off", env={"XDG_CACHE_HOME": str(tmp_path)},
                               until=lambda out, err: "meshd node id=" in out and "meshd.relay.client" in err)
    finally:
        relay.terminate()
        relay.wait(timeout=10)
    prefix = re.search(r"^meshd node id=\S+ prefix=(\w{8})", out, re.M).group(1)
    logged = [m.groups() for line in err.splitlines() if (m := LOG_LINE.match(line))]
    assert ("INFO", "stage-0", prefix, "meshd.relay.client") in logged, err


def test_a_snapshot_line_still_being_written_is_left_out_and_whole_ones_are_read(tmp_path):
    from meshd.snapshot import SnapshotWriter, read_snapshots

    writer = SnapshotWriter(tmp_path, "abcd1234")
    writer.write({"time": 1, "members": [{"prefix": "x", "state": "alive"}]})
    writer.write({"time": 2, "members": [{"prefix": "x", "state": "dead"}]})
    with open(writer.path, "a", encoding="utf-8") as f:
        f.write('{"time":3,"members":[{"prefix":"x","sta')  # what a reader meets mid-write
    assert [s["time"] for s in read_snapshots(writer.path)] == [1, 2]
