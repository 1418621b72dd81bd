"""What a request must be before the dashboard app sees it: an ASGI middleware.

The dashboard listens on a port any page in the user's browser can reach, so
every request is checked here, in one place, before a handler runs:

* **Host** must name this dashboard (the address the connection arrived on,
  the bound host, localhost / 127.0.0.1 / [::1], or a name the user allowed):
  a page whose DNS name was rebound to us sends its own name, and gets 421.
* **Origin** of a state-changing request must be the origin the Host names
  (or, without Origin, ``Sec-Fetch-Site`` must not say another site): another
  page's POST gets 403, even from another port of the same host.
* **Token**: bound beyond loopback, everything but the page, its static files
  and ``/metrics`` needs the node's token (401 without it).
* **Route**: a state-changing request to a path no route serves, or with a method
  its route does not take, goes to the app with its body unread, before any check
  below, and gets the app's 404 or 405 (with ``Allow``): what is wrong with it is
  the method or the path, not the body it sends.
* **Body** of a state-changing request: ``Content-Type: application/json``
  (415 otherwise: a form or a ``text/plain`` fetch is how a page posts without
  asking), at most ``max_body`` bytes counted while it streams in (413 as soon
  as it passes), UTF-8, and nested at most ``max_depth`` arrays/objects deep
  (400), measured without recursion so ``json.loads`` never recurses further.
  The whole body must arrive within ``BODY_TIMEOUT_S`` (408 and the connection
  closed otherwise): Hypercorn has no deadline on a request's body, and its
  ``read_timeout`` would be one on every read of the connection, cutting
  ``/api/live`` and long generations whose clients rightly send nothing.

A request of another **HTTP version** (HTTP/2's preface, which the server reads as a
request of version 2.0: it keeps connections to HTTP/1.1) gets 505 before anything else.

A **WebSocket** (``/api/live``) passes the same Host and token checks, and its
Origin is checked whatever it asks for: no CORS stands between a page and a
WebSocket, so a foreign Origin (or ``Sec-Fetch-Site`` naming another site) is
refused before the handshake completes, with the HTTP status and message a
plain request would get.  A browser cannot set headers on a WebSocket, so the
page passes the token as ``?token=``.

Every response, refused or not, carries a strict Content-Security-Policy and
the headers that keep the page out of frames and its URL out of Referer.  A
refusal under ``/v1`` comes in OpenAI's error shape, as every error there.
"""

from __future__ import annotations

import json
import re
import secrets
from array import array
from collections.abc import Callable, Iterable
from itertools import accumulate
from urllib.parse import parse_qs, urlsplit

import anyio
from starlette.datastructures import Headers

from .requests import is_openai_path, openai_error_body

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
HTTP_VERSIONS = frozenset({"1.0", "1.1"})  # the server keeps every connection to HTTP/1.x
HOSTS_ENV = "MESHD_DASHBOARD_HOSTS"
TOKEN_ENV = "MESHD_DASHBOARD_TOKEN"  # the token, set by the operator or printed at boot
# How long a state-changing request's whole body may take to arrive, from the end of its headers
# (a 408 and a close past it).  Bodies here are JSON of at most MAX_BODY_BYTES (1 MiB), most a few
# hundred bytes sent with the headers; 15 s takes the largest at about 70 KiB/s, a slow link, while
# a client that stalls (or drips a byte now and then: the deadline is for the whole body, not
# each read) holds its connection and the bytes read so far for at most that long.
BODY_TIMEOUT_S = 15.0

SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
     b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]

# A JSON string literal (escapes included), or a run of characters that are neither
# brackets nor quotes: removing both leaves the brackets outside strings.
_NOT_STRUCTURE = re.compile(r'"(?:[^"\\]++|\\.)*+"|[^\[\]{}"]++', re.DOTALL)
# Opening brackets count +1, closing ones -1 (as signed bytes); a stray quote counts 0.
_STEP = bytes.maketrans(b"[{]}\"", b"\x01\x01\xff\xff\x00")


def json_depth(text: str) -> int:
    """How deep ``json.loads(text)`` would nest arrays and objects before it finishes or fails.

    Strings are skipped exactly as JSON reads them, so brackets inside them do not
    count; the running sum over the remaining brackets is taken in C (translate,
    accumulate), so a megabyte costs milliseconds and never a Python recursion.
    """
    skeleton = _NOT_STRUCTURE.sub("", text).encode("ascii")
    return max(accumulate(array("b", skeleton.translate(_STEP))), default=0)


