"""Hugging Face configs of the families meshd runs, the presets of their shapes, sharded
checkpoints, `meshd model inspect`, and load progress.  No transformers needed: the
comparison with it is tests/test_reference.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from meshd.pipeline.checkpoint import PRESETS, LoadProgress, init_checkpoint, load_weights
from meshd.pipeline.config import ConfigError, LlamaConfig, RopeScaling
from meshd.pipeline.generate import generate
from meshd.pipeline.inspection import InspectError, describe, render

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, bos_token_id=1, eos_token_id=2)
LLAMA3_SCALING = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


def test_llama3_rope_scaling_is_read_in_both_spellings():
    hub = LlamaConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING})
    saved = LlamaConfig.from_dict({**BASE, "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}})
    assert hub == saved
    assert hub.rope_theta == 500000.0
    assert hub.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    # "type" is the older key for "rope_type"; "default" is no scaling
    old = LlamaConfig.from_dict({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_scaling == RopeScaling("linear", 2.0)
    assert LlamaConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "default"}}).rope_scaling is None
    assert LlamaConfig.from_dict(hub.to_dict()) == hub


def test_qwen2_and_mistral_get_their_biases_and_windows():
    qwen = LlamaConfig.from_dict({**BASE, "model_type": "qwen2", "use_sliding_window": False,
                                  "sliding_window": 4096, "max_window_layers": 2})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None  # the window is off
    windowed = LlamaConfig.from_dict({**BASE, "model_type": "qwen2", "use_sliding_window": True,
                                      "sliding_window": 16, "max_window_layers": 2})
    assert [windowed.window(n) for n in range(4)] == [None, None, 16, 16]
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    typed = LlamaConfig.from_dict({**BASE, "model_type": "qwen2", "use_sliding_window": True,
                                   "sliding_window": 16, "layer_types": types})
    assert typed.sliding_layers == (0, 2)
    mistral = LlamaConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert [mistral.window(n) for n in range(4)] == [4096] * 4 and not mistral.qkv_bias
    for config in (windowed, typed, mistral):
        assert LlamaConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("fields, named", [
    ({"model_type": "gemma"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 0.5}}, "rope_scaling.high_freq_factor"),
    ({"rope_scaling": "llama3"}, "rope_scaling"),
    ({"rope_parameters": {"full_attention": {}, "sliding_attention": {}}}, "rope_parameters"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"attention_bias": "yes"}, "attention_bias"),
    ({"model_type": "mistral", "sliding_window": -3}, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["x"]},
     "layer_types"),
])
def test_a_config_meshd_cannot_run_is_refused_naming_the_field(fields, named):
    with pytest.raises(ConfigError, match=f"config field {named.replace('.', '[.]')}"):
        LlamaConfig.from_dict({**BASE, **fields})


def test_generation_configs_end_tokens_stop_generation_too(tmp_path):
    """Llama 3 instruct ends a turn with <|eot_id|>, listed in generation_config.json only."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert LlamaConfig.load(tmp_path).eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 999}))
    with pytest.raises(ConfigError, match="generation_config.json: field eos_token_id"):
        LlamaConfig.load(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ConfigError, match="generation_config.json: cannot read"):
        LlamaConfig.load(tmp_path)


@pytest.mark.parametrize("preset", ["llama3", "qwen2", "mistral", "smollm2", "tinyllama"])
def test_each_family_preset_writes_a_checkpoint_that_generates(tmp_path, preset):
    config = init_checkpoint(tmp_path, preset, seed=3)
    assert LlamaConfig.load(tmp_path) == config
    out = generate(tmp_path, "Once upon a time", 8)
    assert len(out["tokens"]) == 8 or out["finish_reason"] == "eos"


def test_a_sharded_bf16_checkpoint_reads_as_the_single_file_one(tmp_path):
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    init_checkpoint(one, "llama3", seed=1, dtype="bfloat16")
    init_checkpoint(sharded, "llama3", seed=1, dtype="bfloat16", shards=4)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)]
    assert not (sharded / "model.safetensors").exists()
    a, b = load_weights(one, embed=True, head=True), load_weights(sharded, embed=True, head=True)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    # rewritten as one file, the shards go: a stale index would win over model.safetensors
    init_checkpoint(sharded, "llama3", seed=1, force=True)
    assert not list(sharded.glob("model-*")) and not (sharded / "model.safetensors.index.json").exists()


