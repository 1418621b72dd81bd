"""The weight products of a decode step, compiled: ``x @ w.T`` for a few rows.

A decode step multiplies a handful of rows (one per request in the batch)
by every weight.  BLAS's matrix product copies a weight into blocks before
it multiplies, which costs more than the arithmetic when there are only a
few rows: over the small preset's LM head share, 2 to 8 rows took two to
four times one row's time (``bench/rows.py``).  The kernel here reads each
weight row once from memory and takes its dot product with every input row
while it is in cache, four input rows against four weight rows at a time, so a
batch of 8 costs about twice one row, and one row costs about what BLAS's
matrix-vector product does.  For many rows (a prompt's prefill) BLAS's
blocked product is the faster.

Each output element is one dot product over the weight row, in an order that
depends only on the input's row count, the row's place in it and whether the
weight row is among a pair: a weight cut into row blocks at a multiple of
two rows (the LM head split between two stages, at a multiple of
``model.HEAD_CUT_ALIGN``) gives the very bits the whole weight gives, and the
same rows give the same bits every time.
The sums may be reassociated (vectorised) and fused, not otherwise relaxed:
a NaN or an infinity in the input still comes out.

Two more kernels serve a decode step, one row at a time, so a row's results
never depend on the batch it is in:

- ``attend_rows``: each request's attention for its one new position: rotates
  its query and key (RoPE), writes its key and value into the request's cache
  and attends over the positions its window sees.  numpy pays mostly for its
  calls per request: for 8 requests at position 64 it took 5.4 times the
  kernel's time (``bench/decode_step.py``).  Over a long context numpy's
  vectorised exponentials win, so a row past ``ATTEND_KERNEL_SCORES`` runs
  there (``StageModel._attend_rows``).
- ``top_k_floor``: the k-th largest entry of a row of scaled logits, what a
  sampled row's shortlist keeps everything at or above.  One pass with a heap
  of k entries, not a partition of the whole row: 4.5 times faster at k=20
  over the last stage's 14400 logits, and the very same value.

Numba compiles the kernels on first use and keeps the machine code in its
cache (next to this file, or the user's cache directory), so a process pays
the compile once per machine, a few seconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Up to this many rows a product runs in the kernel; more go to BLAS.  Measured on the small
# preset's weights (bench/rows.py, one core): the kernel's lead narrows as rows are added
# and BLAS's blocked product overtakes it on long prompts.
KERNEL_ROWS = 16
# A decode row's attention runs in the kernel up to this many scores (its query heads times
# the positions it sees); past it, numpy's batched products and vectorised exponentials are
# the faster.  Measured one row at a time: the two cross at about 8000 scores for 6, 16 and
# 32 heads (positions 1200, 512 and 256).
ATTEND_KERNEL_SCORES = 8192
# Weight rows per tile: what a tile's rows meet in cache while every input row passes.
TILE = 256
_FLAGS = {"reassoc", "contract", "arcp", "nsz"}  # not nnan/ninf: NaN and inf propagate

# Compiled on first use (``_compiled``): name -> the numba dispatcher.
_kernels: dict[str, Any] = {}


def _dot_rows(x, w, out):  # numba compiles it (``_compiled``)
    """out[t, n] = x[t] . w[n], over tiles of TILE weight rows.

    Input rows go four at a time, and each four meet two weight rows at once:
    eight sums in registers, so each weight value loaded serves four products
    and each input value two, where one weight row at a time loads an input
    value for every product.  Sixteen sums (four weight rows) do not fit in
    AVX2's sixteen vector registers beside the values they take, and spill to
    memory on every step: 10-25 % slower at 8 and 16 rows.  A tile's last
    weight row (when it has an odd number) and the last input rows (fewer
    than four) go one weight row at a time.  Which body computes an element
    depends only on T and the element's place in its tile, so a weight cut at
    a multiple of two rows gives the whole weight's bits.
    """
    T, K = x.shape
    N = w.shape[0]
    t4 = T - T % 4
    t2 = T - T % 2
    for n0 in range(0, N, TILE):
        n1 = min(N, n0 + TILE)
        q1 = n0 + (n1 - n0) // 2 * 2
        for t in range(0, t4, 4):
            for n in range(n0, q1, 2):
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                b0 = np.float32(0.0)
                b1 = np.float32(0.0)
                b2 = np.float32(0.0)
                b3 = np.float32(0.0)
                for k in range(K):
                    x0 = x[t, k]
                    x1 = x[t + 1, k]
                    x2 = x[t + 2, k]
                    x3 = x[t + 3, k]
                    wa = w[n, k]
                    wb = w[n + 1, k]
                    a0 += x0 * wa
                    a1 += x1 * wa
                    a2 += x2 * wa
                    a3 += x3 * wa
                    b0 += x0 * wb
                    b1 += x1 * wb
                    b2 += x2 * wb
                    b3 += x3 * wb
                out[t, n] = a0
                out[t + 1, n] = a1
                out[t + 2, n] = a2
                out[t + 3, n] = a3
                out[t, n + 1] = b0
                out[t + 1, n + 1] = b1
                out[t + 2, n + 1] = b2
                out[t + 3, n + 1] = b3
            for n in range(q1, n1):
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


def _rotate(x, cos, sin, out):  # numba compiles it without fastmath: apply_rope's very bits
    """Rotate-half RoPE of one head's vector x (hd,) by cos, sin (hd / 2,), into out (hd,)."""
    half = cos.shape[0]
    for i in range(half):
        a = x[i] * cos[i]
        b = x[i + half] * sin[i]
        out[i] = a - b
        c = x[i + half] * cos[i]
        d = x[i] * sin[i]
        out[i + half] = c + d


