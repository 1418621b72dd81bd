"""What stages and the orchestrator share: messages in from the data channel, out through it.

Each message is decoded and handled as the channel delivers it (see
``DataChannel.dispatch``), and a send writes to the peer's stream before it
returns; the channel's per-peer task waits for acks and resends, so compute
never waits on a round trip.  A message the channel cannot deliver fails its
request, naming the peer that did not take it, so the orchestrator can move
the request to a replica of that peer's stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable

import trio

from ..logs import Quieted
from ..mesh import Mesh
from ..wire import Message, WireError
from .api import PipelineError
from .messages import Activation, Batch, HeadParts, Hop, decode_app, encode_app

log = logging.getLogger("meshd.pipeline")

RESOLVE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0
PREFILL_ROWS = 8  # more rows than this run in a thread, from a task of their own
# After a "could not deliver" line for a peer, the failures to it in this long are counted
# and logged as one line: a peer that dies takes every message queued to it along.
UNDELIVERED_QUIET_S = 5.0


class Undelivered(PipelineError):
    """A message found no path to a peer whose process was not seen to go (its stream did
    not end with its port refusing a dial): no direct path answered and no relay took it
    within SEND_TIMEOUT_S.  A peer that went away fails its messages with a PipelineError."""


async def resolve(mesh: Mesh, name: str, timeout: float = RESOLVE_TIMEOUT_S) -> bytes:
    """A live owner of ``name``, waiting for one up to ``timeout`` seconds."""
    owner = mesh.resolve(name)
    if owner is not None:  # the usual case: no cancel scope, no deadline
        return owner
    with trio.move_on_after(timeout):
        while True:
            owner = mesh.resolve(name)
            if owner is not None:
                return owner
            await trio.sleep(0.05)
    raise PipelineError(f"{mesh.name}: name {name} did not resolve within {timeout:g}s")


def per_request(msgs: tuple[Message, ...]) -> list[Message]:
    """One message of each request that ``msgs`` carry, a batch's rows each their request's
    own: what is failed, once per request, when they cannot be delivered."""
    rows = [row for m in msgs for row in (m.rows() if isinstance(m, (Batch, HeadParts)) else (m,))]
    return list({getattr(m, "req_id", id(m)): m for m in rows}.values())


class App:
    """Shared plumbing of the pipeline's services."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._nursery: trio.Nursery | None = None
        self._undelivered: dict[bytes, int] = {}  # per peer in its quiet time: failures not logged yet
        self._bad_messages = Quieted()  # messages that do not decode, logged per sender

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.start_background(nursery)
            task_status.started()
            # Handlers run in the stream's reader: a decode step is short, and a prefill
            # (the one long piece of work) gets a task of its own (see _handle).
            await self.mesh.dispatch(self._handle, inline=True)

    def start_background(self, nursery: trio.Nursery) -> None:
        """Start the service's own loops (watchers), if it has any."""

    async def _handle(self, src: bytes, data: bytes) -> None:
        try:
            packet = decode_app(data)
        except WireError as exc:
            held = self._bad_messages.due(src, trio.current_time())
            if held is not None:
                more = f" ({held} more since, not logged)" if held else ""
                log.warning("bad pipeline message from %s: %s%s", self.mesh.describe(src), exc, more)
            return
        for msg in packet.messages:
            if isinstance(msg, (Batch, HeadParts)):
                await self.on_rows(src, msg)
            elif isinstance(msg, Activation) and max(msg.rows, len(msg.tokens)) > PREFILL_ROWS:
                # Another request's message from the same sender may go first: requests
                # are independent, and nothing else of this one comes before its prefill ends.
                assert self._nursery is not None  # messages arrive only while serve() runs
                self._nursery.start_soon(self._on_message, src, msg)
            else:
                await self._on_message(src, msg)

    async def on_rows(self, src: bytes, msg: Batch | HeadParts) -> None:
        """The rows of a batch message.  Each row is its request's own message: one
        request's failure fails it alone."""
        for row in msg.rows():
            await self._on_message(src, row)

    async def _on_message(self, src: bytes, msg: Message) -> None:
        await self._guarded(msg, self.on_message(src, msg))

    async def _guarded(self, msg: Message, work: Awaitable[None]) -> None:
        """Run ``work`` for ``msg``: what it raises fails ``msg``'s request alone."""
        try:
            await work
        except PipelineError as exc:  # a failure the message names: no traceback to read
            log.warning("%s: %s", self.mesh.name, exc)
            await self.failed(msg, exc)
        except Exception as exc:  # one bad request must not stop the service
            log.exception("%s: %s failed", self.mesh.name, type(msg).__name__)
            await self.failed(msg, exc)

    async def send(self, dst: bytes, *msgs: Message) -> None:
        """To ``dst`` over the data channel, in order, without waiting for its ack.

        Several messages go as one, in order.  A message that cannot be
        delivered fails its request (``failed``, naming ``dst``).
        """
        data = encode_app(self.mesh.node_id, *msgs)
        if dst == self.mesh.node_id:
            await self.mesh.loopback(data)
            return

        async def undelivered(exc: Exception) -> None:
            self._log_undelivered(dst, exc)
            # The channel's error names the peer and every path tried: it is the request's error.
            failure = (PipelineError if self.mesh.peer_down(dst) else Undelivered)(str(exc))
            for msg in per_request(msgs):
                await self.failed(msg, failure, dst)

        await self.mesh.post(dst, data, SEND_TIMEOUT_S, undelivered)

    def _log_undelivered(self, dst: bytes, exc: Exception) -> None:
        """Log ``exc``, the first failure to ``dst`` in UNDELIVERED_QUIET_S; count the rest, which
        ``_undelivered_summary`` logs as one line (each still fails its own request)."""
        if dst in self._undelivered:
            self._undelivered[dst] += 1
            return
        log.warning("%s: %s", self.mesh.name, exc)
        if self._nursery is None:
            return
        try:
            self._nursery.start_soon(self._undelivered_summary, dst)
        except RuntimeError:  # the service stopped (its nursery closed): each failure logs its own line
            return
        self._undelivered[dst] = 0

    async def _undelivered_summary(self, dst: bytes) -> None:
        await trio.sleep(UNDELIVERED_QUIET_S)
        more = self._undelivered.pop(dst, 0)
        if more:
            log.warning("%s: %d more message%s to %s could not be delivered in the %gs after that",
                        self.mesh.name, more, "" if more == 1 else "s", self.mesh.describe(dst),
                        UNDELIVERED_QUIET_S)

    def path_to(self, dst: bytes) -> str:
        if dst == self.mesh.node_id:
            return "local"
        return self.mesh.path(dst)

    async def on_message(self, src: bytes, msg: Message) -> None:
        raise NotImplementedError

    async def failed(self, msg: Message, exc: Exception, peer: bytes = b"") -> None:
        """``msg``'s request failed here; ``peer`` is the node that did not take it, if one."""


def route_neighbours(route: tuple[bytes, ...], k: int) -> set[bytes]:
    """The nodes stage ``k`` of ``route`` exchanges a request's messages with: the stage
    before it and the one after, the last stage's after being stage 0 (its head share)."""
    return {route[k - 1] if k > 0 else route[-1], route[k + 1] if k + 1 < len(route) else route[0]}


def arrived(trace: tuple[Hop, ...], sent_at: float) -> tuple[Hop, ...]:
    """Fill in the transit time of the hop that just arrived (the last one)."""
    if not trace or trace[-1].kind != "transit":
        return trace
    last = trace[-1]
    ms = max(0.0, (time.time() - sent_at) * 1000)
    return (*trace[:-1], Hop("transit", last.name, ms, last.path))
