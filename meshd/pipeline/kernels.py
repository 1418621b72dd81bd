"""The weight products of a decode step, compiled: ``x @ w.T`` for a few rows.

A decode step multiplies a handful of rows (one per request in the batch)
by every weight.  BLAS's matrix product copies a weight into blocks before
it multiplies, which costs more than the arithmetic when there are only a
few rows: over the small preset's LM head share, 2 to 8 rows took two to
four times one row's time (``bench/rows.py``).  The kernel here reads each
weight row once from memory and takes its dot product with every input row
while it is in cache, four input rows at a time, so a batch of 8 costs about
twice one row, and one row costs about what BLAS's matrix-vector product
does.  For many rows (a prompt's prefill) BLAS's blocked product is the faster.

Each output element is one dot product over the weight row, in an order that
depends only on the input's row count and the row's place in it: a weight
cut into row blocks (the LM head split between two stages) gives the very
bits the whole weight gives, and the same rows give the same bits every time.
The sums may be reassociated (vectorised) and fused, not otherwise relaxed:
a NaN or an infinity in the input still comes out.

Numba compiles the kernel on first use and keeps the machine code in its
cache (next to this file, or the user's cache directory), so a process pays
the compile once per machine, about a second.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Up to this many rows a product runs in the kernel; more go to BLAS.  Measured on the small
# preset's weights (bench/rows.py, one core): the kernel's lead narrows as rows are added
# and BLAS's blocked product overtakes it on long prompts.
KERNEL_ROWS = 16
# Weight rows per tile: what a tile's rows meet in cache while every input row passes.
TILE = 256
_FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: NaN and inf propagate

_kernel: Any = None


def _dot_rows(x, w, out):  # numba compiles it (``_compile``)
    """out[t, n] = x[t] . w[n], over tiles of TILE weight rows, input rows four at a time."""
    T, K = x.shape
    N = w.shape[0]
    t4 = T - T % 4
    t2 = T - T % 2
    for n0 in range(0, N, TILE):
        n1 = min(N, n0 + TILE)
        for t in range(0, t4, 4):
            for n in range(n0, n1):
                s0 = np.float32(0.0)
                s1 = np.float32(0.0)
                s2 = np.float32(0.0)
                s3 = np.float32(0.0)
                for k in range(K):
                    b = w[n, k]
                    s0 += x[t, k] * b
                    s1 += x[t + 1, k] * b
                    s2 += x[t + 2, k] * b
                    s3 += x[t + 3, k] * b
                out[t, n] = s0
                out[t + 1, n] = s1
                out[t + 2, n] = s2
                out[t + 3, n] = s3
        if t2 > t4:
            for n in range(n0, n1):
                s0 = np.float32(0.0)
                s1 = np.float32(0.0)
                for k in range(K):
                    b = w[n, k]
                    s0 += x[t4, k] * b
                    s1 += x[t4 + 1, k] * b
                out[t4, n] = s0
                out[t4 + 1, n] = s1
        if T > t2:
            for n in range(n0, n1):
                s0 = np.float32(0.0)
                for k in range(K):
                    s0 += x[t2, k] * w[n, k]
                out[t2, n] = s0


def _compile() -> Any:
    from numba import njit

    flags = _FLAGS
    try:
        return njit(cache=True, fastmath=flags, boundscheck=False, error_model="numpy", nogil=True)(_dot_rows)
    except RuntimeError:  # no cache directory it may write: compile in each process
        return njit(fastmath=flags, boundscheck=False, error_model="numpy", nogil=True)(_dot_rows)


def rows_times(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for x (T, K) and a weight w (N, K) as checkpoints store it, C-contiguous
    float32: (T, N) float32.  A decode step's few rows run in the kernel, a prefill's many
    in BLAS; either way the same rows give the same bits (see the module's text)."""
    global _kernel
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"rows {x.shape} cannot multiply a weight {w.shape}: both need one width")
    if w.dtype != np.float32 or not w.flags.c_contiguous:
        raise ValueError(f"a weight must be C-contiguous float32, got {w.dtype}")
    if x.shape[0] > KERNEL_ROWS:
        # BLAS multiplies a row-major weight on the left faster than its transpose on the
        # right (a layer of 64 rows: 1.25x); the result is a transposed view, which every
        # later step takes as it is.
        return (w @ x.T).T
    if _kernel is None:
        _kernel = _compile()
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    _kernel(np.ascontiguousarray(x, dtype=np.float32), w, out)
    return out


def warm() -> None:
    """Compile (or load from the cache) now, not in the first request's step."""
    rows_times(np.ones((1, 4), dtype=np.float32), np.ones((2, 4), dtype=np.float32))
