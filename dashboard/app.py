"""The node's Starlette app: the page and the dashboard API, and on the orchestrator the
generation API (``dashboard.generation``).

It reads node state only through the mesh's ``snapshot()``, joins only through
its ``join`` and drives generation only through the orchestrator's
``Generator`` interface.  It serves the page (``/``), the dashboard API
(``/api/peers``, ``/api/peers/add``, ``/api/topology``, ``/api/snapshot``,
``/api/traces``, ``/api/keys``, ``/metrics``), the page's own feed (``/api/state``,
``/api/history``, and the WebSocket ``/api/live`` that pushes the state: ``dashboard.live``),
``/api/generate``, and OpenAI's ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions``.

``serve_dashboard`` also runs the node's history ring (``dashboard.history``: the
last minutes of readiness, paths, RTTs, tokens/s and time to first token) and
the push of ``/api/live``, in its own nursery.

Every request passes ``guard.DashboardGuard`` first: the Host must name this
dashboard, a state-changing request must come from its own page (Origin) with
a bounded JSON body, and bound beyond loopback everything but the page, its
static files and ``/metrics`` needs the node's token (printed at boot) as
``Authorization: Bearer TOKEN``, ``X-Meshd-Token`` or ``?token=``.

Every error under ``/api`` and ``/v1`` is JSON, an unknown path's 404 and a wrong method's
405 (with ``Allow``) included: ``{"error": message}`` under ``/api``, OpenAI's
``{"error": {"message", "type", "param", "code"}}`` under ``/v1`` (``http_error``).  The
page and its static files answer those in plain text.  A method a route does not serve is
a 405 before the guard looks at the body (``served_methods``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Match, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from meshd.pipeline.api import Generator
from meshd.pipeline.metrics import PipelineMetrics, StageMetrics

from . import generation, state, views
from .guard import HOSTS_ENV, TOKEN_ENV, DashboardGuard
from .history import History, serve_history
from .live import MAX_CLIENT_MESSAGE_BYTES, LiveHub, live
from .requests import MAX_BODY_BYTES, BadRequest, error, is_openai_path, json_body, openai_error

if TYPE_CHECKING:
    from meshd.mesh import Mesh

log = logging.getLogger("meshd.dashboard")

STATIC = Path(__file__).parent / "static"
__all__ = ["MAX_BODY_BYTES", "create_app", "dashboard_token", "is_loopback_bind", "parse_peer_addr",
           "serve_dashboard"]


def parse_peer_addr(value: Any) -> str:
    """A join address: ``IP:PORT`` (or ``localhost:PORT``); BadRequest says what is wrong."""
    from meshd.net.udp import AddressError, format_addr, parse_addr

    if not isinstance(value, str) or not value or len(value) > 64:
        raise BadRequest("'addr' must be a string HOST:PORT")
    try:
        host, port = parse_addr(value)
    except AddressError as exc:
        raise BadRequest(str(exc)) from None
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise BadRequest(f"{value!r}: host {host!r} is not an IP address") from None
    if ip.is_multicast or ip.is_unspecified:
        raise BadRequest(f"{value!r}: {host} cannot be a peer")
    return format_addr(str(ip), port)


def is_loopback_bind(bind: str) -> bool:
    host = bind.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _mesh(request: Request) -> Mesh:
    return request.app.state.mesh


async def api_snapshot(request: Request) -> Response:
    """The mesh's snapshot; at a pipeline node also its ``load``, which ``meshd doctor`` prints:
    an orchestrator's requests against its limits (``Generator.load``), a stage's KV cache
    against its budget (``StageService.load``)."""
    snap = _mesh(request).snapshot()
    generator, inference = request.app.state.generator, request.app.state.inference
    if generator is not None:
        snap = {**snap, "load": generator.load()}
    elif isinstance(inference, StageMetrics):
        snap = {**snap, "load": inference.load()}
    return JSONResponse(snap)


async def api_peers(request: Request) -> Response:
    return JSONResponse(views.peers(_mesh(request).snapshot()))


async def api_peers_add(request: Request) -> Response:
    try:
        addr = parse_peer_addr((await json_body(request)).get("addr"))
    except BadRequest as exc:
        return error(400, str(exc))
    _mesh(request).join([addr])
    return JSONResponse({"joining": addr}, status_code=202)


async def api_keys(request: Request) -> Response:
    return JSONResponse(views.keys(_mesh(request).snapshot()))


async def api_keys_change(request: Request) -> Response:
    """``{"op": "install"|"use"|"remove", "key": KEY}``: a rotation step for the whole mesh,
    applied here and gossiped (KEY: base64 for install; the key or its id for use and remove)."""
    from meshd.keyring import KeyringError

    try:
        body = await json_body(request)
        op, key = body.get("op"), body.get("key")
        if op not in ("install", "use", "remove"):
            raise BadRequest("'op' must be install, use or remove")
        if not isinstance(key, str) or not key or len(key) > 128:
            raise BadRequest("'key' must be a string: the key (base64), or for use and remove its id")
        done = _mesh(request).change_keyring(op, key)
    except (BadRequest, KeyringError) as exc:
        return error(400, str(exc))
    return JSONResponse(done, status_code=202)


async def api_topology(request: Request) -> Response:
    return JSONResponse(views.topology(_mesh(request).snapshot()))


async def api_traces(request: Request) -> Response:
    return JSONResponse(state.traces_view(request.app.state.generator))


def _since(request: Request) -> int:
    """``?since=SEQ``: history samples after that one (0, the default: all)."""
    value = request.query_params.get("since", "0")
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise BadRequest("'since' must be a sample's seq (a non-negative integer)")
    return int(value)


async def api_history(request: Request) -> Response:
    try:
        since = _since(request)
    except BadRequest as exc:
        return error(400, str(exc))
    return JSONResponse(request.app.state.history.view(since))


async def api_state(request: Request) -> Response:
    """What one push of ``/api/live`` carries: the page's polling fallback."""
    try:
        since = _since(request)
    except BadRequest as exc:
        return error(400, str(exc))
    return Response(request.app.state.live.message(since), media_type="application/json")


