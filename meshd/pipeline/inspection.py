"""``meshd model inspect``: what a checkpoint holds, and what each stage of a split loads.

Reads config.json, the safetensors headers, the tokenizer files and the chat
template; never the weights, so it answers at once for a checkpoint of any size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .checkpoint import (
    WEIGHTS_FILE,
    CheckpointError,
    _SafetensorsFile,
    _tensor_files,
    checkpoint_params,
    expected_tensors,
)
from .config import ConfigError, LlamaConfig
from .tokenizer import BYTE_SPEC_FILE, HF_FILE, TokenizerError, load_tokenizer


class InspectError(Exception):
    """A checkpoint that cannot be described; the message names the file."""


def describe(model_dir: str | Path, stages: int = 1) -> dict[str, Any]:
    """The checkpoint in ``model_dir``, split into ``stages`` stages, as a JSON-ready dict."""
    from .chat import ChatTemplate
    from .model import split_layers
    from .stage import stage_share

    root = Path(model_dir)
    if not root.is_dir():
        raise InspectError(f"{root}: no such directory")
    try:
        config = LlamaConfig.load(root)
        split_layers(config.num_hidden_layers, stages)
    except ConfigError as exc:
        raise InspectError(str(exc)) from None
    except ValueError as exc:
        raise InspectError(f"--stages {stages}: {exc}") from None
    try:
        stored = stored_weights(root, config)
    except CheckpointError as exc:
        raise InspectError(str(exc)) from None
    per_stage = []
    for k in range(stages):
        layers, embed, head = stage_share(config, k, stages)
        tensors = expected_tensors(config, layers, embed=embed, head=head)
        params = sum(math.prod(s) for s in tensors.values())
        per_stage.append({
            "stage": k, "layers": [layers.start, layers.stop - 1], "embedding": embed, "head": head,
            "parameters": params, "bytes_on_disk": sum(stored["bytes"].get(n, 0) for n in tensors),
            "bytes_in_memory": 4 * params,  # float32 compute
        })
    template = ChatTemplate.load(root)
    return {
        "model": str(root),
        "architecture": config.architecture,
        "config": {
            "model_type": config.model_type, "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "attention_heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "vocab_size": config.vocab_size,
            "max_positions": config.max_position_embeddings, "rope_theta": config.rope_theta,
            "rope_scaling": config.rope_scaling.to_dict() if config.rope_scaling else None,
            "sliding_window": config.sliding_window,
            "sliding_layers": list(config.sliding_layers) if config.sliding_layers is not None else None,
            "biases": [b for b, on in (("qkv", config.qkv_bias), ("o", config.o_bias),
                                       ("mlp", config.mlp_bias)) if on],
            "tied_embeddings": config.tie_word_embeddings,
            "bos_token_id": config.bos_token_id, "eos_token_ids": list(config.eos_token_ids),
        },
        "parameters": checkpoint_params(config),
        "stored": {"files": stored["files"], "dtypes": stored["dtypes"],
                   "bytes": sum(stored["bytes"].values())},
        "stages": per_stage,
        "tokenizer": _tokenizer(root, config),
        "chat_template": {"found": template.source is not None,
                          "file": template.where if template.source is not None else None},
    }


def stored_weights(root: Path, config: LlamaConfig) -> dict[str, Any]:
    """Bytes on disk per tensor, the dtypes found and the weight files, from the headers:
    each file's header read and checked, and every tensor the model needs there.  Raises
    CheckpointError naming the file."""
    shard_of = _tensor_files(root)
    paths = sorted(set(shard_of.values())) if shard_of else [root / WEIGHTS_FILE]
    sizes: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    for path in paths:
        st = _SafetensorsFile(path)
        for name, (dtype, _, start, end) in st.entries.items():
            sizes[name] = end - start
            dtypes[dtype] = dtypes.get(dtype, 0) + 1
    missing = [n for n in expected_tensors(config, range(config.num_hidden_layers), embed=True, head=True)
               if n not in sizes]
    if missing:
        raise CheckpointError(f"{root}: {len(missing)} tensors missing, the first {missing[0]}")
    return {"files": [p.name for p in paths], "dtypes": dtypes, "bytes": sizes}


def _tokenizer(root: Path, config: LlamaConfig) -> dict[str, Any]:
    kind = "tokenizer.json" if (root / HF_FILE).exists() else \
        "byte spec" if (root / BYTE_SPEC_FILE).exists() else "plain bytes"
    out: dict[str, Any] = {"kind": kind}
    try:
        tok = load_tokenizer(root, config.bos_token_id, config.eos_token_ids)
    except TokenizerError as exc:
        return {**out, "error": str(exc)}
    sample = tok.encode_prompt("Hello")
    out["prompt_of_hello"] = sample
    out["adds_bos"] = config.bos_token_id is not None and sample[:1] == [config.bos_token_id]
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def render(report: dict[str, Any]) -> str:
    """``describe``'s report as text for a person."""
    c = report["config"]
    lines = [f"{report['model']}: {report['architecture']} ({c['model_type']}), "
             f"{report['parameters'] / 1e6:.2f}M parameters"]
    attention = f"{c['attention_heads']} heads, {c['kv_heads']} kv heads, head_dim {c['head_dim']}"
    if c["sliding_window"] is not None:
        where = "every layer" if c["sliding_layers"] is None else f"layers {c['sliding_layers']}"
        attention += f", sliding window {c['sliding_window']} in {where}"
    rope = f"rope_theta {c['rope_theta']:g}"
    if c["rope_scaling"]:
        rope += ", rope_scaling " + json.dumps(c["rope_scaling"], separators=(",", ":"))
    lines += [
        f"  layers {c['layers']}, hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
        f"vocab {c['vocab_size']}, context {c['max_positions']}",
        f"  attention: {attention}",
        f"  {rope}",
        f"  biases: {', '.join(c['biases']) or 'none'}; "
        f"embeddings {'tied' if c['tied_embeddings'] else 'untied'}; "
        f"BOS {c['bos_token_id']}, EOS {c['eos_token_ids']}",
    ]
    s = report["stored"]
    dtypes = ", ".join(f"{k} x{v}" for k, v in s["dtypes"].items())
    lines.append(f"  stored: {_mb(s['bytes'])} in {len(s['files'])} file(s), {dtypes}")
    lines.append(f"  split into {len(report['stages'])} stage(s):")
    for st in report["stages"]:
        parts = [p for p, on in (("embedding", st["embedding"]), ("head", st["head"])) if on]
        extra = " + " + " + ".join(parts) if parts else ""
        lines.append(f"    stage-{st['stage']}: layers {st['layers'][0]}..{st['layers'][1]}{extra}: "
                     f"{st['parameters'] / 1e6:.2f}M parameters, "
                     f"{_mb(st['bytes_on_disk'])} on disk, {_mb(st['bytes_in_memory'])} in memory (float32)")
    t = report["tokenizer"]
    tok = f"  tokenizer: {t['kind']}"
    tok += f", error: {t['error']}" if "error" in t else f", BOS {'added' if t['adds_bos'] else 'not added'}"
    lines.append(tok)
    ct = report["chat_template"]
    lines.append(f"  chat template: {ct['file']}" if ct["found"] else
                 "  chat template: none (chat requests use the plain role: content fallback)")
    return "\n".join(lines)
