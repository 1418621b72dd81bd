"""``meshd model init`` and ``meshd generate``: argument parsing and output."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

from ..argtypes import path, positive_int

# The HTTP API's bounds (dashboard/generation.py's ``sampling``): a value the API refuses is
# refused here too, so `meshd generate` stays the reference for what a request can ask.
MAX_TOKENS = 4096
MAX_TEMPERATURE = 10.0
MAX_TOP_K = 1 << 20
MAX_SEED = 2**63 - 1

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
    init.add_argument("--out", type=path, required=True, metavar="DIR",
                      help="directory to write (created if missing)")
    init.add_argument("--preset", choices=list(PRESET_HELP), default="tiny", metavar="NAME",
                      help="; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items()) + " (default %(default)s)")
    init.add_argument("--seed", type=seed_int, default=0, metavar="N",
                      help=f"weights seed, 0 to {MAX_SEED} (default %(default)s)")
    init.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="stored dtype (default %(default)s)")
    init.add_argument("--shards", type=positive_int, default=1, metavar="N",
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
    gen.add_argument("--model", type=path, required=True, metavar="DIR", help="checkpoint directory")
    gen.add_argument("--prompt", required=True, metavar="TEXT")
    gen.add_argument("--max-tokens", required=True, type=int, metavar="K",
                     help=f"tokens to generate, 1 to {MAX_TOKENS}")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help=f"0 is greedy; at most {MAX_TEMPERATURE:g} (default %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, metavar="K",
                     help=f"0 keeps every token; at most {MAX_TOP_K} (default %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="nucleus sampling: draw among the most likely tokens whose probability "
                     "reaches P together; 1 keeps every token (default %(default)s)")
    gen.add_argument("--seed", type=int, default=0, metavar="S",
                     help=f"sampling seed, 0 to {MAX_SEED} (default %(default)s)")
    gen.add_argument("--json", action="store_true", help="one JSON object: tokens, text, timings")
    gen.set_defaults(func=_cmd_generate)


def seed_int(text: str) -> int:
    """A seed: a whole number from 0 to MAX_SEED (numpy refuses a negative one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} must be from 0 to {MAX_SEED}")
    return value


def _within(least: float, most: float) -> Callable[[float], bool]:
    """A test of a number from ``least`` to ``most``; NaN and infinities fail it (an int of any size
    is compared exactly, never made a float)."""
    return lambda v: (isinstance(v, int) or math.isfinite(v)) and least <= v <= most


# (option, attribute, test, what it must be): the API's bounds, one line naming the option.
_GENERATE_BOUNDS: list[tuple[str, str, Callable[[float], bool], str]] = [
    ("--max-tokens", "max_tokens", _within(1, MAX_TOKENS), f"must be at least 1 and at most {MAX_TOKENS}"),
    ("--temperature", "temperature", _within(0, MAX_TEMPERATURE),
     f"must be >= 0 and at most {MAX_TEMPERATURE:g}"),
    ("--top-k", "top_k", _within(0, MAX_TOP_K), f"must be >= 0 and at most {MAX_TOP_K}"),
    ("--top-p", "top_p", lambda v: 0 < v <= 1, "must be within (0, 1]"),
    ("--seed", "seed", _within(0, MAX_SEED), f"must be from 0 to {MAX_SEED}"),
]


def check_generate_options(args: argparse.Namespace) -> str | None:
    """What is wrong with ``meshd generate``'s sampling options and prompt, naming the option;
    None when nothing is."""
    for option, attr, ok, must in _GENERATE_BOUNDS:
        value = getattr(args, attr)
        if not ok(value):
            return f"{option} {must}, got {value}"
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Bytes that are not UTF-8 reach us as lone surrogates (Python's surrogateescape): count
        # the bytes before the first as the command line held them.
        byte = len(args.prompt[:exc.start].encode("utf-8", "surrogateescape"))
        return f"--prompt is not valid UTF-8 (byte {byte})"
    return None


def _error(message: str) -> int:
    print(f"meshd: error: {message}", file=sys.stderr)
    return 2


def _cmd_model_init(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .checkpoint import (
        CheckpointError,
        checkpoint_params,
        expected_tensors,
        init_checkpoint,
        preset_config,
    )

    config = preset_config(args.preset)
    tensors = len(expected_tensors(config, range(config.num_hidden_layers), embed=True, head=True))
    if args.shards > tensors:
        return _error(f"model init: --shards {args.shards}: the {args.preset} preset has only {tensors} "
                      f"tensors, so at most {tensors} shards")
    t0 = time.perf_counter()
    try:
        config = init_checkpoint(args.out, args.preset, args.seed, dtype=args.dtype, force=args.force,
                                 shards=args.shards)
    except CheckpointError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"model init: cannot write {exc.filename or args.out}: {exc.strerror or exc}")
    shards = f", {args.shards} shards" if args.shards > 1 else ""
    print(f"wrote {args.out}: preset {args.preset}, seed {args.seed}, {args.dtype}{shards}, "
          f"{checkpoint_params(config) / 1e6:.2f}M parameters, {config.num_hidden_layers} layers, "
          f"dim {config.hidden_size}, vocab {config.vocab_size} ({time.perf_counter() - t0:.2f}s)")
    return 0


def _cmd_model_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .checkpoint import CheckpointError, check_headers
    from .config import LlamaConfig, not_a_checkpoint_dir
    from .inspection import InspectError, describe, render

    if (wrong := not_a_checkpoint_dir(args.model_dir)) is not None:
        return _error(f"model inspect: {wrong}")
    try:
        report = describe(args.model_dir, args.stages)
        # describe counts the stored bytes; a tensor whose shape config.json contradicts is
        # refused here as `meshd run` and `meshd generate` refuse it.
        check_headers(args.model_dir, LlamaConfig.load(args.model_dir))
    except (InspectError, CheckpointError) as exc:
        return _error(f"model inspect: {exc}")
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .checkpoint import CheckpointError, LoadProgress
    from .config import ConfigError, not_a_checkpoint_dir
    from .generate import generate
    from .model import StageModel
    from .tokenizer import TokenizerError

    wrong = check_generate_options(args)
    if wrong is not None:
        return _error(f"generate: {wrong}")
    if (wrong := not_a_checkpoint_dir(args.model)) is not None:
        return _error(f"generate: --model {wrong}")
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
