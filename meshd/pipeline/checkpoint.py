"""Weights in the Hugging Face layout: read one stage's share, or write a random checkpoint.

A stage reads only the tensors its layer range needs (``safe_open`` reads
single tensors).  numpy has no bfloat16: such tensors are read as raw bytes
and widened (uint16 -> uint32 << 16 -> float32), which is exact.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

import numpy as np

from .config import ConfigError, LlamaConfig, RopeScaling
from .tokenizer import ByteTokenizer, write_byte_tokenizer_spec


class CheckpointError(Exception):
    """A checkpoint we cannot load; the message names the file or the tensor."""


WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> numpy dtype, for the ones numpy reads directly.
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
_READABLE = "F32, F16, BF16 or F64"

SHARD_FILE = "model-{:05d}-of-{:05d}.safetensors"


def layer_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer tensor suffix -> shape; Hugging Face Linear weights are (out, in)."""
    d, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    out = {
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (i, d),
        "mlp.up_proj.weight": (i, d),
        "mlp.down_proj.weight": (d, i),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    if config.qkv_bias:
        out |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if config.o_bias:
        out["self_attn.o_proj.bias"] = (d,)
    if config.mlp_bias:
        out |= {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (d,)}
    return out


def expected_tensors(config: LlamaConfig, layers: Iterable[int], *, embed: bool,
                     head: bool) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a stage with these parts needs."""
    out: dict[str, tuple[int, ...]] = {}
    vd = (config.vocab_size, config.hidden_size)
    if embed:
        out["model.embed_tokens.weight"] = vd
    shapes = layer_shapes(config)
    for n in layers:
        if not 0 <= n < config.num_hidden_layers:
            raise ValueError(f"layer {n} is outside 0..{config.num_hidden_layers - 1}")
        for suffix, shape in shapes.items():
            out[f"model.layers.{n}.{suffix}"] = shape
    if head:
        out["model.norm.weight"] = (config.hidden_size,)
        out["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"] = vd
    return out


def _brief(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error line stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_count(value: object) -> bool:
    """A JSON non-negative integer (not a bool, not a float)."""
    return type(value) is int and value >= 0


def _header_entry(path: Path, name: str, info: object,
                  data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor's header entry, every field checked: (dtype, shape, start, end)."""
    where = f"{path}: safetensors header, tensor {name}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: expected an object with dtype, shape and data_offsets, "
                              f"got {_brief(info)}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        raise CheckpointError(f"{where}: field dtype: expected a string such as F32, got {_brief(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: field shape: expected a list of non-negative integers, "
                              f"got {_brief(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{where}: field data_offsets: expected [start, end], two non-negative "
                              f"integers, got {_brief(offsets)}")
    start, end = offsets
    if start > end:
        raise CheckpointError(f"{where}: field data_offsets: start {start} is past end {end}")
    if end > data_len:
        raise CheckpointError(f"{path}: tensor {name} lies outside the file "
                              f"(bytes {start}..{end} of {data_len}; truncated?)")
    dims = tuple(shape)
    if dtype in _ITEMSIZE and end - start != math.prod(dims) * _ITEMSIZE[dtype]:
        raise CheckpointError(f"{path}: tensor {name}: {end - start} bytes do not hold "
                              f"{dtype} of shape {dims}")
    return dtype, dims, start, end


class _SafetensorsFile:
    """One .safetensors file: its header, parsed and checked, and single-tensor reads."""

    def __init__(self, path: Path):
        self.path = path
        try:
            info = path.stat()
            if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
                raise CheckpointError(f"{path}: not a regular file (a pipe or a device)")
            size = info.st_size
            with path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, 100 << 20):
                    raise CheckpointError(f"{path}: not a safetensors file (header length {n} "
                                          f"does not fit a {size}-byte file)")
                raw = f.read(n)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such file") from None
        except (OSError, ValueError) as exc:  # ValueError: a path with a NUL byte
            raise CheckpointError(f"{path}: cannot read: {exc}") from exc
        if len(raw) != n:
            raise CheckpointError(f"{path}: not a safetensors file (header cut short)")
        try:
            header = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointError(f"{path}: corrupted safetensors header: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (isinstance(metadata, dict) and all(
                isinstance(v, str) for v in metadata.values())):
            raise CheckpointError(f"{path}: safetensors header field __metadata__: expected an object of "
                                  f"strings, got {_brief(metadata)}")
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self.entries[name] = _header_entry(path, name, info, data_len)

    def nbytes(self, name: str) -> int:
        """The tensor's size on disk."""
        _, _, start, end = self.entries[name]
        return end - start

    def read(self, name: str) -> np.ndarray:
        """The tensor as C-contiguous float32; NaN or infinity in it is refused, naming it."""
        array = self._read(name)
        # One pass, no copy: a sum in float64 of float32 values is finite exactly when each is
        # (it cannot overflow), so a flipped exponent bit is caught here, not as NaN logits.
        if not math.isfinite(float(array.sum(dtype=np.float64))):
            raise CheckpointError(f"{self.path}: tensor {name} holds NaN or infinite values "
                                  f"(a corrupted file?)")
        return array

    def _read(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self.entries[name]
        if dtype == "BF16":
            try:
                with self.path.open("rb") as f:
                    f.seek(self.data_start + start)
                    raw = f.read(end - start)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: cannot read tensor {name}: {exc}") from exc
            if len(raw) != end - start:
                raise CheckpointError(f"{self.path}: tensor {name} is truncated")
            widened = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)
            return widened.view(np.float32).reshape(shape)
        if dtype not in _NUMPY_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {dtype}; expected {_READABLE}")
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="np") as f:
                array = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own SafetensorError and OSError
            raise CheckpointError(f"{self.path}: cannot read tensor {name}: {exc}") from exc
        try:
            return np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
        except ValueError as exc:  # the library's idea of the tensor is not the header's
            raise CheckpointError(f"{self.path}: cannot read tensor {name}: {exc}") from exc


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it (one file, or shards listed in an index); {} for one file.

    The index is checked: a JSON object whose ``weight_map`` maps each tensor name to the
    name of a file inside ``model_dir``."""
    index = model_dir / INDEX_FILE
    if (model_dir / WEIGHTS_FILE).exists() or not index.exists():
        return {}
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8
        raise CheckpointError(f"{index}: cannot read the shard index: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{index}: the shard index is not a JSON object")
    if "weight_map" not in raw:
        raise CheckpointError(f"{index}: field weight_map: missing")
    weight_map = raw["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: field weight_map: expected an object of tensor name -> file "
                              f"name, got {_brief(weight_map)}")
    out: dict[str, Path] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _inside(file):
            raise CheckpointError(f"{index}: field weight_map[{name!r}]: expected the name of a file in "
                                  f"{model_dir}, got {_brief(file)}")
        out[name] = model_dir / file
    return out


def _inside(file: str) -> bool:
    """A relative path that stays in its directory: not empty, no root, no "..", no NUL or backslash."""
    path = PurePosixPath(file)
    return (bool(path.parts) and not path.is_absolute() and ".." not in path.parts
            and "\0" not in file and "\\" not in file)


Progress = Callable[[int, int, int, int], None]  # (layers read, layers, bytes read, bytes)


def load_weights(model_dir: str | Path, layers: Iterable[int] | None = None, *, embed: bool = False,
                 head: bool = False, config: LlamaConfig | None = None,
                 progress: Progress | None = None) -> dict[str, np.ndarray]:
    """Read only the tensors for ``layers`` (plus embedding / final norm and head), as float32.

    Returns Hugging Face name -> array.  With a tied head, ``head=True`` reads
    ``model.embed_tokens.weight`` (the head is the embedding).  ``progress``
    is called after each part (the embedding, a layer, the head) with the
    layers and bytes read so far and in all.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: no such directory")
    if config is None:
        config = LlamaConfig.load(model_dir)
    layers = range(config.num_hidden_layers) if layers is None else layers
    wanted = expected_tensors(config, layers, embed=embed, head=head)
    where = _headers(model_dir, wanted)  # every header first: a missing tensor fails before any read
    parts = [_part(name) for name in wanted]
    total_layers = len({p for p in parts if p is not None})
    total_bytes = sum(st.nbytes(name) for name, st in where.items())
    out: dict[str, np.ndarray] = {}
    done_layers = done_bytes = 0
    for k, (name, st) in enumerate(where.items()):
        out[name] = st.read(name)
        done_bytes += st.nbytes(name)
        if progress is not None and (k + 1 == len(parts) or parts[k + 1] != parts[k]):
            done_layers += parts[k] is not None
            progress(done_layers, total_layers, done_bytes, total_bytes)
    return out


