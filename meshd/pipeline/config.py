"""The model's shape, read from a Hugging Face Llama ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json we cannot run; the message names the field."""


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

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field {name}: expected a positive integer, got {value!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"config field hidden_size: {self.hidden_size} is not a multiple of "
                                  f"num_attention_heads {self.num_attention_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"config field head_dim: expected a positive even integer, "
                              f"got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config field num_key_value_heads: {self.num_key_value_heads} does not divide "
                              f"num_attention_heads {self.num_attention_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name}: expected a positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"config field tie_word_embeddings: expected true or false, "
                              f"got {self.tie_word_embeddings!r}")
        special = [("bos_token_id", self.bos_token_id)] if self.bos_token_id is not None else []
        special += [("eos_token_id", t) for t in self.eos_token_ids]
        for name, token in special:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise ConfigError(f"config field {name}: {token!r} is not a token id below "
                                  f"vocab_size {self.vocab_size}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        if not isinstance(raw, dict):
            raise ConfigError("config.json is not a JSON object")
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(f"config field model_type: {model_type!r} is not supported (only 'llama')")
        if raw.get("rope_scaling") is not None:
            raise ConfigError(f"config field rope_scaling: {raw['rope_scaling']!r} is not supported")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "vocab_size"):
            if name not in raw:
                raise ConfigError(f"config field {name}: missing")
        eos = raw.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id", 1),
            eos_token_ids=eos_ids,
            head_dim=raw.get("head_dim") or 0,
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> LlamaConfig:
        path = Path(model_dir) / "config.json"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from exc
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face form, as ``from_dict`` reads it back."""
        eos: int | list[int] | None
        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids) or None
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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
        return out
