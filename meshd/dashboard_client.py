"""Asking a node's dashboard from the command line (``meshd keys``, ``meshd peers``,
``meshd doctor``): a URL checked before it is asked, one deadline for the whole exchange, an
answer of bounded size, and errors of one line that say why there is no answer."""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from . import ctrl_c

TOKEN_ENV = "MESHD_DASHBOARD_TOKEN"  # as dashboard.guard names it
MAX_ANSWER_BYTES = 64 << 20  # a node's largest answer (a big mesh's snapshot) is a few MB


def json_kind(value: Any) -> str:
    """What a JSON value is, for an error: ``a JSON array``, ``JSON null``."""
    if value is None:
        return "JSON null"
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean"}
    return f"a JSON {kinds.get(type(value), 'number')}"


class NodeError(Exception):
    """A node's dashboard could not be asked: a URL that is none, no connection, no complete
    answer in time, an answer too large.  The message says why; the caller names the URL."""


def dashboard_base(url: str) -> tuple[str, str | None]:
    """A dashboard URL as the user gave it (``http://`` when it names no scheme) -> its base,
    without query or trailing slash, and the token to send: its ``?token=``, else
    ``$MESHD_DASHBOARD_TOKEN``, else None.  NodeError for a URL that cannot be asked."""
    full = url if "://" in url else "http://" + url
    try:
        parts = urlsplit(full)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
    except ValueError as exc:
        raise NodeError(f"{url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise NodeError(f"{url!r} is not a dashboard's URL: it starts http:// or https://, "
                        f"not {parts.scheme}://")
    if not parts.hostname:
        raise NodeError(f"{url!r} is not a URL: it names no host")
    token = (parse_qs(parts.query).get("token") or [os.environ.get(TOKEN_ENV, "")])[0] or None
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}", token


@dataclass(frozen=True, slots=True)
class NodeAnswer:
    status: int
    body: bytes

    @property
    def reason(self) -> str:
        """The status's standard phrase (``Not Found``), not whatever the server wrote."""
        import httpx

        return httpx.codes.get_reason_phrase(self.status) or "(no standard meaning)"

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not JSON (NaN and Infinity included)."""
        def no_constant(name: str) -> Any:
            raise ValueError(f"{name} is not JSON")

        try:
            return json.loads(self.body, parse_constant=no_constant)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None

    def text(self, limit: int = 200) -> str:
        """The start of the body on one line, for an error message."""
        text = self.body[:limit * 4].decode("utf-8", "replace")
        return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:limit]


def ask_node(method: str, url: str, *, headers: dict[str, str], timeout: float,
             body: Any = None) -> NodeAnswer:
    """One HTTP request, done within ``timeout`` seconds all told: resolving, connecting,
    sending and reading the whole answer.  httpx's own timeouts are for each read, so a server
    that trickles a byte a second would hold them forever; trio's deadline holds for the lot.
    NodeError says why there is no answer (and, for a timeout, after how long)."""
    import httpx
    import trio

    async def exchange() -> NodeAnswer:
        async with httpx.AsyncClient(timeout=None) as client:
            async with client.stream(method, url, json=body, headers=headers) as r:
                data = bytearray()
                async for chunk in r.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_ANSWER_BYTES:
                        raise NodeError(f"its answer is over {MAX_ANSWER_BYTES >> 20} MB")
                return NodeAnswer(r.status_code, bytes(data))

    async def within_deadline() -> NodeAnswer | None:
        with trio.move_on_after(timeout):
            return await exchange()
        return None

    try:
        with ctrl_c.pythons_own():
            answer = trio.run(within_deadline)
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise NodeError(f"not a URL meshd can ask: {exc}") from exc
    except httpx.HTTPError as exc:
        raise NodeError(_why(exc)) from exc
    except UnicodeEncodeError as exc:  # a header (the token) that is not ASCII
        raise NodeError("the token holds a character that is not ASCII") from exc
    if answer is None:
        raise NodeError(f"no complete answer within {timeout:g}s")
    return answer


# What OpenSSL says when the other end answers a TLS hello in plain HTTP.
_PLAIN_HTTP_ANSWERS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                       "HTTP_REQUEST")


def _why(exc: BaseException) -> str:
    """httpx's message, with the operating system's reasons when trio tried several addresses
    (``all attempts to connect to 127.0.0.1:1 failed (Connection refused)``)."""
    said = str(exc) or type(exc).__name__
    reasons: list[str] = []
    seen: BaseException | None = exc
    for _ in range(8):  # the chain is short: httpx's error, httpcore's, trio's OSError, its group
        if seen is None:
            break
        for inner in getattr(seen, "exceptions", ()):
            reason = os.strerror(inner.errno) if isinstance(inner, OSError) and inner.errno else None
            if reason and reason not in reasons:
                reasons.append(reason)
        if isinstance(seen, ssl.SSLError):
            tls = f"TLS failed: {seen.reason or seen}"
            if seen.reason in _PLAIN_HTTP_ANSWERS:
                tls += "; a node's dashboard speaks plain HTTP, so its URL starts with http://"
            if tls not in reasons:
                reasons.append(tls)
        seen = seen.__cause__ or seen.__context__
    return f"{said} ({', '.join(reasons)})" if reasons else said