def check_headers(model_dir: str | Path, config: LlamaConfig) -> None:
    """Every tensor the model needs, checked in the safetensors headers alone (no weight is
    read): present, of the shape config.json implies and of a dtype meshd reads.  Raises
    CheckpointError naming the file and the tensor, as :func:`load_weights` would."""
    every = expected_tensors(config, range(config.num_hidden_layers), embed=True, head=True)
    _headers(Path(model_dir), every)


def _headers(model_dir: Path, wanted: dict[str, tuple[int, ...]]) -> dict[str, _SafetensorsFile]:
    """Name -> the file holding it, for each wanted tensor, its header entry checked."""
    shard_of = _tensor_files(model_dir)
    files: dict[Path, _SafetensorsFile] = {}
    where: dict[str, _SafetensorsFile] = {}
    for name, shape in wanted.items():
        if shard_of and name not in shard_of:
            raise CheckpointError(f"{model_dir / INDEX_FILE}: field weight_map: no file for tensor {name}")
        path = shard_of.get(name, model_dir / WEIGHTS_FILE)
        if path not in files:
            files[path] = _SafetensorsFile(path)
        st = files[path]
        if name not in st.entries:
            raise CheckpointError(f"{path}: missing tensor {name} (expected shape {shape})")
        dtype, found = st.entries[name][:2]
        if found != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {found}, expected {shape}")
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}; expected {_READABLE}")
        where[name] = st
    return where


