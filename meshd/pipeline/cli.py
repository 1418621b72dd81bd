"""``meshd model init`` and ``meshd generate``: argument parsing and output."""

from __future__ import annotations

import argparse
import json
import sys
import time

PRESET_HELP = {
    "tiny": "4 layers, dim 64, for tests",
    "small": "stories15M's shapes (6 layers)",
    "deep": "16 layers, dim 128, for meshes of up to 16 stages",
    "llama3": "Llama 3.2's architecture (rope_scaling llama3, tied embeddings) at dim 128",
    "qwen2": "Qwen2.5's (q/k/v biases, tied) at dim 128",
    "mistral": "Mistral's (a sliding window of 16) at dim 128",
    "smollm2": "SmolLM2's proportions at dim 192",
    "tinyllama": "TinyLlama's proportions (8 query heads per kv head) at dim 128",
}


def add_parser(sub) -> None:
    model = sub.add_parser("model", help="model checkpoints",
                           description="Model checkpoints in the Hugging Face Llama layout.")
    model_sub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    init = model_sub.add_parser(
        "init", help="write a random checkpoint",
        description="Write config.json, model.safetensors and a byte tokenizer spec with seeded random "
        "weights. The same seed gives the same bytes.")
    init.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if missing)")
    init.add_argument("--preset", choices=list(PRESET_HELP), default="tiny", metavar="NAME",
                      help="; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items()) + " (default %(default)s)")
    init.add_argument("--seed", type=int, default=0, metavar="N", help="weights seed (default %(default)s)")
    init.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="stored dtype (default %(default)s)")
    init.add_argument("--shards", type=int, default=1, metavar="N",
                      help="write the weights as N files and their index, as large checkpoints ship "
                      "(default %(default)s: one model.safetensors)")
    init.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    init.set_defaults(func=_cmd_model_init)

    inspect = model_sub.add_parser(
        "inspect", help="what a checkpoint holds and how it splits",
        description="Print a checkpoint's architecture, parameter count, bytes per stage, and the "
        "tokenizer and chat template found. Reads headers only, never the weights.")
    inspect.add_argument("model_dir", metavar="DIR", help="checkpoint directory")
    inspect.add_argument("--stages", type=int, default=1, metavar="N",
                         help="split into N stages as `meshd run --stages N` would (default %(default)s)")
    inspect.add_argument("--json", action="store_true", help="one JSON object")
    inspect.set_defaults(func=_cmd_model_inspect)

    gen = sub.add_parser(
        "generate", help="generate text in one process (the reference for pipelined runs)",
        description="Run the whole model in this process: the tokens a pipelined run must equal.")
    gen.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    gen.add_argument("--prompt", required=True, metavar="TEXT")
    gen.add_argument("--max-tokens", required=True, type=int, metavar="K")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="0 is greedy (default %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="0 keeps every token (default %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="nucleus sampling: draw among the most likely tokens whose probability "
                     "reaches P together; 1 keeps every token (default %(default)s)")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default %(default)s)")
    gen.add_argument("--json", action="store_true", help="one JSON object: tokens, text, timings")
    gen.set_defaults(func=_cmd_generate)


def _error(message: str) -> int:
    print(f"meshd: error: {message}", file=sys.stderr)
    return 2


def _cmd_model_init(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .checkpoint import CheckpointError, checkpoint_params, init_checkpoint

    t0 = time.perf_counter()
    try:
        config = init_checkpoint(args.out, args.preset, args.seed, dtype=args.dtype, force=args.force,
                                 shards=args.shards)
    except (CheckpointError, OSError) as exc:
        return _error(str(exc))
    shards = f", {args.shards} shards" if args.shards > 1 else ""
    print(f"wrote {args.out}: preset {args.preset}, seed {args.seed}, {args.dtype}{shards}, "
          f"{checkpoint_params(config) / 1e6:.2f}M parameters, {config.num_hidden_layers} layers, "
          f"dim {config.hidden_size}, vocab {config.vocab_size} ({time.perf_counter() - t0:.2f}s)")
    return 0


def _cmd_model_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .inspection import InspectError, describe, render

    try:
        report = describe(args.model_dir, args.stages)
    except InspectError as exc:
        return _error(f"model inspect: {exc}")
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    from .checkpoint import CheckpointError, LoadProgress
    from .config import ConfigError
    from .generate import generate
    from .model import StageModel
    from .tokenizer import TokenizerError

    if args.max_tokens < 1:
        return _error(f"generate: --max-tokens must be at least 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        return _error(f"generate: --temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        return _error(f"generate: --top-k must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        return _error(f"generate: --top-p must be within (0, 1], got {args.top_p}")
    if not Path(args.model).is_dir():
        return _error(f"generate: --model {args.model}: no such directory")
    try:
        model = StageModel.load(args.model, progress=LoadProgress(
            args.model, lambda line: print(line, file=sys.stderr, flush=True)))
        result = generate(args.model, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed,
                          top_p=args.top_p, model=model)
    except (CheckpointError, ConfigError, TokenizerError, ValueError, OSError) as exc:
        return _error(f"generate: {exc}")
    if args.json:
        print(json.dumps({k: result[k] for k in ("tokens", "text", "finish_reason", "timings")}))
    else:
        print(result["text"])
        t = result["timings"]
        print(f"{t['generated_tokens']} tokens ({result['finish_reason']}), "
              f"{t['tokens_per_s']:.1f} tokens/s, "
              f"prefill {t['prefill_ms']:.1f} ms for {t['prompt_tokens']} tokens", file=sys.stderr)
    return 0
