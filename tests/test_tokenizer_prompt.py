"""A real checkpoint's tokenizer: a prompt's ids are what Hugging Face's ``tokenizer(text)`` gives.

Three layouts the families use: a post-processor that adds BOS (Llama 2 and 3),
none (Qwen2: no BOS at all), and ``add_bos_token`` in tokenizer_config.json
deciding.  Compared with transformers' own tokenizer when it is installed.
"""

from __future__ import annotations

import json

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")

from meshd.pipeline.generate import prompt_ids  # noqa: E402
from meshd.pipeline.tokenizer import HFTokenizer, TokenizerError, load_tokenizer  # noqa: E402

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "once": 5, "upon": 6}
TEXT = "hello world once upon"


def write_tokenizer(path, *, post_bos: bool, add_bos_token: bool | None) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (path / "tokenizer_config.json").write_text(json.dumps(config))


CASES = {  # (post-processor adds BOS, add_bos_token) -> ids
    (True, None): [1, 3, 4, 5, 6],
    (False, None): [3, 4, 5, 6],
    (False, True): [1, 3, 4, 5, 6],
    (True, False): [3, 4, 5, 6],
}


@pytest.mark.parametrize("post_bos, add_bos", list(CASES))
def test_prompt_ids_follow_the_tokenizers_own_rule(tmp_path, post_bos, add_bos):
    write_tokenizer(tmp_path, post_bos=post_bos, add_bos_token=add_bos)
    tok = load_tokenizer(tmp_path, bos_token_id=1, eos_token_ids=(2,))
    assert isinstance(tok, HFTokenizer)
    assert prompt_ids(tok, TEXT) == CASES[post_bos, add_bos]
    assert tok.encode(TEXT) == [3, 4, 5, 6]  # a chat template's text: no specials added
    assert tok.decode(prompt_ids(tok, TEXT)) == TEXT


@pytest.mark.parametrize("post_bos, add_bos", [(True, None), (False, None)])
def test_prompt_ids_equal_transformers(tmp_path, post_bos, add_bos):
    transformers = pytest.importorskip("transformers", reason="the reference extra is not installed")
    write_tokenizer(tmp_path, post_bos=post_bos, add_bos_token=add_bos)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path, bos_token_id=1, eos_token_ids=(2,))
    assert prompt_ids(tok, TEXT) == reference(TEXT)["input_ids"]


def test_a_broken_tokenizer_config_is_named(tmp_path):
    write_tokenizer(tmp_path, post_bos=True, add_bos_token=None)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path, bos_token_id=1, eos_token_ids=(2,))