def _part(name: str) -> int | None:
    """The layer a tensor belongs to; None for the embedding and the head."""
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


class LoadProgress:
    """Reports a load that takes longer than ``after_s``: at most every ``every_s``, and once
    done, as "3 of 8 layers, 41.2 of 110.0 MB read, 1.4 s"."""

    def __init__(self, what: str, report: Callable[[str], None], *, after_s: float = 1.0,
                 every_s: float = 1.0) -> None:
        self.what, self.report = what, report
        self.after_s, self.every_s = after_s, every_s
        self.started = time.monotonic()
        self.last = self.started

    def __call__(self, layers: int, total_layers: int, read: int, total: int) -> None:
        now = time.monotonic()
        done = read == total
        if now - self.started < self.after_s or (now - self.last < self.every_s and not done):
            return
        self.last = now
        self.report(f"loading {self.what}: {layers} of {total_layers} layers, {read / 1e6:.1f} of "
                    f"{total / 1e6:.1f} MB read, {now - self.started:.1f} s{' (done)' if done else ''}")


# --- writing ----------------------------------------------------------------

PRESETS: dict[str, dict] = {
    # For tests: byte vocabulary (0..255) plus BOS 256 and EOS 257.
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=258, max_position_embeddings=256,
                 rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=256, eos_token_ids=(257,)),
    # stories15M's shapes.  Llama's vocabulary layout: 1 = BOS, 2 = EOS, bytes at 3..258.
    # Untied head: with random weights a tied head mostly echoes the input token.
    "small": dict(hidden_size=288, intermediate_size=768, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=6, vocab_size=32000, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,)),
    # Deep and narrow, for wide meshes: 16 layers, so up to 16 stages, each cheap to run.
    "deep": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=16, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32000, max_position_embeddings=256,
                 rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,)),
    # The families' shapes at small sizes: what each architecture adds, on a byte vocabulary
    # (0..255, BOS 256, EOS 257) padded to 512 ids.
    # Llama 3.2: rope_scaling of type llama3, rope_theta 500000, tied embeddings, 4 query heads per kv head.
    "llama3": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                   rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=256, eos_token_ids=(257,),
                   rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    # Qwen2.5: biases on q, k and v, tied embeddings, rope_theta 1e6.
    "qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, qkv_bias=True,
                  bos_token_id=256, eos_token_ids=(257,)),
    # Mistral: a sliding attention window in every layer, 16 positions here.
    "mistral": dict(model_type="mistral", hidden_size=128, intermediate_size=384, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=1, vocab_size=512, max_position_embeddings=512,
                    rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=16, bos_token_id=256,
                    eos_token_ids=(257,)),
    # SmolLM2-135M's proportions: 3 query heads per kv head, tied, rope_theta 1e5.
    "smollm2": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=256, eos_token_ids=(257,)),
    # TinyLlama-1.1B's: 8 query heads per kv head, Llama 2's vocabulary layout, untied.
    "tinyllama": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=1, vocab_size=32000, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,)),
}
_BYTE_OFFSET = {"tiny": 0, "small": 3, "deep": 3, "tinyllama": 3}


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random float32 weights: matrices normal(0, 0.02), the embedding normal(0, 0.3), norms 1,
    biases normal(0, 0.1).

    With the embedding at 0.02 too, the (near-uniform) attention average
    drowns the current token and greedy decoding repeats one token; at 0.3
    the stories15M-shaped model gives 64 distinct tokens in 64.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    all_tensors = expected_tensors(config, range(config.num_hidden_layers), embed=True, head=True)
    for name, shape in all_tensors.items():  # insertion order is fixed, so the seed fixes every byte
        if name.endswith(".bias"):
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
        elif len(shape) == 1:
            out[name] = np.ones(shape, dtype=np.float32)
        else:
            std = np.float32(0.3 if name == "model.embed_tokens.weight" else 0.02)
            out[name] = rng.standard_normal(shape, dtype=np.float32) * std
    return out


