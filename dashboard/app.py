"""The node's Starlette app.

It reads node state only through ``node.snapshot()``, joins only through
``node.join`` and drives generation only through the orchestrator's public
``generate``.  It serves the page (``/``), the dashboard API (``/api/peers``,
``/api/peers/add``, ``/api/topology``, ``/api/snapshot``, ``/api/traces``,
``/metrics``) and, on the orchestrator, ``/api/generate`` and ``/v1/completions``.

Every request passes ``guard.DashboardGuard`` first: the Host must name this
dashboard, a state-changing request must come from its own page (Origin) with
a bounded JSON body, and bound beyond loopback everything but the page, its
static files and ``/metrics`` needs the node's token (printed at boot) as
``Authorization: Bearer TOKEN``, ``X-Meshd-Token`` or ``?token=``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import secrets
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from meshd.pipeline.api import Generator, NotReady, PipelineError

if TYPE_CHECKING:
    from meshd.mesh import Mesh

from . import views
from .guard import HOSTS_ENV, TOKEN_ENV, DashboardGuard

log = logging.getLogger("meshd.dashboard")

MAX_BODY_BYTES = 1 << 20
STATIC = Path(__file__).parent / "static"


class BadRequest(ValueError):
    pass


def _field(body: dict, name: str, kind: type, default: Any, *, low: float | None = None,
           high: float | None = None) -> Any:
    value: Any = body.get(name, default)
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise BadRequest(f"{name!r} must be {kind.__name__}")
    if kind in (int, float):
        number = cast(float, value)
        if kind is float and not math.isfinite(number):
            raise BadRequest(f"{name!r} must be finite")
        if (low is not None and number < low) or (high is not None and number > high):
            raise BadRequest(f"{name!r} must be within [{low}, {high}]")
    return value


async def _json_body(request: Request) -> dict:
    """The body as a JSON object; the guard has bounded its size and nesting, as UTF-8 text."""
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8") or "null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _sampling(body: dict, prompt_key: str) -> dict:
    prompt = body.get(prompt_key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI allows a list of prompts; we serve one
    if not isinstance(prompt, str):
        raise BadRequest(f"{prompt_key!r} must be a string")
    return {
        "prompt": prompt,
        "max_tokens": _field(body, "max_tokens", int, 16, low=1, high=4096),
        "temperature": _field(body, "temperature", float, 0.0, low=0.0, high=10.0),
        "top_k": _field(body, "top_k", int, 0, low=0, high=1 << 20),
        "seed": _field(body, "seed", int, 0, low=0, high=2**63 - 1),
    }


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


def _traces(generator: Generator | None) -> list[dict]:
    """The orchestrator's recent request traces (hops as dicts), newest last."""
    if generator is None:
        return []
    out = []
    for item in list(generator.recent_traces)[-32:]:
        hops = [[{"kind": h[0], "name": h[1], "ms": h[2], "path": h[3]} for h in trace]
                for trace in item.get("traces", [])]
        out.append({"req_id": item.get("req_id"), "traces": hops})
    return out


def token_breakdown(traces: list[dict]) -> list[dict]:
    """Where one token's time goes: mean ms per hop over the recent traces, in pipeline order."""
    sums: dict[str, list] = {}
    for item in traces:
        for trace in item["traces"]:
            for hop in trace:
                entry = sums.setdefault(hop["name"], [hop["kind"], hop["path"], 0.0, 0])
                entry[1] = hop["path"] or entry[1]
                entry[2] += hop["ms"]
                entry[3] += 1
    return [{"name": name, "kind": k, "path": path, "ms": round(total / n, 3)}
            for name, (k, path, total, n) in sums.items()]