def split_host(value: str) -> tuple[str, int | None] | None:
    """``name:port`` / ``[v6]:port`` / ``name`` as (lowercased name, port or None); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] or None
    else:
        name, _, port = value.partition(":")
        port = port or None
    if not name or (port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536)):
        return None
    return name, None if port is None else int(port)


def parse_allowed(entries: Iterable[str]) -> list[tuple[str, int | None]]:
    """User-allowed hosts (``name`` allows any port, ``name:port`` that port); blanks skipped."""
    out = []
    for entry in entries:
        if not entry.strip():
            continue
        parsed = split_host(entry)
        if parsed is None:
            raise ValueError(f"{entry!r} is not a host name or HOST:PORT")
        out.append(parsed)
    return out


def authorized(token: str | None, headers: Headers, query: str) -> bool:
    """The node's token as ``X-Meshd-Token``, ``?token=`` or ``Authorization: Bearer``."""
    if token is None:
        return True
    given = (headers.get("x-meshd-token") or (parse_qs(query).get("token") or [""])[0]
             or headers.get("authorization", "").removeprefix("Bearer ").strip())
    return secrets.compare_digest(given.encode(), token.encode())


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DashboardGuard:
    """Wraps the dashboard's ASGI app; see the module docstring for what it refuses."""

    def __init__(self, app, *, token: str | None = None, allowed_hosts: Iterable[str] = (),
                 max_body: int, max_depth: int = 32, open_paths: Iterable[str] = ("/", "/metrics"),
                 open_prefixes: Iterable[str] = ("/static/",),
                 serves: Callable[[dict], bool] | None = None, body_timeout: float | None = None):
        """``serves(scope)``: whether a route of the app takes this method at this path (None:
        every request is taken to be served); ``body_timeout``: seconds, ``BODY_TIMEOUT_S`` if None."""
        self.app = app
        self.serves = serves
        self.body_timeout = BODY_TIMEOUT_S if body_timeout is None else body_timeout
        self.token = token
        self.allowed = parse_allowed(allowed_hosts)
        self.max_body = max_body
        self.max_depth = max_depth
        self.open_paths = frozenset(open_paths)
        self.open_prefixes = tuple(open_prefixes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            try:
                self._admit_websocket(scope)
            except Refused as refusal:
                await self._refuse_websocket(scope, send, refusal)
                return
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        version = scope.get("http_version", "1.1")
        # No route takes this method at this path: the app's 404 or 405 leaves the body unread,
        # so Hypercorn closes the connection after it, and the answer says so.
        unserved = (version in HTTP_VERSIONS and scope["method"] not in SAFE_METHODS
                    and self.serves is not None and not self.serves(scope))

        async def send_secured(message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in names]
                if unserved and b"connection" not in names:
                    extra.append((b"connection", b"close"))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        if version not in HTTP_VERSIONS:
            # HTTP/2's preface, read as a request of version 2.0 without a body.  The answer
            # does not close the connection: closing with the rest of the preface unread would
            # cut it short.  That rest is no request; the server answers it 400 and closes.
            other = Refused(505, f"this dashboard speaks HTTP/1.1, not HTTP/{version}: ask over HTTP/1.1 "
                                 "(without --http2-prior-knowledge or http2=True)")
            await self._refuse(send_secured, other, scope["path"], close=False)
            return
        try:
            receive = await self._admit(scope, receive, unserved)
        except Refused as refusal:
            await self._refuse(send_secured, refusal, scope["path"])
            return
        if receive is None:  # the client left while sending its body
            return
        await self.app(scope, receive, send_secured)

    async def _refuse(self, send, refusal: Refused, path: str, *, close: bool = True) -> None:
        answer = (openai_error_body(refusal.status, str(refusal)) if is_openai_path(path)
                  else {"error": str(refusal)})
        body = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                *([(b"connection", b"close")] if close else [])]})
        await send({"type": "http.response.body", "body": body})

    async def _refuse_websocket(self, scope, send, refusal: Refused) -> None:
        """Answer the handshake with the refusal's status and message (ASGI's WebSocket denial
        response), or, where the server cannot send one, close it (403)."""
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": str(refusal)}).encode()
        await send({"type": "websocket.http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *SECURITY_HEADERS]})
        await send({"type": "websocket.http.response.body", "body": body})

    # -- the checks, in order -------------------------------------------------------------
    def _admit_websocket(self, scope) -> None:
        """Host, Origin (always: a page may open a WebSocket anywhere) and the token."""
        headers = Headers(scope=scope)
        self._check_host(headers, scope.get("server") or (None, None))
        self._check_origin(headers, "open a live feed of")
        if not authorized(self.token, headers, scope.get("query_string", b"").decode("latin-1")):
            raise Refused(401, "this dashboard is bound beyond loopback: open the page as /?token=TOKEN "
                               "(printed at boot); its live feed passes the token on as ?token=TOKEN")

    async def _admit(self, scope, receive, unserved: bool = False):
        """``receive`` for the app (the body replayed, when read here), or None; Refused otherwise.
        ``unserved``: no route takes this request, so its body is left to the app, unread."""
        headers = Headers(scope=scope)
        server = scope.get("server") or (None, None)
        self._check_host(headers, server)
        state_changing = scope["method"] not in SAFE_METHODS
        if state_changing:
            self._check_origin(headers)
        path = scope["path"]
        if (path not in self.open_paths and not path.startswith(self.open_prefixes)
                and not authorized(self.token, headers, scope.get("query_string", b"").decode("latin-1"))):
            raise Refused(401, "this dashboard is bound beyond loopback: send the node's token (printed "
                               "at boot) as 'Authorization: Bearer TOKEN', 'X-Meshd-Token: TOKEN' or "
                               "?token=TOKEN")
        if not state_changing:
            return receive
        if unserved:
            return receive  # the app answers 404 or 405 and never reads the body
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise Refused(415, f"send the body as 'Content-Type: application/json', not "
                               f"{media_type or 'no Content-Type'!r}")
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise Refused(415, f"a body with 'Content-Encoding: {encoding}' is not accepted: send plain "
                               "JSON (no Content-Encoding)")
        body: bytes | None = b""
        with anyio.move_on_after(self.body_timeout) as reading:
            body = await self._read_body(headers, receive)
        if reading.cancelled_caught:
            raise Refused(408, f"the request's body did not arrive within {self.body_timeout:g} s; "
                               "send it whole, with its headers")
        if body is None:
            return None
        self._check_json(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    def _host_allowed(self, name: str, port: int | None, server: tuple) -> bool:
        local_host, local_port = server
        ours = set(LOOPBACK_NAMES)
        if local_host is not None:
            ours.add(str(local_host).lower())
        if name in ours and port in (None, local_port):
            return True
        return any(name == a_name and a_port in (None, port) for a_name, a_port in self.allowed)

    def _check_host(self, headers: Headers, server: tuple) -> None:
        raw = headers.get("host", "")
        parsed = split_host(raw)
        if parsed is None or not self._host_allowed(*parsed, server):
            raise Refused(421, f"Host {raw!r} is not this dashboard (a DNS name pointed at it by "
                               f"someone else is refused); to open it under that name, allow it: "
                               f"{HOSTS_ENV}={raw or 'NAME:PORT'}")

    def _check_origin(self, headers: Headers, act: str = "change") -> None:
        """Origin, when sent, must be the Host asked for (already checked to be ours): scheme,
        name and port; without Origin, Sec-Fetch-Site must not name another site."""
        origin = headers.get("origin")
        if origin is None:
            site = headers.get("sec-fetch-site", "").lower()
            if site in ("cross-site", "same-site"):
                raise Refused(403, f"a request from another site (Sec-Fetch-Site: {site}) cannot "
                                   f"{act} this node")
            return
        try:
            parts = urlsplit(origin)
            default = {"http": 80, "https": 443}.get(parts.scheme)
            theirs = (parts.hostname, parts.port or default)
        except ValueError:  # a port that is not a number
            default, theirs = None, None
        name, port = split_host(headers.get("host", "")) or (None, None)
        if default is None or theirs != (name, port or default):
            raise Refused(403, f"a request from the page at Origin {origin!r} cannot {act} this node; "
                               "only this dashboard's own page can")

    async def _read_body(self, headers: Headers, receive) -> bytes | None:
        """The whole body, or Refused(413) once it passes ``max_body``: never more is held."""
        length = headers.get("content-length")
        if length is not None and length.isascii() and length.isdigit() and int(length) > self.max_body:
            raise Refused(413, f"body of {length} bytes; at most {self.max_body}")
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                raise Refused(413, f"body over {self.max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _check_json(self, body: bytes) -> None:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Refused(400, f"body is not UTF-8 JSON: {exc}") from None
        depth = json_depth(text)
        if depth > self.max_depth:
            raise Refused(400, f"JSON nested {depth} levels deep; at most {self.max_depth}")