async def metrics(request: Request) -> Response:
    from .metrics import render

    hub = request.app.state.live
    body, content_type = render(_mesh(request).snapshot(), request.app.state.inference,
                                {**hub.counters, "listeners": hub.clients})
    return Response(body, media_type=content_type)


async def page(request: Request) -> Response:
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))


ANY_METHOD = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _route_scope(scope: Mapping[str, Any]) -> dict[str, Any]:
    """What routing reads of a request: its method and whole path (a Mount that has already
    matched moves ``root_path``, which would hide the path from the routes)."""
    return {"type": "http", "method": scope.get("method", "GET"), "path": scope.get("path", "")}


def served_methods(routes: Iterable[BaseRoute], scope: Mapping[str, Any]) -> frozenset[str] | None:
    """The methods the routes take at the request's path, every route on that path counted
    (``/api/keys`` has one for GET and one for POST); None where no route has that path."""
    request = _route_scope(scope)
    methods: set[str] = set()
    found = False
    for route in routes:
        if not isinstance(route, (Route, Mount)) or route.matches(request)[0] is Match.NONE:
            continue
        found = True
        if isinstance(route, Mount):
            methods |= {"GET", "HEAD"} if isinstance(route.app, StaticFiles) else ANY_METHOD
        else:
            methods |= route.methods or ANY_METHOD
    return frozenset(methods) if found else None


def _is_api_path(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:-1]) + f" and {paths[-1]}" if len(paths) > 1 else "".join(paths)


def _http_error_message(routes: list[BaseRoute], status: int, method: str, path: str,
                        methods: frozenset[str] | None, detail: str) -> str:
    if status == 405 and methods:
        named = methods - {"HEAD"} if "GET" in methods else methods
        return f"{path} takes {' or '.join(sorted(named))}, not {method}"
    if status == 404 and methods is None:  # routing's: no route here (an endpoint's says why)
        if any(isinstance(r, WebSocketRoute) and r.path_regex.match(path) for r in routes):
            return f"{path} is a WebSocket: open it with a GET asking 'Upgrade: websocket'"
        prefix, who = ("/v1/", "this mesh") if is_openai_path(path) else ("/api/", "this node")
        served = list(dict.fromkeys(r.path for r in routes if isinstance(r, (Route, WebSocketRoute))
                                    and r.path.startswith(prefix) and "{" not in r.path))
        return f"{path} is not served here; {who} serves {_listed(served)}"
    return detail


async def http_error(request: Request, exc: Exception) -> Response:
    """Routing's 404 and 405 (and any other HTTPException): JSON in the API's shape under
    ``/api`` and ``/v1``, plain text elsewhere; a 405's ``Allow`` names every method served at
    the path."""
    assert isinstance(exc, HTTPException)
    path, method, status = request.scope["path"], request.method, exc.status_code
    headers = dict(exc.headers or {})
    routes = request.app.routes
    methods = served_methods(routes, request.scope)
    if status == 405 and methods:
        headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
        headers["Allow"] = ", ".join(sorted(methods))
    if not (_is_api_path(path) or is_openai_path(path)):
        return PlainTextResponse(exc.detail, status_code=status, headers=headers)
    message = _http_error_message(routes, status, method, path, methods, exc.detail)
    response = openai_error(status, message) if is_openai_path(path) else error(status, message)
    response.headers.update(headers)
    return response


