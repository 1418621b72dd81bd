"""The orchestrator's HTTP API: ``/api/generate``, and the OpenAI-compatible ``/v1/models`` and
``/v1/completions`` (errors there in OpenAI's shape, so its clients show the message and field).

The endpoints drive the pipeline only through ``meshd.pipeline.api.Generator``
(the app's ``state.generator``, None on a node that is not an orchestrator).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshd.pipeline.api import Generator, NotReady, PipelineError

from .requests import BadRequest, error, field, json_body, openai_error


def sampling(body: dict, prompt_key: str) -> dict:
    """The generation parameters of a request body; BadRequest names what is wrong."""
    prompt = body.get(prompt_key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI allows a list of prompts; we serve one
    if not isinstance(prompt, str):
        raise BadRequest(f"{prompt_key!r} must be a string", prompt_key)
    return {
        "prompt": prompt,
        "max_tokens": field(body, "max_tokens", int, 16, low=1, high=4096),
        "temperature": field(body, "temperature", float, 0.0, low=0.0, high=10.0),
        "top_k": field(body, "top_k", int, 0, low=0, high=1 << 20),
        "seed": field(body, "seed", int, 0, low=0, high=2**63 - 1),
    }


def _openai_only(body: dict) -> None:
    """The OpenAI fields we do not serve yet, refused by name rather than ignored."""
    if field(body, "n", int, 1, low=1) != 1:
        raise BadRequest("'n' must be 1: one completion per request", "n")
    if body.get("stop") is not None:
        raise BadRequest("'stop' is not supported yet", "stop")
    if field(body, "top_p", float, 1.0, low=0.0, high=1.0) != 1.0:
        raise BadRequest("'top_p' other than 1 is not supported yet (use top_k)", "top_p")


async def _prepare(request: Request, openai: bool = False) -> tuple[Generator, dict, dict] | Response:
    """(the orchestrator, the body, its parameters), or the error response (in OpenAI's shape
    with ``openai``): 404 on a node that is not an orchestrator, 400 for a bad body, 503
    naming what does not resolve."""
    fail = openai_error if openai else error
    orch: Generator | None = request.app.state.generator
    if orch is None:
        return fail(404, "this node is not an orchestrator with a model")
    try:
        body = await json_body(request)
        params = sampling(body, "prompt")
        if openai:
            _openai_only(body)
    except BadRequest as exc:
        return openai_error(400, str(exc), param=exc.param) if openai else error(400, str(exc))
    missing = orch.missing()
    if missing:
        return fail(503, str(NotReady(missing)), missing=missing)
    return orch, body, params


async def _generate(orch: Generator, params: dict, openai: bool = False) -> dict | Response:
    """The result, or the error response: 400 for a request that cannot run (e.g. the
    context does not fit), 503 for a pipeline that failed it."""
    fail = openai_error if openai else error
    try:
        return await orch.generate(**params)
    except ValueError as exc:
        return fail(400, str(exc))
    except PipelineError as exc:
        return fail(503, str(exc))


async def api_generate(request: Request) -> Response:
    ready = await _prepare(request)
    if isinstance(ready, Response):
        return ready
    orch, _body, params = ready
    result = await _generate(orch, params)
    if isinstance(result, Response):
        return result
    return JSONResponse({"tokens": result["tokens"], "text": result["text"],
                         "finish_reason": result["finish_reason"], "timings": result["timings"],
                         "request": result["request"], "failovers": result["failovers"]})


async def api_requests(request: Request) -> Response:
    """The running requests (where each runs now, stage by stage) and the latest failovers."""
    orch: Generator | None = request.app.state.generator
    if orch is None:
        return error(404, "this node is not an orchestrator with a model")
    return JSONResponse({"requests": orch.active(), "failovers": list(orch.recent_failovers)})


def _finish_reason(result: dict) -> str:
    return "stop" if result["finish_reason"] == "eos" else "length"


def _usage(result: dict) -> dict:
    prompt, completion = result["prompt_tokens"], len(result["tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def models(request: Request) -> Response:
    """The one model this mesh serves, as OpenAI's ``/v1/models`` lists models."""
    orch: Generator | None = request.app.state.generator
    if orch is None:
        return openai_error(404, "this node is not an orchestrator with a model")
    return JSONResponse({"object": "list", "data": [
        {"id": orch.model_name, "object": "model", "created": orch.created, "owned_by": "meshd"}]})


