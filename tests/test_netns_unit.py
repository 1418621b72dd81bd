"""The netns provider's refusals, without root: one line a person can act on."""

from __future__ import annotations

import pytest

from meshd.launch import netns


def test_not_root_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetnsError) as exc:
        netns.check_available()
    assert str(exc.value) == "--provider netns needs root (network namespaces and nftables)"


def test_missing_tools_are_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "nft" else f"/usr/sbin/{tool}")
    with pytest.raises(netns.NetnsError) as exc:
        netns.check_available()
    assert str(exc.value) == "--provider netns needs nft: apt-get install -y iproute2 nftables"
    assert "\n" not in str(exc.value)


def test_the_provider_handles_only_network_faults():
    p = netns.NetnsProvider.__new__(netns.NetnsProvider)
    p._netem = True
    assert all(p.handles(s) for s in ["drop:a->b", "isolate:x", "loss:0.1", "delay:5", "nat:x"])
    assert not any(p.handles(s) for s in ["kill:stage-1@token-3", "relay-down@2"])


def test_without_netem_each_node_delays_its_own_sends():
    # A kernel without sch_netem: the delay goes to every node's --fault, as on local, not nowhere.
    from meshd.launch.plan import plan_faults

    p = netns.NetnsProvider.__new__(netns.NetnsProvider)
    p._netem = False
    assert not p.handles("delay:50") and p.handles("loss:0.1")
    plan = plan_faults(["delay:50"], {"stage-0": "10.0.0.2:7946", "stage-1": "10.0.0.3:7946"})
    assert plan.node_faults == {"stage-0": ["delay:50"], "stage-1": ["delay:50"]}


def test_every_relay_gets_its_own_namespace_address_and_the_relay_port():
    p = netns.NetnsProvider.__new__(netns.NetnsProvider)
    p.names = ["relay", "relay-2", "orchestrator", "stage-0"]
    p.ips = {n: f"10.213.7.{10 + i}" for i, n in enumerate(p.names)}
    relay, gossip = netns.RELAY_PORT, netns.GOSSIP_PORT
    assert p.addresses() == {"relay": f"10.213.7.10:{relay}", "relay-2": f"10.213.7.11:{relay}",
                             "orchestrator": f"10.213.7.12:{gossip}", "stage-0": f"10.213.7.13:{gossip}"}