def create_app(node: Mesh, generator: Generator | None = None, token: str | None = None,
               allowed_hosts: list[str] | None = None) -> DashboardGuard:
    """The app behind its guard: ``node``'s dashboard, and with ``generator`` (the orchestrator)
    the generation API.  ``allowed_hosts`` are extra Host names (``NAME`` or ``NAME:PORT``)."""

    def orchestrator() -> Generator | None:
        return generator

    def error(status: int, message: str, **extra) -> JSONResponse:
        return JSONResponse({"error": message, **extra}, status_code=status)

    async def _prepare(request: Request, prompt_key: str):
        orch = orchestrator()
        if orch is None:
            return None, error(404, "this node is not an orchestrator with a model")
        try:
            params = _sampling(await _json_body(request), prompt_key)
        except BadRequest as exc:
            return None, error(400, str(exc))
        missing = orch.missing()
        if missing:

            return None, error(503, str(NotReady(missing)), missing=missing)
        return (orch, params), None

    async def _generate(orch, params: dict):
        """(result, None), or (None, the error response): 400 for a request that cannot run
        (e.g. the context does not fit), 503 for a pipeline that failed it."""

        try:
            return await orch.generate(**params), None
        except ValueError as exc:
            return None, error(400, str(exc))
        except PipelineError as exc:
            return None, error(503, str(exc))

    async def api_generate(request: Request):
        ready, failure = await _prepare(request, "prompt")
        if failure is not None:
            return failure
        orch, params = ready
        result, failure = await _generate(orch, params)
        if failure is not None:
            return failure
        return JSONResponse({"tokens": result["tokens"], "text": result["text"],
                             "finish_reason": result["finish_reason"], "timings": result["timings"]})

    async def completions(request: Request):

        ready, failure = await _prepare(request, "prompt")
        if failure is not None:
            return failure
        orch, params = ready
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return error(400, str(exc))
        cid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())
        model = body.get("model") if isinstance(body.get("model"), str) else "meshd"
        if not body.get("stream"):
            result, failure = await _generate(orch, params)
            if failure is not None:
                return failure
            return JSONResponse({
                "id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": result["text"], "logprobs": None,
                             "finish_reason": "stop" if result["finish_reason"] == "eos" else "length"}],
                "usage": {"completion_tokens": len(result["tokens"])},
            })

        send, receive = trio.open_memory_channel[str](64)

        async def produce() -> None:
            async with send:
                tokens: list[int] = []
                emitted = ""

                def event(text: str, reason: str | None, token: int | None = None) -> str:
                    chunk = {"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": text, "finish_reason": reason}]}
                    if token is not None:  # an extension: the token id, for exact comparisons
                        chunk["meshd"] = {"token": token, "index": len(tokens) - 1}
                    return f"data: {json.dumps(chunk)}\n\n"

                async def on_token(token: int) -> None:
                    nonlocal emitted
                    tokens.append(token)
                    text = orch.decode(tokens)
                    # Hold back a character whose bytes are not all here yet.
                    stable = text.rstrip("\ufffd")
                    await send.send(event(stable[len(emitted):], None, token))
                    emitted = max(emitted, stable, key=len)

                try:
                    result = await orch.generate(**params, on_token=on_token)
                    reason = "stop" if result["finish_reason"] == "eos" else "length"
                    last = json.loads(event(result["text"][len(emitted):], reason)[6:])
                    await send.send(f"data: {json.dumps(last)}\n\n")
                except (ValueError, PipelineError) as exc:
                    await send.send(f"data: {json.dumps({'error': str(exc)})}\n\n")
                await send.send("data: [DONE]\n\n")

        async def stream():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                async with receive:
                    async for line in receive:
                        yield line

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def api_snapshot(request: Request):
        return JSONResponse(node.snapshot())

    async def api_peers(request: Request):
        return JSONResponse(views.peers(node.snapshot()))

    async def api_peers_add(request: Request):
        try:
            body = await _json_body(request)
            addr = parse_peer_addr(body.get("addr"))
        except BadRequest as exc:
            return error(400, str(exc))
        node.join([addr])
        return JSONResponse({"joining": addr}, status_code=202)

    async def api_topology(request: Request):
        return JSONResponse(views.topology(node.snapshot()))

    async def api_traces(request: Request):
        traces = _traces(generator)
        return JSONResponse({"orchestrator": generator is not None, "requests": traces,
                             "per_token": token_breakdown(traces)})

    async def metrics(request: Request):
        from .metrics import render

        body, content_type = render(node.snapshot())
        return Response(body, media_type=content_type)

    async def page(request: Request):
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    async def crashed(request: Request, exc: Exception):
        # An endpoint's bug is a 500 for that request, never a crash of the node.
        log.exception("dashboard %s %s failed", request.method, request.url.path)
        return error(500, f"internal error: {type(exc).__name__}")

    app = Starlette(routes=[
        Route("/", page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        Route("/api/peers", api_peers, methods=["GET"]),
        Route("/api/peers/add", api_peers_add, methods=["POST"]),
        Route("/api/topology", api_topology, methods=["GET"]),
        Route("/api/traces", api_traces, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/api/generate", api_generate, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/api/snapshot", api_snapshot, methods=["GET"]),
    ], exception_handlers={Exception: crashed})
    return DashboardGuard(app, token=token, allowed_hosts=allowed_hosts or (), max_body=MAX_BODY_BYTES)


def dashboard_token(bind: str) -> str | None:
    """The token a dashboard on ``bind`` asks for: none on loopback; beyond it the operator's
    (MESHD_DASHBOARD_TOKEN, so scripts and containers can know it beforehand), else a fresh one."""
    if is_loopback_bind(bind):
        return None
    return os.environ.get(TOKEN_ENV, "").strip() or secrets.token_urlsafe(24)


async def serve_dashboard(node: Mesh, bind: str, generator: Generator | None = None,
                          token: str | None = None, *, allowed_hosts: list[str] | None = None,
                          task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the app on ``bind`` (HOST:PORT, port 0 picks one); reports the URL.

    ``token`` (see ``dashboard_token``) is asked of every request but for the page and
    ``/metrics``.

    Requests must name the dashboard in their Host: its address, localhost, the host
    in ``bind``, or one of ``allowed_hosts`` and of MESHD_DASHBOARD_HOSTS (comma-separated
    ``NAME`` or ``NAME:PORT``), for a name the user reaches it by (a proxy, /etc/hosts).
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = None
    host = bind.rpartition(":")[0].strip("[]")
    wildcard = host in ("", "0.0.0.0", "::")
    extra = [*(allowed_hosts or ()), *os.environ.get(HOSTS_ENV, "").split(","),
             *([] if wildcard else [f"[{host}]" if ":" in host else host])]
    try:
        app = create_app(node, generator, token, extra)
    except ValueError as exc:
        raise ValueError(f"dashboard: allowed hosts (allowed_hosts, {HOSTS_ENV}): {exc}") from exc

    async def run(*, task_status=trio.TASK_STATUS_IGNORED):
        await serve(app, config, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        task_status.started(binds[0])
