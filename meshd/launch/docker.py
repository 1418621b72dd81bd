"""The `docker` provider: every job in its own container, on an internal network the run makes.

Layout of one run (``X`` is picked free when the run starts; the run owns 10.215.X.0/24):

    meshd-smoke-X            a user-defined bridge network, ``internal`` (nothing routed out of
                             it); the host holds 10.215.X.1 on it, so smoke-run reaches the
                             dashboards as it does the netns testbed's
    meshd-smoke-X-<job>-<n>  one container per job and start (a restart starts the next ``n``),
                             at the job's fixed address 10.215.X.(10 + slot); the image's
                             entrypoint is ``meshd``, given the job's own arguments

Everything of the run carries the label ``meshd.smoke=X``, which ``teardown`` removes by, and
``meshd.smoke.owner=HOST:PID``: a smoke-run killed before its teardown leaves its containers
running, and the next one on this host removes them.

The containers see the run's files at the host's paths: its temp dir (node keys, the mesh
key, snapshots, the compiled kernels' cache) and the checkpoint, read-only, are bind-mounted
where they are, and a job runs as the user smoke-run runs as, so the files it writes are
ours to delete.  A checkpoint's links are followed on the host: each folder outside the
checkpoint that one leads into is mounted read-only where it is too (a Hugging Face cache
snapshot's files are links into its ``../../blobs``), and a link that leads to no file is
refused before anything starts.  The image is ``$MESHD_IMAGE`` if set, used as it is; otherwise
``meshd:latest``, which a checkout's ``scripts/docker-build.sh`` (re)builds from the tree first
(a few seconds when only meshd changed; the base image and wheels are cached), so the
containers run the code the reference runs.

Faults are the nodes' own (``--fault``), as on the local provider; ``kill:`` and
``restart:`` go through ``docker kill``, which a container's process cannot ignore.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

from .local import LocalProcess
from .model import is_relay_job
from .netns import DASHBOARD_PORT, GOSSIP_PORT, RELAY_PORT

DEFAULT_IMAGE = "meshd:latest"
LABEL = "meshd.smoke"
OWNER = "meshd.smoke.owner"  # host:pid of the smoke-run that made it
BUILD_TIMEOUT_S = 900.0  # the first build makes a Debian root with debootstrap: a few minutes
DOCKER_TIMEOUT_S = 60.0  # one docker command that changes state (create, kill, remove)
MAX_LINK_HOPS = 40  # links followed from one checkpoint file, as Linux's own limit


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DockerError(Exception):
    """The containers cannot be run; the message is one line a person can act on."""


def _docker(*argv: str, timeout: float = DOCKER_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DockerError(f"docker {argv[0]} did not answer within {timeout:g}s") from None


def _first_line(r: subprocess.CompletedProcess[str]) -> str:
    return (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or [f"exit {r.returncode}"])[0]


def check_available() -> None:
    """Raise DockerError (one line) unless a Docker engine answers here."""
    if shutil.which("docker") is None:
        raise DockerError("--provider docker needs the docker command and a running engine "
                          "(apt-get install -y docker.io; start dockerd)")
    r = _docker("info", "--format", "{{.ServerVersion}}", timeout=20)
    if r.returncode != 0 or not r.stdout.strip():
        raise DockerError(f"--provider docker: no Docker engine answers here (docker info: {_first_line(r)})")


def build_script() -> Path | None:
    """``scripts/docker-build.sh`` of the checkout this meshd runs from, if it runs from one."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "docker-build.sh"
    return script if script.is_file() else None