def _to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write float tensors as F32, F16 or BF16 (numpy cannot hold BF16, so we write the format)."""
    code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        array = tensors[name]
        if dtype == "bfloat16":
            data = _to_bf16_bits(array).astype("<u2").tobytes()
        else:
            data = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)


def preset_config(preset: str, **overrides) -> LlamaConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    try:
        return LlamaConfig(**{**PRESETS[preset], **overrides})
    except TypeError as exc:
        raise ValueError(f"bad override: {exc}") from None


def preset_tokenizer(preset: str) -> ByteTokenizer:
    """The tokenizer ``init_checkpoint`` writes for ``preset``, without writing it: a run can
    check its prompts against a checkpoint it has not made yet."""
    config = preset_config(preset)
    return ByteTokenizer(_BYTE_OFFSET.get(preset, 0), config.bos_token_id, config.eos_token_ids[:1])


def write_shards(out: Path, tensors: dict[str, np.ndarray], shards: int, dtype: str = "float32") -> None:
    """Write ``tensors`` as ``shards`` files of near-equal size, in order, and the index that
    maps each name to its file (Hugging Face's ``save_pretrained(max_shard_size=...)`` layout)."""
    names = list(tensors)
    if not 1 <= shards <= len(names):
        raise CheckpointError(f"cannot write {len(names)} tensors as {shards} shards")
    itemsize = _ITEMSIZE[{"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]]
    sizes = [tensors[n].size * itemsize for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    running = g = 0
    for k, (name, size) in enumerate(zip(names, sizes, strict=True)):
        # a shard per 1/shards of the bytes, one after the other, and never an empty one
        g = max(min(running * shards // max(total, 1), g + 1, shards - 1), shards - (len(names) - k))
        groups[g].append(name)
        running += size
    weight_map: dict[str, str] = {}
    for g, group in enumerate(groups):
        file = SHARD_FILE.format(g + 1, shards)
        write_safetensors(out / file, {n: tensors[n] for n in group}, dtype)
        weight_map |= {n: file for n in group}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def init_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, *, dtype: str = "float32",
                    force: bool = False, shards: int = 1, **overrides) -> LlamaConfig:
    """Write config.json, the weights and a byte tokenizer spec with seeded random weights.

    The weights go in model.safetensors, or ``shards`` files and their index.
    ``overrides`` replace preset fields (e.g. ``tie_word_embeddings=True``).
    Refuses a non-empty ``out_dir`` unless ``force``.
    """
    config = preset_config(preset, **overrides)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CheckpointError(f"{out}: directory is not empty (use --force to overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    for old in [out / WEIGHTS_FILE, out / INDEX_FILE, *out.glob(SHARD_FILE.replace("{:05d}", "*"))]:
        old.unlink(missing_ok=True)
    if shards > 1:
        write_shards(out, weights, shards, dtype)
    else:
        write_safetensors(out / WEIGHTS_FILE, weights, dtype)
    config_json = {**config.to_dict(), "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer.json").unlink(missing_ok=True)
    write_byte_tokenizer_spec(out, offset=_BYTE_OFFSET.get(preset, 0), bos_token_id=config.bos_token_id,
                              eos_token_id=config.eos_token_ids[0])
    return config


def checkpoint_params(config: LlamaConfig) -> int:
    tensors = expected_tensors(config, range(config.num_hidden_layers), embed=True, head=True)
    return sum(int(np.prod(s)) for s in tensors.values())


__all__ = ["CheckpointError", "ConfigError", "init_checkpoint", "load_weights", "expected_tensors",
           "random_weights", "write_safetensors", "PRESETS",
           "preset_tokenizer"]


FINGERPRINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "chat_template.jinja")


def fingerprint(model_dir: str | Path) -> str:
    """16 hex digits that name a checkpoint's content: its config, tokenizer and every weight
    file, read in full.  Nodes gossip it, so a replica holding other weights is refused;
    two copies of one checkpoint in different places have the same fingerprint."""
    import hashlib

    root = Path(model_dir)
    digest = hashlib.sha256()
    files = [root / n for n in FINGERPRINT_FILES if (root / n).is_file()]
    single = root / WEIGHTS_FILE
    weights = [single] if single.is_file() else sorted(set(_tensor_files(root).values()))
    files += [p for p in weights if p.is_file()]
    for path in files:
        digest.update(path.name.encode() + b"\0")
        try:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return digest.hexdigest()[:16]
