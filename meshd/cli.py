"""The ``meshd`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .argtypes import cpu_list, cpu_text, float_between, int_up_to, path, positive_int, writable_dir
from .identity import Identity, IdentityError, hold_key_file, load_node_ids, load_or_create
from .net.faults import Faults, FaultSpecError
from .net.udp import AddressError, BindError, first_of, parse_addr
from .pipeline.polling import DEFAULT_POLL_MS
from .swim import PROFILES
from .wire import MAX_BATCH_ROWS, MAX_STAGES


def _addr(text: str) -> str:
    try:
        parse_addr(text, allow_port_zero=True)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _seed_addr(text: str) -> str:
    try:
        parse_addr(text)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshd",
        description="Pipeline-parallel inference across machines that do not all reach each other.",
    )
    parser.add_argument("--version", action="version", version=f"meshd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    parser.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="text: event lines as the contract writes them on stdout, log lines with "
                             "time, level, node and prefix on stderr; json: both as JSON lines "
                             "(default %(default)s)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="run one node (one per host)",
                         description="Run one mesh node: SWIM membership over UDP on --bind.")
    run.add_argument("--role", choices=["orchestrator", "stage"], default=None,
                     help="default stage; under dstack, from DSTACK_NODE_RANK (see launch/dstack_env.py)")
    run.add_argument("--stage", type=int, metavar="K", help="this node's stage (role stage)")
    run.add_argument("--stages", type=int, metavar="N", help="how many stages the run has")
    run.add_argument("--bind", type=_addr, default="127.0.0.1:0", metavar="HOST:PORT",
                     help="gossip over UDP (port 0 picks one; default %(default)s)")
    run.add_argument("--advertise", type=_seed_addr, metavar="HOST:PORT",
                     help="the address peers should use, if not the bound one (e.g. behind 0.0.0.0)")
    run.add_argument("--seed", type=_seed_addr, action="append", default=[], metavar="HOST:PORT",
                     help="a node to join through; repeatable")
    run.add_argument("--key-file", type=path, metavar="PATH",
                     help="node identity, created 0600 if missing (default: a new identity each run)")
    run.add_argument("--profile", choices=sorted(PROFILES), default="lan",
                     help="protocol timings, as memberlist's profiles (default %(default)s)")
    run.add_argument("--snapshot-dir", type=writable_dir, metavar="DIR",
                     help="append JSON-line snapshots to DIR/<prefix>.jsonl")
    run.add_argument("--snapshot-interval", type=float_between(0.1, 86400, "seconds"), default=5.0,
                     metavar="SECONDS", help="how often to append a snapshot (default %(default)s)")
    model = run.add_mutually_exclusive_group()
    model.add_argument("--model", type=path, metavar="DIR",
                       help="checkpoint folder (config.json + model.safetensors)")
    model.add_argument("--stub", action="store_true", help="serve the tiny built-in model")
    run.add_argument("--compute-threads", type=positive_int, metavar="N",
                     help="threads for this node's matrix maths (default: one per core; nodes that "
                          "share a host should split the cores, as smoke-run does)")
    run.add_argument("--cpus", type=cpu_list, metavar="LIST",
                     help="run on these CPUs only (0-1,4, as taskset takes them); stages that share a "
                          "host should each have their own, as smoke-run gives them")
    run.add_argument("--max-batch", type=int_up_to(MAX_BATCH_ROWS), default=16, metavar="N",
                     help="a stage runs the decode steps of up to N requests as one forward pass, so "
                          f"they share each weight read; 1 runs each alone, at most {MAX_BATCH_ROWS} "
                          "(default %(default)s)")
    run.add_argument("--poll-ms", type=float_between(0, 60_000, "milliseconds"), default=DEFAULT_POLL_MS,
                     metavar="MS",
                     help="while a stage serves a single request, it polls its sockets for MS after "
                          "each of its messages rather than sleep, yielding its CPU to anything else "
                          "runnable: a sleeping (v)CPU takes tens of microseconds or more to wake at "
                          "every hop; 0 sleeps at once (default %(default)g)")
    run.add_argument("--max-running", type=positive_int, default=64, metavar="N",
                     help="the orchestrator runs up to N requests at once; more wait (default %(default)s)")
    run.add_argument("--max-queued", type=positive_int, default=256, metavar="N",
                     help="requests waiting for a slot; past N, a request gets 503 with Retry-After "
                          "(default %(default)s)")
    run.add_argument("--kv-budget-mb", type=positive_int, default=1024, metavar="MB",
                     help="KV cache per stage: the orchestrator admits requests within it, a stage "
                          "refuses what would pass it (default %(default)s; same on every node)")
    run.add_argument("--dashboard", default="127.0.0.1:0", metavar="HOST:PORT|off",
                     help="HTTP API and dashboard (default %(default)s; the URL is printed)")
    run.add_argument("--relay", action="append", metavar="URL",
                     help="a relay, ws://HOST:PORT (see `meshd relay`); repeatable: the first is the home "
                          "relay, and a pair uses any relay both ends hold")
    run.add_argument("--fault", action="append", default=[], metavar="SPEC",
                     help="inject a fault in this node's transport: drop:HOST:PORT (our direct packets "
                          "to that peer are lost), isolate, loss:P, delay:MS; repeatable")
    run.add_argument("--allow-nodes", type=path, metavar="FILE",
                     help="only the node ids in FILE (one per line, 64 hex digits) may claim stage names")
    trust = run.add_mutually_exclusive_group()
    trust.add_argument("--mesh-key-file", type=path, metavar="PATH",
                       help="the mesh's key(ring): every packet is sealed with it and what does not open "
                            "is dropped (make one with `meshd keys generate --out PATH`); required beyond "
                            "loopback unless --insecure")
    trust.add_argument("--insecure", action="store_true",
                       help="run beyond loopback without a mesh key: anyone who reaches the port can join")
    run.set_defaults(func=_cmd_run)

    from .relay.cli import add_parser as add_relay
    add_relay(sub)
    from .keys_cli import add_parser as add_keys
    add_keys(sub)
    from .sim.cli import add_parser as add_sim
    add_sim(sub)
    from .launch.smoke import add_parser as add_smoke

    add_smoke(sub)
    from .launch.ps import add_parser as add_ps
    add_ps(sub)
    from .pipeline.cli import add_parser as add_pipeline
    add_pipeline(sub)
    from dashboard.cli import add_parser as add_dashboard
    add_dashboard(sub)
    return parser


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import trio

    from .daemon import run_daemon
    from .launch import dstack_env
    from .memory import state_file_for
    from .node import NodeOptions, TwinError

    try:  # flags absent: role, stage count and seed from DSTACK_NODE_RANK/NODES_NUM/MASTER_NODE_IP
        dstack_env.apply(args, os.environ)
    except ValueError as exc:
        parser.error(f"run: {exc}")
    if args.stages is not None and not 1 <= args.stages <= MAX_STAGES:
        parser.error(f"run: --stages must be from 1 to {MAX_STAGES}, not {args.stages}")
    if args.role == "stage":
        if args.stage is None or args.stages is None:
            parser.error("run: a stage (the default --role) needs --stage K and --stages N; the "
                         "orchestrator takes --role orchestrator --stages N (under dstack, "
                         "DSTACK_NODE_RANK and DSTACK_NODES_NUM give them)")
        if not 0 <= args.stage < args.stages:
            parser.error(f"run: --stage {args.stage} is outside 0..{args.stages - 1}")
    elif args.stage is not None:
        parser.error("run: --stage is only for --role stage")
    from .relay.client import parse_relay_url

    for url in args.relay or []:
        try:
            parse_relay_url(url)
        except ValueError as exc:
            parser.error(f"run: --relay {url}: {exc}")
    if args.dashboard != "off":
        try:
            parse_addr(args.dashboard, allow_port_zero=True)
        except AddressError as exc:
            parser.error(f"run: --dashboard: {exc}")
    mesh_key = None
    if args.mesh_key_file:
        from .keyring import KeyringError, load

        try:
            mesh_key = load(args.mesh_key_file)
        except KeyringError as exc:
            print(f"meshd: error: --mesh-key-file: {exc}", file=sys.stderr)
            return 2
    elif not _on_loopback(args.bind):
        if not args.insecure:
            print(f"meshd: refusing to run on {args.bind} without a mesh key: anyone who can reach this "
                  "port could join the mesh, take a stage and read activations; give --mesh-key-file PATH "
                  "(make one with: meshd keys generate --out PATH), or --insecure", file=sys.stderr)
            return 2
        print(f"meshd: warning: running on {args.bind} without a mesh key (--insecure): anyone who can "
              "reach this port can join the mesh", file=sys.stderr)
    model_dir = args.model
    if args.stub:
        from .pipeline.stub import stub_checkpoint

        model_dir = str(stub_checkpoint())
    if model_dir is not None:
        from .pipeline.checkpoint import CheckpointError, check_headers
        from .pipeline.config import ConfigError, LlamaConfig
        from .pipeline.model import split_layers

        try:
            config = LlamaConfig.load(model_dir)
            if args.stages is not None:  # every role of a run whose stages cannot split it
                split_layers(config.num_hidden_layers, args.stages)
            # The weights' headers, each tensor's shape against config.json: an orchestrator
            # never loads the weights, and a broken file would only show as the stages failing.
            check_headers(model_dir, config)
        except (ConfigError, CheckpointError, OSError, ValueError) as exc:
            print(f"meshd: error: --model {model_dir}: {exc}", file=sys.stderr)
            return 2
    if args.cpus is not None:
        from .pipeline.threads import pin

        try:
            pin(args.cpus)
        except ValueError as exc:
            print(f"meshd: error: --cpus {cpu_text(args.cpus)}: {exc}", file=sys.stderr)
            return 2
    if args.compute_threads is not None:
        from .pipeline.threads import set_compute_threads

        set_compute_threads(args.compute_threads)
    try:
        faults = Faults.parse(args.fault)
    except FaultSpecError as exc:
        parser.error(f"run: {exc}")
    try:
        identity = load_or_create(args.key_file) if args.key_file else Identity.generate()
        if args.key_file:
            hold_key_file(args.key_file)  # held until the process ends
        allow_nodes = load_node_ids(args.allow_nodes) if args.allow_nodes else None
    except IdentityError as exc:
        print(f"meshd: error: {exc}", file=sys.stderr)
        return 2
    if args.snapshot_dir:
        from .snapshot import SnapshotWriter

        try:
            SnapshotWriter(args.snapshot_dir, identity.prefix)
        except OSError as exc:
            print(f"meshd: error: --snapshot-dir {args.snapshot_dir}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    from .logs import set_node

    set_node(f"stage-{args.stage}" if args.role == "stage" else args.role, identity.prefix)
    options = NodeOptions(
        role=args.role,
        stage=args.stage,
        stages=args.stages,
        bind=args.bind,
        advertise=args.advertise,
        seeds=args.seed,
        profile=args.profile,
        snapshot_dir=args.snapshot_dir,
        snapshot_interval=args.snapshot_interval,
        faults=faults,
        relays=list(args.relay or []),
        model=model_dir,
        max_batch=args.max_batch,
        max_running=args.max_running,
        max_queued=args.max_queued,
        kv_budget_mb=args.kv_budget_mb,
        poll_ms=args.poll_ms,
        dashboard=None if args.dashboard == "off" else args.dashboard,
        state_file=state_file_for(args.key_file) if args.key_file else None,
        allow_nodes=allow_nodes,
        mesh_key=mesh_key,
        mesh_key_file=args.mesh_key_file,
    )
    from .pipeline.checkpoint import CheckpointError
    from .pipeline.config import ConfigError
    from .pipeline.tokenizer import TokenizerError

    try:
        return trio.run(run_daemon, identity, options)
    except (BindError, CheckpointError, ConfigError, TokenizerError, BaseExceptionGroup) as exc:
        bind = first_of(exc, BindError)
        if isinstance(bind, BindError):
            print(f"meshd: error: {bind.strerror}", file=sys.stderr)
            return 2
        twin = first_of(exc, TwinError)
        if twin is not None:
            print(f"meshd: error: {twin}", file=sys.stderr)
            return 2
        # The weights and the tokenizer load as the node starts: a file that breaks there
        # is named, as the config's fields are above.
        bad = first_of(exc, CheckpointError) or first_of(exc, ConfigError) or first_of(exc, TokenizerError)
        if bad is None:
            raise
        print(f"meshd: error: --model {model_dir}: {bad}", file=sys.stderr)
        return 2



def _on_loopback(bind: str) -> bool:
    """Whether ``bind`` (HOST:PORT) listens on loopback only: 127.0.0.0/8, ::1 or localhost."""
    import ipaddress

    host = parse_addr(bind, allow_port_zero=True)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .logs import setup

    setup(args.verbose, args.log_format)
    return args.func(args, parser)


if __name__ == "__main__":
    sys.exit(main())
