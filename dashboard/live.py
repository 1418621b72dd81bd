"""``/api/live``: the page's state pushed over a WebSocket, once a second, instead of polled.

One task (``LiveHub.serve``) composes the state while any client listens and
serializes it once; every client sends that same text, so a client costs one
reference to a shared string, never a queue of its own.  Each send has a
deadline: a client that does not take a message within ``send_timeout``
seconds is closed (1013), not waited on.  At most ``max_clients`` listen at
once; one more is refused with 503 before the handshake completes, and the
page falls back to polling ``/api/state``.

A message is ``{"ring", "state": PAGE_STATE, "samples": [HISTORY_SAMPLE, ..]}``: the
first carries the whole history ring, later ones its last few samples (the page
keeps them by ``seq``, within one ``ring``: a restarted node starts another).

The page sends nothing; what a client sends anyway is read and dropped
(Hypercorn cuts a message over ``MAX_CLIENT_MESSAGE_BYTES`` with 1009), and past
``MAX_CLIENT_MESSAGES`` of them the connection is closed (1008).

The guard (``guard.DashboardGuard``) has checked Host, Origin and the token
before the endpoint runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import trio
from starlette.websockets import WebSocket, WebSocketDisconnect

from .history import History

log = logging.getLogger("meshd.dashboard")

MAX_CLIENTS = 16
PUSH_INTERVAL_S = 1.0
SEND_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 1.0
TAIL = 4  # history samples repeated in every push, so a push that is skipped loses none
MAX_CLIENT_MESSAGES = 64
MAX_CLIENT_MESSAGE_BYTES = 64 << 10

CLOSE_POLICY = 1008  # the client sent more than the page ever does
CLOSE_TRY_LATER = 1013  # too slow to take the pushes


class LiveHub:
    """The listening clients' count and the latest push, shared by all of them."""

    def __init__(self, compose: Callable[[], dict[str, Any]], history: History, *,
                 max_clients: int = MAX_CLIENTS, interval: float = PUSH_INTERVAL_S,
                 send_timeout: float = SEND_TIMEOUT_S) -> None:
        self.compose = compose
        self.history = history
        self.max_clients = max_clients
        self.interval = interval
        self.send_timeout = send_timeout
        self.clients = 0
        self.version = 0
        self.text = ""  # the latest push, serialized once for every client
        self.counters = {"accepted": 0, "refused_full": 0, "closed_slow": 0, "closed_chatty": 0,
                         "client_messages": 0, "pushes": 0}
        self._pushed = trio.Event()
        self._listening = trio.Event()

    def admit(self) -> bool:
        if self.clients >= self.max_clients:
            self.counters["refused_full"] += 1
            return False
        self.clients += 1
        self.counters["accepted"] += 1
        self._listening.set()
        return True

    def release(self) -> None:
        self.clients -= 1
        if self.clients == 0:
            self._listening = trio.Event()

    def message(self, since: int = 0) -> str:
        """A message composed now: the state and the history samples after ``since``."""
        return json.dumps({"ring": self.history.ring, "state": self.compose(),
                           "samples": self.history.since(since)}, separators=(",", ":"))

    def publish(self) -> None:
        """Compose the next push and wake every client."""
        last = self.history.samples[-1]["seq"] if self.history.samples else 0
        self.text = self.message(max(0, last - TAIL))
        self.version += 1
        self.counters["pushes"] += 1
        self._pushed.set()
        self._pushed = trio.Event()

    async def next_push(self, seen: int) -> tuple[int, str]:
        """The first push after version ``seen``: (its version, its text)."""
        while self.version <= seen:
            await self._pushed.wait()
        return self.version, self.text

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Push every ``interval`` seconds while a client listens."""
        task_status.started()
        while True:
            await self._listening.wait()
            try:
                self.publish()
            except Exception:  # a bug here costs the page a push, never the node
                log.exception("dashboard live: composing a push failed")
            await trio.sleep(self.interval)


async def refuse(websocket: WebSocket, status: int, message: str) -> None:
    """Refuse the handshake with an HTTP answer, where the server can send one; else close."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        body = json.dumps({"error": message}).encode()
        await websocket.send({"type": "websocket.http.response.start", "status": status,
                              "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]})
        await websocket.send({"type": "websocket.http.response.body", "body": body})
    else:
        await websocket.close(code=CLOSE_TRY_LATER)


async def live(websocket: WebSocket) -> None:
    """The endpoint: accept, push until the client leaves, is too slow, or says too much."""
    hub: LiveHub = websocket.app.state.live
    if not hub.admit():
        with trio.move_on_after(hub.send_timeout):
            await refuse(websocket, 503, f"{hub.max_clients} pages are listening already; poll /api/state")
        return
    try:
        with trio.move_on_after(hub.send_timeout) as accepting:
            await websocket.accept()
        if accepting.cancelled_caught:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_read_and_drop, websocket, hub, nursery.cancel_scope)
            await _push(websocket, hub)
            nursery.cancel_scope.cancel()
    except WebSocketDisconnect:
        pass
    finally:
        hub.release()


async def _push(websocket: WebSocket, hub: LiveHub) -> None:
    version = hub.version
    text = hub.message()  # the first: composed now, with the whole history
    while True:
        with trio.move_on_after(hub.send_timeout) as sending:
            await websocket.send_text(text)
        if sending.cancelled_caught:
            hub.counters["closed_slow"] += 1
            await _close(websocket, CLOSE_TRY_LATER, "too slow to take the pushes")
            return
        version, text = await hub.next_push(version)


async def _read_and_drop(websocket: WebSocket, hub: LiveHub, done: trio.CancelScope) -> None:
    """The page sends nothing: read what comes (so the server never holds it) and drop it;
    close a client that keeps sending.  Ends the connection when the client leaves."""
    received = 0
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            received += 1
            hub.counters["client_messages"] += 1
            if received > MAX_CLIENT_MESSAGES:
                hub.counters["closed_chatty"] += 1
                await _close(websocket, CLOSE_POLICY, "this feed takes no messages")
                return
    finally:
        done.cancel()


async def _close(websocket: WebSocket, code: int, reason: str) -> None:
    with trio.move_on_after(CLOSE_TIMEOUT_S):
        try:
            await websocket.close(code=code, reason=reason)
        except RuntimeError:  # closed already, by the client
            pass
