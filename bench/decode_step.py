#!/usr/bin/env python3
"""A decode step's per-request work: numpy against the model's compiled kernels, side by side.

Two pieces of a decode step run once per request, whatever the batch:

- attention: each request's row over its own KV cache.  numpy's path (what a
  prompt's rows run: RoPE, then products, softmax and sums over the cache)
  against ``kernels.attend_rows``, which a decode step runs; one layer of the
  small preset, B requests each at position P;
  a Llama 3.2 1B-shaped layer shows the model handing long contexts back to
  numpy (``kernels.ATTEND_KERNEL_SCORES``);
- a sampled row's shortlist: the k-th largest of a stage's share of the
  scaled logits by ``np.partition`` against ``kernels.top_k_floor`` (the
  same value).

Prints the median microseconds of each and the ratio numpy / kernel, one
BLAS thread, in one run.

    .venv/bin/python bench/decode_step.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from rows import median_us  # noqa: E402  (bench/rows.py, beside this script)

from meshd.pipeline import kernels  # noqa: E402
from meshd.pipeline.checkpoint import preset_config, random_weights  # noqa: E402
from meshd.pipeline.model import StageModel, head_cut, rope_tables  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    config = preset_config("small")
    model = StageModel(config, random_weights(config, seed=0), range(0, 1), embed=False, head=False)
    c = config
    width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    rope = rope_tables(c, c.max_position_embeddings)
    rng = np.random.default_rng(0)
    print(f"one layer's attention, small preset ({c.num_attention_heads} heads of {c.head_dim}), "
          "median us: numpy / kernel (ratio)")
    for batch in (1, 8, 16):
        cells = []
        for pos in (16, 64, 200):
            caches = [model.new_cache() for _ in range(batch)]
            for cache in caches:
                cache.k[...] = rng.standard_normal(cache.k.shape, dtype=np.float32)
                cache.v[...] = rng.standard_normal(cache.v.shape, dtype=np.float32)
                cache.length = pos
            qkv = rng.standard_normal((batch, width), dtype=np.float32)
            spans = [(cache, pos, pos + 1) for cache in caches]
            def per_request(qkv=qkv, caches=caches, pos=pos) -> None:
                for i, cache in enumerate(caches):
                    model._attend(qkv[i:i + 1], 0, None, cache, pos, pos + 1, {}, rope)

            numpy_us = median_us(per_request, args.repeats)
            kernel_us = median_us(lambda qkv=qkv, spans=spans: model._attend_rows(qkv, 0, None, spans, rope),
                                  args.repeats)
            cells.append(f"P={pos:<3} {numpy_us:7.1f} / {kernel_us:6.1f} ({numpy_us / kernel_us:.1f}x)")
        print(f"  B={batch:<2}  " + ";  ".join(cells))
    # A Llama 3.2 1B-shaped layer's attention (32 query heads of 64, 8 kv heads) over long
    # contexts: past ATTEND_KERNEL_SCORES (256 positions here) the model hands a row to numpy.
    big = preset_config("small", hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=64, num_hidden_layers=1, vocab_size=300,
                        max_position_embeddings=4096)
    wide = StageModel(big, random_weights(big, seed=0), embed=False, head=False)
    big_rope = rope_tables(big, big.max_position_embeddings)
    cache = wide.new_cache()
    cache.k[...] = rng.standard_normal(cache.k.shape, dtype=np.float32)
    cache.v[...] = rng.standard_normal(cache.v.shape, dtype=np.float32)
    qkv = rng.standard_normal((1, (32 + 2 * 8) * big.head_dim), dtype=np.float32)
    cells = []
    for pos in (64, 256, 1024, 2000):
        cache.length = pos
        span = [(cache, pos, pos + 1)]
        numpy_us = median_us(lambda pos=pos: wide._attend(qkv, 0, None, cache, pos, pos + 1, {}, big_rope),
                             max(20, args.repeats // 10))
        model_us = median_us(lambda span=span: wide._attend_rows(qkv, 0, None, span, big_rope),
                             max(20, args.repeats // 10))
        cells.append(f"P={pos:<4} {numpy_us:7.1f} / {model_us:7.1f} ({numpy_us / model_us:.1f}x)")
    print("one row, a Llama 3.2 1B-shaped layer (32 heads of 64, 8 kv heads), median us: numpy / the model's "
          "path (the kernel up to 256 positions, numpy past them)")
    print("  " + ";  ".join(cells))
    share = c.vocab_size - head_cut(c.vocab_size)
    logits = (rng.standard_normal(share) * 3).astype(np.float32)
    print(f"a sampled row's k-th largest of {share} scaled logits, median us: np.partition / kernel (ratio)")
    cells = []
    for k in (1, 20, 50, 256):
        part = median_us(lambda k=k: np.partition(logits, -k)[-k], args.repeats)
        heap = median_us(lambda k=k: kernels.top_k_floor(logits, k), args.repeats)
        cells.append(f"k={k:<3} {part:6.1f} / {heap:5.1f} ({part / heap:.1f}x)")
    print("  " + ";  ".join(cells))


if __name__ == "__main__":
    main()
