"""The official ``openai`` client against a 3-stage mesh's ``/v1``: what it calls (models, completions,
chat completions, streamed and not), what it gets (the reference's tokens, usage), and what it shows
of an error (the message and the field)."""

from __future__ import annotations

import json

import openai
import pytest
import trio

from meshd.node import NodeOptions
from meshd.pipeline.chat import ChatTemplate
from meshd.pipeline.config import LlamaConfig
from meshd.pipeline.generate import generate
from meshd.pipeline.tokenizer import load_tokenizer
from meshd.testing.inprocess import start_node, wait_converged

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


async def _mesh(nursery, checkpoint, lines: list[str]):
    opts = dict(profile="local", stages=3, model=str(checkpoint))
    orch = await start_node(nursery, NodeOptions(role="orchestrator", dashboard="127.0.0.1:0", **opts), lines)
    nodes = [orch]
    for k in range(3):
        nodes.append(await start_node(nursery, NodeOptions(stage=k, seeds=[orch.addr], **opts), lines))
    await wait_converged(nodes)
    await orch.app.wait_ready(10)
    return orch, nodes[1:]


async def _sampled_after(stages, run) -> int:
    """How many tokens the stages sample while ``run()`` runs and until they drop every request."""
    before = sum(stage.app.counters["tokens"] for stage in stages)
    await run()
    while any(stage.app.jobs for stage in stages):
        await trio.sleep(0.05)
    return sum(stage.app.counters["tokens"] for stage in stages) - before


def _bad_request(call) -> tuple[int, str, str | None]:
    try:
        call()
    except openai.BadRequestError as exc:
        return exc.status_code, exc.message, exc.param
    raise AssertionError("no BadRequestError")


def _calls(base_url: str, stop: str) -> dict:
    """Every call a client makes, from a thread (the client blocks)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
    out: dict = {"models": [m.id for m in client.models.list()]}
    model = out["models"][0]
    done = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0.7,
                                     extra_body={"top_k": 10}, seed=3)
    out["text"], out["usage"] = done.choices[0].text, done.usage
    stream = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0.7,
                                       extra_body={"top_k": 10}, seed=3, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    out["streamed"] = "".join(c.choices[0].text for c in chunks if c.choices)
    out["stream_usage"] = chunks[-1].usage

    out["top_p"] = client.completions.create(model=model, prompt="Hello", max_tokens=16, temperature=0.9,
                                             top_p=0.8, seed=5).choices[0].text
    stopped = client.completions.create(model=model, prompt="Hello", max_tokens=16, stop=[stop, "\x00\x00"])
    choice = stopped.choices[0]
    out["stopped"] = (choice.text, choice.finish_reason, stopped.usage.completion_tokens)
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=16, stop=stop,
                                            stream=True))
    out["stopped_chunks"] = [c.choices[0].text for c in chunks]
    out["stopped_stream_reason"] = chunks[-1].choices[0].finish_reason

    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0.7, seed=3,
                                          extra_body={"top_k": 10})
    message = chat.choices[0].message
    out["chat"] = (message.role, message.content, chat.choices[0].finish_reason, chat.usage, chat.object)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0.7,
                                                 seed=3, extra_body={"top_k": 10}, stream=True,
                                                 stream_options={"include_usage": True}))
    out["chat_chunks"] = chunks
    # No max_tokens: the answer runs to its end (EOS, or the context), as OpenAI's chat does.
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
    out["chat_whole"] = (whole.choices[0].message.content, whole.choices[0].finish_reason, whole.usage)

    for name, call in {
        "max_tokens": lambda: client.completions.create(model=model, prompt="Hello", max_tokens=0),
        "n": lambda: client.chat.completions.create(model=model, messages=CHAT, n=2),
        "stop": lambda: client.completions.create(model=model, prompt="Hello", stop=list("abcde")),
        "top_p": lambda: client.completions.create(model=model, prompt="Hello", top_p=0),
        "top_p_chat": lambda: client.chat.completions.create(model=model, messages=CHAT, top_p=1.5),
        "role": lambda: client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]),
        "content": lambda: client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages": lambda: client.chat.completions.create(model=model, messages=[]),
        "penalty": lambda: client.chat.completions.create(model=model, messages=CHAT, presence_penalty=1.0),
    }.items():
        out[f"error_{name}"] = _bad_request(call)
    try:
        client.embeddings.create(model=model, input="x")
    except openai.NotFoundError as exc:
        out["not_served"] = exc.message
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 6-layer tiny checkpoint with a ChatML template in its tokenizer_config.json."""
    from meshd.pipeline.checkpoint import init_checkpoint

    path = tmp_path_factory.mktemp("tiny6")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=6)
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def _chat_ids(checkpoint, messages) -> list[int]:
    config = LlamaConfig.load(checkpoint)
    tokenizer = load_tokenizer(checkpoint, config.bos_token_id, config.eos_token_ids)
    return ChatTemplate.load(checkpoint).prompt_ids(messages, tokenizer)


