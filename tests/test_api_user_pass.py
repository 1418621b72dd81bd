"""The dashboard's HTTP API as a new user (and an attacker) meets it, over real sockets: what a
client that reads to the end, speaks HTTP/1.0 or HTTP/2, or sends a body the API does not
take gets back."""

from __future__ import annotations

import json
from typing import Any

import trio
from test_dashboard_api import FakeNode

from dashboard.app import serve_dashboard


class FakeGenerator:
    """Enough of an orchestrator for the generation API: token t is the letter chr(97 + t)."""

    model_name = "fake"
    created = 0
    recent_traces: tuple = ()
    recent_failovers: tuple = ()
    recently_ended: tuple = ()

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []

    def active(self) -> list:
        return []

    def missing(self) -> list:
        return []

    def not_ready(self):
        return None

    def busy(self):
        return None

    def layer_split(self) -> dict:
        return {}

    def load(self) -> dict:
        return {"running": 0, "waiting": 0}

    def decode(self, tokens: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in tokens)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return [1]

    async def generate(self, prompt, max_tokens, temperature=0.0, top_k=0, seed=0, *, top_p=1.0, stop=(),
                       on_token=None, request_id=None) -> dict:
        self.asked.append({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                           "top_k": top_k, "seed": seed, "top_p": top_p, "stop": stop})
        tokens = []
        for t in range(max_tokens or 4):
            tokens.append(t)
            if on_token is not None:
                await on_token(t)
        return {"tokens": tokens, "text": self.decode(tokens), "prompt_tokens": 1, "finish_reason": "length",
                "timings": {}, "request": request_id or "r1", "failovers": []}


async def _serve(nursery: trio.Nursery, generator: FakeGenerator | None = None) -> int:
    url = await nursery.start(lambda task_status: serve_dashboard(
        FakeNode(), "127.0.0.1:0", generator or FakeGenerator(), task_status=task_status))
    return int(url.rsplit(":", 1)[1])


async def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` and read everything until the server closes the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


def _length(head: bytes) -> int:
    """The Content-Length of a response whose head (status line and headers) is ``head``."""
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:"))


def _post(port: int, path: str, body: dict, version: str = "1.1", extra: str = "") -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{extra}\r\n").encode() + raw


# -- a connection the client asks to close is closed once its answer is sent --------------------
async def test_a_static_file_asked_with_connection_close_ends_its_connection():
    """A client that reads to the end (or a crowd holding sockets open) is not left waiting."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            for path in ("/static/favicon.svg", "/static/app.js"):
                with trio.fail_after(10):
                    answer = await _exchange(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                                   "Connection: close\r\n\r\n".encode())
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), answer[:200]
                assert len(body) == _length(head)
            nursery.cancel_scope.cancel()


async def test_a_stream_read_over_http_1_0_ends_after_its_last_event():
    """HTTP/1.0 has no chunks: the end of the stream is the end of the connection."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            for version, extra in (("1.0", ""), ("1.1", "Connection: close\r\n")):
                request = _post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True},
                                version, extra)
                with trio.fail_after(10):
                    answer = await _exchange(port, request)
                head, _, body = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), answer[:200]
                assert b"data: [DONE]" in body
                assert b"abc" == b"".join(json.loads(line[len(b"data: "):])["choices"][0]["text"].encode()
                                          for line in body.split(b"\n")
                                          if line.startswith(b"data: {"))
            nursery.cancel_scope.cancel()


# -- HTTP/1.1 only: an HTTP/2 client is answered in words, never with a dropped connection -------
async def test_an_h2c_upgrade_is_answered_in_http_1_1_and_a_refusal_after_it_too():
    """``curl --http2`` asks to upgrade; the dashboard answers in HTTP/1.1 on the same connection,
    so a body it refuses next gets its 413, not a connection broken inside HTTP/2."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
            upgrade = (f"GET /api/peers HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: h2c\r\n"
                       "Connection: Upgrade, HTTP2-Settings\r\n"
                       "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
            post = (f"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(big)}\r\n\r\n")
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(upgrade.encode())
                first = b""
                while b"\r\n\r\n" not in first:
                    first += await stream.receive_some(65536)
                assert first.startswith(b"HTTP/1.1 200"), first[:100]
                while len(first.partition(b"\r\n\r\n")[2]) < _length(first.partition(b"\r\n\r\n")[0]):
                    first += await stream.receive_some(65536)
                await stream.send_all(post.encode())  # the body is refused by its length, unsent
                second = b""
                while chunk := await stream.receive_some(65536):
                    second += chunk
            head, _, body = second.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413"), second[:100]
            assert "at most 1048576" in json.loads(body)["error"]
            nursery.cancel_scope.cancel()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame, as a client sends next


async def test_http_2_prior_knowledge_gets_505_naming_the_version_the_dashboard_speaks():
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            with trio.fail_after(10):
                answer = await _exchange(port, PREFACE + SETTINGS)
            head, _, rest = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 505"), answer[:100]
            body = rest[:_length(head)]
            assert json.loads(body)["error"].startswith("this dashboard speaks HTTP/1.1, not HTTP/2.0")
            # What follows the preface is no request: a 400, and the connection closed (read above).
            assert rest[len(body):].startswith(b"HTTP/1.1 400")
            # and the node goes on serving
            with trio.fail_after(10):
                answer = await _exchange(port, f"GET /api/peers HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                               "Connection: close\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 200")
            nursery.cancel_scope.cancel()
