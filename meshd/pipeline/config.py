"""The model's shape, read from a Hugging Face ``config.json``.

One decoder serves the Llama family and the ones shaped like it: Llama 2, 3,
3.1 and 3.2 (``rope_scaling`` of type ``llama3``), Mistral (a sliding
attention window), Qwen2 and 2.5 (biases on q, k and v), and the small
Llama-shaped models (SmolLM2, TinyLlama).  A field this decoder does not
implement is refused, naming the field: a config read half-way would run
and print plausible nonsense.

Both spellings Hugging Face writes are read: ``rope_theta`` and
``rope_scaling`` at the top level (the checkpoints on the Hub), and
``rope_parameters`` (what transformers 5 saves).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json we cannot run; the message names the field."""


MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("linear", "llama3")
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How positions are stretched past the trained context.

    ``linear``: every frequency divided by ``factor``.  ``llama3``: low
    frequencies (wavelength above ``original_max_position_embeddings /
    low_freq_factor``) divided by ``factor``, high ones kept, the band
    between blended smoothly (Llama 3.1 and 3.2).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, raw: Any, field: str) -> RopeScaling | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"config field {field}: expected an object, got {_brief(raw)}")
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"config field {field}.rope_type: {_brief(rope_type)} is not supported "
                              f"(supported: default, {', '.join(ROPE_TYPES)})")
        factor = _number(raw.get("factor"))
        if factor is None or factor < 1:
            raise ConfigError(f"config field {field}.factor: expected a finite number of at least 1 "
                              f"(positions are stretched, never squeezed), got {_brief(raw.get('factor'))}")
        if rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                value = _number(raw.get(name))
                if value is None or value <= 0:
                    raise ConfigError(f"config field {field}.{name}: expected a finite number above 0, "
                                      f"got {_brief(raw.get(name))}")
            if not _positive_int(raw.get("original_max_position_embeddings")):
                got = _brief(raw.get("original_max_position_embeddings"))
                raise ConfigError(f"config field {field}.original_max_position_embeddings: expected a "
                                  f"positive integer, got {got}")
        if rope_type == "linear":
            return cls("linear", float(raw["factor"]))
        if raw["high_freq_factor"] <= raw["low_freq_factor"]:
            raise ConfigError(f"config field {field}.high_freq_factor: {_brief(raw['high_freq_factor'])} "
                              f"must be above low_freq_factor {_brief(raw['low_freq_factor'])}")
        return cls("llama3", float(raw["factor"]), float(raw["low_freq_factor"]),
                   float(raw["high_freq_factor"]), int(raw["original_max_position_embeddings"]))

    def to_dict(self) -> dict[str, Any]:
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": self.rope_type, "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    # Hugging Face allows a list (Llama 3 has several); any of them stops generation.
    eos_token_ids: tuple[int, ...] = (2,)
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    model_type: str = "llama"
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # biases on q, k and v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on the attention output (Llama's attention_bias)
    mlp_bias: bool = False  # biases on gate, up and down (Llama's mlp_bias)
    # A query at position i attends to keys i - sliding_window + 1 .. i, in the layers listed
    # (None: every layer).  No window: every key before it.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ConfigError(f"config field {name}: expected a positive integer, got {_brief(value)}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"config field hidden_size: {self.hidden_size} is not a multiple of "
                                  f"num_attention_heads {self.num_attention_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not _positive_int(self.head_dim) or self.head_dim % 2:
            raise ConfigError(f"config field head_dim: expected a positive even integer, "
                              f"got {_brief(self.head_dim)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config field num_key_value_heads: {self.num_key_value_heads} does not divide "
                              f"num_attention_heads {self.num_attention_heads}")
        eps = _number(self.rms_norm_eps)
        if eps is None or not 0 < eps < 1:
            raise ConfigError(f"config field rms_norm_eps: expected a finite number above 0 and below 1, "
                              f"got {_brief(self.rms_norm_eps)}")
        theta = _number(self.rope_theta)
        if theta is None or theta <= 1:  # at or below 1 the rotary frequencies do not fall with depth
            raise ConfigError(f"config field rope_theta: expected a finite number above 1, "
                              f"got {_brief(self.rope_theta)}")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name}: expected true or false, "
                                  f"got {_brief(getattr(self, name))}")
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"config field model_type: {_brief(self.model_type)} is not supported "
                              f"(supported: {', '.join(MODEL_TYPES)})")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"config field sliding_window: expected a positive integer or null, "
                              f"got {_brief(window)}")
        if self.sliding_layers is not None and not all(
                isinstance(n, int) and 0 <= n < self.num_hidden_layers for n in self.sliding_layers):
            raise ConfigError(f"config field layer_types: layers {_brief(self.sliding_layers)} are not all "
                              f"within 0..{self.num_hidden_layers - 1}")
        special = [("bos_token_id", self.bos_token_id)] if self.bos_token_id is not None else []
        special += [("eos_token_id", t) for t in self.eos_token_ids]
        for name, token in special:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise ConfigError(f"config field {name}: {_brief(token)} is not a token id below "
                                  f"vocab_size {self.vocab_size}")

    def window(self, layer: int) -> int | None:
        """The attention window of layer ``layer``, None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        if not isinstance(raw, dict):
            raise ConfigError("config.json is not a JSON object")
        model_type = raw.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"config field model_type: {_brief(model_type)} is not supported "
                              f"(supported: {', '.join(MODEL_TYPES)})")
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"config field hidden_act: {_brief(raw['hidden_act'])} is not supported "
                              f"(only silu)")
        if raw.get("quantization_config") is not None:
            raise ConfigError("config field quantization_config: quantized checkpoints are not supported")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "vocab_size"):
            if name not in raw:
                raise ConfigError(f"config field {name}: missing")
        rope_theta, rope_scaling = _rope(raw)
        head_dim = raw.get("head_dim")  # null or absent: hidden_size / num_attention_heads
        if head_dim is not None and not _positive_int(head_dim):
            raise ConfigError(f"config field head_dim: expected a positive even integer, "
                              f"got {_brief(head_dim)}")
        eos = raw.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        layers = raw["num_hidden_layers"]
        qkv_bias = o_bias = mlp_bias = False
        window: int | None = None
        sliding_layers: tuple[int, ...] | None = None
        if model_type == "llama":
            qkv_bias = o_bias = _flag(raw, "attention_bias")
            mlp_bias = _flag(raw, "mlp_bias")
        elif model_type == "qwen2":
            qkv_bias = True
            if _flag(raw, "use_sliding_window"):
                window = raw.get("sliding_window")
                sliding_layers = _sliding_layers(raw, layers, raw.get("max_window_layers", 0))
        else:  # mistral: one window for every layer
            window = raw.get("sliding_window")
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=_default(raw, "num_key_value_heads", raw["num_attention_heads"]),
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id", 1),
            eos_token_ids=eos_ids,
            head_dim=0 if head_dim is None else head_dim,
            model_type=model_type,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            sliding_layers=sliding_layers,
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> LlamaConfig:
        if (wrong := not_a_checkpoint_dir(model_dir)) is not None:
            raise ConfigError(wrong)
        path = Path(model_dir) / "config.json"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from exc
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, an integer too long
            raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
        try:
            config = cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        return config.with_generation_eos(Path(model_dir) / GENERATION_CONFIG)

    def with_generation_eos(self, path: Path) -> LlamaConfig:
        """Add ``generation_config.json``'s end tokens: an instruct model ends its turn with one
        config.json does not list (Llama 3's ``<|eot_id|>``), as Hugging Face's generate reads it."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return self
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON
            raise ConfigError(f"{path}: cannot read: {exc}") from exc
        eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        for token in extra:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise ConfigError(f"{path}: field eos_token_id: {_brief(token)} is not a token id below "
                                  f"vocab_size {self.vocab_size}")
        merged = tuple(dict.fromkeys([*self.eos_token_ids, *extra]))
        return self if merged == self.eos_token_ids else replace(self, eos_token_ids=merged)

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face form, as ``from_dict`` reads it back."""
        eos: int | list[int] | None
        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids) or None
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.head_dim != self.hidden_size // self.num_attention_heads:
            out["head_dim"] = self.head_dim
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_dict()
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        elif self.model_type == "qwen2":
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            if self.sliding_layers is not None:
                out["layer_types"] = ["sliding_attention" if n in self.sliding_layers else "full_attention"
                                      for n in range(self.num_hidden_layers)]
        else:
            out["sliding_window"] = self.sliding_window
        return out


def _brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error stays one short line, whatever the file holds."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _positive_int(value: Any) -> bool:
    """A JSON integer of at least 1 (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (NaN, Infinity, a string, a bool,
    an integer too large for a float)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _default(raw: dict[str, Any], name: str, default: Any) -> Any:
    """``raw[name]``, or ``default`` when it is absent or null (never when it is 0 or false)."""
    value = raw.get(name)
    return default if value is None else value


def _flag(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise ConfigError(f"config field {name}: expected true or false, got {_brief(value)}")
    return value


def _rope(raw: dict[str, Any]) -> tuple[Any, RopeScaling | None]:
    """rope_theta and the scaling, from either spelling."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"config field rope_parameters: expected an object, got {_brief(params)}")
        if "full_attention" in params or "sliding_attention" in params:
            raise ConfigError("config field rope_parameters: per-layer-type parameters are not supported")
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        return theta, RopeScaling.from_dict(params, "rope_parameters")
    return raw.get("rope_theta", 10000.0), RopeScaling.from_dict(raw.get("rope_scaling"), "rope_scaling")


def _sliding_layers(raw: dict[str, Any], layers: Any, max_window_layers: Any) -> tuple[int, ...]:
    """Qwen2's windowed layers: ``layer_types`` when given, else the layers from ``max_window_layers``."""
    types = raw.get("layer_types")
    if types is None:
        if not isinstance(max_window_layers, int) or isinstance(max_window_layers, bool):
            raise ConfigError(f"config field max_window_layers: expected an integer, "
                              f"got {_brief(max_window_layers)}")
        return tuple(range(max_window_layers, layers)) if isinstance(layers, int) else ()
    if not isinstance(types, list) or len(types) != layers or not all(
            t in ("full_attention", "sliding_attention") for t in types):
        raise ConfigError(f"config field layer_types: expected {layers} of full_attention or "
                          f"sliding_attention, got {_brief(types)}")
    return tuple(n for n, t in enumerate(types) if t == "sliding_attention")


def not_a_checkpoint_dir(model_dir: str | Path) -> str | None:
    """What is wrong with ``model_dir`` as a checkpoint folder before any file in it is read
    (it is missing, or a file); None when it is a directory."""
    root = Path(model_dir)
    if root.is_dir():
        return _special_file(root)
    if root.exists():
        return f"{root}: not a directory (a checkpoint is a folder holding config.json and the weights)"
    return f"{root}: no such directory"


def _special_file(root: Path) -> str | None:
    """A file meshd may read from the checkpoint (its JSON, weights and template) that is a
    pipe, a socket or a device: opening one would wait forever, or read without end."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return None  # an unreadable folder: the read of config.json says why
    for entry in entries:
        if entry.suffix in (".json", ".safetensors", ".jinja") and entry.exists() \
                and not (entry.is_file() or entry.is_dir()):
            return f"{entry}: not a regular file (a pipe or a device)"
    return None
