"""The orchestrator's HTTP API, served by Hypercorn inside the node, over real sockets."""

from __future__ import annotations

import json
import shutil
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from meshd.node import NodeOptions
from meshd.pipeline.generate import generate
from meshd.testing.inprocess import start_node, start_pipeline, wait_converged


async def _mesh(nursery, checkpoint, stages: int, lines: list[str], start_stages: int | None = None):
    opts = dict(profile="local", stages=stages, model=str(checkpoint))
    orch = await start_node(nursery, NodeOptions(role="orchestrator", dashboard="127.0.0.1:0", **opts), lines)
    nodes = [orch]
    for k in range(stages if start_stages is None else start_stages):
        nodes.append(await start_node(nursery, NodeOptions(stage=k, seeds=[orch.addr], **opts), lines))
    await wait_converged(nodes)
    return orch


@asynccontextmanager
async def _ready_client(checkpoint):
    """A ready one-stage mesh's orchestrator and an HTTP client of its dashboard."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch = await _mesh(nursery, checkpoint, 1, [])
            await orch.app.wait_ready(10)
            async with httpx.AsyncClient(base_url=orch.dashboard_url, timeout=30) as client:
                yield orch, client
            nursery.cancel_scope.cancel()


async def test_generate_and_completions_match_the_reference(checkpoint):
    lines: list[str] = []
    want = generate(checkpoint, "Hello", 8, 0.7, 10, 3)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch = await _mesh(nursery, checkpoint, 2, lines)
            await orch.app.wait_ready(10)
            assert f"meshd dashboard url={orch.dashboard_url}" in lines
            async with httpx.AsyncClient(base_url=orch.dashboard_url, timeout=30) as client:
                body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_k": 10, "seed": 3}
                r = await client.post("/api/generate", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["tokens"] == want["tokens"] and r.json()["text"] == want["text"]
                assert r.json()["timings"]["tokens_per_s"] > 0

                r = await client.post("/v1/completions", json={**body, "model": "tiny"})
                assert r.status_code == 200
                assert r.json()["choices"][0]["text"] == want["text"]
                assert r.json()["meshd"]["failovers"] == [] and r.json()["meshd"]["request"]

                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.headers["content-type"].startswith("text/event-stream")
                    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]
            # Each token names its request from the first on, as the last chunk does.
            named = {c["meshd"]["request"] for c in chunks if "token" in c.get("meshd", {})}
            assert named == {chunks[-1]["meshd"]["request"]}
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            nursery.cancel_scope.cancel()


async def test_a_sampled_request_without_a_seed_draws_its_own_and_says_which(checkpoint):
    """As OpenAI's API: sampling without a seed gives another draw each time (a client's
    "regenerate" gets another answer), and the answer names the seed, which repeats it."""
    with trio.fail_after(60):
        async with _ready_client(checkpoint) as (_, client):
            body = {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0}
            first, second = [(await client.post("/api/generate", json=body)).json() for _ in range(2)]
            assert first["seed"] != second["seed"]
            again = (await client.post("/api/generate", json={**body, "seed": first["seed"]})).json()
            assert again["tokens"] == first["tokens"] and again["seed"] == first["seed"]
            r = await client.post("/v1/completions", json={**body, "seed": None})
            assert r.status_code == 200 and r.json()["meshd"]["seed"] not in (first["seed"], second["seed"])
            greedy = (await client.post("/api/generate", json={"prompt": "Hello", "max_tokens": 8})).json()
            assert greedy["seed"] == 0  # greedy draws nothing


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"max_tokens": 4}).encode(), "'prompt' must be a string"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "'max_tokens' must be within"),
        (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), "'temperature' must be a number"),
        (json.dumps({"prompt": "x", "max_tokens": 4000}).encode(), "exceeds the model's context"),
        # JSON can escape half a surrogate pair, which no text holds; Python's codec would say
        # "surrogates not allowed" from deep in the tokenizer.
        (b'{"prompt": "a\\udcffb"}', "lone surrogate (\\udcff)"),
        (b'{"prompt": "x", "stop": ["\\ud800"]}', "lone surrogate (\\ud800)"),
        # Past 4300 digits Python refuses to convert an integer in words about its own settings.
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b'}', "an integer of 5000 digits; at most 64"),
        (b'{"prompt": "x", "seed": -' + b"1" * 65 + b'}', "an integer of 65 digits"),
        # A client that meant JSON and wrote "yes" must not get a stream of events.
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "'stream' must be true or false"),
    ],
)
async def test_bad_bodies_get_400_with_a_message(checkpoint, body, message):
    async with _ready_client(checkpoint) as (_orch, client):
        headers = {"content-type": "application/json"}
        r = await client.post("/api/generate", content=body, headers=headers)
        if b'"stream"' in body:  # OpenAI's field: the native API has no stream to ask for
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 400, r.text
            assert message in r.json()["error"]
        # The same in OpenAI's shape on /v1, naming the field where there is one.
        r = await client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
        if message.startswith("'"):
            assert error["param"] == message.split("'")[1]


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"model": {"x": 1}}, "model", "'model' must be a string"),
    ({"stream_options": {"include_usage": "x"}}, "stream_options", "'include_usage' is true or false"),
    ({"stream_options": ["include_usage"]}, "stream_options", "'stream_options' must be an object"),
])
async def test_openai_fields_of_the_wrong_type_get_400_naming_the_field(checkpoint, extra, param, message):
    """A client's mistake in a field we take is named, not read as its default."""
    async with _ready_client(checkpoint) as (_orch, client):
        chat = {"messages": [{"role": "user", "content": "x"}]}
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                           ("/v1/chat/completions", chat)):
            r = await client.post(path, json={**body, "stream": True, **extra})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert message in error["message"] and error["param"] == param, error
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "model": "any",
                                                       "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text


