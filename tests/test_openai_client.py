"""The official ``openai`` client against a 3-stage mesh's ``/v1``: what it calls, and what it
shows of an error."""

from __future__ import annotations

import openai
import pytest
import trio

from meshd.node import NodeOptions
from meshd.pipeline.generate import generate
from meshd.testing.inprocess import start_node, wait_converged


async def _mesh(nursery, checkpoint, lines: list[str]):
    opts = dict(profile="local", stages=3, model=str(checkpoint))
    orch = await start_node(nursery, NodeOptions(role="orchestrator", dashboard="127.0.0.1:0", **opts), lines)
    nodes = [orch]
    for k in range(3):
        nodes.append(await start_node(nursery, NodeOptions(stage=k, seeds=[orch.addr], **opts), lines))
    await wait_converged(nodes)
    await orch.app.wait_ready(10)
    return orch


def _calls(base_url: str, want: dict) -> dict:
    """Every call a client makes, from a thread (the client blocks)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    out: dict = {"models": [m.id for m in client.models.list()]}
    done = client.completions.create(model=out["models"][0], prompt="Hello", max_tokens=8, temperature=0.7,
                                     extra_body={"top_k": 10}, seed=3)
    out["text"], out["usage"] = done.choices[0].text, done.usage
    stream = client.completions.create(model=out["models"][0], prompt="Hello", max_tokens=8, temperature=0.7,
                                       extra_body={"top_k": 10}, seed=3, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    out["streamed"] = "".join(c.choices[0].text for c in chunks if c.choices)
    out["stream_usage"] = chunks[-1].usage
    for bad, param in (({"max_tokens": 0}, "max_tokens"), ({"n": 2}, "n"), ({"stop": ["\n"]}, "stop")):
        try:
            client.completions.create(model=out["models"][0], prompt="Hello", **{"max_tokens": 4, **bad})
        except openai.BadRequestError as exc:
            out[f"error_{param}"] = (exc.status_code, exc.message, exc.param)
    try:
        client.chat.completions.create(model=out["models"][0], messages=[{"role": "user", "content": "hi"}])
    except openai.NotFoundError as exc:
        out["chat"] = exc.message
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from meshd.pipeline.checkpoint import init_checkpoint

    path = tmp_path_factory.mktemp("tiny6")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=6)
    return path


async def test_the_openai_client_lists_the_model_completes_streams_and_reads_errors(checkpoint):
    lines: list[str] = []
    want = generate(checkpoint, "Hello", 8, 0.7, 10, 3)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch = await _mesh(nursery, checkpoint, lines)
            got = await trio.to_thread.run_sync(_calls, orch.dashboard_url, want)
            nursery.cancel_scope.cancel()
    assert got["models"] == [checkpoint.name]
    assert got["text"] == want["text"] and got["streamed"] == want["text"]
    for usage in (got["usage"], got["stream_usage"]):
        assert usage.completion_tokens == len(want["tokens"])
        assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The client shows the message and the field, not just "Error code: 400".
    status, message, param = got["error_max_tokens"]
    assert (status, param) == (400, "max_tokens") and "'max_tokens' must be within" in message
    assert got["error_n"][0] == 400 and got["error_n"][2] == "n"
    assert got["error_stop"][2] == "stop" and "not supported yet" in got["error_stop"][1]
    assert "/v1/chat/completions is not served here" in got["chat"]
