"""The mesh key with real ``meshd`` processes on loopback (``--stub``, profile local).

``meshd run`` refuses to listen beyond loopback without a key (unless told
``--insecure``); a node with another key, or none, never joins a keyed mesh
and what it sends is counted as unsealed; a forged unsealed ``Dead`` changes
nothing; a keyed relay refuses a node without the key; ``meshd keys`` rotates
the key of a running five-node mesh while a generation is in flight, with the
same tokens and not one suspicion; and it names the member that lags behind.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from meshd import keyring, wire
from meshd.launch.process import MeshProcess
from meshd.testing.stranger import raw_packet, send_udp

pytestmark = pytest.mark.processes

PROMPT = "the quick brown fox"
MAX_TOKENS = 200  # about as many as the stub's context holds after the prompt


def _meshd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                          timeout=timeout)


def _dashboard(p: MeshProcess) -> str:
    line = p.wait_for(lambda s: s.startswith("meshd dashboard url="), 15, "dashboard url")
    return line.split()[2].split("=", 1)[1]


class Keyed:
    """Nodes of one mesh, each ``meshd run --stub`` with its own copy of the mesh key file."""

    def __init__(self, tmp: Path, stages: int = 3, relay: str | None = None,
                 orchestrator_also_holds: bytes | None = None) -> None:
        self.tmp, self.stages, self.relay = tmp, stages, relay
        self.key = tmp / "mesh.key"
        if not self.key.exists():
            keyring.generate_file(self.key)
        self.procs: list[MeshProcess] = []
        orch_key = tmp / "orchestrator.mesh.key"
        ring = keyring.load(self.key)
        if orchestrator_also_holds is not None:
            ring.install(orchestrator_also_holds)
        ring.save(orch_key)
        self.orch = self.node("orchestrator", ["--role", "orchestrator"], seeds=[], key=orch_key)
        self.url = _dashboard(self.orch)

    def node(self, name: str, role: list[str], *, seeds: list[str] | None = None,
             key: Path | str | None = "copy") -> MeshProcess:
        """``key``: "copy" (a copy of the mesh key, as a real host would hold), a path, or None."""
        if key == "copy":
            key = self.tmp / f"{name}.mesh.key"
            key.write_text(self.key.read_text())
        args = ["run", *role, "--stages", str(self.stages), "--stub", "--profile", "local",
                "--bind", "127.0.0.1:0", *(["--mesh-key-file", str(key)] if key else []),
                *(["--relay", self.relay] if self.relay else []),
                *(f"--seed={s}" for s in (seeds if seeds is not None else [self.orch.boot.addr]))]
        p = MeshProcess(name, args)
        self.procs.append(p)
        p.wait_boot()
        return p

    def stage(self, k: int, name: str | None = None, **kw) -> MeshProcess:
        return self.node(name or f"stage-{k}", ["--role", "stage", "--stage", str(k)], **kw)

    def get(self, path: str, url: str | None = None) -> dict:
        return httpx.get(f"{url or self.url}{path}", timeout=5).json()

    def generate(self, max_tokens: int = 12, timeout: float = 60) -> httpx.Response:
        return httpx.post(f"{self.url}/api/generate", json={"prompt": PROMPT, "max_tokens": max_tokens},
                          timeout=timeout)

    def ready(self, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while (r := self.generate()).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs:
            p.stop(timeout=3)


@pytest.fixture
def keyed(tmp_path):
    made: list[Keyed] = []

    def make(**kw) -> Keyed:
        made.append(Keyed(tmp_path, **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


def _wait(pred, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, f"no {what} within {seconds:g}s"
        time.sleep(0.2)


# --- beyond loopback ---


def test_run_beyond_loopback_without_a_key_exits_2_saying_why_and_insecure_starts():
    r = _meshd("run", "--role", "orchestrator", "--bind", "0.0.0.0:0", "--dashboard", "off")
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("meshd: refusing to run on 0.0.0.0:0 without a mesh key: anyone who can reach "
                           "this port could join the mesh"), line
    for words in ("--mesh-key-file PATH", "meshd keys generate --out PATH", "--insecure"):
        assert words in line
    p = MeshProcess("insecure", ["run", "--role", "orchestrator", "--bind", "0.0.0.0:0", "--insecure",
                                 "--dashboard", "off"])
    try:
        assert p.wait_boot().addr.startswith("0.0.0.0:")
        assert any("without a mesh key (--insecure)" in line for line in p.lines)
    finally:
        assert p.stop() == 0


def test_a_bad_key_file_is_one_line_and_exit_2(tmp_path):
    for path, words in ((tmp_path / "missing.key", "does not exist"), (tmp_path / "bad.key", "line 1")):
        if path.name == "bad.key":
            path.write_text("not a key\n")
        r = _meshd("run", "--role", "orchestrator", "--mesh-key-file", str(path), "--dashboard", "off")
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stderr.startswith("meshd: error: --mesh-key-file: ") and words in r.stderr


def test_keys_generate_prints_the_id_and_never_overwrites(tmp_path):
    out = tmp_path / "mesh.key"
    r = _meshd("keys", "generate", "--out", str(out))
    assert r.returncode == 0
    assert r.stdout == f"meshd keys: new mesh key {keyring.load(out).primary_id} in {out}\n"
    again = _meshd("keys", "generate", "--out", str(out))
    assert again.returncode == 2 and "will not overwrite" in again.stderr


# --- who gets in ---


def test_a_node_with_another_key_or_none_never_joins_and_a_forged_dead_changes_nothing(keyed, tmp_path):
    m = keyed(stages=1)
    stage = m.stage(0)
    m.ready()
    ids = {m.orch.boot.id, stage.boot.id}
    keyring.generate_file(tmp_path / "other.key")
    strangers = [m.stage(0, "other-key", key=tmp_path / "other.key"), m.stage(0, "no-key", key=None)]
    orch_counter = lambda: m.get("/api/snapshot")["counters"].get("rx_unsealed_dropped", 0)  # noqa: E731
    _wait(lambda: orch_counter() >= 4, 15, "unsealed packets counted at the orchestrator")
    time.sleep(1.0)
    for url in (m.url, None):
        peers = m.get("/api/peers") if url else None
        if peers is not None:
            assert {p["id"] for p in peers["peers"]} == ids - {m.orch.boot.id}, peers
    assert any("dropped packets from 127.0.0.1:" in line and "not sealed with our mesh key" in line
               for line in m.orch.lines)
    for s in strangers:
        assert s.latest_stage_map() in (None, {s.boot.prefix: "stage-0"}), s.lines[-5:]

    before = orch_counter()
    victim = bytes.fromhex(stage.boot.id)
    for inc in range(5):  # "stage-0 left", in its own name, unsealed: nobody should believe it
        send_udp(m.orch.boot.addr, raw_packet(victim, (wire.Dead.TAG, [inc, victim, victim, b"s" * 64])))
    _wait(lambda: orch_counter() >= before + 5, 10, "the forged datagrams counted")
    time.sleep(1.0)
    states = {p["id"]: p["state"] for p in m.get("/api/peers")["peers"]}
    assert states == {stage.boot.id: "alive"}
    assert not any(line.startswith("meshd member") and ("left" in line or "dead" in line)
                   for line in m.orch.lines)
    assert m.generate().status_code == 200


def test_a_keyed_relay_refuses_a_node_without_the_key(keyed, tmp_path):
    key = tmp_path / "mesh.key"
    keyring.generate_file(key)
    relay = MeshProcess("relay", ["relay", "--bind", "127.0.0.1:0", "--mesh-key-file", str(key)])
    try:
        url = relay.wait_for(lambda s: s.startswith("meshd relay url="), 10, "relay url").split()[2][4:]
        m = keyed(stages=1, relay=url)
        m.stage(0)
        m.ready()
        stranger = m.stage(0, "no-key", key=None)
        relay.wait_for(lambda s: "refused" in s and "not a member: no valid mesh-key proof" in s, 15,
                       "the relay refusing the node without the key")
        stranger.wait_for(lambda s: "4008 not a member" in s and "we have no mesh key" in s, 15,
                          "the node saying why the relay refused it")
        members = m.get("/api/snapshot")["relay"]
        assert members["connected"], members
    finally:
        relay.stop(timeout=3)


# --- rotation ---


def test_rotating_the_key_of_a_running_mesh_mid_generation_costs_nothing(keyed, tmp_path):
    m = keyed(stages=3)
    for k in range(3):
        m.stage(k)
    m.stage(1, "stage-1b", seeds=[m.orch.boot.addr])  # a replica: five members
    m.ready()
    _wait(lambda: sum(p["state"] == "alive" for p in m.get("/api/peers")["peers"]) == 4, 20, "five members")
    want = m.generate(max_tokens=MAX_TOKENS).json()["tokens"]
    old_id = keyring.load(m.key).primary_id
    new_file = tmp_path / "new.key"
    new_id = keyring.generate_file(new_file).primary_id

    answers: list[httpx.Response | Exception] = []
    rotated = threading.Event()

    def back_to_back() -> None:  # generations in flight from before the install to after the remove
        while not rotated.is_set() or len(answers) < 2:
            try:
                answers.append(m.generate(max_tokens=MAX_TOKENS, timeout=60))
            except httpx.HTTPError as exc:
                answers.append(exc)

    worker = threading.Thread(target=back_to_back)
    worker.start()
    try:
        _wait(lambda: bool(m.get("/api/requests")["requests"]), 10, "a generation under way")
        for op, key in (("install", str(new_file)), ("use", new_id), ("remove", old_id)):
            r = _meshd("keys", op, key, "--url", m.url, "--timeout", "30", timeout=60)
            if r.returncode != 0:
                print(_logs(m))
            assert r.returncode == 0, (op, r.stdout, r.stderr)
            kid = new_id if op == "install" else key
            want_lines = [f"5/5 members {SAID[op]} key {kid}", f"meshd keys {op}: done"]
            assert r.stdout.splitlines()[-2:] == want_lines, r.stdout
    finally:
        rotated.set()
        worker.join(120)
    assert len(answers) >= 2
    for got in answers:
        assert isinstance(got, httpx.Response) and got.status_code == 200, got
        assert got.json()["tokens"] == want
    view = m.get("/api/keys")
    assert view["keyring"] == [new_id] and view["primary"] == new_id
    assert [mm["keyring"] for mm in view["members"]] == [[new_id]] * 5, view
    for p in m.procs:
        assert not any("member suspect" in line for line in p.lines), (p.name, p.lines[-10:])
        assert keyring.load(m.tmp / f"{p.name}.mesh.key").ids == [new_id], p.name


def _logs(m: Keyed) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.lines[-40:]) for p in m.procs)


SAID = {"install": "hold", "use": "seal with", "remove": "have dropped"}


def test_keys_refuses_a_step_out_of_order_and_names_the_members_that_did_not_catch_up(keyed, tmp_path):
    new = keyring.generate_key()
    new_id = keyring.key_id(new)
    m = keyed(stages=1, orchestrator_also_holds=new)  # nobody else holds it
    full = keyring.load(m.key)
    for _ in range(keyring.MAX_KEYS - 1):
        full.install(keyring.generate_key())
    full.save(tmp_path / "full.key")
    stage = m.stage(0, key=tmp_path / "full.key")  # a keyring with no room for another key
    m.ready()
    r = _meshd("keys", "use", "0badc0de", "--url", m.url, "--timeout", "2")
    assert r.returncode == 2 and "refused (400)" in r.stderr and "no key 0badc0de" in r.stderr, r.stderr
    r = _meshd("keys", "use", new_id, "--url", m.url, "--timeout", "2")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"not every member holds key {new_id} yet (stage-0 ({stage.boot.prefix})): install it" in r.stderr
    r = _meshd("keys", "remove", m.get("/api/keys")["primary"], "--url", m.url, "--timeout", "2")
    assert r.returncode == 2 and "still seals at stage-0" in r.stderr, r.stderr

    other = keyring.generate_key()
    r = _meshd("keys", "install", keyring.encode_key(other), "--url", m.url, "--timeout", "2")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout.splitlines()[0] == f"1/2 members hold key {keyring.key_id(other)}", r.stdout
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"meshd keys install: timed out after 2s; 1/2 members hold key "
                           f"{keyring.key_id(other)}; not yet: stage-0 ({stage.boot.prefix}, keys "), line
    stage.wait_for(lambda s: "not applied" in s and "at most 8 keys" in s, 5,
                   "stage-0 saying why it did not install the key")
    assert m.generate().status_code == 200, "a step that failed somewhere cut nobody off"


def test_an_empty_output_path_is_refused_naming_the_option(tmp_path, monkeypatch, capsys):
    """An empty --out would write into the current directory, or say "." exists."""
    from meshd.cli import main

    monkeypatch.chdir(tmp_path)
    for args in (["keys", "generate", "--out", ""], ["model", "init", "--out", " "]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2
        assert "--out: an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