async def test_a_mesh_that_is_not_ready_gets_503_naming_the_missing_stage(checkpoint):
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch = await _mesh(nursery, checkpoint, 2, lines, start_stages=1)
            async with httpx.AsyncClient(base_url=orch.dashboard_url, timeout=30) as client:
                r = await client.post("/api/generate", json={"prompt": "x"})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"  # a stage on its way: clients retry
            assert r.json()["missing"] == ["pp-stage-1", "pp-exit"]
            assert "pp-stage-1 does not resolve" in r.json()["error"]
            nursery.cancel_scope.cancel()


MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
           "{% endif %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}")


async def test_chat_errors_come_in_openais_shape_with_the_templates_message(checkpoint, tmp_path):
    model = tmp_path / "mistralish"
    shutil.copytree(checkpoint, model)
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": MISTRAL}))
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch = await _mesh(nursery, model, 1, lines, start_stages=0)
            async with httpx.AsyncClient(base_url=orch.dashboard_url, timeout=30) as client:
                # The template refuses the conversation: its own words, naming the messages.
                twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
                r = await client.post("/v1/chat/completions", json={"messages": twice})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "messages" and error["type"] == "invalid_request_error"
                assert "Conversation roles must alternate" in error["message"]
                # A conversation it takes, on a mesh with no stage yet: 503 naming the stage.
                r = await client.post("/v1/chat/completions", json={"messages": twice[:1]})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["type"] == "service_unavailable"
                message = r.json()["error"]["message"]
                assert "pp-stage-0 does not resolve (no live node serves stage-0)" in message
                # A served path asked with the wrong method, and one not served.
                r = await client.get("/v1/chat/completions")
                assert r.status_code == 405 and "takes POST" in r.json()["error"]["message"]
                r = await client.post("/v1/embeddings", json={})
                assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
            nursery.cancel_scope.cancel()


async def test_a_request_that_lost_a_stage_gets_503_with_retry_after(checkpoint, monkeypatch):
    """Stages restart within seconds and replicas take over at once: a client told its
    request lost a stage is told when to try again, on both APIs."""
    from meshd.pipeline.api import StageLost

    async def lost(**_params):
        raise StageLost("stage-0 (peer 5c3e9a10 dead)")

    async with _ready_client(checkpoint) as (orch, client):
        monkeypatch.setattr(orch.app, "generate", lost)
        for path, body in (("/api/generate", {"prompt": "Hello", "max_tokens": 4}),
                           ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
                           ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True})):
            r = await client.post(path, json=body)
            assert r.status_code == 503 and r.headers.get("retry-after") == "1", (path, r.text)
            assert "lost: stage-0 (peer 5c3e9a10 dead)" in r.text


def _events(body: bytes) -> list:
    """The JSON events of a server-sent event stream, without its closing [DONE]."""
    lines = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


