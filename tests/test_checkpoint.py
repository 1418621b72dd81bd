"""Checkpoints: round trip, refusals that name the tensor, bf16, per-stage reads, the CLI."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from meshd.cli import main
from meshd.pipeline import (
    CheckpointError,
    ConfigError,
    LlamaConfig,
    StageModel,
    generate,
    init_checkpoint,
    load_tokenizer,
    load_weights,
    stub_checkpoint,
)
from meshd.pipeline.checkpoint import expected_tensors, preset_config, random_weights, write_safetensors

UP2 = "model.layers.2.mlp.up_proj.weight"


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny"
    init_checkpoint(path, "tiny", seed=5)
    return path


def test_round_trip_init_load_generate(tiny, tmp_path):
    config = LlamaConfig.load(tiny)
    assert config == preset_config("tiny")
    weights = load_weights(tiny, embed=True, head=True)
    want = random_weights(config, seed=5)
    assert weights.keys() == want.keys()
    for name, array in weights.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, want[name], err_msg=name)
    a = generate(tiny, "Once upon a time", 16)
    b = generate(tiny, "Once upon a time", 16)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 16
    assert a["finish_reason"] == "length" and a["timings"]["tokens_per_s"] > 0
    # the same seed writes the same bytes; another seed does not
    init_checkpoint(tmp_path / "again", "tiny", seed=5)
    init_checkpoint(tmp_path / "other", "tiny", seed=6)
    same = (tiny / "model.safetensors").read_bytes()
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == same
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != same


def test_init_refuses_non_empty_dir_without_force(tiny):
    with pytest.raises(CheckpointError, match="not empty"):
        init_checkpoint(tiny, "tiny", seed=1)
    init_checkpoint(tiny, "tiny", seed=1, force=True)
    np.testing.assert_array_equal(load_weights(tiny, embed=True)["model.embed_tokens.weight"],
                                  random_weights(preset_config("tiny"), 1)["model.embed_tokens.weight"])


def test_stage_reads_only_its_own_tensors(tiny):
    config = LlamaConfig.load(tiny)
    got = load_weights(tiny, range(1, 3))
    assert set(got) == {f"model.layers.{n}.{s}" for n in (1, 2) for s in [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight"]}
    # a checkpoint missing layer 2 still serves a stage of layers 0..1
    weights = random_weights(config, 5)
    del weights[UP2]
    write_safetensors(tiny / "model.safetensors", weights)
    first = StageModel.load(tiny, range(0, 2))
    assert first.has_embed and not first.has_head
    with pytest.raises(CheckpointError, match=UP2):
        StageModel.load(tiny, range(2, 4))


def test_missing_tensor_is_named_with_its_shape(tiny):
    weights = random_weights(LlamaConfig.load(tiny), 5)
    del weights[UP2]
    write_safetensors(tiny / "model.safetensors", weights)
    with pytest.raises(CheckpointError, match=rf"missing tensor {UP2} \(expected shape \(172, 64\)\)"):
        load_weights(tiny)


def test_wrong_shape_is_named(tiny):
    weights = random_weights(LlamaConfig.load(tiny), 5)
    weights["model.layers.1.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    write_safetensors(tiny / "model.safetensors", weights)
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.k_proj.weight has shape "
                                              r"\(64, 64\), expected \(32, 64\)"):
        load_weights(tiny)


def test_truncated_file_names_the_tensor(tiny):
    path = tiny / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"tensor \S+ lies outside the file"):
        load_weights(tiny, embed=True, head=True)


@pytest.mark.parametrize("garbage", [
    b"", b"abc", b"\xff" * 64, struct.pack("<Q", 20) + b"{not json at all}   ",
])
def test_corrupted_file_is_refused(tiny, garbage):
    (tiny / "model.safetensors").write_bytes(garbage)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_weights(tiny, range(0, 1))


def test_missing_weights_file(tiny):
    (tiny / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: no such file"):
        load_weights(tiny, range(0, 1))


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.05), ("float16", 2e-3)])
def test_half_precision_checkpoint_matches_float32(tmp_path, dtype, tol):
    init_checkpoint(tmp_path / "f32", "tiny", seed=2)
    init_checkpoint(tmp_path / "half", "tiny", seed=2, dtype=dtype)
    assert (tmp_path / "half" / "model.safetensors").stat().st_size < \
        0.6 * (tmp_path / "f32" / "model.safetensors").stat().st_size
    full, half = load_weights(tmp_path / "f32", embed=True, head=True), \
        load_weights(tmp_path / "half", embed=True, head=True)
    for name in full:
        assert half[name].dtype == np.float32
        np.testing.assert_allclose(half[name], full[name], rtol=2 ** -7, atol=1e-6, err_msg=name)
    ids = [256, *b"a bf16 test"]
    a, b = StageModel.load(tmp_path / "f32"), StageModel.load(tmp_path / "half")
    la = a.logits(a.forward(a.embed(ids), a.new_cache(16), 0))
    lb = b.logits(b.forward(b.embed(ids), b.new_cache(16), 0))
    assert lb.dtype == np.float32
    np.testing.assert_allclose(lb, la, atol=tol * np.abs(la).max())


def test_bf16_widening_is_exact():
    from meshd.pipeline.checkpoint import _to_bf16_bits

    values = np.array([1.0, -2.5, 0.15625, 3.0e38, -1e-30, 0.0], dtype=np.float32)
    bits = _to_bf16_bits(values)
    widened = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    # these all fit in bf16's 8 mantissa bits except -1e-30, which rounds to within 2**-8
    np.testing.assert_array_equal(widened[[0, 1, 2, 5]], values[[0, 1, 2, 5]])
    np.testing.assert_allclose(widened, values, rtol=2 ** -8)


def test_tied_head_reads_the_embedding(tmp_path):
    init_checkpoint(tmp_path, "tiny", seed=1, tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert "lm_head.weight" not in f.keys()
    last = StageModel.load(tmp_path, range(3, 4))
    assert last.has_head and not last.has_embed
    head = load_weights(tmp_path, range(3, 4), head=True)
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(head)
    assert len(generate(tmp_path, "tied", 4)["tokens"]) == 4


def test_sharded_checkpoint_through_the_index(tiny):
    weights = load_weights(tiny, embed=True, head=True)
    (tiny / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        write_safetensors(tiny / file, {n: weights[n] for n in part})
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
    again = load_weights(tiny, embed=True, head=True)
    for name in weights:
        np.testing.assert_array_equal(again[name], weights[name])


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.pop("hidden_size"), "hidden_size"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers"),
    (lambda c: c.update(eos_token_id=10_000), "eos_token_id"),
    (lambda c: c.update(rope_scaling={"type": "llama3"}), "rope_scaling"),
    (lambda c: c.update(rms_norm_eps="tiny"), "rms_norm_eps"),
])
def test_bad_config_names_the_field(tiny, edit, field):
    raw = json.loads((tiny / "config.json").read_text())
    edit(raw)
    (tiny / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"config field {field}"):
        LlamaConfig.load(tiny)


def test_config_not_json(tiny):
    (tiny / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LlamaConfig.load(tiny)


def test_expected_tensors_cover_the_hf_layout():
    config = preset_config("small")
    names = expected_tensors(config, range(6), embed=True, head=True)
    assert len(names) == 6 * 9 + 3
    assert names["lm_head.weight"] == (32000, 288)
    assert names["model.layers.5.self_attn.o_proj.weight"] == (288, 288)
    assert names["model.layers.0.mlp.down_proj.weight"] == (288, 768)


# --- tokenizer -----------------------------------------------------------------

def test_byte_tokenizer_round_trip(tiny):
    tok = load_tokenizer(tiny, 256, (257,))
    ids = tok.encode("héllo ✓")
    assert max(ids) < 256 and tok.decode(ids) == "héllo ✓"
    assert tok.decode([256, *ids, 257]) == "héllo ✓"


def test_byte_tokenizer_llama_layout(tmp_path):
    init_checkpoint(tmp_path, "small")
    tok = load_tokenizer(tmp_path, 1, (2,))
    assert tok.encode("A") == [3 + 65] and tok.decode([1, 68, 2, 5000]) == "A<5000>"


def test_hf_tokenizer_json_is_used(tiny):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(250)} | {"[UNK]": 250, "hello": 251, "world": 252}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tiny / "tokenizer.json"))
    loaded = load_tokenizer(tiny, 256, (257,))
    assert loaded.encode("hello world") == [251, 252]
    out = generate(tiny, "hello world", 5)
    # no post-processor adding BOS, no add_bos_token: the 2 words alone, as tokenizer(text) gives
    assert out["timings"]["prompt_tokens"] == 2


# --- CLI -------------------------------------------------------------------------

def test_cli_init_and_generate(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["model", "init", "--out", str(out), "--preset", "tiny", "--seed", "4"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["model", "init", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err and err.count("\n") == 1
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "6", "--json",
                 "--temperature", "0.8", "--top-k", "20", "--seed", "9"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["tokens"]) == 6 and result["timings"]["tokens_per_s"] > 0
    assert result["tokens"] == generate(out, "hi", 6, 0.8, 20, 9)["tokens"]


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/meshd", "--max-tokens", "3"], "no such directory"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--max-tokens", "3", "--temperature", "-1"], "--temperature"),
    (["--max-tokens", "300"], "exceeds the model's context"),
])
def test_cli_generate_bad_input(args, message, capsys):
    argv = ["generate", "--model", str(stub_checkpoint()), "--prompt", "x", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_generate_corrupted_checkpoint(tiny, capsys):
    path = tiny / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])
    assert main(["generate", "--model", str(tiny), "--prompt", "x", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "lies outside the file" in err and err.count("\n") == 1
