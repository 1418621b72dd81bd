"""A stream's text, decoded a token at a time: the same text as decoding every token at once,
for byte tokenizers and for the two ways Hugging Face tokenizers mark a word's space
(GPT-2's byte-level alphabet, SentencePiece's ▁ with byte fallback), at a cost that grows
with the stream's length, not its square."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.pipeline.tokenizer import ByteTokenizer, IncrementalText

CORPUS = ["hello world once upon a time", "naïve café — déjà vu 😀 über", "  spaces\tand\nnewlines",
          "日本語のテキスト", "the end."] * 40


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"]))
    return tok


def _sentencepiece_like():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=specials))
    return tok


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def hf(request):
    pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    tok = _byte_level() if request.param == "byte-level" else _sentencepiece_like()
    return tok


def _streamed(decode, ids: list[int]) -> str:
    text = IncrementalText(decode)
    pieces = [text.add(t) for t in ids]
    assert "".join(pieces) == text.text, "each token's piece adds up to the text"
    return text.text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_text_a_byte_tokenizer_streams_is_the_text_of_all_its_tokens(text):
    tok = ByteTokenizer(offset=3, bos_token_id=1, eos_token_ids=(2,))
    ids = tok.encode(text)
    assert _streamed(tok.decode, ids) == tok.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=40))
def test_any_byte_ids_stream_a_prefix_held_back_only_for_an_unfinished_character(ids):
    """Ids no text encodes to (lone continuation bytes, specials, ids past the bytes): what
    streams is the text of them all, but a tail whose last character is not finished."""
    tok = ByteTokenizer(offset=3, bos_token_id=1, eos_token_ids=(2,))
    whole, got = tok.decode(ids), _streamed(tok.decode, ids)
    assert whole.startswith(got)
    assert got == whole or whole.endswith("\ufffd"), (got, whole)


def test_a_hugging_face_tokenizers_text_streams_as_it_decodes_whole(hf):
    def decode(ids: list[int]) -> str:
        return hf.decode(list(ids), skip_special_tokens=True)

    for line in dict.fromkeys(CORPUS):
        for start in range(len(line)):
            ids = hf.encode(line[start:], add_special_tokens=False).ids
            assert _streamed(decode, ids) == decode(ids), (line[start:], ids)


def test_streaming_a_long_text_decodes_each_token_a_few_times_not_the_whole_text_again():
    tok = ByteTokenizer(offset=3)
    decoded = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return tok.decode(ids)

    ids = tok.encode("naïve café 😀 " * 200)
    assert _streamed(decode, ids) == tok.decode(ids)
    assert sum(decoded) <= 16 * len(ids), f"{sum(decoded)} ids decoded for a text of {len(ids)}"