def _attend_row(qkv, cos, sin, keys, values, pos, lo, scale, out):  # numba compiles it (``_compiled``)
    """One request's attention at position ``pos``.  qkv (H + 2 KV, hd): the row's queries,
    key and value heads, the query and key not yet rotated; cos, sin (hd / 2,): ``pos``'s
    RoPE angles.  Writes the rotated key and the value at ``pos`` of a layer's keys and
    values (KV, positions, hd), then for each query head the softmax of its scaled scores
    over positions lo..pos times those values, into out (H, hd)."""
    KV, _, hd = keys.shape
    H = qkv.shape[0] - 2 * KV
    G = H // KV
    for j in range(KV):
        _jit_rotate(qkv[H + j], cos, sin, keys[j, pos])
        for d in range(hd):
            values[j, pos, d] = qkv[H + KV + j, d]
    q = np.empty(hd, dtype=np.float32)
    scores = np.empty(pos + 1 - lo, dtype=np.float32)
    acc = np.empty(hd, dtype=np.float32)
    for h in range(H):
        j = h // G
        _jit_rotate(qkv[h], cos, sin, q)
        top = np.float32(-np.inf)
        for p in range(lo, pos + 1):
            s = np.float32(0.0)
            for d in range(hd):
                s += q[d] * keys[j, p, d]
            s *= scale
            scores[p - lo] = s
            top = max(top, s)
        total = np.float32(0.0)
        for i in range(pos + 1 - lo):
            e = np.exp(scores[i] - top)
            scores[i] = e
            total += e
        for d in range(hd):
            acc[d] = 0.0
        for p in range(lo, pos + 1):
            e = scores[p - lo]
            for d in range(hd):
                acc[d] += e * values[j, p, d]
        for d in range(hd):
            out[h, d] = acc[d] / total


