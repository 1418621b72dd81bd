"""What `smoke-run --provider docker` mounts for a checkpoint whose files are links, and the one
line it says for a link that leads nowhere, with no engine: the provider is built against a
fake one (the module's ``docker`` calls answered in-process), and its ``docker run`` arguments
are read, not run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.launch import docker
from meshd.launch.docker import DockerError, DockerProvider, checkpoint_mounts

FILES = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"\0" * 64}


def hf_snapshot(hub: Path, files: dict[str, bytes] = FILES, repo: str = "models--org--tiny",
                rev: str = "0123abcd") -> Path:
    """A Hugging Face cache entry: ``files`` in ``blobs/`` under made-up hashes, and the
    snapshot's files links to them (``../../blobs/<hash>``)."""
    root = hub / repo
    snapshot = root / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    for k, (name, data) in enumerate(files.items()):
        blob = f"{k:040x}"
        (root / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    return snapshot


@pytest.fixture
def engine(monkeypatch) -> list[tuple[str, ...]]:
    """A fake engine: an image, no containers or networks yet, and every network create
    answered.  Returns the docker commands the provider ran."""
    ran: list[tuple[str, ...]] = []

    def fake_docker(*argv: str, timeout: float = 0) -> subprocess.CompletedProcess[str]:
        ran.append(argv)
        return subprocess.CompletedProcess(["docker", *argv], 0, "", "")

    monkeypatch.setattr(docker, "check_available", lambda: ran.append(("info",)))
    monkeypatch.setattr(docker, "ensure_image", lambda say: "meshd:test")
    monkeypatch.setattr(docker, "_docker", fake_docker)
    return ran


def volumes(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--volume"]


def test_a_hugging_face_cache_snapshot_is_mounted_with_its_blobs(tmp_path, engine):
    """The snapshot's files are links to ``../../blobs``: the containers get the blobs folder
    too, read-only at its host path (one mount for every link into it), so the links resolve
    in there as on the host."""
    tmp_path = tmp_path.resolve()
    snapshot = hf_snapshot(tmp_path / "hub")
    blobs = tmp_path / "hub" / "models--org--tiny" / "blobs"
    run = tmp_path / "run"
    run.mkdir()
    provider = DockerProvider(["relay", "orchestrator", "stage-0"], run, str(snapshot), lambda _: None)
    argv = provider.run_argv("stage-0", {"MESHD_HOSTFILE": str(run / "hosts")}, 1)
    assert volumes(argv) == [f"{run}:{run}", f"{snapshot}:{snapshot}:ro", f"{blobs}:{blobs}:ro",
                             f"{run / 'hosts'}:{run / 'hosts'}:ro"]
    assert argv[argv.index("--name") + 1] == f"{provider.network}-stage-0-1"
    assert argv[-1] == "meshd:test"


def test_a_checkpoint_without_links_is_one_mount(tmp_path):
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "alias.json").symlink_to("config.json")  # a link that stays inside
    assert checkpoint_mounts(tmp_path) == [f"{tmp_path}:{tmp_path}:ro"]


def test_links_through_other_folders_mount_each_folder_they_pass_once(tmp_path):
    """A link to a link elsewhere needs both folders; a linked folder is mounted itself, and a
    folder inside one already mounted adds nothing."""
    tmp_path = tmp_path.resolve()
    model, a, b, shared = (tmp_path / n for n in ("model", "a", "b", "shared"))
    for folder in (model, a, b, shared / "inner"):
        folder.mkdir(parents=True)
    (b / "weights").write_bytes(b"w")
    (a / "weights").symlink_to(b / "weights")
    (model / "model.safetensors").symlink_to("../a/weights")
    (shared / "inner" / "vocab").write_text("v")
    (model / "tokenizer").symlink_to(shared)
    (model / "vocab.json").symlink_to(shared / "inner" / "vocab")
    assert checkpoint_mounts(model) == [f"{d}:{d}:ro" for d in (model, a, b, shared)]


def test_links_inside_a_linked_folder_are_followed_and_mounted_too(tmp_path):
    """model/sub is a link to x/ext, whose w is a link to ../blobs/w: a container reads w
    through both, so x/blobs is mounted beside x/ext; a link back into a folder already
    walked is walked once; a link there that leads nowhere is refused by its path in the
    checkpoint."""
    tmp_path = tmp_path.resolve()
    model, x = tmp_path / "model", tmp_path / "x"
    for folder in (model, x / "ext", x / "blobs"):
        folder.mkdir(parents=True)
    (x / "blobs" / "w").write_bytes(b"w")
    (x / "ext" / "w").symlink_to("../blobs/w")
    (x / "ext" / "back").symlink_to(x / "ext")  # a cycle
    (model / "sub").symlink_to(x / "ext")
    (model / "again").symlink_to(x / "ext")
    assert checkpoint_mounts(model) == [f"{d}:{d}:ro" for d in (model, x / "blobs", x / "ext")]
    (x / "ext" / "lost").symlink_to("../blobs/missing")
    with pytest.raises(DockerError) as caught:
        checkpoint_mounts(model)
    message = str(caught.value)
    assert message.startswith("--provider docker: the checkpoint's again/lost is a link to ../blobs/missing")
    assert "\n" not in message


def test_a_link_through_a_linked_folder_mounts_each_folder_where_the_container_reads_it(tmp_path):
    """model/w names /t/link/w, /t/link is a link to deep/real, and real/w is a link to
    ../blobs/w.  The container has /t/link as a plain folder (deep/real mounted there), so it
    reads ../blobs from /t/link: deep/blobs, which the host's kernel reaches, is mounted at
    /t/blobs, a path the host does not have."""
    tmp_path = tmp_path.resolve()
    model, t, deep = tmp_path / "model", tmp_path / "t", tmp_path / "far" / "deep"
    for folder in (model, t, deep / "real", deep / "blobs"):
        folder.mkdir(parents=True)
    (deep / "blobs" / "w").write_bytes(b"w")
    (deep / "real" / "w").symlink_to("../blobs/w")
    (t / "link").symlink_to(deep / "real")
    (model / "w").symlink_to(t / "link" / "w")
    mounts = checkpoint_mounts(model)
    assert mounts == [f"{model}:{model}:ro", f"{deep / 'blobs'}:{t / 'blobs'}:ro",
                      f"{deep / 'real'}:{t / 'link'}:ro"]
    assert all(os.path.isdir(m.split(":")[0]) and not os.path.islink(m.split(":")[0]) for m in mounts)
    assert not (t / "blobs").exists()


def test_a_link_to_a_link_to_a_folder_mounts_the_folder_holding_the_second_link(tmp_path):
    """model/a is a link to /s/one, itself a link to real: the container follows /s/one as
    the host does, so the folder holding that link is mounted as it is, and real beside it."""
    tmp_path = tmp_path.resolve()
    model, s, real = tmp_path / "model", tmp_path / "s", tmp_path / "real"
    for folder in (model, s, real):
        folder.mkdir()
    (real / "w").write_bytes(b"w")
    (s / "one").symlink_to(real)
    (model / "a").symlink_to(s / "one")
    assert checkpoint_mounts(model) == [f"{d}:{d}:ro" for d in (model, real, s)]


@pytest.mark.parametrize("target", ["../../blobs/" + "f" * 40, "generation_config.json"],
                         ids=["missing", "loop-to-itself"])
def test_a_link_that_leads_to_no_file_is_refused_in_one_line_before_the_engine_is_asked(
        tmp_path, engine, target):
    snapshot = hf_snapshot(tmp_path / "hub")
    (snapshot / "generation_config.json").symlink_to(target)
    with pytest.raises(DockerError) as caught:
        DockerProvider(["orchestrator", "stage-0"], tmp_path, str(snapshot), lambda _: None)
    message = str(caught.value)
    assert message.startswith("--provider docker: the checkpoint's generation_config.json is a link to ")
    assert "which leads to no file" in message and "\n" not in message
    assert engine == []  # nothing asked of the engine, no network made


def test_smoke_run_with_a_dangling_link_in_its_checkpoint_fails_in_one_line_with_exit_1(tmp_path):
    """The stub checkpoint, laid out as a cache snapshot, with one link to a missing blob."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "TMPDIR": str(tmp_path), "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}  # nothing to start
    code = "from meshd.pipeline.stub import stub_checkpoint; print(stub_checkpoint())"
    stub = Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env=env).stdout.strip())
    snapshot = hf_snapshot(tmp_path / "hub", {p.name: p.read_bytes() for p in sorted(stub.iterdir())})
    (snapshot / "generation_config.json").symlink_to("../../blobs/" + "f" * 40)
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--model", str(snapshot), "--stages", "2",
                        "--provider", "docker"], capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert ("error (--provider docker: the checkpoint's generation_config.json is a link to "
            "../../blobs/ffff") in out and "Traceback" not in out, out
    assert "leftovers: 0" in out
