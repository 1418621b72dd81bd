"""Small random checkpoints built with Hugging Face's own classes, and their logits.

The reference meshd's numpy decoder is checked against (tests/test_reference.py,
scripts/reference_table.py): a model of each family is built by ``transformers``
at small dimensions, saved with ``save_pretrained``, and run by ``transformers``
(float32, eager attention) one greedy step at a time.  Needs the ``reference``
extra (torch and transformers).

Weights are drawn at scales that keep activations near 1 through the layers
(each matrix normal(0, 1/sqrt(fan-in)); the embedding normal(0, 1), or 0.3
when the head is tied to it, so the head does not just echo the input; norms
1 + normal(0, 0.1); biases normal(0, 0.2)), so the top logits stand apart:
Hugging Face's own init (normal(0, 0.02)) leaves them near-tied, and a
comparison of greedy tokens would then test rounding, not the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..pipeline.tokenizer import write_byte_tokenizer_spec

# Every family on a byte vocabulary: 0..255, BOS 256, EOS 257, padded to 320 ids.
_COMMON: dict[str, Any] = dict(vocab_size=320, bos_token_id=256, eos_token_id=257, hidden_act="silu",
                               max_position_embeddings=256, rms_norm_eps=1e-5)


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # transformers' config class: llama, mistral or qwen2
    fields: dict[str, Any]
    what: str  # what this family adds to plain Llama


FAMILIES = [
    Family("llama2", "llama", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=4), "multi-head, untied"),
    Family("llama3.2", "llama", dict(hidden_size=64, intermediate_size=192, num_hidden_layers=6,
                                     num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                                     tie_word_embeddings=True,
                                     rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0,
                                                       original_max_position_embeddings=64)),
           "rope_scaling llama3, tied, GQA 4:1"),
    Family("llama-bias", "llama", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=6,
                                       num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                       mlp_bias=True, rope_scaling=dict(rope_type="linear", factor=2.0)),
           "attention_bias, mlp_bias, linear rope scaling"),
    Family("qwen2", "qwen2", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                                  tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                                  max_window_layers=3),
           "q/k/v biases, tied, window 8 in layers 3..5"),
    Family("mistral", "mistral", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=1, sliding_window=8),
           "sliding window 8, GQA 4:1"),
    Family("smollm2", "llama", dict(hidden_size=96, intermediate_size=256, num_hidden_layers=6,
                                    num_attention_heads=6, num_key_value_heads=2, rope_theta=100000.0,
                                    tie_word_embeddings=True), "SmolLM2's proportions, tied"),
    Family("tinyllama", "llama", dict(hidden_size=64, intermediate_size=176, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=1),
           "TinyLlama's proportions, GQA 8:1"),
]
BY_NAME = {f.name: f for f in FAMILIES}


def _config(family: Family):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[family.model_type]
    return cls(**{**_COMMON, **family.fields})


def build(family: Family, out: Path, *, dtype: str = "float32", max_shard_size: str | None = None,
          seed: int = 0) -> None:
    """Write ``family``'s random checkpoint to ``out`` with ``save_pretrained`` (``dtype``
    float32, bfloat16 or float16; sharded when ``max_shard_size`` is given), plus meshd's
    byte tokenizer spec."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.3 if model.config.tie_word_embeddings else 1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model = model.to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    write_byte_tokenizer_spec(out, offset=0, bos_token_id=_COMMON["bos_token_id"],
                              eos_token_id=_COMMON["eos_token_id"])


def load(model_dir: Path):
    """The saved checkpoint as transformers runs it: float32, eager attention."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def greedy_logits(model, ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's logits (steps, vocab), every step run on the whole
    sequence from scratch: no cache, the plainest reading of the model."""
    import torch

    ids = list(ids)
    tokens: list[int] = []
    rows = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].numpy().astype(np.float32)
            rows.append(logits)
            token = int(np.argmax(logits))
            if token == _COMMON["eos_token_id"]:
                break
            tokens.append(token)
            ids.append(token)
    return tokens, np.stack(rows)


def worst_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over every step, as a fraction of max |want|."""
    if got.shape != want.shape:
        raise ValueError(f"logits of shape {got.shape} against the reference's {want.shape}")
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def staged_greedy(model_dir: Path, ids: list[int], steps: int,
                  stages: int = 3) -> tuple[list[int], np.ndarray]:
    """meshd's greedy tokens and logits with the layers cut into ``stages`` stages, each
    reading only its share of the tensors, chained the way the pipeline chains them."""
    from ..pipeline.config import LlamaConfig
    from ..pipeline.model import StageModel, split_layers

    config = LlamaConfig.load(model_dir)
    ranges = split_layers(config.num_hidden_layers, stages)
    parts = [StageModel.load(model_dir, r, config=config) for r in ranges]
    caches = [p.new_cache(len(ids) + steps) for p in parts]
    tokens: list[int] = []
    rows = []
    pos, step = 0, list(ids)
    for _ in range(steps):
        hidden = parts[0].embed(step)
        for part, cache in zip(parts, caches, strict=True):
            hidden = part.forward(hidden, cache, pos)
        logits = parts[-1].logits(hidden[-1:])[0]
        rows.append(logits)
        token = int(np.argmax(logits))
        if token in config.eos_token_ids:
            break
        tokens.append(token)
        pos += len(step)
        step = [token]
    return tokens, np.stack(rows)
