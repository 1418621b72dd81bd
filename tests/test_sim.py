"""``meshd sim``: deterministic, faithful to the wire path, and honest about crashes."""

from __future__ import annotations

import json

import pytest

from meshd.cli import main
from meshd.sim import Scenario, simulate
from meshd.sim.memnet import MemNet
from meshd.sim.network import Latency, SpecError
from meshd.swim import Config

SMALL = Scenario(nodes=24, periods=30, loss=0.05, crash=0.1, churn=0.02, asym=0.05, seed=7)


def test_same_seed_same_output_byte_for_byte(capsys):
    argv = ["sim", "--nodes", "24", "--periods", "30", "--loss", "0.05", "--crash", "0.1",
            "--churn", "0.02", "--asym", "0.05", "--latency", "lognormal:1:0.5", "--seed", "7", "--json"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    second = capsys.readouterr()
    assert first.out == second.out
    assert first.err == ""  # --json stays quiet
    data = json.loads(first.out)
    assert data["params"]["nodes"] == 24
    assert {"false_dead", "detection", "dissemination", "load"} <= data.keys()


def test_another_seed_gives_another_run():
    a = simulate(SMALL).to_dict()
    b = simulate(Scenario(**{**SMALL.__dict__, "seed": 8})).to_dict()
    assert a != b


def test_every_crash_is_known_to_all_within_the_max_bound():
    r = simulate(Scenario(nodes=30, periods=40, crash=0.1, seed=3))
    d = r.detection()
    low, high = r.bounds
    assert d["crashes"] == 3 and d["unresolved"] == 0
    assert d["all_within_max_bound"]
    # Lifeguard: confirmations bring the suspicion down to its floor.
    assert d["suspicion_phase_median_s"] == pytest.approx(low, abs=0.1)
    assert r.false_dead == 0


def test_joins_and_metadata_reach_everyone():
    r = simulate(Scenario(nodes=40, periods=30, seed=2))
    dis = r.dissemination()
    for kind in ("join", "meta"):
        assert dis[kind]["count"] == 3 and dis[kind]["unfinished"] == 0
        assert dis[kind]["p99_rounds_median"] < 5


def test_blocked_directions_without_a_relay_lose_packets_with_one_do_not():
    base = dict(nodes=20, periods=15, asym=0.2, seed=4, joins=0, meta_changes=0)
    without = simulate(Scenario(**base, relay=False))
    with_relay = simulate(Scenario(**base, relay=True))
    assert without.counters.get("net_lost", 0) > 0
    assert with_relay.counters.get("net_lost", 0) == 0


def test_skipping_decode_changes_nothing_but_speed():
    """MemNet(decode=False) is what the simulator uses; it must be the same run."""

    def run(decode: bool):
        net = MemNet(seed=5, config=Config(), decode=decode)
        first = net.add_node()
        for _ in range(7):
            net.add_node(seeds=[first.addr])
        net.set_loss(0.1)
        net.run_periods(10)
        net.crash(list(net.nodes.values())[3])
        net.run_periods(20)
        log = [(o.at, o.observer, o.event.kind, o.event.node) for o in net.log]
        return log, [(n.tx_packets, n.tx_bytes) for n in net.nodes.values()]

    assert run(True) == run(False)


@pytest.mark.parametrize("argv", [
    ["--nodes", "0"], ["--nodes", "x"], ["--loss", "1.5"], ["--loss", "-0.1"], ["--asym", "1"],
    ["--periods", "0"], ["--latency", "uniform:5:1"], ["--latency", "gauss:1"], ["--seed", "-1"],
    ["--nodes", "10", "--crash", "0.01"], ["--nodes", "10000000000"], ["--periods", "10000001"],
])
def test_bad_input_is_a_one_line_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sim", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("meshd") and "error:" in last


@pytest.mark.parametrize("argv, says", [
    (["--nodes", "3001"], "argument --nodes: '3001' must be at most 3000 nodes, held in one process"),
    (["--periods", "1001"], "argument --periods: '1001' must be at most 1000 periods"),
])
def test_a_size_past_what_one_process_simulates_says_the_bound(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sim", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_latency_specs():
    assert str(Latency.parse("uniform:0.5:1.5")) == "uniform:0.5:1.5"
    assert Latency.parse("fixed:20").a == pytest.approx(0.02)
    assert Latency.parse("lognormal:20:0.5").median == pytest.approx(0.02)
    with pytest.raises(SpecError):
        Latency.parse("lognormal:0:1")


def test_warm_start_is_a_settled_member():
    import random

    from meshd.swim import Swim
    from meshd.wire import STATE_ALIVE, MemberState, Meta

    ids = [bytes([i]) * 32 for i in range(5)]
    states = [MemberState(i, f"10.0.0.{n}:1", 0, STATE_ALIVE, Meta(stage=n)) for n, i in enumerate(ids)]
    swim = Swim(ids[0], "10.0.0.0:1", Meta(stage=0), Config(), random.Random(1), 0.0)
    swim.warm_start(states, 0.0)
    assert swim.live_count() == 5
    assert swim.events() == [] and len(swim.broadcasts) == 0
    assert swim.next_deadline() <= Config().probe_interval


def test_with_a_relay_a_lossy_probe_gets_a_second_chance():
    """The core pings over the relay after the direct timeout (memberlist's TCP
    fallback): far fewer live members are suspected at high loss."""
    base = dict(nodes=50, periods=30, loss=0.2, seed=1, joins=0, meta_changes=0)
    without = simulate(Scenario(**base, relay=False))
    with_relay = simulate(Scenario(**base, relay=True))
    assert "relay_pings" not in without.counters
    assert with_relay.counters["relay_pings"] > 0
    assert with_relay.false_suspicions * 2 < without.false_suspicions


def test_a_run_into_a_log_says_how_far_it_is_every_few_seconds(capsys, monkeypatch):
    """Without a terminal (a log, a pipe) a long run prints a progress line now and then,
    on stderr, so stdout stays the result (or the JSON object) alone."""
    from meshd.sim import cli as sim_cli

    monkeypatch.setattr(sim_cli, "PROGRESS_EVERY_S", 0.0)
    main(["sim", "--nodes", "5", "--periods", "4", "--json"])
    out, err = capsys.readouterr()
    assert json.loads(out)["params"]["periods"] == 4
    lines = [line for line in err.splitlines() if line.startswith("meshd sim: 5 nodes, period")]
    assert lines and lines[0].startswith("meshd sim: 5 nodes, period 1 of 4 (25%), ")
