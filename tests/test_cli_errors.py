"""The command line's bad moments: one line and an exit code, never a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def meshd(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_dashboard_port_in_use_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = meshd("run", "--stub", "--role", "stage", "--stage", "0", "--stages", "1",
                  "--dashboard", f"127.0.0.1:{port}", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert line.startswith("meshd: error: cannot serve the dashboard on 127.0.0.1:") and "in use" in line


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT now (its SigIgn mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & 1 << (signal.SIGINT - 1))
    return False


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _default_sigint() -> None:  # whatever the test runner was started with
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize("after_s", [0.15, 0.3, 3.0])
def test_ctrl_c_at_any_moment_ends_without_a_traceback(tmp_path, after_s, inherited):
    """Through the `meshd` script, as a user types it.  Before the node runs: exit 130.  Once
    it runs, Ctrl-C is its graceful leave: exit 0.  Python's own start-up (its site module,
    before any of meshd loads) is the interpreter's: a Ctrl-C that lands there is tried
    again a little later.  A shell starts a script's background job with SIGINT ignored
    ("ignored"); meshd takes SIGINT all the same from its first line on."""
    script = os.path.join(os.path.dirname(sys.executable), "meshd")
    if not os.path.exists(script):
        pytest.skip(f"{script}: the meshd script is not installed beside this Python")
    argv = [script, "run", "--stub", "--role", "stage", "--stage", "0", "--stages", "1", "--dashboard", "off"]
    for _ in range(5):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
                                preexec_fn=_ignore_sigint if inherited == "ignored" else _default_sigint)
        time.sleep(after_s)
        while inherited == "ignored" and proc.poll() is None and _ignores_sigint(proc.pid):
            time.sleep(0.01)  # the interpreter's start-up keeps what it inherited: not meshd's yet
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            lost = f"SIGINT {after_s}s after start was lost: still running 30s later"
            raise AssertionError(f"{lost}\n{out}{err}") from None
        if "<frozen site>" not in err:
            break
        after_s += 0.1
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if "meshd node id=" in out:
        assert proc.returncode == 0 and "leaving (SIGINT)" in err
    else:
        assert proc.returncode == 130


@pytest.mark.parametrize("raised", [KeyboardInterrupt(), "wrapped"])
def test_ctrl_c_while_a_module_loads_exits_130_even_as_the_error_python_makes_of_it(monkeypatch, raised):
    # Ctrl-C inside a dataclass field's __set_name__ (a module loading) reaches us as a
    # RuntimeError caused by the KeyboardInterrupt.
    from meshd import __main__ as entry_module
    from meshd import cli

    def interrupted() -> int:
        if raised == "wrapped":
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from KeyboardInterrupt()
        raise raised

    monkeypatch.setattr(cli, "main", interrupted)
    with pytest.raises(SystemExit) as exit_:
        entry_module.entry()
    assert exit_.value.code == 130


def test_started_with_sigint_ignored_meshd_takes_it_before_its_first_module_loads(monkeypatch):
    """A script's background job inherits SIGINT ignored: from meshd's first line on a SIGINT
    is Ctrl-C all the same, not lost while the node starts and then waited for forever."""
    from meshd import __main__ as entry_module
    from meshd import cli, ctrl_c

    seen = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(signal.getsignal(signal.SIGINT)) or 0)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(SystemExit):
            entry_module.entry()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [ctrl_c.interrupt]


def test_an_error_not_caused_by_ctrl_c_is_not_taken_for_one(monkeypatch):
    from meshd import __main__ as entry_module
    from meshd import cli

    def broken() -> int:
        raise RuntimeError("a real bug") from ValueError("its cause")

    monkeypatch.setattr(cli, "main", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        entry_module.entry()


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`meshd ps --json | head -c 1`: the reader went away."""
    proc = subprocess.Popen([sys.executable, "-m", "meshd", "ps", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "XDG_STATE_HOME": str(tmp_path)})
    proc.stdout.close()  # before the child writes: its write finds no reader
    err = proc.stderr.read().decode()
    proc.wait(timeout=30)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode in (0, 141)