async def not_served(request: Request) -> Response:
    """Any other ``/v1/...`` path: a 404 an OpenAI client can read, naming what is served."""
    return openai_error(404, f"{request.url.path} is not served here; this mesh serves /v1/models and "
                             "/v1/completions")


async def completions(request: Request) -> Response:
    ready = await _prepare(request, openai=True)
    if isinstance(ready, Response):
        return ready
    orch, body, params = ready
    events = _CompletionEvents(body)
    if body.get("stream"):
        options = body.get("stream_options")
        events.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        return StreamingResponse(events.stream(orch, params), media_type="text/event-stream")
    result = await _generate(orch, params, openai=True)
    if isinstance(result, Response):
        return result
    return JSONResponse({
        **events.head, "object": "text_completion",
        "choices": [{"index": 0, "text": result["text"], "logprobs": None,
                     "finish_reason": _finish_reason(result)}],
        "usage": _usage(result),
    })


class _CompletionEvents:
    """One completion's server-sent events: text as it becomes whole, then the finish."""

    def __init__(self, body: dict) -> None:
        model = body.get("model") if isinstance(body.get("model"), str) else "meshd"
        self.head = {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "created": int(time.time()), "model": model}
        self.tokens: list[int] = []
        self.emitted = ""
        self.include_usage = False  # stream_options.include_usage: a last chunk with usage

    def event(self, text: str, reason: str | None, token: int | None = None, done: dict | None = None) -> str:
        chunk: dict[str, Any] = {**self.head, "object": "text_completion",
                                 "choices": [{"index": 0, "text": text, "finish_reason": reason}]}
        if token is not None:  # an extension: the token id, for exact comparisons
            chunk["meshd"] = {"token": token, "index": len(self.tokens) - 1}
        if done is not None:  # the last chunk: which request it was, and where it moved
            chunk["meshd"] = {"request": done["request"], "failovers": done["failovers"]}
        return f"data: {json.dumps(chunk)}\n\n"

    async def stream(self, orch: Generator, params: dict) -> AsyncIterator[str]:
        send, receive = trio.open_memory_channel[str](64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._produce, orch, params, send)
            async with receive:
                async for line in receive:
                    yield line

    async def _produce(self, orch: Generator, params: dict, send: trio.MemorySendChannel[str]) -> None:
        async def on_token(token: int) -> None:
            self.tokens.append(token)
            # Hold back a character whose bytes are not all here yet.
            stable = orch.decode(self.tokens).rstrip("\ufffd")
            await send.send(self.event(stable[len(self.emitted):], None, token))
            self.emitted = max(self.emitted, stable, key=len)

        async with send:
            try:
                result = await orch.generate(**params, on_token=on_token)
                await send.send(self.event(result["text"][len(self.emitted):], _finish_reason(result),
                                           done=result))
                if self.include_usage:  # as OpenAI sends it: no choices, the usage
                    usage: dict[str, Any] = {**self.head, "object": "text_completion", "choices": [],
                                             "usage": _usage(result)}
                    await send.send(f"data: {json.dumps(usage)}\n\n")
            except (ValueError, PipelineError) as exc:
                kind = "invalid_request_error" if isinstance(exc, ValueError) else "service_unavailable"
                failure = {"error": {"message": str(exc), "type": kind, "param": None, "code": None}}
                await send.send(f"data: {json.dumps(failure)}\n\n")
            await send.send("data: [DONE]\n\n")


ROUTES = [
    Route("/api/generate", api_generate, methods=["POST"]),
    Route("/api/requests", api_requests, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/{rest:path}", not_served, methods=["GET", "POST"]),
]