async def crashed(request: Request, exc: Exception) -> Response:
    # An endpoint's bug is a 500 for that request, never a crash of the node.
    log.exception("dashboard %s %s failed", request.method, request.url.path)
    fail = openai_error if is_openai_path(request.url.path) else error
    return fail(500, f"internal error: {type(exc).__name__}")


def create_app(node: Mesh, generator: Generator | None = None, token: str | None = None,
               allowed_hosts: list[str] | None = None, *,
               inference: PipelineMetrics | None = None) -> DashboardGuard:
    """The app behind its guard: ``node``'s dashboard, and with ``generator`` (the orchestrator)
    the generation API.  ``allowed_hosts`` are extra Host names (``NAME`` or ``NAME:PORT``);
    ``inference`` is the pipeline service's metrics, for ``/metrics``."""
    app = Starlette(routes=[
        Route("/", page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        Route("/api/peers", api_peers, methods=["GET"]),
        Route("/api/peers/add", api_peers_add, methods=["POST"]),
        Route("/api/topology", api_topology, methods=["GET"]),
        Route("/api/traces", api_traces, methods=["GET"]),
        Route("/api/keys", api_keys, methods=["GET"]),
        Route("/api/keys", api_keys_change, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/api/snapshot", api_snapshot, methods=["GET"]),
        Route("/api/history", api_history, methods=["GET"]),
        Route("/api/state", api_state, methods=["GET"]),
        WebSocketRoute("/api/live", live),
        *generation.ROUTES,
    ], exception_handlers={HTTPException: http_error, Exception: crashed})
    app.state.mesh, app.state.generator, app.state.inference = node, generator, inference
    app.state.history = History()
    app.state.live = LiveHub(lambda: state.page_state(node.snapshot(), generator), app.state.history)
    return DashboardGuard(app, token=token, allowed_hosts=allowed_hosts or (), max_body=MAX_BODY_BYTES,
                          serves=lambda scope: scope["method"] in (served_methods(app.routes, scope) or ()))


def dashboard_token(bind: str) -> str | None:
    """The token a dashboard on ``bind`` asks for: none on loopback; beyond it the operator's
    (MESHD_DASHBOARD_TOKEN, so scripts and containers can know it beforehand), else a fresh one."""
    if is_loopback_bind(bind):
        return None
    return os.environ.get(TOKEN_ENV, "").strip() or secrets.token_urlsafe(24)


async def serve_dashboard(node: Mesh, bind: str, generator: Generator | None = None,
                          token: str | None = None, *, allowed_hosts: list[str] | None = None,
                          inference: PipelineMetrics | None = None,
                          task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the app on ``bind`` (HOST:PORT, port 0 picks one); reports the URL.

    ``token`` (see ``dashboard_token``) is asked of every request but for the page and
    ``/metrics``.

    Requests must name the dashboard in their Host: its address, localhost, the host
    in ``bind``, or one of ``allowed_hosts`` and of MESHD_DASHBOARD_HOSTS (comma-separated
    ``NAME`` or ``NAME:PORT``), for a name the user reaches it by (a proxy, /etc/hosts).
    """
    from hypercorn.config import Config

    from .server import serve

    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = None
    # The page sends nothing over /api/live: a bigger message is cut (1009) before it is held.
    config.websocket_max_message_size = MAX_CLIENT_MESSAGE_BYTES
    host = bind.rpartition(":")[0].strip("[]")
    wildcard = host in ("", "0.0.0.0", "::")
    extra = [*(allowed_hosts or ()), *os.environ.get(HOSTS_ENV, "").split(","),
             *([] if wildcard else [f"[{host}]" if ":" in host else host])]
    try:
        app = create_app(node, generator, token, extra, inference=inference)
    except ValueError as exc:
        raise ValueError(f"dashboard: allowed hosts (allowed_hosts, {HOSTS_ENV}): {exc}") from exc

    async def run(*, task_status=trio.TASK_STATUS_IGNORED):
        await serve(app, config, task_status=task_status)

    async with trio.open_nursery() as nursery:
        # The history ring fills from the start, so a page opened later draws the minutes before.
        await nursery.start(serve_history, app.app.state.history, node.snapshot, inference)
        await nursery.start(app.app.state.live.serve)
        try:
            binds = await nursery.start(run)
        except (OSError, BaseExceptionGroup) as exc:  # the port is taken, or the address is not ours
            from meshd.net.udp import BindError, first_of

            failed = first_of(exc, OSError)
            if not isinstance(failed, OSError):
                raise
            reason = failed.strerror or str(failed)
            raise BindError(failed.errno or 0, f"cannot serve the dashboard on {bind}: {reason} "
                                               "(--dashboard HOST:PORT, or off)") from None
        task_status.started(binds[0])