def test_smoke_run_help_says_what_each_option_is():
    r = meshd("smoke-run", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--stages N pipeline stages" in text
    assert "--prompt PROMPT the text to continue" in text
    assert "--max-tokens K tokens to generate" in text
    assert "as dstack's startup_order" in text and "as dstack's stop_criteria" in text
    assert "(default master-done)" in text and "$XDG_STATE_HOME/meshd/runs" in text


def test_a_split_that_cannot_work_is_refused_before_anything_starts(tmp_path):
    t0 = time.monotonic()
    r = meshd("smoke-run", "--stub", "--stages", "5", env={"XDG_STATE_HOME": str(tmp_path / "state"),
                                                          "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 2
    assert one_line(r.stderr) == "meshd: error: smoke-run: --stub: cannot split 4 layers into 5 stages"
    assert not (tmp_path / "state").exists()  # no run was recorded: nothing started
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("args, says", [
    (["--max-tokens", "1000"], "exceeds the model's context of 256 positions"),
    # 41 tokens and 214 fit; the fourth stream's prompt ("..., 4") is 3 tokens longer.
    (["--max-tokens", "214", "--streams", "4"], "prompt (44 tokens) + max_tokens 214 exceeds"),
    (["--run-dir", "FILE"], "argument --run-dir: "),
])
def test_smoke_run_refuses_what_cannot_run_before_anything_starts(tmp_path, args, says):
    """Prompts past the context (the first, or another stream's longer one), a run dir that
    is a file: one line and exit 2, nothing started or recorded."""
    (tmp_path / "file").write_text("x")
    args = [str(tmp_path / "file") if a == "FILE" else a for a in args]
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = meshd("smoke-run", "--stub", "--stages", "2", "--prompt", "x" * 40, *args, env=env)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "state").exists()


def test_the_docker_provider_without_an_engine_fails_in_one_line_and_leaves_nothing(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "TMPDIR": str(tmp_path),
           "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    r = meshd("smoke-run", "--stub", "--stages", "2", "--provider", "docker", env=env)
    assert r.returncode == 1, (r.stdout, r.stderr)
    out = r.stdout + r.stderr
    assert "error (--provider docker: " in out and "Traceback" not in out, out
    assert "leftovers: 0" in out
    assert list(tmp_path.glob("meshd-smoke-*")) == []  # the run's temp dir went with it


def test_prompts_past_the_context_of_the_checkpoint_smoke_run_writes_are_refused_up_front(tmp_path):
    """Without --model or --stub the run writes a checkpoint of its own (`deep` past 6 stages):
    its context is known before anything is written or started, as with a given one."""
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "TMPDIR": str(tmp_path)}
    r = meshd("smoke-run", "--stages", "7", "--max-tokens", "1000", "--json", env=env)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert one_line(r.stderr) == ("meshd: error: smoke-run: the deep checkpoint it writes (no --model): "
                                  "prompt (17 tokens) + max_tokens 1000 exceeds the model's context of "
                                  "256 positions (it takes 1016: the last token is never fed back; "
                                  "max_tokens 240 fits)")
    assert not (tmp_path / "state").exists() and list(tmp_path.iterdir()) == []


def test_the_stub_checkpoint_is_written_once_per_user(tmp_path):
    code = "from meshd.pipeline.stub import stub_checkpoint; print(stub_checkpoint())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    paths = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            check=True).stdout.strip() for _ in range(3)}
    assert len(paths) == 1
    (path,) = paths
    assert path.startswith(str(tmp_path / "meshd" / "stub-"))
    # nothing half-written beside it
    assert [p.name for p in (tmp_path / "meshd").iterdir()] == [os.path.basename(path)]


def test_a_ctrl_c_python_swallowed_while_meshd_started_still_ends_the_node(monkeypatch, capsys):
    """A KeyboardInterrupt raised inside a weakref callback (every import releases its module
    lock in one) is printed as "Exception ignored" and dropped by the interpreter.  The node
    must not start as if the Ctrl-C never came: it exits as Ctrl-C asks, having bound nothing."""
    import gc
    import weakref

    import trio

    from meshd import ctrl_c
    from meshd.daemon import run_daemon
    from meshd.identity import Identity
    from meshd.node import NodeOptions

    class Lock:
        pass

    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: ignored.append(unraisable.exc_type))
    lock = Lock()
    released = weakref.ref(lock, lambda _: ctrl_c.interrupt(signal.SIGINT, None))
    del lock
    gc.collect()
    assert released() is None and ignored == [KeyboardInterrupt]  # Python dropped it
    with pytest.raises(KeyboardInterrupt):
        trio.run(run_daemon, Identity.generate(), NodeOptions(profile="local", stages=1, stage=0))
    assert "meshd node id=" not in capsys.readouterr().out


def test_the_ctrl_c_python_swallows_is_not_printed_as_a_traceback():
    """As a process sees it, without the test runner's own hook for dropped exceptions."""
    script = """
import gc, signal, weakref
from meshd import ctrl_c
ctrl_c.install()
class Lock: pass
lock = Lock()
released = weakref.ref(lock, lambda _: ctrl_c.interrupt(signal.SIGINT, None))
del lock
gc.collect()
try:
    ctrl_c.raise_if_lost()
except KeyboardInterrupt:
    print("raised")
ctrl_c.raise_if_lost()  # once: the Ctrl-C is not raised twice
print("once")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["raised", "once"], r
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["doctor", "peers"])
def test_ctrl_c_while_a_command_waits_on_a_node_is_exit_130_without_a_traceback(command):
    """A node that takes the connection and never answers: Ctrl-C ends the wait at once with
    exit 130, as trio's own handling of Ctrl-C gives it, and prints no traceback."""
    script = os.path.join(os.path.dirname(sys.executable), "meshd")
    if not os.path.exists(script):
        pytest.skip(f"{script}: the meshd script is not installed beside this Python")
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        proc = subprocess.Popen([script, command, f"http://127.0.0.1:{port}", "--timeout", "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        silent.settimeout(30)
        conn, _ = silent.accept()  # the command is inside its trio run, waiting on the answer
        with conn:
            time.sleep(0.2)
            _ctrl_c_ends_it_with_130(proc, command)


def test_ctrl_c_while_a_command_is_still_connecting_is_exit_130_without_a_traceback():
    """A node whose listen queue is full never completes the connection (its SYNs are
    dropped): Ctrl-C then lands while trio waits for the connection in a nursery."""
    script = os.path.join(os.path.dirname(sys.executable), "meshd")
    if not os.path.exists(script):
        pytest.skip(f"{script}: the meshd script is not installed beside this Python")
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        fillers = [socket.create_connection(("127.0.0.1", port), timeout=5)]  # the queue of one is full
        try:
            proc = subprocess.Popen([script, "doctor", f"http://127.0.0.1:{port}", "--timeout", "60"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(2.5)  # started, and waiting for the connection
            _ctrl_c_ends_it_with_130(proc, "doctor")
        finally:
            for f in fillers:
                f.close()


def _ctrl_c_ends_it_with_130(proc: subprocess.Popen, command: str) -> None:
    """Ctrl-C to ``proc``, a `meshd COMMAND` waiting on a node: it ends at once, exit 130,
    printing no traceback."""
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"meshd {command} still waits 20s after Ctrl-C\n{out}{err}") from None
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err
