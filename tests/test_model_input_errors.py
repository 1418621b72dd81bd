"""Bad model input: a checkpoint's files (the shard index, safetensors headers, config.json,
the tokenizer files) and `meshd model init` / `meshd generate` options.  Each is refused in
one line naming the file and field, or the option, with exit 2: never a traceback, and never
a run that goes on producing garbage.  The readers raise only CheckpointError, ConfigError or
TokenizerError, whatever the bytes (fuzzed below)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli_errors import meshd, one_line

from meshd.cli import main
from meshd.pipeline.checkpoint import (
    INDEX_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    fingerprint,
    init_checkpoint,
    load_weights,
    random_weights,
    write_safetensors,
)
from meshd.pipeline.config import ConfigError, LlamaConfig
from meshd.pipeline.tokenizer import BYTE_SPEC_FILE, TokenizerError, load_tokenizer, tokenizer_config

# A checkpoint small enough to rewrite for every fuzzed example: one layer, dim 8.
MICRO = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, bos_token_id=1, eos_token_id=2)
NORM = "model.norm.weight"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("micro")
    init_checkpoint(path, "tiny", seed=1, **MICRO)
    return path


@pytest.fixture(scope="module")
def micro_sharded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("micro-sharded")
    init_checkpoint(path, "tiny", seed=1, shards=2, **MICRO)
    return path


@pytest.fixture
def ck(micro, tmp_path) -> Path:
    """A fresh copy of the micro checkpoint, for one test to break."""
    return Path(shutil.copytree(micro, tmp_path / "ck"))


@pytest.fixture
def sharded(micro_sharded, tmp_path) -> Path:
    return Path(shutil.copytree(micro_sharded, tmp_path / "sharded"))


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_index(model_dir: Path, edit) -> None:
    path = model_dir / INDEX_FILE
    index = json.loads(path.read_text())
    index = edit(index)
    path.write_text(json.dumps(index))


def load_all(model_dir: Path) -> dict[str, np.ndarray]:
    return load_weights(model_dir, embed=True, head=True)


# --- 1. the shard index and the safetensors header -------------------------------------

@pytest.mark.parametrize("weight_map", [[], "model-00001-of-00002.safetensors", 3, None, {}])
def test_a_weight_map_that_is_no_object_of_names_is_named(sharded, weight_map):
    edit_index(sharded, lambda index: {**index, "weight_map": weight_map})
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}: field weight_map: expected an object"):
        load_all(sharded)
    with pytest.raises(CheckpointError, match="field weight_map"):
        fingerprint(sharded)


@pytest.mark.parametrize("file", [3, None, "", "/etc/passwd", "../model-00001-of-00002.safetensors",
                                  "a/../../x.safetensors", "x\0y"])
def test_a_weight_map_entry_that_is_no_file_in_the_checkpoint_is_named(sharded, file):
    edit_index(sharded, lambda index: {**index, "weight_map": {**index["weight_map"], NORM: file}})
    with pytest.raises(CheckpointError, match=rf"field weight_map\['{NORM}'\]: expected the name of a file"):
        load_all(sharded)


@pytest.mark.parametrize("index,says", [([], "not a JSON object"), ({"metadata": {}}, "weight_map: missing")])
def test_an_index_of_the_wrong_shape_is_named(sharded, index, says):
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=says):
        load_all(sharded)


def test_a_tensor_the_weight_map_does_not_list_is_named_in_the_index(sharded):
    edit_index(sharded, lambda index: {**index, "weight_map": {
        k: v for k, v in index["weight_map"].items() if k != NORM}})
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: field weight_map: no file for tensor {NORM}"):
        load_all(sharded)


def test_generate_on_a_bad_index_is_one_line_and_exit_2(sharded, capsys):
    edit_index(sharded, lambda index: {**index, "weight_map": []})
    assert main(["generate", "--model", str(sharded), "--prompt", "x", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and INDEX_FILE in err and "weight_map" in err, err


def test_a_node_on_a_bad_index_is_one_line_and_exit_2(sharded, tmp_path):
    edit_index(sharded, lambda index: {**index, "weight_map": []})
    r = meshd("run", "--stage", "0", "--stages", "1", "--profile", "local", "--dashboard", "off",
              "--model", str(sharded), env={"XDG_CACHE_HOME": str(tmp_path)})
    line = one_line(r.stderr)
    assert r.returncode == 2 and INDEX_FILE in line and "weight_map" in line, r.stderr


@pytest.mark.parametrize("field,value,says", [
    ("dtype", 5, "field dtype"),
    ("dtype", None, "field dtype"),
    ("shape", "ab", "field shape"),
    ("shape", [-1, -8], "field shape"),
    ("shape", [8.0], "field shape"),
    ("shape", [True] * 8, "field shape"),
    ("data_offsets", "ab", "field data_offsets"),
    ("data_offsets", [0.0, 32.0], "field data_offsets"),
    ("data_offsets", [0, 32, 64], "field data_offsets"),
    ("data_offsets", [-32, 0], "field data_offsets"),
    ("data_offsets", [32, 0], "field data_offsets: start 32 is past end 0"),
    ("data_offsets", None, "field data_offsets"),
])
def test_a_header_field_of_the_wrong_type_or_range_is_named(ck, field, value, says):
    path = ck / WEIGHTS_FILE
    header, data = read_header(path)
    header[NORM][field] = value
    write_header(path, header, data)
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS_FILE}: safetensors header, tensor {NORM}: {says}"):
        load_all(ck)


@pytest.mark.parametrize("entry", [[], "F32", 3])
def test_a_header_entry_that_is_no_object_is_named(ck, entry):
    path = ck / WEIGHTS_FILE
    header, data = read_header(path)
    header[NORM] = entry
    write_header(path, header, data)
    with pytest.raises(CheckpointError, match=f"tensor {NORM}: expected an object"):
        load_all(ck)


def test_metadata_that_is_not_strings_is_named(ck):
    path = ck / WEIGHTS_FILE
    header, data = read_header(path)
    header["__metadata__"] = {"format": 1}
    write_header(path, header, data)
    with pytest.raises(CheckpointError, match="field __metadata__"):
        load_all(ck)


def test_a_dtype_meshd_cannot_read_is_refused_before_any_read(ck):
    path = ck / WEIGHTS_FILE
    header, data = read_header(path)
    header[NORM]["dtype"] = "I32"  # 4 bytes each, as F32: the sizes still agree
    write_header(path, header, data)
    with pytest.raises(CheckpointError, match=f"tensor {NORM} has dtype I32; expected F32, F16, BF16"):
        load_all(ck)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_holding_nan_or_infinity_are_refused_naming_the_tensor(tmp_path, dtype):
    init_checkpoint(tmp_path, "tiny", seed=1, **MICRO)
    config = LlamaConfig.load(tmp_path)
    weights = random_weights(config, 1)
    weights["model.layers.0.mlp.up_proj.weight"][3, 2] = np.nan
    write_safetensors(tmp_path / WEIGHTS_FILE, weights, dtype)
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight holds NaN"):
        load_all(tmp_path)


# --- 2. model init and generate: seeds and shards ---------------------------------------

@pytest.mark.parametrize("args,option", [
    (["--seed", "-1"], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--shards", "0"], "--shards"),
    (["--shards", "-2"], "--shards"),
])
def test_model_init_refuses_a_bad_seed_or_shard_count_naming_the_option(tmp_path, capsys, args, option):
    with pytest.raises(SystemExit) as exit:
        main(["model", "init", "--out", str(tmp_path / "m"), *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"argument {option}" in err and "Traceback" not in err, err
    assert not (tmp_path / "m").exists()


def test_model_init_refuses_more_shards_than_tensors_naming_the_option(tmp_path, capsys):
    assert main(["model", "init", "--out", str(tmp_path / "m"), "--shards", "999"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--shards 999" in err and "at most 39 shards" in err, err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("seed", ["-1", str(2**63), "9" * 400])
def test_generate_refuses_a_seed_out_of_range_naming_the_option(micro, capsys, seed):
    argv = ["generate", "--model", str(micro), "--prompt", "x", "--max-tokens", "2", "--seed", seed]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed must be from 0 to" in err, err


# --- 3. config.json fields --------------------------------------------------------------

@pytest.mark.parametrize("fields,named", [
    ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rms_norm_eps": 2.0}, "rms_norm_eps"),
    ({"rms_norm_eps": True}, "rms_norm_eps"),
    ({"rope_theta": math.inf}, "rope_theta"),
    ({"rope_theta": -math.inf}, "rope_theta"),
    ({"rope_theta": math.nan}, "rope_theta"),
    ({"rope_theta": 10**400}, "rope_theta"),  # an integer no float holds
    ({"rope_theta": 0.5}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.inf}}, "rope_theta"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_attention_heads": 5}, "hidden_size"),
    ({"head_dim": 0}, "head_dim"),
    ({"head_dim": 7}, "head_dim"),
    ({"head_dim": False}, "head_dim"),
    ({"rope_scaling": {"rope_type": "linear", "factor": math.nan}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": math.inf}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": math.nan,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": math.inf, "original_max_position_embeddings": 8192}},
     "rope_scaling.high_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.5}},
     "rope_scaling.original_max_position_embeddings"),
])
def test_a_config_number_out_of_its_range_is_refused_naming_the_field(fields, named):
    with pytest.raises(ConfigError, match=f"config field {named.replace('.', '[.]')}"):
        LlamaConfig.from_dict({**BASE, **fields})


def test_a_null_kv_head_count_or_head_dim_still_means_the_default():
    config = LlamaConfig.from_dict({**BASE, "num_key_value_heads": None, "head_dim": None})
    assert config.num_key_value_heads == 4 and config.head_dim == 16


@pytest.mark.parametrize("field,value", [("rms_norm_eps", "NaN"), ("rope_theta", "Infinity"),
                                         ("rope_theta", "1e400")])
def test_generate_on_a_non_finite_config_number_is_one_line_and_exit_2(ck, capsys, field, value):
    text = (ck / "config.json").read_text()
    raw = json.loads(text)
    text = text.replace(f'"{field}": {json.dumps(raw[field])}', f'"{field}": {value}')
    assert value in text
    (ck / "config.json").write_text(text)
    assert main(["generate", "--model", str(ck), "--prompt", "hi", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"config.json: config field {field}" in err, err


def test_a_config_integer_too_long_to_read_is_a_config_error(ck):
    text = (ck / "config.json").read_text().replace('"vocab_size": 258', '"vocab_size": ' + "9" * 5000)
    (ck / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        LlamaConfig.load(ck)


# --- 4. generate's sampling options: the HTTP API's bounds -------------------------------

BAD_OPTIONS = [
    ("--temperature", "inf"), ("--temperature", "nan"), ("--temperature", "-inf"), ("--temperature", "10.5"),
    ("--temperature", "-1"), ("--top-p", "nan"), ("--top-p", "inf"), ("--top-p", "0"), ("--top-p", "1.5"),
    ("--top-k", "-1"), ("--top-k", str((1 << 20) + 1)), ("--max-tokens", "0"), ("--max-tokens", "4097"),
]


@pytest.mark.parametrize("option,value", BAD_OPTIONS)
def test_generate_refuses_what_the_api_refuses_naming_the_option(micro, capsys, option, value):
    args = {"--max-tokens": "2", option: value}
    argv = ["generate", "--model", str(micro), "--prompt", "x", *[f"{k}={v}" for k, v in args.items()]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"meshd: error: generate: {option} " in err, err


def _namespace(**kw) -> argparse.Namespace:
    base = dict(max_tokens=2, temperature=0.0, top_k=0, top_p=1.0, seed=0, prompt="x")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("field,value", [
    ("temperature", 10.0), ("temperature", 10.000001), ("temperature", math.inf), ("temperature", 0.0),
    ("top_p", 1.0), ("top_p", 1e-9), ("top_p", 0.0), ("top_k", 1 << 20), ("top_k", (1 << 20) + 1),
    ("top_k", -1), ("max_tokens", 4096), ("max_tokens", 4097), ("max_tokens", 1), ("max_tokens", 0),
    ("seed", 2**63 - 1), ("seed", 2**63), ("seed", -1),
])
def test_generate_and_the_http_api_agree_on_every_bound(field, value):
    generation = pytest.importorskip("dashboard.generation")
    from dashboard.requests import BadRequest
    from meshd.pipeline.cli import check_generate_options

    try:
        generation.sampling({field: value})
        api_ok = True
    except BadRequest:
        api_ok = False
    assert (check_generate_options(_namespace(**{field: value})) is None) == api_ok


# --- 5. a prompt that is not UTF-8 ------------------------------------------------------

@pytest.mark.parametrize("prompt,byte", [("a\udcff\udcfeb", 1), ("é\udcff", 2), ("\udc80", 0)])
def test_a_prompt_of_non_utf8_bytes_names_the_option_and_the_byte(micro, capsys, prompt, byte):
    assert main(["generate", "--model", str(micro), "--prompt", prompt, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"meshd: error: generate: --prompt is not valid UTF-8 (byte {byte})\n", err


# --- the readers under fuzz: only their own errors, whatever the bytes --------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


def _in_copy(source: Path, check) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        check(Path(shutil.copytree(source, Path(tmp) / "ck")))


def _loads_or_refuses(model_dir: Path) -> None:
    try:
        load_all(model_dir)
    except CheckpointError:
        pass
    try:
        fingerprint(model_dir)
    except CheckpointError:
        pass


@FUZZ
@given(cut=st.integers(min_value=0, max_value=4096),
       flips=st.lists(st.tuples(st.integers(min_value=0, max_value=1 << 16), st.integers(1, 255)),
                      max_size=6))
def test_fuzz_a_cut_or_flipped_safetensors_file_is_a_checkpoint_error(micro, cut, flips):
    def check(model_dir: Path) -> None:
        path = model_dir / WEIGHTS_FILE
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        for pos, xor in flips:  # mostly in the header, where the structure is
            data[pos % (n + 8 + 64)] ^= xor
        if cut:
            del data[len(data) - cut:]
        path.write_bytes(bytes(data))
        _loads_or_refuses(model_dir)

    _in_copy(micro, check)


@FUZZ
@given(data=st.data(), field=st.sampled_from(["dtype", "shape", "data_offsets", None, "__metadata__"]),
       value=json_values)
def test_fuzz_a_header_of_wrong_json_types_is_a_checkpoint_error(micro, data, field, value):
    def check(model_dir: Path) -> None:
        path = model_dir / WEIGHTS_FILE
        header, blob = read_header(path)
        if field == "__metadata__":
            header["__metadata__"] = value
        else:
            name = data.draw(st.sampled_from(sorted(n for n in header if n != "__metadata__")))
            if field is None:
                header[name] = value
            else:
                header[name][field] = value
        write_header(path, header, blob)
        _loads_or_refuses(model_dir)

    _in_copy(micro, check)


@FUZZ
@given(data=st.data(), where=st.sampled_from(["index", "weight_map", "entry", "bytes"]), value=json_values)
def test_fuzz_an_index_of_wrong_json_types_is_a_checkpoint_error(micro_sharded, data, where, value):
    def check(model_dir: Path) -> None:
        path = model_dir / INDEX_FILE
        index = json.loads(path.read_text())
        if where == "index":
            index = value
        elif where == "weight_map":
            index["weight_map"] = value
        elif where == "entry":
            index["weight_map"][data.draw(st.sampled_from(sorted(index["weight_map"])))] = value
        if where == "bytes":
            path.write_bytes(data.draw(st.binary(max_size=64)))
        else:
            path.write_text(json.dumps(index))
        _loads_or_refuses(model_dir)

    _in_copy(micro_sharded, check)


CONFIG_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta",
                 "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "head_dim",
                 "model_type", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "hidden_act",
                 "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                 "quantization_config"]


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(CONFIG_FIELDS), json_values, min_size=1, max_size=3),
       model_type=st.sampled_from(["llama", "qwen2", "mistral"]))
def test_fuzz_a_config_of_wrong_json_types_is_a_config_error(fields, model_type):
    try:
        config = LlamaConfig.from_dict({**BASE, "model_type": model_type, **fields})
    except ConfigError:
        return
    # what is accepted is runnable: finite numbers in range
    assert math.isfinite(config.rms_norm_eps) and 0 < config.rms_norm_eps < 1
    assert math.isfinite(config.rope_theta) and config.rope_theta > 1
    assert config.num_attention_heads % config.num_key_value_heads == 0 and config.head_dim % 2 == 0


@FUZZ
@given(text=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()),
       file=st.sampled_from(["config.json", "generation_config.json"]))
def test_fuzz_a_config_file_of_any_bytes_is_a_config_error(micro, text, file):
    def check(model_dir: Path) -> None:
        (model_dir / file).write_bytes(text)
        try:
            LlamaConfig.load(model_dir)
        except ConfigError:
            pass

    _in_copy(micro, check)


@FUZZ
@given(spec=json_values | st.dictionaries(st.sampled_from(["type", "offset", "bos_token_id", "eos_token_id"]),
                                          json_values | st.just("byte"), max_size=4),
       raw=st.none() | st.binary(max_size=32))
def test_fuzz_a_tokenizer_file_of_any_shape_is_a_tokenizer_error(tmp_path_factory, spec, raw):
    model_dir = tmp_path_factory.mktemp("tok")
    (model_dir / BYTE_SPEC_FILE).write_bytes(raw if raw is not None else json.dumps(spec).encode())
    try:
        tok = load_tokenizer(model_dir, 256, (257,))
    except TokenizerError:
        pass
    else:  # what loads gives token ids
        ids = tok.encode_prompt("hé")
        assert all(type(t) is int and t >= 0 for t in ids) and isinstance(tok.decode(ids), str)
    (model_dir / "tokenizer_config.json").write_bytes(raw if raw is not None else json.dumps(spec).encode())
    try:
        tokenizer_config(model_dir)
    except TokenizerError:
        pass
