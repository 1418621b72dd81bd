"""Print meshd's logits against Hugging Face transformers, family by family.

    .venv/bin/python scripts/reference_table.py [--steps N]

Builds each family's small random model with transformers (meshd/testing/reference.py),
then prints the largest |delta logits| over every greedy step, as a fraction of the
reference's largest |logit|, for meshd in one process and over 3 stages, and whether the
greedy tokens are the same.  The tests (tests/test_reference.py) hold both to 1e-4.
Needs the reference extra: pip install -e '.[reference]'.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.pipeline.config import LlamaConfig  # noqa: E402
from meshd.pipeline.generate import generate, prompt_ids  # noqa: E402
from meshd.pipeline.tokenizer import load_tokenizer  # noqa: E402
from meshd.testing import reference  # noqa: E402

STORED = {"llama3.2": ("bfloat16", "40KB"), "tinyllama": ("float16", None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="greedy steps (default %(default)s)")
    parser.add_argument("--prompt", default="Once upon a time")
    args = parser.parse_args()
    print(f"{'family':<11} {'adds':<46} {'stored':<20} {'1 process':>10} {'3 stages':>10}  tokens")
    with tempfile.TemporaryDirectory() as tmp:
        for family in reference.FAMILIES:
            path = Path(tmp) / family.name
            dtype, shard = STORED.get(family.name, ("float32", None))
            reference.build(family, path, dtype=dtype, max_shard_size=shard)
            config = LlamaConfig.load(path)
            ids = prompt_ids(load_tokenizer(path, config.bos_token_id, config.eos_token_ids), args.prompt)
            want_tokens, want = reference.greedy_logits(reference.load(path), ids, args.steps)
            mono = generate(path, args.prompt, args.steps, return_logits=True)
            staged_tokens, staged = reference.staged_greedy(path, ids, args.steps)
            same = mono["tokens"] == want_tokens == staged_tokens
            stored = dtype + (f", {len(list(path.glob('model-*')))} shards" if shard else "")
            print(f"{family.name:<11} {family.what:<46} {stored:<20} "
                  f"{reference.worst_error(mono['logits'], want):>10.2e} "
                  f"{reference.worst_error(staged, want):>10.2e}  "
                  f"{'same' if same else 'DIFFER'} ({len(want_tokens)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
