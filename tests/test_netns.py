"""`meshd smoke-run --provider netns`: a namespace per node, faults as real packet filters.

Root only; skipped (with the reason) when not root or `ip`/`nft` are missing. `.ci/run`
installs iproute2 and nftables when it runs as root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from meshd.testing.processes import smoke_signalled_at

pytestmark = [
    pytest.mark.processes,
    pytest.mark.netns,
    pytest.mark.host_network,
    pytest.mark.skipif(os.geteuid() != 0, reason="netns provider needs root"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("nft") is None,
                       reason="netns provider needs `ip` (iproute2) and `nft` (nftables)"),
]


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def netns_smoke(*args: str, timeout: float = 180) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--provider", "netns", "--json",
                        "--max-tokens", "8", *args], capture_output=True, text=True, timeout=timeout)
    assert r.stdout.strip(), r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert_nothing_left(out)
    return r.returncode, out


def assert_nothing_left(out: dict) -> None:
    """`ip netns list` and `nft list ruleset` hold nothing of the run; no host leg is left."""
    assert out["leftovers"] == 0, out
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    ruleset = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    testbed = out.get("testbed")
    if testbed is not None:
        x = testbed["subnet"].split(".")[2]
        assert f"meshd-{x}-" not in spaces, spaces
        assert f"m{x}-host" not in links
        assert f"10.213.{x}." not in ruleset and "meshd" not in ruleset, ruleset
        procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert f"10.213.{x}." not in procs, procs  # no node of this run (they bind its subnet)


@pytest.mark.parametrize("stages", [3, 5])
def test_netns_smoke_run_passes(stages):
    rc, out = netns_smoke("--stages", str(stages))
    assert rc == 0, out
    assert out["ok"] and out["matches_reference"] and out["asymmetric"] == []
    assert len(out["testbed"]["namespaces"]) == stages + 3  # switch, relay, orchestrator, stages
    assert len(out["paths"]) == (stages + 1) * stages
    assert {p["path"] for p in out["paths"]} == {"direct"}


def test_a_delay_holds_every_hop_of_the_first_token():
    # Four hops (orchestrator, three stages, back) each held 50 ms: tc netem where the kernel
    # has it, each node's own hold where it does not; either way the first token is late.
    rc, out = netns_smoke("--stages", "3", "--stub", "--max-tokens", "4", "--fault", "delay:50")
    assert rc == 0, out
    assert out["matches_reference"]
    assert out["timings"]["first_token_s"] >= 3 * 0.050, out["timings"]


@pytest.mark.parametrize("fault, pair", [
    ("drop:stage-0->orchestrator", ("orchestrator", "stage-0")),
    ("drop:stage-2->stage-0", ("stage-0", "stage-2")),  # the feedback edge
])
def test_a_kernel_one_way_drop_passes_and_reports_the_pair(fault, pair):
    rc, out = netns_smoke("--stages", "3", "--fault", fault)
    assert rc == 0, out
    assert out["matches_reference"]
    a, b = fault[5:].split("->")
    paths = {(p["from"], p["to"]): p for p in out["paths"]}
    assert paths[(a, b)]["path"] == "relay" or paths[(a, b)]["data"] == "relay", paths[(a, b)]
    assert {(x["from"], x["to"]) for x in out["asymmetric"]} == {pair}, out["asymmetric"]
    assert f"{a}→{b}: relay" in out["asymmetric"][0]["detail"]


def test_an_orchestrator_behind_nat_dials_out_and_is_reached_through_a_punch():
    rc, out = netns_smoke("--stages", "3", "--fault", "nat:orchestrator")
    assert rc == 0, out
    assert out["matches_reference"]
    assert out["testbed"]["nat"] == {"orchestrator": out["testbed"]["nat"]["orchestrator"]}
    paths = {(p["from"], p["to"]): p for p in out["paths"]}
    for k in range(3):
        # Out of the NAT: direct. Into it: nobody can dial its own address, but a punch
        # through its NAT opens a way to its mapping.
        assert paths[("orchestrator", f"stage-{k}")]["path"] == "direct"
        into = paths[(f"stage-{k}", "orchestrator")]
        assert into["path"] == "direct" and into["punched"], into
    # The tokens, as datagrams through its NAT.
    assert [p["data"] for p in _into(out, "orchestrator") if p["data"]] == ["punched"]
    assert out["asymmetric"] == []


def test_a_replica_behind_nat_serves_its_stage():
    rc, out = netns_smoke("--stages", "3", "--replicas", "2", "--fault", "nat:stage-1.2")
    assert rc == 0, out
    assert out["matches_reference"] and list(out["testbed"]["nat"]) == ["stage-1.2"]
    # The switch, the relay, the orchestrator, six stage nodes and the NAT router.
    assert len(out["testbed"]["namespaces"]) == 1 + 1 + 1 + 6 + 1
    paths = {(p["from"], p["to"]): p for p in out["paths"]}
    assert paths[("orchestrator", "stage-1.2")]["punched"]  # nobody dials into the NAT: punched
    assert paths[("stage-1.2", "orchestrator")]["path"] == "direct"


def _into(out: dict, job: str) -> list[dict]:
    return [p for p in out["paths"] if p["to"] == job]


def test_every_pair_with_a_stage_behind_nat_ends_punched_datagrams_and_data():
    rc, out = netns_smoke("--stages", "5", "--relays", "2", "--fault", "nat:stage-2")
    assert rc == 0, out
    assert out["matches_reference"] and out["asymmetric"] == []
    # Two relays' STUN saw one mapping: a NAT a peer can punch through. Nobody else has one.
    assert out["nat"]["stage-2"] == "endpoint-independent"
    assert {job for job, kind in out["nat"].items() if kind != "none"} == {"stage-2"}
    into = _into(out, "stage-2")
    assert len(into) == 5 and all(p["path"] == "direct" and p["punched"] for p in into), into
    assert [p["data"] for p in into if p["from"] == "stage-1"] == ["punched"]


def test_two_stages_behind_their_own_nats_punch_each_other():
    rc, out = netns_smoke("--stages", "5", "--relays", "2", "--fault", "nat:stage-1",
                          "--fault", "nat:stage-2")
    assert rc == 0, out
    assert out["matches_reference"] and out["asymmetric"] == []
    paths = {(p["from"], p["to"]): p for p in out["paths"]}
    for a, b in (("stage-1", "stage-2"), ("stage-2", "stage-1")):
        assert paths[(a, b)]["path"] == "direct" and paths[(a, b)]["punched"], paths[(a, b)]
    assert paths[("stage-1", "stage-2")]["data"] == "punched"


def test_a_symmetric_nat_keeps_its_pairs_on_the_relay_and_says_why():
    rc, out = netns_smoke("--stages", "5", "--relays", "2", "--fault", "nat-symmetric:stage-2")
    assert rc == 0, out
    assert out["matches_reference"]
    assert out["nat"]["stage-2"] == "symmetric"  # two relays' STUN saw two mappings
    into = _into(out, "stage-2")
    assert len(into) == 5 and all(p["path"] == "relay" and not p["punched"] for p in into), into
    assert all(p["why"].startswith("behind a symmetric NAT: not punched") for p in into), into
    details = " ".join(a["detail"] for a in out["asymmetric"])
    assert "→stage-2: relay, because behind a symmetric NAT: not punched" in details


def test_ten_stages_two_behind_nat_and_a_one_way_firewall_pass():
    rc, out = netns_smoke("--stages", "10", "--relays", "2", "--fault", "nat:stage-3",
                          "--fault", "nat:stage-7", "--fault", "drop:stage-5->stage-6", timeout=300)
    assert rc == 0, out
    assert out["matches_reference"]
    paths = {(p["from"], p["to"]): p for p in out["paths"]}
    assert paths[("stage-5", "stage-6")]["path"] == "relay"  # a filter, not a NAT: nothing to punch
    for job in ("stage-3", "stage-7"):
        assert all(p["punched"] for p in _into(out, job)), _into(out, job)
    assert paths[("stage-6", "stage-7")]["data"] == "punched"


def test_a_killed_serving_replica_fails_over_with_a_replica_behind_nat():
    rc, out = netns_smoke("--stages", "3", "--replicas", "2", "--fault", "nat:stage-1.2",
                          "--fault", "kill:stage-1@token-5", "--max-tokens", "48")
    assert rc == 0, out
    assert out["matches_reference"]
    [killed] = out["disruptions"]
    [failover] = out["failovers"]
    assert failover["from_job"] == killed["job"] and failover["to_job"] in ("stage-1", "stage-1.2")
    assert failover["to_job"] != killed["job"]


def test_an_isolated_stage_fails_the_run_naming_it():
    rc, out = netns_smoke("--stages", "3", "--fault", "isolate:stage-1", "--timeout", "15")
    assert rc == 1
    assert out["status"] == "unreachable: stage-1", out


def test_a_bad_fault_is_refused_before_anything_is_built():
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--provider", "netns", "--stages", "2",
                        "--stub", "--fault", "nat:stage-9"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no node named 'stage-9'" in r.stderr and "testbed" not in r.stderr, r.stderr
    assert_nothing_left({"leftovers": 0})


def test_sigterm_mid_generation_removes_the_testbed_and_a_second_run_passes():
    rc, stdout, _ = smoke_signalled_at("generating", "--provider", "netns")
    assert rc == 130
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["status"] == "stopped"
    assert_nothing_left(out)
    rc, again = netns_smoke("--stages", "3")
    assert rc == 0, again