def test_load_progress_counts_parts_and_bytes(tmp_path):
    init_checkpoint(tmp_path, "llama3", seed=0, shards=3)
    calls = []
    load_weights(tmp_path, range(2, 4), embed=True, head=True, progress=lambda *a: calls.append(a))
    # after the embedding, layers 2 and 3, and the head (its norm; the tied head is the embedding)
    assert [c[:2] for c in calls] == [(0, 2), (1, 2), (2, 2), (2, 2)]
    assert calls[-1][2] == calls[-1][3] > 0
    assert all(a[2] <= b[2] for a, b in zip(calls, calls[1:], strict=False))
    lines: list[str] = []
    report = LoadProgress("stage-1 (layers 2..3)", lines.append, after_s=0, every_s=0)
    load_weights(tmp_path, range(2, 4), progress=report)
    assert lines[-1].startswith("loading stage-1 (layers 2..3): 2 of 2 layers,") and "(done)" in lines[-1]
    quiet: list[str] = []
    load_weights(tmp_path, range(2, 4), progress=LoadProgress("x", quiet.append))  # well under a second
    assert quiet == []


def test_inspect_describes_the_split_a_run_would_load(tmp_path):
    init_checkpoint(tmp_path, "qwen2", seed=0, dtype="bfloat16", shards=2)
    report = describe(tmp_path, 3)
    assert report["architecture"] == "Qwen2ForCausalLM"
    assert report["config"]["biases"] == ["qkv"] and report["config"]["tied_embeddings"]
    assert report["stored"]["dtypes"] == {"BF16": report["stored"]["dtypes"]["BF16"]}
    assert len(report["stored"]["files"]) == 2
    stages = report["stages"]
    assert [s["layers"] for s in stages] == [[0, 1], [2, 3], [4, 5]]
    assert stages[0]["embedding"] and stages[2]["head"] and not stages[1]["head"]
    # the tied head reads the embedding again at the last stage
    assert sum(s["bytes_on_disk"] for s in stages) > report["stored"]["bytes"]
    assert all(s["bytes_in_memory"] == 2 * s["bytes_on_disk"] for s in stages)  # bf16 widened to float32
    assert report["tokenizer"]["kind"] == "byte spec"
    text = render(report)
    assert "Qwen2ForCausalLM" in text and "stage-2: layers 4..5 + head" in text and "biases: qkv" in text


def test_inspect_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(InspectError, match="no such directory"):
        describe(tmp_path / "absent")
    init_checkpoint(tmp_path, "tiny", seed=0)
    with pytest.raises(InspectError, match="--stages 9: cannot split 4 layers"):
        describe(tmp_path, 9)
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(InspectError, match="model.safetensors: not a safetensors file"):
        describe(tmp_path)


def test_the_model_cli_inits_inspects_and_refuses_cleanly(tmp_path):
    def meshd(*args):
        return subprocess.run([sys.executable, "-m", "meshd", *args], capture_output=True, text=True,
                              timeout=60)

    made = meshd("model", "init", "--out", str(tmp_path / "m"), "--preset", "llama3", "--dtype", "bfloat16",
                 "--shards", "3")
    assert made.returncode == 0, made.stderr
    assert "llama3" in made.stdout and "3 shards" in made.stdout
    shown = meshd("model", "inspect", str(tmp_path / "m"), "--stages", "3", "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["config"]["rope_scaling"]["rope_type"] == "llama3"
    assert len(report["stages"]) == 3
    bad = meshd("model", "inspect", str(tmp_path / "nothing"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "no such directory" in bad.stderr
    unknown = meshd("model", "init", "--out", str(tmp_path / "x"), "--preset", "gemma")
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr


def test_every_preset_is_a_valid_config():
    for name, fields in PRESETS.items():
        LlamaConfig(**fields)  # raises ConfigError naming the field if not
        assert name
