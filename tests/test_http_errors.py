"""HTTP errors of the dashboard and API: every error under /api and /v1 is JSON in the shape
of the API's other errors (404, and 405 with ``Allow``), a method a route does not serve is a
405 before the body is looked at, and a client that stalls while sending its body gets a 408
within a bounded time, without holding up anybody else."""

from __future__ import annotations

import gzip
import json

import pytest
import trio
from starlette.testclient import TestClient
from test_dashboard_api import FakeNode

import dashboard.guard
from dashboard.app import create_app, serve_dashboard

OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture
def client():
    node = FakeNode()
    with TestClient(create_app(node), backend="trio") as c:
        c.node = node
        yield c


def api_error(r) -> str:
    """The message of an /api error: ``{"error": message}``."""
    assert r.headers["content-type"] == "application/json", (r.request.url.path, r.text)
    message = r.json()["error"]
    assert isinstance(message, str) and message, r.text
    return message


def openai_error(r) -> dict:
    """The error of a /v1 error, in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""
    assert r.headers["content-type"] == "application/json", (r.request.url.path, r.text)
    error = r.json()["error"]
    assert set(error) == OPENAI_ERROR_FIELDS and error["message"], r.text
    return error


def allowed(r) -> set[str]:
    return {m.strip() for m in r.headers["allow"].split(",")}


# -- 1: unknown paths and wrong methods -------------------------------------------------------
@pytest.mark.parametrize("path", ["/api/nope", "/api/peers/nope", "/api"])
def test_an_unknown_api_path_is_a_json_404(client, path):
    for method in ("GET", "OPTIONS", "DELETE"):
        r = client.request(method, path)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert path in api_error(r)


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/embeddings", "/v1"])
def test_an_unknown_v1_path_is_a_404_in_openais_shape(client, path):
    for method in ("GET", "POST", "OPTIONS"):
        r = client.request(method, path, json={})
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        error = openai_error(r)
        assert error["type"] == "not_found_error" and "/v1/chat/completions" in error["message"]


def test_a_404_an_endpoint_raises_keeps_its_own_words():
    """Routing's 404 lists what the node serves; an endpoint that found no such thing says
    what it looked for, and that is what the caller reads."""
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    async def lookup(request):
        raise HTTPException(404, "no request abc123 here")

    guard = create_app(FakeNode())
    guard.app.router.routes.append(Route("/api/lookup", lookup))
    with TestClient(guard, backend="trio") as c:
        r = c.get("/api/lookup")
        assert r.status_code == 404 and api_error(r) == "no request abc123 here"
        r = c.get("/api/lookdown")
        assert r.status_code == 404 and api_error(r).startswith("/api/lookdown is not served here")


@pytest.mark.parametrize("path", ["/nope", "/static/nope.js", "/index.html/x"])
def test_pages_and_static_files_stay_404(client, path):
    assert client.get(path).status_code == 404


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/api/peers/add", {"POST"}),
    ("GET", "/api/generate", {"POST"}),
    ("PUT", "/api/topology", {"GET", "HEAD"}),
    ("DELETE", "/api/keys", {"GET", "HEAD", "POST"}),  # two routes share the path: both count
    ("OPTIONS", "/api/peers", {"GET", "HEAD"}),
])
def test_a_wrong_method_on_the_api_is_a_json_405_with_allow(client, method, path, allow):
    r = client.request(method, path)
    assert r.status_code == 405, (method, path, r.status_code, r.text)
    assert allowed(r) == allow
    message = api_error(r)
    assert path in message and method in message


@pytest.mark.parametrize(("method", "path", "allow", "takes"), [
    ("GET", "/v1/chat/completions", {"POST"}, "takes POST"),
    ("GET", "/v1/completions", {"POST"}, "takes POST"),
    ("OPTIONS", "/v1/models", {"GET", "HEAD"}, "takes GET"),
    ("DELETE", "/v1/models", {"GET", "HEAD"}, "takes GET"),
])
def test_a_wrong_method_on_v1_is_a_405_in_openais_shape_with_allow(client, method, path, allow, takes):
    r = client.request(method, path)
    assert r.status_code == 405, (method, path, r.status_code, r.text)
    assert allowed(r) == allow
    error = openai_error(r)
    assert error["type"] == "invalid_request_error" and takes in error["message"]


def test_a_wrong_method_on_a_static_file_is_405_with_allow(client):
    r = client.post("/static/app.js", content=b"x")
    assert r.status_code == 405 and allowed(r) == {"GET", "HEAD"}


# -- 2: a method the route does not serve is a 405 before any look at the body --------------
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("headers", [{}, {"Content-Type": "text/plain"},
                                     {"Content-Type": "application/json"}])
def test_a_method_the_route_does_not_serve_is_405_before_the_body_is_checked(client, method, headers):
    r = client.request(method, "/api/peers", content=b"not json {{{", headers=headers)
    assert r.status_code == 405, (method, headers, r.status_code, r.text)
    assert allowed(r) == {"GET", "HEAD"} and "/api/peers" in api_error(r)
    assert client.node.joined == []


def test_an_unknown_path_is_404_before_the_body_is_checked(client):
    r = client.post("/api/nope", content=b"x")
    assert r.status_code == 404 and "/api/nope" in api_error(r)
    r = client.post("/v1/models", content=b"x")
    assert r.status_code == 405 and allowed(r) == {"GET", "HEAD"}
    assert "takes GET" in openai_error(r)["message"]
    r = client.post("/v1/embeddings", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 404 and openai_error(r)["type"] == "not_found_error"


def test_the_body_checks_still_hold_where_the_method_is_served(client):
    r = client.post("/api/peers/add", content=b'{"addr": "10.0.0.1:7946"}')
    assert r.status_code == 415 and "application/json" in api_error(r)
    r = client.post("/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in openai_error(r)["message"]
    r = client.post("/api/peers/add", json={"addr": "10.0.0.1:7946"})
    assert r.status_code == 202 and client.node.joined == [["10.0.0.1:7946"]]


def test_a_compressed_body_is_refused_naming_its_encoding_not_read_as_bad_json(client):
    packed = gzip.compress(b'{"prompt": "hi"}')
    r = client.post("/v1/completions", content=packed,
                    headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding: gzip" in openai_error(r)["message"]
    r = client.post("/api/peers/add", content=b'{"addr": "10.0.0.1:7946"}',
                    headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 202


def test_the_token_is_still_asked_before_any_404_or_405():
    with TestClient(create_app(FakeNode(), token="s3cret"), backend="trio") as c:
        for method, path in [("GET", "/api/nope"), ("PUT", "/api/peers"), ("GET", "/api/peers/add"),
                             ("POST", "/v1/models")]:
            assert c.request(method, path).status_code == 401, (method, path)
        r = c.request("PUT", "/api/peers", headers={"X-Meshd-Token": "s3cret"})
        assert r.status_code == 405 and allowed(r) == {"GET", "HEAD"}


# -- over a real socket: 405 at once, and 408 for a body that stalls --------------------------
async def _serve(nursery: trio.Nursery) -> int:
    url = await nursery.start(lambda task_status: serve_dashboard(FakeNode(), "127.0.0.1:0",
                                                                  task_status=task_status))
    return int(url.rsplit(":", 1)[1])


async def _connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def _read_all(stream: trio.SocketStream) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


def _head(port: int, method: str, path: str, length: int) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def test_a_405_does_not_wait_for_the_body():
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            stream = await _connect(port)
            await stream.send_all(_head(port, "PUT", "/api/peers", 100) + b'{"a"')
            with trio.fail_after(3):  # answered, and closed, with the body still owed
                answer = await _read_all(stream)
            assert answer.startswith(b"HTTP/1.1 405"), answer
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"\r\nallow: GET, HEAD" in head and b"connection: close" in head.lower()
            assert "/api/peers takes GET, not PUT" in json.loads(body)["error"]
            await stream.aclose()
            nursery.cancel_scope.cancel()


@pytest.fixture
def short_body_timeout(monkeypatch):
    monkeypatch.setattr(dashboard.guard, "BODY_TIMEOUT_S", 1.0, raising=False)
    return 1.0


@pytest.mark.parametrize("path", ["/api/generate", "/api/peers/add", "/v1/completions"])
async def test_a_body_that_stalls_gets_408_and_a_close(short_body_timeout, path):
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            stalled = await _connect(port)
            await stalled.send_all(_head(port, "POST", path, 100) + b'{"pro')
            started = trio.current_time()
            # Meanwhile the node answers others at once.
            other = await _connect(port)
            await other.send_all(f"GET /api/peers HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                 "Connection: close\r\n\r\n".encode())
            with trio.fail_after(short_body_timeout / 2):
                assert (await _read_all(other)).startswith(b"HTTP/1.1 200")
            with trio.fail_after(short_body_timeout + 3):
                answer = await _read_all(stalled)
            took = trio.current_time() - started
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            assert b"connection: close" in head.lower()
            error = json.loads(body)["error"]
            message = error["message"] if path.startswith("/v1/") else error
            assert "within 1 s" in message
            assert short_body_timeout * 0.9 <= took < short_body_timeout + 2, took
            for s in (stalled, other):
                await s.aclose()
            nursery.cancel_scope.cancel()


async def test_a_body_dripped_byte_by_byte_is_cut_at_the_deadline_too(short_body_timeout):
    """The deadline is for the whole body, not for each read: a drip cannot stretch it."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            stream = await _connect(port)
            await stream.send_all(_head(port, "POST", "/api/peers/add", 1000))
            started = trio.current_time()
            answer = b""

            async def drip():
                try:
                    while True:
                        await stream.send_all(b" ")
                        await trio.sleep(0.1)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            async with trio.open_nursery() as inner:
                inner.start_soon(drip)
                with trio.fail_after(short_body_timeout + 3):
                    answer = await _read_all(stream)
                inner.cancel_scope.cancel()
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert trio.current_time() - started < short_body_timeout + 2
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_a_body_in_time_is_not_cut(short_body_timeout):
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery)
            stream = await _connect(port)
            body = b'{"addr": "10.0.0.1:7946"}'
            await stream.send_all(_head(port, "POST", "/api/peers/add", len(body)) + body[:5])
            await trio.sleep(short_body_timeout / 2)
            await stream.send_all(body[5:])
            with trio.fail_after(3):
                answer = await stream.receive_some(65536)
            assert answer.startswith(b"HTTP/1.1 202"), answer
            await stream.aclose()
            nursery.cancel_scope.cancel()


def test_the_body_deadline_is_a_few_seconds_to_half_a_minute():
    assert 2 <= dashboard.guard.BODY_TIMEOUT_S <= 30
