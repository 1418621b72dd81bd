#!/usr/bin/env python3
"""A weight product over B rows: BLAS against the model's kernel, side by side.

For each B in 1..16 (and 24, 32, past ``kernels.KERNEL_ROWS``, where the model
hands a product to BLAS), the small preset's decode-step shapes (a layer's
four products and the last stage's share of the LM head), one BLAS thread:
the median microseconds of BLAS's ``x @ W.T`` with W as the checkpoint stores
it (out, in), of BLAS over an input-major (in, out) copy (the layout OpenBLAS
streams fastest), and of ``model.rows_times``, which the model runs; the
ratio is the faster BLAS over ``rows_times``.  BLAS copies a weight into
blocks before a product of several rows; the kernel reads each weight row once
and meets every input row with it in cache.  ``--cold`` reads 64 MB between
products, so each weight comes from memory, as in a pipeline whose weights do
not fit the cache.

    .venv/bin/python bench/rows.py [--repeats 200] [--cold]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from meshd.pipeline.checkpoint import preset_config  # noqa: E402
from meshd.pipeline.model import head_cut, rows_times  # noqa: E402

_SPILL: list[np.ndarray] = []  # 64 MB, more than a 2-core VM's L3; made on the first cold pass


def median_us(fn, repeats: int, cold: bool = False) -> float:
    """Median microseconds of ``fn()`` over ``repeats`` calls; ``cold`` reads 64 MB before each."""
    if cold and not _SPILL:
        _SPILL.append(np.ones(64 * 2**20 // 4, dtype=np.float32))
    times = []
    for _ in range(repeats):
        if cold:
            _SPILL[0].sum()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--cold", action="store_true", help="weights from memory, not the cache")
    args = parser.parse_args()
    c = preset_config("small")
    d, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    kvd = c.num_key_value_heads * c.head_dim
    rng = np.random.default_rng(0)
    shapes = {"layer (qkv, o, gate-up, down)": [(d + 2 * kvd, d), (d, d), (2 * inter, d), (d, inter)],
              "last stage's head share": [(vocab - head_cut(vocab), d)]}
    weights = {name: [rng.standard_normal(s, dtype=np.float32) for s in ss] for name, ss in shapes.items()}
    majors = {name: [np.ascontiguousarray(w.T) for w in ws] for name, ws in weights.items()}
    repeats = min(args.repeats, 25) if args.cold else args.repeats
    print(f"small preset, one BLAS thread, {'cold' if args.cold else 'warm'}, median of {repeats} (µs): "
          "BLAS x @ W.T (checkpoint layout), BLAS over an input-major copy, rows_times")
    for name, ws in weights.items():
        print(f"  {name}:")
        ratios = []
        for rows in [*range(1, 17), 24, 32]:
            xs = [rng.standard_normal((rows, w.shape[1]), dtype=np.float32) for w in ws]
            pairs = list(zip(xs, ws, strict=True))
            major = list(zip(xs, majors[name], strict=True))
            plain = median_us(lambda pairs=pairs: [x @ w.T for x, w in pairs], repeats, args.cold)
            blas = median_us(lambda major=major: [x @ w for x, w in major], repeats, args.cold)
            model = median_us(lambda pairs=pairs: [rows_times(x, w) for x, w in pairs], repeats, args.cold)
            best = min(plain, blas)
            if rows <= 16:
                ratios.append(best / model)
            print(f"    {rows:2d} rows: {plain:8.1f} {blas:8.1f} against {model:8.1f}  ({best / model:.2f}x)")
        print(f"    median ratio over 1-16 rows: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