async def test_a_stream_refused_before_its_first_token_gets_the_status_a_plain_request_gets(checkpoint):
    """A streamed request whose context does not fit gets 400, and one past a full queue 503
    with Retry-After, as without streaming: never a 200 whose events say so.  The streams
    that run get their tokens, with no error among them."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 1, lines, max_running=1, max_queued=0,
                                         dashboard="127.0.0.1:0")
            async with httpx.AsyncClient(base_url=nodes[0].dashboard_url, timeout=60) as client:
                chat = {"messages": [{"role": "user", "content": "Hi"}]}
                for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", chat)):
                    r = await client.post(path, json={**body, "max_tokens": 4000, "stream": True})
                    assert r.status_code == 400, r.text
                    assert r.json()["error"]["type"] == "invalid_request_error"
                    assert "context" in r.json()["error"]["message"], r.text
                got: list[httpx.Response] = []

                async def one() -> None:
                    body = {"prompt": "Hello", "max_tokens": 120, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        await r.aread()
                        got.append(r)

                async with trio.open_nursery() as clients:
                    for _ in range(4):  # at once: one runs, and the queue holds none
                        clients.start_soon(one)
            nursery.cancel_scope.cancel()
    ran = [r for r in got if r.status_code == 200]
    refused = [r for r in got if r.status_code != 200]
    assert ran and refused, [r.status_code for r in got]
    for r in refused:
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text
        assert json.loads(r.content)["error"]["message"].startswith("busy: "), r.text
    for r in ran:
        events = _events(r.content)
        assert not [e for e in events if "error" in e], events
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_a_streaming_client_that_leaves_cancels_its_request(checkpoint):
    """A client that stops reading a stream and closes the connection mid-generation ends its
    request: the slot and every stage's KV cache are freed well before max_tokens, it counts
    as cancelled, and the next request is served."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 2, lines, dashboard="127.0.0.1:0")
            orch, stages = nodes[0].app, [n.app for n in nodes[1:]]
            async with httpx.AsyncClient(base_url=nodes[0].dashboard_url, timeout=60) as client:
                body = {"prompt": "Hello", "max_tokens": 200, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen == 3:
                            break
                while orch.admission.running or any(s.jobs for s in stages):
                    await trio.sleep(0.005)
                generated = orch.metrics.generation_tokens
                after = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            outcomes = dict(orch.metrics.requests)
            nursery.cancel_scope.cancel()
    assert generated < 200, "the request ran on after its client left"
    assert outcomes["cancelled"] == 1 and outcomes["length"] == 1, outcomes
    assert after.status_code == 200, after.text


async def test_answers_name_the_model_the_mesh_serves_whatever_name_was_asked(checkpoint):
    """The mesh serves one model: an answer names it as /v1/models does, not as the client
    asked; a name too long to be one is refused, not copied into every event."""
    async with _ready_client(checkpoint) as (_orch, client):
        served = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {"prompt": "Hello", "max_tokens": 3, "model": "gpt-4"}
        assert (await client.post("/v1/completions", json=body)).json()["model"] == served
        r = await client.post("/v1/completions", json={**body, "stream": True})
        assert {e["model"] for e in _events(r.content)} == {served}
        r = await client.post("/v1/completions", json={**body, "model": "m" * 100_000, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        # One model, as OpenAI's /v1/models/{id} retrieves it; another name is a 404.
        assert (await client.get(f"/v1/models/{served}")).json()["id"] == served
        r = await client.get("/v1/models/gpt-4")
        assert r.status_code == 404 and "not served here" in r.json()["error"]["message"], r.text


async def test_a_developer_message_is_the_system_prompt_and_max_tokens_is_checked_beside_its_successor(
        checkpoint):
    """OpenAI's newer clients send the system prompt as role "developer"; a chat with it gets
    the same answer as with "system".  A max_tokens of the wrong type is refused even when
    max_completion_tokens is given."""
    async with _ready_client(checkpoint) as (_orch, client):
        answers = []
        for role in ("system", "developer"):
            body = {"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                    "max_tokens": 6}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"])
        assert answers[0] == answers[1]
        r = await client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 4,
                                                            "max_tokens": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


async def test_a_prompt_longer_than_the_context_is_a_400_naming_it_streamed_or_not(checkpoint):
    """A long prompt is tokenised off the event loop; one past the context is refused with
    the numbers, as a short one that does not fit is."""
    async with _ready_client(checkpoint) as (orch, client):
        prompt = "once upon a time " * 2000  # 34,000 characters, past LONG_PROMPT_CHARS
        for stream in (False, True):
            body = {"prompt": prompt, "max_tokens": 4, "stream": stream}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            assert "context" in r.json()["error"]["message"], r.text
        r = await client.post("/v1/completions", json={"prompt": prompt[:100], "max_tokens": 4})
        assert r.status_code == 200, r.text


async def test_a_stream_whose_request_breaks_unexpectedly_ends_in_words_before_or_after_its_first_token(
        checkpoint, monkeypatch):
    """A failure no one planned for (a bug) is a 500 in OpenAI's shape before the first token,
    and an error event then [DONE] after it: never a stream that just stops."""
    async with _ready_client(checkpoint) as (orch, client):
        real = orch.app.generate

        async def broken(*, after: int, **params):
            async def on_token(token: int) -> None:
                await params["on_token"](token)
                if len(seen) == after:
                    raise RuntimeError("a bug")
                seen.append(token)

            seen: list[int] = []
            if after == 0:
                raise RuntimeError("a bug")
            return await real(**{**params, "on_token": on_token})

        body = {"prompt": "Hello", "max_tokens": 8, "stream": True}
        monkeypatch.setattr(orch.app, "generate", lambda **p: broken(after=0, **p))
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError", r.text
        monkeypatch.setattr(orch.app, "generate", lambda **p: broken(after=2, **p))
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200
        events = _events(r.content)  # ends with [DONE]
        assert events[-1]["error"]["type"] == "server_error", events
        assert [e["choices"][0]["text"] for e in events[:-1]], events
