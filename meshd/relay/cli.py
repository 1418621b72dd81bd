"""``meshd relay --bind HOST:PORT [--mesh-key-file PATH]``: run a relay until SIGINT, SIGTERM or
SIGHUP (unless started under ``nohup``: see ``ctrl_c.leave_signals``)."""

from __future__ import annotations

import argparse
import signal
import sys
from functools import partial

from .. import ctrl_c
from ..argtypes import int_up_to, path, positive_float
from ..net.udp import AddressError, format_addr, parse_addr


def _bind(text: str) -> tuple[str, int]:
    try:
        return parse_addr(text, allow_port_zero=True)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    relay = sub.add_parser(
        "relay", help="run a relay: WebSocket frames between nodes, STUN over UDP on the same port",
        description="Run a meshd relay. Nodes connect over WebSocket (ws://HOST:PORT), prove their "
                    "node id, and send frames to each other; STUN binding requests are answered "
                    "over UDP on the same port.")
    relay.add_argument("--bind", type=_bind, default=("127.0.0.1", 0), metavar="HOST:PORT",
                       help="TCP (WebSocket) and UDP (STUN) port; 0 picks one (default 127.0.0.1:0)")
    relay.add_argument("--rate", type=positive_float, default=8 * 1024 * 1024, metavar="BYTES_PER_S",
                       help="per-client forwarding rate (default %(default)d)")
    relay.add_argument("--burst", type=positive_float, default=16 * 1024 * 1024, metavar="BYTES",
                       help="per-client burst above the rate (default %(default)d)")
    relay.add_argument("--ping-interval", type=positive_float, default=15.0, metavar="SECONDS",
                       help="ping a client this long after its last message (default %(default)g)")
    relay.add_argument("--ping-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                       help="drop a client whose pong takes longer (default %(default)g)")
    relay.add_argument("--max-clients", type=int_up_to(1 << 20, "clients"), default=4096, metavar="N",
                       help="clients connected at once; past it a new node is refused (default %(default)d)")
    relay.add_argument("--mesh-key-file", type=path, metavar="PATH",
                       help="the mesh's key file: admit members only (clients that prove a key in it); "
                            "read again when it changes, so add a new key here before rotating the mesh")
    relay.set_defaults(func=_cmd_relay)


def _cmd_relay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import trio

    from ..keyring import KeyringError
    from .server import Relay, RelayConfig

    try:
        config = RelayConfig(rate_bytes_per_s=args.rate, burst_bytes=args.burst,
                             ping_interval=args.ping_interval, ping_timeout=args.ping_timeout,
                             max_clients=args.max_clients)
    except ValueError as exc:
        parser.error(f"relay: {exc}")
    try:
        relay = Relay(config, mesh_key_file=args.mesh_key_file)
    except KeyringError as exc:
        print(f"meshd: error: --mesh-key-file: {exc}", file=sys.stderr)
        return 2
    return trio.run(_serve_until_signal, args.bind, relay)


async def _serve_until_signal(bind: tuple[str, int], relay) -> int:
    import trio

    from ..limits import raise_open_files_limit
    from ..logs import event, set_node
    from .server import RelayBindError, serve_relay

    set_node("relay", "-")

    with trio.open_signal_receiver(*ctrl_c.leave_signals()) as signals:
        ctrl_c.raise_if_lost()
        raise_open_files_limit()
        async with trio.open_nursery() as nursery:
            try:
                host, port = await nursery.start(partial(serve_relay, bind[0], bind[1], relay=relay))
            except RelayBindError as exc:
                print(f"meshd: error: {exc.strerror}", file=sys.stderr)
                return 2
            addr = format_addr(host, port)
            event(f"meshd relay url=ws://{addr} stun={addr}/udp")
            async for signum in signals:
                event(f"meshd relay leaving ({signal.Signals(signum).name})")
                break
            nursery.cancel_scope.cancel()
    return 0
