"""dstack multi-node tasks: DSTACK_* variables decide role, stage count and seed; the task YAML."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from meshd.cli import build_parser
from meshd.launch import dstack_env

ROOT = Path(__file__).resolve().parent.parent
ENV = {"DSTACK_NODE_RANK": "0", "DSTACK_NODES_NUM": "4", "DSTACK_MASTER_NODE_IP": "10.0.0.5"}


def run_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def test_outside_dstack_nothing_changes_and_role_defaults_to_stage():
    assert dstack_env.from_env({}) is None
    args = run_args("--stage", "0", "--stages", "2")
    dstack_env.apply(args, {})
    assert (args.role, args.seed, args.relay, args.bind) == ("stage", [], None, "127.0.0.1:0")


def test_rank_0_is_the_orchestrator_and_every_other_rank_a_stage():
    master = dstack_env.from_env(ENV)
    assert (master.role, master.stage, master.stages, master.seeds) == ("orchestrator", None, 3, [])
    assert master.relay == "ws://10.0.0.5:3478" and master.advertise == "10.0.0.5:7946"
    for rank in (1, 2, 3):
        node = dstack_env.from_env({**ENV, "DSTACK_NODE_RANK": str(rank)})
        assert (node.role, node.stage, node.stages) == ("stage", rank - 1, 3)
        assert node.seeds == ["10.0.0.5:7946"] and node.relay == "ws://10.0.0.5:3478"
        assert node.bind == "0.0.0.0:7946"


def test_own_address_from_dstack_nodes_ips():
    ips = "10.0.0.5\n10.0.0.6\n10.0.0.7\n10.0.0.8"
    node = dstack_env.from_env({**ENV, "DSTACK_NODE_RANK": "2", "DSTACK_NODES_IPS": ips})
    assert node.advertise == "10.0.0.7:7946"


def test_an_ipv6_master_and_nodes_are_written_in_brackets():
    ips = "fd00::5\nfd00::6\nfd00::7"
    env = {"DSTACK_NODES_NUM": "3", "DSTACK_MASTER_NODE_IP": "fd00::5", "DSTACK_NODES_IPS": ips}
    master = dstack_env.from_env({**env, "DSTACK_NODE_RANK": "0"})
    assert master.relay == "ws://[fd00::5]:3478" and master.advertise == "[fd00::5]:7946"
    node = dstack_env.from_env({**env, "DSTACK_NODE_RANK": "2"})
    assert node.seeds == ["[fd00::5]:7946"] and node.advertise == "[fd00::7]:7946"
    args = run_args()
    dstack_env.apply(args, {**env, "DSTACK_NODE_RANK": "1"})
    assert args.relay == ["ws://[fd00::5]:3478"] and args.seed == ["[fd00::5]:7946"]


def test_an_ipv6_master_given_in_brackets_is_bracketed_once():
    env = {"DSTACK_NODES_NUM": "3", "DSTACK_MASTER_NODE_IP": "[::1]", "DSTACK_NODES_IPS": "[::1] ::2 [::3]"}
    node = dstack_env.from_env({**env, "DSTACK_NODE_RANK": "2"})
    assert node.relay == "ws://[::1]:3478" and node.seeds == ["[::1]:7946"] and node.advertise == "[::3]:7946"


def test_flags_fill_in_only_what_is_absent():
    args = run_args()
    dstack_env.apply(args, {**ENV, "DSTACK_NODE_RANK": "2"})
    assert (args.role, args.stage, args.stages) == ("stage", 1, 3)
    assert args.seed == ["10.0.0.5:7946"] and args.bind == "0.0.0.0:7946"
    args = run_args("--stages", "5", "--seed", "1.2.3.4:9", "--bind", "127.0.0.1:7000",
                    "--relay", "ws://r:1", "--role", "orchestrator")
    dstack_env.apply(args, {**ENV, "DSTACK_NODE_RANK": "2"})
    assert (args.role, args.stage, args.stages) == ("orchestrator", None, 5)
    assert (args.seed, args.bind, args.relay) == (["1.2.3.4:9"], "127.0.0.1:7000", ["ws://r:1"])


@pytest.mark.parametrize("env, message", [
    ({**ENV, "DSTACK_NODE_RANK": "x"}, "DSTACK_NODE_RANK='x' is not a whole number"),
    ({**ENV, "DSTACK_NODE_RANK": "4"}, "DSTACK_NODE_RANK=4 is outside 0..3"),
    ({**ENV, "DSTACK_NODES_NUM": "1"}, "DSTACK_NODES_NUM=1 must be at least 2"),
    ({"DSTACK_NODE_RANK": "1", "DSTACK_NODES_NUM": "3"}, "DSTACK_MASTER_NODE_IP is not set"),
])
def test_bad_variables_are_named(env, message):
    with pytest.raises(ValueError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        dstack_env.from_env(env)


def test_the_cli_reports_a_bad_variable_as_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("DSTACK_NODE_RANK", "9")
    monkeypatch.setenv("DSTACK_NODES_NUM", "3")
    monkeypatch.setenv("DSTACK_MASTER_NODE_IP", "10.0.0.5")
    args = run_args()
    with pytest.raises(SystemExit) as exc:
        args.func(args, build_parser())
    assert exc.value.code == 2
    assert "run: DSTACK_NODE_RANK=9 is outside 0..2" in capsys.readouterr().err


def _top_level_keys(text: str) -> dict[str, str]:
    """Top-level `key: value` pairs of a simple YAML file (no PyYAML needed)."""
    keys = {}
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#") and ":" in line:
            key, _, value = line.partition(":")
            keys[key.strip()] = value.strip()
    return keys


def test_the_dstack_task_keeps_dstacks_schema_keys():
    text = (ROOT / "docker" / "dstack.yml").read_text()
    keys = _top_level_keys(text)
    assert keys["type"] == "task"
    assert {"type", "nodes", "commands", "startup_order", "stop_criteria"} <= set(keys)
    assert keys["startup_order"] == "workers-first" and keys["stop_criteria"] == "master-done"
    assert keys["nodes"].isdigit() and int(keys["nodes"]) >= 2
    assert "DSTACK_NODE_RANK" in text and "meshd relay" in text and "meshd run" in text
    try:
        import yaml
    except ImportError:
        return
    doc = yaml.safe_load(text)
    assert doc["type"] == "task" and isinstance(doc["commands"], list)
