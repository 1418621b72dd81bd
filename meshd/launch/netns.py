"""The `netns` provider: every job in its own network namespace, faults as real packet filters.

Layout of one run (``X`` is derived from our pid; the run owns 10.213.X.0/24):

    meshd-X-sw            switch namespace with bridge ``br0``
    meshd-X-<job>         one per job (relay, relay-N, orchestrator, stage-K, a replica's stage-K.j):
                          ``eth0`` on the bridge, lo up; every relay listens on its own address
    host veth ``mX-host`` 10.213.X.1 in the root namespace, on the bridge, so smoke-run reaches
                          the dashboards without entering a namespace
    meshd-X-nat-<job>     for ``nat:<job>``: a router with ``out`` on the bridge (the job's
                          address slot + 100) and ``in`` to the job (10.214.X.4j+2/30); masquerades,
                          and forwards nothing new from outside (the host's dashboard polls excepted)

Faults (all silent, as a real network is):

- ``drop:A->B``  nftables in B's namespace, input hook, ``ip saddr A drop`` (never A's output:
                 that hands A an EPERM);
- ``isolate:X``  X's input drops everything but the host; every other namespace's input drops X;
- ``loss:P`` / ``delay:MS``  tc netem on every job's ``eth0``.  A kernel without sch_netem
                 gets loss as an nftables rule (a random share of what arrives is dropped)
                 and delay from each node itself (``--fault delay:MS`` on every node, as the
                 local provider does: its direct sends, data streams included, held that long);
- ``nat:X``      X behind a masquerading router, as most home routers: one public port for X's
                 socket whoever it sends to (endpoint-independent mapping), and in only what
                 answers what X sent (address-and-port-dependent filtering). The router's
                 outside leg drops what is addressed to the router itself, so a peer's punch
                 that beats X's own packet leaves no conntrack entry to clash with X's mapping;
- ``nat-symmetric:X``  the same with ``masquerade random``: a new public port per destination,
                 so the mapping a STUN server sees is no use to anyone else.

Every namespace goes in ``teardown`` (their links, routes and rules with them); the host veth
goes with its peer in the switch namespace.

Job names appear only in namespace names (a file name: ``stage-1.2`` is fine, and no length
limit near); interfaces are named by slot (``p<i>``, ``eth0``, ``in``, ``out``, ``mX-host``), so
they stay within the kernel's 15 characters whatever the jobs are called.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

from .local import LocalProcess
from .model import is_relay_job

GOSSIP_PORT = 7946
RELAY_PORT = 3478
DASHBOARD_PORT = 8080
_DROP = re.compile(r"^drop:(?P<a>[\w.-]+)->(?P<b>[\w.-]+)$")
_NETWORK = ("drop:", "isolate:", "loss:", "delay:", "nat:", "nat-symmetric:")


class NetnsError(Exception):
    """The testbed cannot be built; the message is one line a person can act on."""


def check_available() -> None:
    """Raise NetnsError (one line) unless we are root and have `ip`, `nft` and `tc`."""
    if os.geteuid() != 0:
        raise NetnsError("--provider netns needs root (network namespaces and nftables)")
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"--provider netns needs {', '.join(missing)}: "
                         "apt-get install -y iproute2 nftables")


def _sh(*argv: str, input: str | None = None) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, input=input)
    if r.returncode != 0:
        first = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[0]
        raise NetnsError(f"{' '.join(argv)}: {first}")


def _pick_subnet() -> int:
    """A third octet X such that 10.213.X.0/24 and 10.214.X.0/24 are unused here."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    spaces = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    start = os.getpid() % 250 + 1
    for i in range(250):
        x = (start + i - 1) % 250 + 1
        if f"10.213.{x}." not in used and f"10.214.{x}." not in used and f"meshd-{x}-sw" not in spaces:
            return x
    raise NetnsError("no free 10.213.X.0/24 subnet for the testbed")