def _top_k_floor(x, k):  # numba compiles it, without fastmath: only comparisons
    """The k-th largest of x (1 <= k <= len(x)), ties counted; NaN if x holds a NaN."""
    heap = np.empty(k, dtype=x.dtype)  # a min-heap of the k largest so far
    n = 0
    for i in range(x.shape[0]):
        v = x[i]
        if v != v:
            return v
        if n < k:
            j = n
            n += 1
            while j > 0:
                parent = (j - 1) >> 1
                if heap[parent] <= v:
                    break
                heap[j] = heap[parent]
                j = parent
            heap[j] = v
        elif v > heap[0]:
            j = 0
            while True:
                c = 2 * j + 1
                if c >= k:
                    break
                if c + 1 < k and heap[c + 1] < heap[c]:
                    c += 1
                if heap[c] >= v:
                    break
                heap[j] = heap[c]
                j = c
            heap[j] = v
    return heap[0]


def _rms_norm_into(x, weight, eps, out):  # numba compiles it (``_compiled``)
    """RMSNorm of each row of x (T, D) times ``weight`` (D,), into out (T, D)."""
    T, D = x.shape
    inv_d = np.float32(1.0) / np.float32(D)
    for t in range(T):
        ss = np.float32(0.0)
        for d in range(D):
            ss += x[t, d] * x[t, d]
        scale = np.float32(1.0) / np.sqrt(ss * inv_d + eps)
        for d in range(D):
            out[t, d] = x[t, d] * scale * weight[d]


def _add_into(x, y):  # numba compiles it: x += y, rows alike
    for t in range(x.shape[0]):
        for d in range(x.shape[1]):
            x[t, d] += y[t, d]


def _add_bias(out, bias):  # numba compiles it; an empty bias adds nothing
    if bias.shape[0]:
        for t in range(out.shape[0]):
            for n in range(out.shape[1]):
                out[t, n] += bias[n]


def _layer_in(x, norm, eps, w, bias, out):  # numba compiles it
    """A decoder layer's start for a decode step's rows: out = rms_norm(x) @ w.T + bias."""
    h = np.empty_like(x)
    _jit_rms_norm(x, norm, eps, h)
    _jit_dot_rows(h, w, out)
    _jit_add_bias(out, bias)


def _layer_mid(x, attn, wo, bo, norm, eps, w_gate_up, b_gate_up, out):  # numba compiles it
    """After attention: x += attn @ wo.T + bo, in place; out = rms_norm(x) @ w_gate_up.T + b_gate_up."""
    o = np.empty_like(x)
    _jit_dot_rows(attn, wo, o)
    _jit_add_bias(o, bo)
    _jit_add_into(x, o)
    h = np.empty_like(x)
    _jit_rms_norm(x, norm, eps, h)
    _jit_dot_rows(h, w_gate_up, out)
    _jit_add_bias(out, b_gate_up)


def _layer_out(x, a, w_down, b_down):  # numba compiles it
    """A decoder layer's end: x += a @ w_down.T + b_down, in place."""
    d_out = np.empty_like(x)
    _jit_dot_rows(a, w_down, d_out)
    _jit_add_bias(d_out, b_down)
    _jit_add_into(x, d_out)


# Each kernel's Python source, its fastmath flags, and the kernels it calls, by name.
_SOURCES: dict[str, tuple[Any, set[str], tuple[str, ...]]] = {
    "dot_rows": (_dot_rows, _FLAGS, ()),
    "rotate": (_rotate, set(), ()),
    "attend_row": (_attend_row, _FLAGS, ("rotate",)),
    "top_k_floor": (_top_k_floor, set(), ()),
    "rms_norm": (_rms_norm_into, _FLAGS, ()),
    "add_bias": (_add_bias, _FLAGS, ()),
    "add_into": (_add_into, _FLAGS, ()),
    "layer_in": (_layer_in, _FLAGS, ("rms_norm", "dot_rows", "add_bias")),
    "layer_mid": (_layer_mid, _FLAGS, ("rms_norm", "dot_rows", "add_bias", "add_into")),
    "layer_out": (_layer_out, _FLAGS, ("dot_rows", "add_bias", "add_into")),
}
# The compiled kernels other kernels call: numba reads these globals when it compiles a
# caller, so ``_compiled`` binds each callee first.
_jit_rotate: Any = None
_jit_dot_rows: Any = None
_jit_rms_norm: Any = None
_jit_add_bias: Any = None
_jit_add_into: Any = None


