"""Chat templates (meshd.pipeline.chat): real models' templates render as Hugging Face's
``apply_chat_template`` renders them, text and token ids; a template's refusal and a hostile
template end in a ChatTemplateError with a message, never a hang or Python's internals."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from meshd.pipeline import chat
from meshd.pipeline.chat import ChatTemplate, ChatTemplateError
from meshd.pipeline.tokenizer import ByteTokenizer, HFTokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Multi-line, with whitespace control, trim_blocks / lstrip_blocks, namespace, loop controls and
# tojson with an indent, as Llama 3.1's and SmolLM's templates are written.
BLOCKS = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- set ns.system = message.content %}
        {%- continue %}
    {%- endif %}
    {% if loop.first and ns.system %}
<<SYS>>{{ {"system": ns.system, "n": messages|length} | tojson(indent=2) }}<</SYS>>
    {% endif %}
<|{{ message.role }}|>
{{ message.content }}{{ eos_token if message.role == 'assistant' }}
{% endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}"""

SPECIALS = ["<s>", "</s>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>"]


def _added(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False, "special": True}


def tokenizer_dir(path: Path, template: object, bos: str = "<s>", eos: str = "</s>") -> Path:
    """A Hugging Face tokenizer folder: byte-level BPE over the 256 bytes (any text encodes),
    the special tokens, and tokenizer_config.json with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": _added(eos),
              "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hello there"}],
    "system and turns": [
        {"role": "system", "content": "You answer in haiku."},
        {"role": "user", "content": "  What is a mesh?  "},
        {"role": "assistant", "content": "Nodes that reach each other"},
        {"role": "user", "content": "Grüße, 世界! \"quotes\" and {braces}"},
    ],
    "user and assistant": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
}
TEMPLATES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2": (QWEN2, "<s>", "<|im_end|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
    "blocks": (BLOCKS, "<s>", "</s>"),
}


# Mistral's template refuses a system message: that is the refusal test's.
CASES = [(name, conversation) for name in TEMPLATES for conversation in CONVERSATIONS
         if not (name == "mistral" and CONVERSATIONS[conversation][0]["role"] == "system")]


@pytest.mark.parametrize("name, conversation", CASES)
def test_real_templates_render_as_transformers_does(tmp_path, name, conversation):
    transformers = pytest.importorskip("transformers", reason="the reference rendering is transformers'")
    template, bos, eos = TEMPLATES[name]
    messages = CONVERSATIONS[conversation]
    folder = tokenizer_dir(tmp_path / name, template, bos, eos)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    want_text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want_ids = list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)

    ours = ChatTemplate.load(folder)
    assert ours.render(messages) == want_text
    # The template wrote BOS itself: nothing is added in front of it.
    assert ours.prompt_ids(messages, HFTokenizer(folder / "tokenizer.json", 0, ())) == want_ids
    if name in ("llama3", "mistral"):  # BOS once, first: none added in front of the template's
        bos_id = reference.convert_tokens_to_ids(bos)
        assert want_ids[0] == bos_id and want_ids.count(bos_id) == 1


def test_named_templates_use_the_default_one(tmp_path):
    folder = tokenizer_dir(tmp_path, [{"name": "tool_use", "template": "TOOLS"},
                                      {"name": "default", "template": QWEN2}])
    text = ChatTemplate.load(folder).render([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system")


def test_a_template_file_beside_the_config_comes_first(tmp_path):
    folder = tokenizer_dir(tmp_path, QWEN2)
    (folder / chat.TEMPLATE_FILE).write_text("{{ bos_token }}[{{ messages[0].content }}]", encoding="utf-8")
    assert ChatTemplate.load(folder).render([{"role": "user", "content": "hi"}]) == "<s>[hi]"


def test_a_refusal_of_the_template_names_its_message_and_the_messages(tmp_path):
    transformers = pytest.importorskip("transformers", reason="compared with transformers' refusal")
    folder = tokenizer_dir(tmp_path, MISTRAL)
    wrong = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate"):
        transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(wrong, tokenize=False)
    with pytest.raises(ChatTemplateError, match="refuses this conversation: Conversation roles") as e:
        ChatTemplate.load(folder).render(wrong)
    assert e.value.param == "messages"
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles are supported"):
        ChatTemplate.load(folder).render([{"role": "user", "content": "x"},
                                          {"role": "system", "content": "y"}])


def test_strftime_now_and_tojson_as_hugging_face_defines_them(tmp_path):
    folder = tokenizer_dir(tmp_path, "{{ strftime_now('%Y') }} {{ messages[0] | tojson }}")
    text = ChatTemplate.load(folder).render([{"role": "user", "content": "é <b>"}])
    assert text == time.strftime("%Y") + ' {"role": "user", "content": "é <b>"}'


def test_without_a_template_the_prompt_is_plain_and_starts_with_bos(tmp_path):
    ours = ChatTemplate.load(tmp_path)  # no tokenizer_config.json at all
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.render(messages) == "system: Be brief.\nuser: Hi\nassistant:"
    tokenizer = ByteTokenizer(0, 256, (257,))
    assert ours.prompt_ids(messages, tokenizer) == [256, *b"system: Be brief.\nuser: Hi\nassistant:"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}), encoding="utf-8")
    assert ChatTemplate.load(tmp_path).render(messages) == "system: Be brief.\nuser: Hi\nassistant:"


@pytest.mark.parametrize(
    "template, message",
    [
        # Python's internals, the classic sandbox escape.
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}",
         "sandbox forbids: access to attribute '__class__'"),
        ("{{ cycler.__init__.__globals__.os }}", "sandbox forbids"),
        # The immutable sandbox: the caller's messages are not the template's to change.
        ("{{ messages.append({'role': 'system'}) }}", "sandbox forbids"),
        ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", "sandbox forbids"),
        # Huge output: at once, or from a loop.
        ("{{ 'x' * 1000000000 }}", "'*' would build 1000000000 items"),
        ("{{ 10 ** 100000000 }}", "'**' with an exponent of 100000000"),
        ("{{ '%0999999999d' % 1 }}", "'%' with a field width"),
        ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
         f"wrote more than {chat.MAX_PROMPT_CHARS} characters"),
        # A loop of loops writing nothing, as long as it likes.
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         f"ran past {chat.MAX_RENDER_STEPS} steps"),
        # Templates that are broken rather than hostile.
        ("{% for m in messages %}{{ m.content }}", "not valid jinja: line 1"),
        ("{{ messages[0].content + 1 }}", "failed: TypeError"),
        ("{{ missing.attribute }}", "failed on this conversation: 'missing' is undefined"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed: RecursionError"),
    ],
)
def test_a_hostile_or_broken_template_fails_the_request_with_a_message(tmp_path, template, message):
    folder = tokenizer_dir(tmp_path, template)
    ours = ChatTemplate.load(folder)
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message.replace("(", r"\(").replace("*", r"\*")):
        ours.render([{"role": "user", "content": "hi"}])
    print(f"{template[:40]!r}: refused after {time.monotonic() - started:.2f}s")
    # The refusal leaves no trace function behind: the next render runs as usual.
    assert ChatTemplate.load(tokenizer_dir(tmp_path / "ok", QWEN2)).render([{"role": "user", "content": "x"}])


def test_a_config_that_cannot_be_read_fails_chat_requests_not_the_load(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    ours = ChatTemplate.load(tmp_path)
    with pytest.raises(ChatTemplateError, match="the chat template cannot be read"):
        ours.render([{"role": "user", "content": "hi"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use",
                                                                                     "template": "x"}]}))
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        ChatTemplate.load(tmp_path).render([{"role": "user", "content": "hi"}])
