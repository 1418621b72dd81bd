"""The orchestrator's HTTP API: ``/api/generate``, and the OpenAI-compatible ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (errors there in OpenAI's shape, so its
clients show the message and the field).

The endpoints drive the pipeline only through ``meshd.pipeline.api.Generator``
(the app's ``state.generator``, None on a node that is not an orchestrator).
A chat's messages become a prompt through the model's chat template
(``meshd.pipeline.chat``), rendered off the event loop.  OpenAI fields that
would change the answer and are not served (penalties, logprobs, tools, ..)
are refused by name, never ignored.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from meshd.pipeline.api import Busy, Generator, NotReady, PipelineError, StageLost
from meshd.pipeline.stops import MAX_STOP_CHARS, MAX_STOPS, settled
from meshd.pipeline.tokenizer import IncrementalText

from .requests import BadRequest, error, field, json_body, openai_error

log = logging.getLogger("meshd.dashboard")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096
MAX_TOKENS = 4096
MAX_MODEL_NAME = 256
# OpenAI fields that would change the answer, with the values that ask for nothing.
_UNSERVED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (False,),
    "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": ("",), "tools": ([],),
    "functions": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
}


def prompt_text(body: dict) -> str:
    """``body["prompt"]``: one string (OpenAI allows a list of prompts; we serve one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", "prompt")
    return prompt


def stop_strings(body: dict) -> tuple[str, ...]:
    """``body["stop"]``: a string or a list of up to MAX_STOPS strings (none when absent)."""
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    for i, stop in enumerate(stops):
        if not 0 < len(stop) <= MAX_STOP_CHARS:
            where = "stop" if isinstance(value, str) else f"stop[{i}]"
            raise BadRequest(f"'{where}' must be 1 to {MAX_STOP_CHARS} characters long", "stop")
    return tuple(stops)


def sampling(body: dict, default_max_tokens: int | None = 16) -> dict:
    """The generation parameters of a request body, but the prompt; BadRequest names what is
    wrong.  ``max_tokens`` None: what the context holds (a chat's default, as OpenAI's)."""
    max_tokens = field(body, "max_completion_tokens", int, None, low=1, high=MAX_TOKENS)
    older = field(body, "max_tokens", int, default_max_tokens, low=1, high=MAX_TOKENS)  # checked either way
    if max_tokens is None:
        max_tokens = older
    top_p = field(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest("'top_p' must be within (0, 1]", "top_p")
    temperature = field(body, "temperature", float, 0.0, low=0.0, high=10.0)
    seed = field(body, "seed", int, None, low=0, high=2**63 - 1)
    if seed is None:
        # Sampled without a seed, each request draws its own (as OpenAI's API does); the
        # native answer says which, so a run can be repeated.  Greedy draws nothing.
        seed = secrets.randbits(63) if temperature > 0 else 0
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_k": field(body, "top_k", int, 0, low=0, high=1 << 20),
        "top_p": top_p,
        "seed": seed,
        "stop": stop_strings(body),
    }


def chat_messages(body: dict) -> list[dict[str, str]]:
    """``body["messages"]`` checked: each ``{role, content}``, content a string or a list of
    ``{"type": "text", "text"}`` parts (joined with newlines, as vLLM joins them); ``name`` and
    ``tool_call_id`` are kept for templates that write them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content}", "messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' holds {len(messages)} messages; at most {MAX_MESSAGES}", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, not {role!r}",
                             f"{where}.role")
        # OpenAI's newer clients send the system prompt as "developer"; templates know "system".
        checked = {"role": "system" if role == "developer" else role,
                   "content": _content(message.get("content"), f"{where}.content")}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                checked[key] = message[key]
        out.append(checked)
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise BadRequest(f"'{where}[{j}]' must be {{\"type\": \"text\", \"text\": string}}: only text is "
                             "served", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _openai_only(body: dict) -> None:
    """The OpenAI fields we do not serve, refused by name rather than ignored."""
    if field(body, "n", int, 1) != 1:
        raise BadRequest("'n' must be 1: one choice per request", "n")
    field(body, "stream", bool, False)  # "yes" or 1 would stream where a client asked for JSON
    # Any name: the mesh serves one model, and answers under its own name.
    if len(field(body, "model", str, "")) > MAX_MODEL_NAME:
        raise BadRequest(f"'model' must be at most {MAX_MODEL_NAME} characters", "model")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or type(options.get("include_usage", False)) is not bool:
            raise BadRequest("'stream_options' must be an object whose 'include_usage' is true or false",
                             "stream_options")
    for name, nothing in _UNSERVED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in nothing):
            raise BadRequest(f"'{name}' is not supported; leave it out", name)


async def _prepare(request: Request, api: str = "native") -> tuple[Generator, dict, dict] | Response:
    """(the orchestrator, the body, its parameters), or the error response (in OpenAI's shape
    but for ``api`` "native"): 404 on a node that is not an orchestrator, 400 for a bad body
    or a conversation the chat template refuses, 503 naming what does not resolve."""
    openai = api != "native"
    fail = openai_error if openai else error
    orch: Generator | None = request.app.state.generator
    if orch is None:
        return fail(404, "this node is not an orchestrator with a model")
    try:
        body = await json_body(request)
        if api == "chat":
            params = sampling(body, default_max_tokens=None)
            messages = chat_messages(body)
        else:
            params = {"prompt": prompt_text(body), **sampling(body)}
        if openai:
            _openai_only(body)
    except BadRequest as exc:
        return openai_error(400, str(exc), param=exc.param) if openai else error(400, str(exc))
    if api == "chat":
        try:
            params = {"prompt": await trio.to_thread.run_sync(orch.chat_prompt, messages), **params}
        except ValueError as exc:  # ChatTemplateError: the template's message, and the field
            return openai_error(400, str(exc), param=getattr(exc, "param", None))
    not_ready = orch.not_ready()
    if not_ready is not None:
        return _retry_later(not_ready, fail)
    busy = orch.busy()
    if busy is not None:  # before a stream starts: a 503 the client can retry, not an event
        return _retry_later(busy, fail)
    return orch, body, params


def _retry_later(exc: Busy | NotReady | StageLost, fail) -> Response:
    """503 with Retry-After: every slot is taken and the queue is full, a pipeline name
    does not resolve yet (then ``missing`` lists them), or a stage was lost mid-request."""
    extra = {"missing": exc.missing} if isinstance(exc, NotReady) else {}
    response = fail(503, str(exc), **extra)
    response.headers["Retry-After"] = str(exc.retry_after)
    return response


# What a request whose client went away gets (nginx's "client closed request"): nobody reads it.
CLIENT_GONE = 499


def _refusal(exc: Exception, fail) -> Response:
    """The response for a request that failed before any of its output: 400 for one that
    cannot run (e.g. the context does not fit), 503 with Retry-After for a busy or not yet
    ready mesh or a stage lost, 503 for a pipeline that failed it."""
    if isinstance(exc, ValueError):
        return fail(400, str(exc))
    if isinstance(exc, Busy | NotReady | StageLost):
        return _retry_later(exc, fail)
    if isinstance(exc, PipelineError):
        return fail(503, str(exc))
    return fail(500, _said(exc))


def _said(exc: Exception) -> str:
    """What a client is told of ``exc``: a pipeline's or a request's error as it is worded, any
    other only by its type (the node's log has the traceback)."""
    if isinstance(exc, ValueError | PipelineError):
        return str(exc)
    return f"internal error: {type(exc).__name__}"


async def _generate(request: Request, orch: Generator, params: dict, openai: bool = False) -> dict | Response:
    """The result, or the error response (``_refusal``).

    A client that disconnects (a timeout, Ctrl-C) cancels its request, as a stream's does:
    it leaves the queue, or its stages free its place in their batches and its KV cache,
    and ``meshd_requests_total{outcome="cancelled"}`` counts it."""
    try:
        result = await _unless_gone(request, lambda: orch.generate(**params))
    except (ValueError, PipelineError) as exc:
        return _refusal(exc, openai_error if openai else error)
    if result is None:
        return Response(status_code=CLIENT_GONE)
    return result


async def _watch_gone(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once the client disconnects.  The body is read by now, so the next
    ASGI message is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _unless_gone(request: Request, run) -> dict | None:
    """``await run()``, or None once the client has disconnected (run is then cancelled)."""
    outcome: list[dict] = []
    failure: list[Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_gone, request.receive, nursery.cancel_scope)
        try:
            outcome.append(await run())
        except Exception as exc:  # raised as itself, not inside the nursery's group
            failure.append(exc)
        nursery.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return outcome[0] if outcome else None


async def api_generate(request: Request) -> Response:
    ready = await _prepare(request)
    if isinstance(ready, Response):
        return ready
    orch, _body, params = ready
    result = await _generate(request, orch, params)
    if isinstance(result, Response):
        return result
    return JSONResponse({"tokens": result["tokens"], "text": result["text"],
                         "finish_reason": result["finish_reason"], "timings": result["timings"],
                         "request": result["request"], "failovers": result["failovers"],
                         "seed": params["seed"]})


async def api_requests(request: Request) -> Response:
    """The running requests (where each runs now, stage by stage), the latest ended ones (where
    each ran last) and the latest failovers."""
    orch: Generator | None = request.app.state.generator
    if orch is None:
        return error(404, "this node is not an orchestrator with a model")
    return JSONResponse({"requests": orch.active(), "ended": list(orch.recently_ended),
                         "failovers": list(orch.recent_failovers)})


def _finish_reason(result: dict) -> str:
    """OpenAI's word: "stop" for EOS or a stop string, "length" for max_tokens."""
    return "length" if result["finish_reason"] == "length" else "stop"


def _usage(result: dict) -> dict:
    prompt, completion = result["prompt_tokens"], len(result["tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def models(request: Request) -> Response:
    """The one model this mesh serves, as OpenAI's ``/v1/models`` lists models."""
    orch: Generator | None = request.app.state.generator
    if orch is None:
        return openai_error(404, "this node is not an orchestrator with a model")
    return JSONResponse({"object": "list", "data": [
        _model_card(orch)]})


async def model(request: Request) -> Response:
    """``/v1/models/{id}``: the model served, under its name; any other name is a 404."""
    orch: Generator | None = request.app.state.generator
    if orch is None:
        return openai_error(404, "this node is not an orchestrator with a model")
    name = request.path_params["name"]
    if name != orch.model_name:
        return openai_error(404, f"the model {name[:100]!r} is not served here; this mesh serves "
                                 f"{orch.model_name!r}", param="model")
    return JSONResponse(_model_card(orch))


def _model_card(orch: Generator) -> dict:
    return {"id": orch.model_name, "object": "model", "created": orch.created, "owned_by": "meshd"}


async def completions(request: Request) -> Response:
    return await _openai(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _openai(request, chat=True)


async def _openai(request: Request, chat: bool) -> Response:
    ready = await _prepare(request, "chat" if chat else "completions")
    if isinstance(ready, Response):
        return ready
    orch, body, params = ready
    events = _Events(body, chat, params["stop"], orch.model_name)
    if body.get("stream"):
        return _EventStream(events, orch, params)
    result = await _generate(request, orch, params, openai=True)
    if isinstance(result, Response):
        return result
    reason = _finish_reason(result)
    choice = ({"index": 0, "message": {"role": "assistant", "content": result["text"]}, "logprobs": None,
               "finish_reason": reason} if chat else
              {"index": 0, "text": result["text"], "logprobs": None, "finish_reason": reason})
    return JSONResponse({**events.head, "object": "chat.completion" if chat else "text_completion",
                         "choices": [choice], "usage": _usage(result),
                         "meshd": {"request": result["request"], "failovers": result["failovers"],
                                   "seed": params["seed"]}})


class _Events:
    """One request's server-sent events: for a chat, first the assistant's role; then text as it
    settles (whole characters, and nothing that may turn out to begin a stop string), one
    chunk per token; then the finish; usage when asked (``stream_options.include_usage``)."""

    def __init__(self, body: dict, chat: bool, stop: tuple[str, ...], model: str) -> None:
        self.chat = chat
        self.object = "chat.completion.chunk" if chat else "text_completion"
        # Answered under the name /v1/models lists, whatever name the client asked for.
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
                     "created": int(time.time()), "model": model}
        # The orchestrator's id for the request, in every token's ``meshd`` object: a client
        # (smoke-run's faults) can find it in /api/requests while it runs, beside others.
        self.request = uuid.uuid4().hex[:12]
        self.stop = stop
        self.text: IncrementalText  # the text so far (``produce``)
        self.emitted = ""
        options = body.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True

    def _choice(self, text: str, reason: str | None, delta: dict | None = None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if delta is None:
            delta = {"content": text} if text or reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}

    def event(self, text: str, reason: str | None, token: int | None = None, done: dict | None = None,
              delta: dict | None = None) -> str:
        chunk: dict[str, Any] = {**self.head, "object": self.object,
                                 "choices": [self._choice(text, reason, delta)]}
        if token is not None:  # an extension: the token id, for exact comparisons
            chunk["meshd"] = {"token": token, "index": len(self.text.tokens) - 1, "request": self.request}
        if done is not None:  # the last chunk: which request it was, and where it moved
            chunk["meshd"] = {"request": done["request"], "failovers": done["failovers"]}
        return f"data: {json.dumps(chunk)}\n\n"

    async def produce(self, orch: Generator, params: dict,
                      send: trio.MemorySendChannel[str | Exception]) -> None:
        """The request's events onto ``send``; a failure before its first event goes there
        as the exception itself (the response is then that error's), a later one as an
        error event."""
        started = False
        self.text = IncrementalText(orch.decode)

        async def start() -> None:
            nonlocal started
            if not started and self.chat:
                await send.send(self.event("", None, delta={"role": "assistant", "content": ""}))
            started = True

        async def on_token(token: int) -> None:
            await start()
            self.text.add(token)
            shown = settled(self.text.text, self.stop)
            new = shown[len(self.emitted):] if shown.startswith(self.emitted) else ""
            await send.send(self.event(new, None, token))
            self.emitted += new

        async with send:
            try:
                result = await orch.generate(**params, on_token=on_token, request_id=self.request)
            except Exception as exc:  # every failure ends the stream in words
                if not isinstance(exc, ValueError | PipelineError):
                    log.exception("a streamed request failed")
                if not started:
                    await send.send(exc)
                    return
                kind = ("invalid_request_error" if isinstance(exc, ValueError) else
                        "service_unavailable" if isinstance(exc, PipelineError) else "server_error")
                failure = {"error": {"message": _said(exc), "type": kind, "param": None, "code": None}}
                await send.send(f"data: {json.dumps(failure)}\n\n")
            else:
                await start()
                await send.send(self.event(result["text"][len(self.emitted):], _finish_reason(result),
                                           done=result))
                if self.include_usage:  # as OpenAI sends it: no choices, the usage
                    usage: dict[str, Any] = {**self.head, "object": self.object, "choices": [],
                                             "usage": _usage(result)}
                    await send.send(f"data: {json.dumps(usage)}\n\n")
            await send.send("data: [DONE]\n\n")


class _EventStream(Response):
    """A request's server-sent events, whose status waits for its first event: a request
    refused before any output (its context does not fit, every slot and the queue are
    taken, a stage is lost) gets the same 400 or 503 with Retry-After as without
    streaming.  A client that disconnects cancels the request."""

    media_type = "text/event-stream"

    def __init__(self, events: _Events, orch: Generator, params: dict) -> None:
        self.status_code, self.background = 200, None
        self.init_headers()  # no body yet, so no content-length: it streams
        self.events, self.orch, self.params = events, orch, params

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lines_in, lines = trio.open_memory_channel[str | Exception](64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_gone, receive, nursery.cancel_scope)
            nursery.start_soon(self.events.produce, self.orch, self.params, lines_in)
            async with lines:
                first = await lines.receive()
                if isinstance(first, Exception):
                    await _refusal(first, openai_error)(scope, receive, send)
                else:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    await send({"type": "http.response.body", "body": first.encode(), "more_body": True})
                    async for line in lines:
                        assert isinstance(line, str)  # only the first can be a failure
                        await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()


ROUTES = [
    Route("/api/generate", api_generate, methods=["POST"]),
    Route("/api/requests", api_requests, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{name:path}", model, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