def ensure_image(say: Callable[[str], None]) -> str:
    """The image the jobs run: ``$MESHD_IMAGE`` as it is, or ``meshd:latest`` built from this
    checkout first.  DockerError when there is none to run."""
    image = os.environ.get("MESHD_IMAGE") or DEFAULT_IMAGE
    script = build_script()
    if not os.environ.get("MESHD_IMAGE") and script is not None:
        say(f"building the image {image} from this checkout (scripts/docker-build.sh)")
        try:
            r = subprocess.run([str(script)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                               env={**os.environ, "MESHD_IMAGE": image})
        except subprocess.TimeoutExpired:
            raise DockerError(f"scripts/docker-build.sh had not built {image} "
                              f"after {BUILD_TIMEOUT_S:g}s") from None
        if r.returncode != 0:
            tail = " | ".join((r.stderr.strip() or r.stdout.strip()).splitlines()[-3:])
            raise DockerError(f"scripts/docker-build.sh could not build {image}: {tail}")
        return image
    if _docker("image", "inspect", image, timeout=20).returncode != 0:
        how = ("set MESHD_IMAGE to an image the engine has" if os.environ.get("MESHD_IMAGE")
               else "build it from a meshd checkout with scripts/docker-build.sh")
        raise DockerError(f"--provider docker: the engine has no image {image}: {how}")
    return image


def checkpoint_mounts(model: Path) -> list[str]:
    """The read-only ``--volume`` arguments that make checkpoint folder ``model`` (an absolute
    path without links in it) readable in a container at its host path: the folder, then each
    folder outside it that a link in it leads through, sorted by where the container sees it,
    none inside another that holds it already.  A link to a folder is walked into too (each
    folder once, so a cycle ends), and the links in it count.

    A mounted folder is a plain folder in the container, whatever links led to it on the
    host, and a link in it is read from there: ``../x`` next to a file that the host reaches
    through a linked folder leads, in the container, beside the path the link was reached
    by, not beside the folder the host's kernel finds.  So each folder is mounted at the path
    the container reaches it by, from the host folder the host's kernel reaches.  DockerError
    (one line) for a link that leads to no file, named by its path through the checkpoint."""
    mounts: dict[str, str] = {}  # container folder -> host folder (real)
    walked: list[tuple[str, str]] = []
    # A real host folder to walk, where the container sees it, and its path through the checkpoint.
    todo = [(str(model), str(model), "")]
    while todo:
        real, seen, shown = todo.pop(0)
        if any(_within(real, w) and _within(seen, c) for w, c in walked):
            continue
        walked.append((real, seen))
        for root, subdirs, files in os.walk(real):  # links to folders are listed, not entered
            subdirs.sort()  # the first dangling link named is the same on every run
            for name in sorted([*subdirs, *files]):
                path = os.path.join(root, name)
                if os.path.islink(path):
                    rel = os.path.relpath(path, real)
                    named = os.path.normpath(os.path.join(shown, rel))
                    hops = _link_dirs(named, path, os.path.normpath(os.path.join(seen, rel)))
                    for host, there in hops:
                        mounts.setdefault(there, host)
                    if os.path.isdir(path):
                        todo.append((os.path.realpath(path), hops[-1][1], named))
    outside = {there: host for there, host in mounts.items() if not _within(there, str(model))}
    kept = [there for there in sorted(outside) if not any(
        _within(there, o) and outside[there] == os.path.join(outside[o], os.path.relpath(there, o))
        for o in outside if o != there)]
    return [f"{model}:{model}:ro", *(f"{outside[there]}:{there}:ro" for there in kept)]


def _link_dirs(named: str, link: str, seen: str) -> list[tuple[str, str]]:
    """The folders a container reads through to reach what ``link`` (``named`` in the
    checkpoint, ``seen`` where the container finds it) leads to, one per hop: the host folder
    the host's kernel reaches (the target itself where it is a folder), and where the
    container reaches it.  The kernel reads a hop from the real folder its link is in; the
    container from the folder it found the link in, a plain folder there."""
    if not os.path.exists(link):  # follows every hop: false for a missing target and for a loop
        raise DockerError(f"--provider docker: the checkpoint's {named} is a link "
                          f"to {os.readlink(link)}, which leads to no file; a container could not read it")
    dirs, path = [], link
    for _ in range(MAX_LINK_HOPS):
        if not os.path.islink(path):
            break
        target = os.readlink(path)
        path = os.path.normpath(os.path.join(os.path.realpath(os.path.dirname(path)), target))
        seen = os.path.normpath(os.path.join(os.path.dirname(seen), target))
        if os.path.isdir(path) and not os.path.islink(path):
            dirs.append((os.path.realpath(path), seen))
        else:
            dirs.append((os.path.realpath(os.path.dirname(path)), os.path.dirname(seen)))
    return dirs


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


class ContainerProcess(LocalProcess):
    """A job's container, run attached (``docker run --rm``): its output is the client's, and its
    exit code too.  Signals go through ``docker kill``: the client forwards a SIGTERM, but a
    SIGKILL would end only the client and leave the container running."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None, *,
                 run_argv: Callable[[int], list[str]], container: Callable[[int], str]) -> None:
        self._run_argv, self._container, self.starts = run_argv, container, 0
        super().__init__(name, argv, env)

    def _spawn(self) -> None:
        self.starts += 1
        self.container = self._container(self.starts)
        self._command = [*self._run_argv(self.starts), *self.args]
        super()._spawn()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is not None:
            return
        name = signal.Signals(signum).name.removeprefix("SIG")
        killed = _docker("kill", "--signal", name, self.container, timeout=20).returncode == 0
        if not killed and signum == signal.SIGKILL:
            self.proc.kill()  # the container is gone or going: the client must not outlive it


class DockerProvider:
    name = "docker"

    def __init__(self, names: list[str], tmp: Path, model: str, say: Callable[[str], None]) -> None:
        self.names = list(names)  # every job, the relays included
        self.tmp, self.model = tmp, str(Path(model).resolve())
        self.model_mounts = checkpoint_mounts(Path(self.model))  # before the engine is asked anything
        check_available()
        self.image = ensure_image(say)
        self.x: int | None = None
        self.network = ""
        self.ips: dict[str, str] = {}
        self._reap_orphans(say)
        say("making the run's Docker network")
        self._make_network()  # last: a failure before it leaves nothing to tear down

    # -- what smoke-run asks ------------------------------------------------------------------
    def handles(self, spec: str) -> bool:
        return False  # every fault is the nodes' own, as on the local provider

    def addresses(self) -> dict[str, str]:
        """Each job's gossip HOST:PORT (a relay's is its WebSocket/STUN port)."""
        return {n: f"{self.ips[n]}:{RELAY_PORT if is_relay_job(n) else GOSSIP_PORT}" for n in self.names}

    def dashboard_bind(self, name: str) -> str:
        return f"{self.ips[name]}:{DASHBOARD_PORT}"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None) -> LocalProcess:
        return ContainerProcess(name, argv, env, run_argv=partial(self.run_argv, name, env),
                                container=partial(self.container, name))

    def run_argv(self, name: str, env: dict[str, str] | None, start: int) -> list[str]:
        """``docker run`` for job ``name``'s ``start``-th container, up to the image; the job's
        own arguments follow it."""
        mounts = [f"{self.tmp}:{self.tmp}", *self.model_mounts]
        hostfile = (env or {}).get("MESHD_HOSTFILE")
        if hostfile:
            mounts.append(f"{hostfile}:{hostfile}:ro")
        every = {"HOME": str(self.tmp), "PYTHONUNBUFFERED": "1",
                 "NUMBA_CACHE_DIR": str(self.tmp / "numba"), **(env or {})}
        env_args = [a for k, v in sorted(every.items()) for a in ("--env", f"{k}={v}")]
        return ["docker", "run", "--rm", "--name", self.container(name, start),
                "--label", f"{LABEL}={self.x}", *self._owner_labels(),
                "--network", self.network, "--ip", self.ips[name],
                "--user", f"{os.getuid()}:{os.getgid()}",
                *(a for m in mounts for a in ("--volume", m)), *env_args, self.image]

    def container(self, name: str, start: int) -> str:
        return f"{self.network}-{name}-{start}"

    def describe(self) -> dict:
        return {"network": self.network, "subnet": f"10.215.{self.x}.0/24", "image": self.image,
                "addresses": dict(self.ips)}

    # -- building ------------------------------------------------------------------------------
    def setup(self, specs: list[str]) -> None:
        """Nothing to build past the network: every fault is the nodes' own."""

    def _owner_labels(self) -> list[str]:
        return ["--label", f"{OWNER}={socket.gethostname()}:{os.getpid()}"]

    def _reap_orphans(self, say: Callable[[str], None]) -> None:
        """Remove what a smoke-run on this host left when it was killed before its teardown:
        containers and networks whose owner's process is gone."""
        here = socket.gethostname()
        for kind, ls, field, rm in (("container", ["ps", "-a"], "{{.Names}}", ["rm", "--force"]),
                                    ("network", ["network", "ls"], "{{.Name}}", ["network", "rm"])):
            owner_of = '{{.Label "' + OWNER + '"}}'
            r = _docker(*ls, "--filter", f"label={OWNER}", "--format", f"{field} {owner_of}", timeout=20)
            for line in r.stdout.splitlines() if r.returncode == 0 else []:
                name, _, owner = line.partition(" ")
                host, _, pid = owner.rpartition(":")
                if host == here and pid.isdigit() and not _alive(int(pid)):
                    say(f"removing {kind} {name}, left by a smoke-run (pid {pid}) killed before its teardown")
                    _docker(*rm, name)

    def _make_network(self) -> None:
        """The run's internal network, on the first free 10.215.X.0/24."""
        (self.tmp / "numba").mkdir(exist_ok=True)
        start = os.getpid() % 250 + 1
        last = ""
        for i in range(250):
            x = (start + i - 1) % 250 + 1
            network = f"meshd-smoke-{x}"
            r = _docker("network", "create", "--internal", "--subnet", f"10.215.{x}.0/24",
                        "--label", f"{LABEL}={x}", *self._owner_labels(), network)
            if r.returncode == 0:
                self.x, self.network = x, network
                self.ips = {n: f"10.215.{x}.{10 + k}" for k, n in enumerate(self.names)}
                return
            last = _first_line(r)
            if "overlap" not in last and "already exists" not in last:
                raise DockerError(f"docker network create {network}: {last}")
        raise DockerError(f"no free 10.215.X.0/24 network for the run's containers (last: {last})")

    # -- tearing down --------------------------------------------------------------------------
    def teardown(self) -> int:
        """Remove the run's containers and its network; returns how many are left."""
        if self.x is None:
            return 0
        with contextlib.suppress(DockerError):
            ids = self._labelled("ps", "-aq")
            if ids:
                _docker("rm", "--force", *ids)
            _docker("network", "rm", self.network)
        return len(self.leftovers())

    def leftovers(self) -> list[str]:
        """Containers and networks of this run still present."""
        if self.x is None:
            return []
        try:
            return ([f"container {c}" for c in self._labelled("ps", "-a", "--format", "{{.Names}}")]
                    + [f"network {n}" for n in self._labelled("network", "ls", "--format", "{{.Name}}")])
        except DockerError as exc:
            return [f"unknown ({exc})"]

    def _labelled(self, *argv: str) -> list[str]:
        r = _docker(*argv, "--filter", f"label={LABEL}={self.x}", timeout=20)
        if r.returncode != 0:
            raise DockerError(f"docker {' '.join(argv)}: {_first_line(r)}")
        return r.stdout.split()