class NetnsProvider:
    name = "netns"

    def __init__(self, names: list[str]) -> None:
        check_available()
        self.names = list(names)  # every job, the relays included
        self.x = _pick_subnet()
        self.prefix = f"meshd-{self.x}-"
        self.host_ip = f"10.213.{self.x}.1"
        self.ips = {n: f"10.213.{self.x}.{10 + i}" for i, n in enumerate(self.names)}
        self.ns = {n: f"{self.prefix}{n}" for n in self.names}
        self.switch = f"{self.prefix}sw"
        self.host_if = f"m{self.x}-host"
        self.created: list[str] = []
        self.nat: dict[str, str] = {}  # job -> its router's namespace
        self._nat_routes: list[tuple[str, str, str]] = []  # (job, router's outside ip, inside net)
        self._netem: bool | None = None  # tc netem works here (see netem_available)

    # -- what smoke-run asks ------------------------------------------------------------------
    def handles(self, spec: str) -> bool:
        if spec.startswith("delay:") and not self.netem_available():
            return False  # each node delays its own sends (see the module's docstring)
        return spec.startswith(_NETWORK)

    def netem_available(self) -> bool:
        """Whether tc netem works here, tried once in a throwaway namespace."""
        if self._netem is None:
            probe = f"meshd-{os.getpid()}-netem"
            try:
                _sh("ip", "netns", "add", probe)
                try:
                    self._netem = subprocess.run(
                        ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                         "delay", "0ms"], capture_output=True, timeout=10).returncode == 0
                finally:
                    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
            except (NetnsError, subprocess.TimeoutExpired):
                self._netem = False
        return self._netem

    def addresses(self) -> dict[str, str]:
        """Each job's gossip HOST:PORT (a relay's is its WebSocket/STUN port)."""
        return {n: f"{self.ips[n]}:{RELAY_PORT if is_relay_job(n) else GOSSIP_PORT}" for n in self.names}

    def dashboard_bind(self, name: str) -> str:
        return f"{self.ips[name]}:{DASHBOARD_PORT}"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None) -> LocalProcess:
        return LocalProcess(name, argv, env, prefix=["ip", "netns", "exec", self.ns[name]])

    def describe(self) -> dict:
        return {"subnet": f"10.213.{self.x}.0/24", "namespaces": sorted(self.created),
                "nat": dict(self.nat), "netem": bool(self._netem)}

    # -- building ------------------------------------------------------------------------------
    def _netns(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self.created.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _in(self, ns: str, *argv: str, input: str | None = None) -> None:
        _sh("ip", "netns", "exec", ns, *argv, input=input)

    def setup(self, specs: list[str]) -> None:
        """Build the switch, the host leg and one namespace per job, then apply ``specs``."""
        nats = [s.split(":", 1)[1] for s in specs if s.startswith(("nat:", "nat-symmetric:"))]
        symmetric = {s.split(":", 1)[1] for s in specs if s.startswith("nat-symmetric:")}
        self._check_names(specs)
        self._netns(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        # The host's leg on the bridge: smoke-run polls dashboards from here.
        _sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "host", "netns", self.switch)
        _sh("ip", "-n", self.switch, "link", "set", "host", "master", "br0", "up")
        _sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _sh("ip", "link", "set", self.host_if, "up")
        for i, name in enumerate(self.names):
            ns = self.ns[name]
            self._netns(ns)
            if name in nats:
                self._behind_nat(name, i, nats.index(name), symmetric=name in symmetric)
                continue
            _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)
            _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ips[name]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        # Everyone (the host too) routes a NATed job's private address to its router, which
        # forwards nothing new from outside: the packets are lost, as on the internet.
        for name, router_ip, inside in self._nat_routes:
            for other in self.names:
                if other != name and other not in self.nat:
                    _sh("ip", "-n", self.ns[other], "route", "add", inside, "via", router_ip)
            _sh("ip", "route", "add", inside, "via", router_ip, "dev", self.host_if)
        self._faults(specs)

    def _behind_nat(self, name: str, i: int, j: int, *, symmetric: bool = False) -> None:
        router = f"{self.prefix}nat-{name}"
        self._netns(router)
        self.nat[name] = router
        outside_ip = f"10.213.{self.x}.{110 + i}"
        base = 4 * j
        inside_router, inside_node = f"10.214.{self.x}.{base + 1}", f"10.214.{self.x}.{base + 2}"
        _sh("ip", "link", "add", "out", "netns", router, "type", "veth", "peer", "name", f"p{i}",
            "netns", self.switch)
        _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
        _sh("ip", "-n", router, "addr", "add", f"{outside_ip}/24", "dev", "out")
        _sh("ip", "-n", router, "link", "set", "out", "up")
        _sh("ip", "link", "add", "in", "netns", router, "type", "veth", "peer", "name", "eth0",
            "netns", self.ns[name])
        _sh("ip", "-n", router, "addr", "add", f"{inside_router}/30", "dev", "in")
        _sh("ip", "-n", router, "link", "set", "in", "up")
        _sh("ip", "-n", self.ns[name], "addr", "add", f"{inside_node}/30", "dev", "eth0")
        _sh("ip", "-n", self.ns[name], "link", "set", "eth0", "up")
        _sh("ip", "-n", self.ns[name], "route", "add", "default", "via", inside_router)
        self._in(router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        masquerade = "masquerade random" if symmetric else "masquerade"
        self._in(router, "nft", "-f", "-", input=f"""
table ip nat {{
  chain post {{ type nat hook postrouting priority 100; oifname "out" {masquerade}; }}
}}
table inet f {{
  chain input {{
    type filter hook input priority 0;
    iifname "out" drop
  }}
  chain forward {{
    type filter hook forward priority 0;
    ct state established,related accept
    iifname "out" ip saddr {self.host_ip} tcp dport {DASHBOARD_PORT} accept
    iifname "out" drop
  }}
}}
""")
        self.ips[name] = inside_node
        self._nat_routes.append((name, outside_ip, f"10.214.{self.x}.{base}/30"))

    def _check_names(self, specs: list[str]) -> None:
        for spec in specs:
            if m := _DROP.match(spec):
                who = [m["a"], m["b"]]
            elif spec.startswith(("isolate:", "nat:", "nat-symmetric:")):
                who = [spec.split(":", 1)[1]]
            elif spec.startswith("loss:"):
                try:
                    ok = 0 <= float(spec[5:]) < 1
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(f"--fault {spec}: loss must be 0 <= P < 1")
                continue
            elif spec.startswith("delay:"):
                try:
                    ok = float(spec[6:]) >= 0
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(f"--fault {spec}: delay must be a number of milliseconds")
                continue
            else:
                raise ValueError(f"--fault {spec!r}: expected drop:A->B, isolate:X, loss:P, delay:MS, nat:X, "
                                 "nat-symmetric:X")
            for n in who:
                if n not in self.names:
                    raise ValueError(f"--fault {spec}: no node named {n!r} "
                                     f"(have {', '.join(sorted(self.names))})")

    def _faults(self, specs: list[str]) -> None:
        rules: dict[str, list[str]] = {}
        netem: list[str] = []
        loss = 0.0
        for spec in specs:
            if m := _DROP.match(spec):
                rules.setdefault(m["b"], []).append(f"ip saddr {self._seen_as(m['a'])} drop")
            elif spec.startswith("isolate:"):
                x = spec[8:]
                rules.setdefault(x, []).append(f"ip saddr != {self.host_ip} drop")
                for other in self.names:
                    if other != x:
                        rules.setdefault(other, []).append(f"ip saddr {self._seen_as(x)} drop")
            elif spec.startswith("loss:"):
                loss = float(spec[5:])
                netem += ["loss", f"{loss * 100:g}%"]
            elif spec.startswith("delay:"):
                netem += ["delay", f"{float(spec[6:]):g}ms"]
        if netem and not self.netem_available():
            # Some kernels come without sch_netem: loss is still a real filter (nftables drops a
            # random share of what arrives); delay never comes here (see handles).
            for name in self.names:
                rules.setdefault(name, []).insert(0, f"numgen random mod 10000 < {round(loss * 10000)} drop")
            netem = []
        for name, lines in rules.items():
            body = "\n    ".join(lines)
            self._in(self.ns[name], "nft", "-f", "-", input=f"""
table inet meshd {{
  chain in {{
    type filter hook input priority 0;
    {body}
  }}
}}
""")
        if netem:
            for name in self.names:
                _sh("ip", "netns", "exec", self.ns[name], "tc", "qdisc", "add", "dev", "eth0", "root",
                    "netem", *netem)

    def _seen_as(self, name: str) -> str:
        """The source address others see on ``name``'s packets (its router's, behind NAT)."""
        for n, router_ip, _ in self._nat_routes:
            if n == name:
                return router_ip
        return self.ips[name]

    # -- tearing down --------------------------------------------------------------------------
    def teardown(self) -> int:
        """Delete every namespace of the run and the host leg; returns how many are left."""
        for ns in reversed(self.created):
            with contextlib.suppress(Exception):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        with contextlib.suppress(Exception):
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        return len(self.leftovers())

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run still present."""
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        left = [s for s in spaces if s.startswith(self.prefix)]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        if f" {self.host_if}@" in links or f" {self.host_if}:" in links:
            left.append(self.host_if)
        return left