def _a_stop_string(checkpoint) -> tuple[str, str, int]:
    """Two characters of the greedy text (whole ones, first seen at index 3 or later): the stop
    string, the text before it, and how many tokens it takes to write through it."""
    want = generate(checkpoint, "Hello", 16)
    text = want["text"]
    i = next(i for i in range(3, len(text) - 1)
             if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    stop = text[i:i + 2]
    config = LlamaConfig.load(checkpoint)
    tokenizer = load_tokenizer(checkpoint, config.bos_token_id, config.eos_token_ids)
    n = next(n for n in range(1, 17) if stop in tokenizer.decode(want["tokens"][:n]))
    return stop, text[:i], n


async def test_the_openai_client_lists_completes_chats_streams_and_reads_errors(checkpoint):
    lines: list[str] = []
    want = generate(checkpoint, "Hello", 8, 0.7, 10, 3)
    want_top_p = generate(checkpoint, "Hello", 16, 0.9, 0, 5, top_p=0.8)
    assert want_top_p["text"] != generate(checkpoint, "Hello", 16, 0.9, 0, 5)["text"]  # top_p matters here
    stop, before_stop, stop_tokens = _a_stop_string(checkpoint)
    chat_ids = _chat_ids(checkpoint, CHAT)
    want_chat = generate(checkpoint, chat_ids, 8, 0.7, 10, 3)
    hi_ids = _chat_ids(checkpoint, [{"role": "user", "content": "Hi"}])
    context = LlamaConfig.load(checkpoint).max_position_embeddings
    want_whole = generate(checkpoint, hi_ids, context - len(hi_ids) + 1)
    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            orch, stages = await _mesh(nursery, checkpoint, lines)
            got = await trio.to_thread.run_sync(_calls, orch.dashboard_url, stop)

            # A request a stop string ends, or whose caller leaves, ends on the stages too: they
            # drop it, long before its max_tokens.
            async def stopped() -> None:
                await orch.app.generate("Hello", 200, stop=[stop])

            async def left() -> None:
                with trio.CancelScope() as scope:
                    async def leave(token: int) -> None:
                        scope.cancel()

                    await orch.app.generate("Hello", 200, on_token=leave)

            sampled = [await _sampled_after(stages, stopped), await _sampled_after(stages, left)]
            nursery.cancel_scope.cancel()

    assert got["models"] == [checkpoint.name]
    assert got["text"] == want["text"] and got["streamed"] == want["text"]
    for usage in (got["usage"], got["stream_usage"]):
        assert usage.completion_tokens == len(want["tokens"])
        assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    # top_p: the pipeline draws what the single process draws, seed for seed.
    assert got["top_p"] == want_top_p["text"]
    # stop: the text ends before it, generation ends with it; streamed, no chunk shows any of it
    # (its first character was held back until the second settled it).
    assert got["stopped"] == (before_stop, "stop", stop_tokens)
    assert "".join(got["stopped_chunks"]) == before_stop and got["stopped_stream_reason"] == "stop"
    assert all(n < 200 for n in sampled), sampled

    # Chat: the template's prompt (no BOS added in front of it), the reference's answer.
    role, content, reason, usage, kind = got["chat"]
    assert (role, content, kind) == ("assistant", want_chat["text"], "chat.completion")
    assert reason == ("length" if want_chat["finish_reason"] == "length" else "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(chat_ids), len(want_chat["tokens"]))
    chunks = got["chat_chunks"]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat["text"]
    assert chunks[-2].choices[0].finish_reason == reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == len(chat_ids) + len(want_chat["tokens"])
    content, reason, usage = got["chat_whole"]
    assert content == want_whole["text"] and usage.completion_tokens == len(want_whole["tokens"])
    assert usage.prompt_tokens + usage.completion_tokens >= context or reason == "stop"

    # The client shows the message and the field, not just "Error code: 400".
    status, message, param = got["error_max_tokens"]
    assert (status, param) == (400, "max_tokens") and "'max_tokens' must be within" in message
    for name, param, words in (("n", "n", "'n' must be 1"), ("stop", "stop", "at most 4 strings"),
                               ("top_p", "top_p", "'top_p' must be within (0, 1]"),
                               ("top_p_chat", "top_p", "'top_p' must be within (0, 1]"),
                               ("role", "messages[1].role", "'messages[1].role' must be one of"),
                               ("content", "messages[0].content[0]", "only text is served"),
                               ("messages", "messages", "'messages' must be a non-empty list"),
                               ("penalty", "presence_penalty", "'presence_penalty' is not supported")):
        status, message, got_param = got[f"error_{name}"]
        assert (status, got_param) == (400, param) and words in message, (name, message)
    assert "/v1/embeddings is not served here" in got["not_served"]