def _compiled(name: str) -> Any:
    kernel = _kernels.get(name)
    if kernel is None:
        from numba import njit

        fn, flags, calls = _SOURCES[name]
        for callee in calls:
            globals()["_jit_" + callee] = _compiled(callee)
        try:
            kernel = njit(cache=True, fastmath=flags, boundscheck=False, error_model="numpy", nogil=True)(fn)
        except RuntimeError:  # no cache directory it may write: compile in each process
            kernel = njit(fastmath=flags, boundscheck=False, error_model="numpy", nogil=True)(fn)
        _kernels[name] = kernel
    return kernel


def rows_times(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for x (T, K) and a weight w (N, K) as checkpoints store it, C-contiguous
    float32: (T, N) float32.  A decode step's few rows run in the kernel, a prefill's many
    in BLAS; either way the same rows give the same bits (see the module's text)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"rows {x.shape} cannot multiply a weight {w.shape}: both need one width")
    if w.dtype != np.float32 or not w.flags.c_contiguous:
        raise ValueError(f"a weight must be C-contiguous float32, got {w.dtype}")
    if x.shape[0] > KERNEL_ROWS:
        # BLAS multiplies a row-major weight on the left faster than its transpose on the
        # right (a layer of 64 rows: 1.25x); the result is a transposed view, which every
        # later step takes as it is.
        return (w @ x.T).T
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    _compiled("dot_rows")(np.ascontiguousarray(x, dtype=np.float32), w, out)
    return out


def attend_rows(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                caches: list[tuple[np.ndarray, np.ndarray]], positions: list[int], windows_from: list[int],
                scale: np.float32) -> np.ndarray:
    """A decode step's attention, one row per request: row b of qkv (B, H + 2 KV, hd) is
    request b's query, key and value heads at ``positions[b]``, rotated here by that
    position's RoPE angles from the tables cos, sin (positions, hd / 2).  Writes its key and
    value into ``caches[b]``, one layer's (keys, values), each (KV, positions, hd) C-contiguous
    float32, and attends over its positions windows_from[b]..positions[b].  Returns (B, H, hd).

    Each row runs alone in the kernel, in one fixed order: its result is the same bits in
    any batch, alone included."""
    B, width, hd = qkv.shape
    KV = caches[0][0].shape[0] if caches else 1
    H = width - 2 * KV
    if (not B == len(caches) == len(positions) == len(windows_from) or qkv.dtype != np.float32
            or H <= 0 or H % KV or cos.shape != sin.shape or cos.ndim != 2 or 2 * cos.shape[1] != hd
            or cos.dtype != np.float32 or sin.dtype != np.float32):
        raise ValueError(f"attention over {qkv.shape} {qkv.dtype} rows for {len(caches)} caches: "
                         "shapes do not fit")
    qkv = np.ascontiguousarray(qkv)
    out = np.empty((B, H, hd), dtype=np.float32)
    kernel = _compiled("attend_row")
    for b in range(B):
        keys, values = caches[b]
        pos, lo = positions[b], windows_from[b]
        if (keys.dtype != np.float32 or values.dtype != np.float32 or not keys.flags.c_contiguous
                or not values.flags.c_contiguous or values.shape != keys.shape
                or keys.shape != (KV, keys.shape[1], hd)
                or not 0 <= lo <= pos < min(keys.shape[1], cos.shape[0])):
            raise ValueError(f"attention of row {b} over a cache {keys.shape}/{values.shape} at positions "
                             f"{lo}..{pos}: shapes or positions do not fit")
        kernel(qkv[b], cos[pos], sin[pos], keys, values, pos, lo, scale, out[b])
    return out


_NO_BIAS = np.empty(0, dtype=np.float32)


def _fits(what: str, *checks: bool) -> None:
    if not all(checks):
        raise ValueError(f"{what}: shapes do not fit")


def _rows(a: np.ndarray) -> bool:
    """Whether ``a`` is rows as the compiled layers take them: 2-D, C-contiguous float32."""
    return a.ndim == 2 and a.flags.c_contiguous and a.dtype == np.float32


def layer_in(x: np.ndarray, norm: np.ndarray, eps: np.float32, w: np.ndarray, bias: np.ndarray | None
             ) -> np.ndarray:
    """A decoder layer's start for a decode step's rows x (T, D) C-contiguous float32:
    ``rms_norm(x) @ w.T + bias``, (T, N), in one compiled call."""
    _fits("a layer's input", _rows(x), norm.shape == (x.shape[1],), w.ndim == 2, w.shape[1] == x.shape[1],
          bias is None or bias.shape == (w.shape[0],))
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    _compiled("layer_in")(x, norm, eps, w, _NO_BIAS if bias is None else bias, out)
    return out


def layer_mid(x: np.ndarray, attn: np.ndarray, wo: np.ndarray, bo: np.ndarray | None, norm: np.ndarray,
              eps: np.float32, w_gate_up: np.ndarray, b_gate_up: np.ndarray | None) -> np.ndarray:
    """After attention: ``x += attn @ wo.T + bo`` in place, then ``rms_norm(x) @ w_gate_up.T +
    b_gate_up``, (T, 2 I), in one compiled call."""
    _fits("a layer's attention output", _rows(x), _rows(attn), attn.shape[0] == x.shape[0],
          wo.shape == (x.shape[1], attn.shape[1]), bo is None or bo.shape == (x.shape[1],),
          norm.shape == (x.shape[1],), w_gate_up.ndim == 2, w_gate_up.shape[1] == x.shape[1],
          b_gate_up is None or b_gate_up.shape == (w_gate_up.shape[0],))
    out = np.empty((x.shape[0], w_gate_up.shape[0]), dtype=np.float32)
    _compiled("layer_mid")(x, attn, wo, _NO_BIAS if bo is None else bo, norm, eps, w_gate_up,
                           _NO_BIAS if b_gate_up is None else b_gate_up, out)
    return out


def layer_out(x: np.ndarray, a: np.ndarray, w_down: np.ndarray, b_down: np.ndarray | None) -> None:
    """A decoder layer's end: ``x += a @ w_down.T + b_down``, in place, in one compiled call."""
    _fits("a layer's MLP output", _rows(x), _rows(a), a.shape[0] == x.shape[0],
          w_down.shape == (x.shape[1], a.shape[1]), b_down is None or b_down.shape == (x.shape[1],))
    _compiled("layer_out")(x, a, w_down, _NO_BIAS if b_down is None else b_down)


def top_k_floor(x: np.ndarray, k: int) -> np.float32:
    """The k-th largest entry of the float32 vector ``x``, ties counted: the same value as
    ``np.partition(x, -k)[-k]``, NaN when ``x`` holds a NaN."""
    if x.ndim != 1 or x.dtype != np.float32 or not 1 <= k <= x.shape[0]:
        raise ValueError(f"the {k}-th largest of {x.shape} {x.dtype}: needs a float32 vector of at least k")
    return _compiled("top_k_floor")(np.ascontiguousarray(x), k)


def warm() -> None:
    """Compile (or load from the cache) now, not in the first request's step."""
    rows_times(np.ones((1, 4), dtype=np.float32), np.ones((2, 4), dtype=np.float32))
    cache = np.ones((1, 2, 4), dtype=np.float32), np.ones((1, 2, 4), dtype=np.float32)
    table = np.ones((2, 2), dtype=np.float32)
    attend_rows(np.ones((1, 3, 4), dtype=np.float32), table, table, [cache], [1], [0], np.float32(0.5))
    top_k_floor(np.ones(3, dtype=np.float32), 2)
    x, w, eps = np.ones((1, 4), dtype=np.float32), np.ones((4, 4), dtype=np.float32), np.float32(1e-5)
    qkv = layer_in(x, x[0], eps, w, None)
    layer_out(x, layer_mid(x, qkv, w, None, x[0], eps, w, None), w, None)
