"""A Llama decoder in numpy, float32 end to end, cut into stages.

A ``StageModel`` holds layers [a, b), plus the embedding if it is the first
stage and the final norm and LM head if it is the last.  The whole model is
the stage with every layer.  Chaining stages

    hidden = first.embed(ids)
    for stage, cache in zip(stages, caches):
        hidden = stage.forward(hidden, cache, start_pos)
    logits = last.logits(hidden[-1:])

runs exactly the same numpy operations, in the same order and shapes, as the
whole model, so its logits are the same bits.

Conventions are Hugging Face's (``LlamaForCausalLM``, and the families shaped
like it: ``MistralForCausalLM``, ``Qwen2ForCausalLM``): RMSNorm computed in
float32, rotate-half RoPE (with Llama 3's or linear scaling), grouped-query
attention (windowed in the layers a config names), SwiGLU MLP, Linear
weights stored (out, in), with biases where the config has them.  Every
scalar is ``np.float32``: a Python float would be harmless under NEP 50, a
float64 numpy scalar would not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .config import LlamaConfig
from .kernels import (
    ATTEND_KERNEL_SCORES,
    KERNEL_ROWS,
    attend_rows,
    layer_in,
    layer_mid,
    layer_out,
    rows_times,
    warm,
)

if TYPE_CHECKING:
    from .checkpoint import Progress

F32 = np.float32
# A prefill longer than this runs as chunks of this many rows, each attending to the cache the
# ones before it wrote.  Attention's scores are (heads, chunk, context) rather than (heads,
# prompt, context): a 2048-row prompt of the small preset's shape needs 25 MB of them, not
# 100 MB, and runs in about a third of the time.  Between chunks a stage runs the decode
# steps in flight (``stage.py``).  Every path that prefills (one process, a stage, a replay)
# cuts at the same rows, so the pipeline's numbers stay the same bits as one process's.
PREFILL_CHUNK = 256


def prefill_chunks(rows: int) -> list[slice]:
    """The row slices ``forward`` runs a ``rows``-row pass as, in order."""
    return [slice(a, min(a + PREFILL_CHUNK, rows)) for a in range(0, rows, PREFILL_CHUNK)] or [slice(0, 0)]


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, near-equal layer ranges; the first stages take the extra layers."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for k in range(num_stages):
        stop = start + base + (1 if k < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def kv_cache_bytes(config: LlamaConfig, layers: int, positions: int) -> int:
    """The bytes of a KVCache for ``layers`` layers and ``positions`` positions: keys and
    values, float32.  The orchestrator's admission counts with it what the stages allocate."""
    return 2 * layers * config.num_key_value_heads * positions * config.head_dim * 4


class KVCache:
    """Keys and values of one request for one stage's layers, preallocated.

    ``k``/``v``: (stage layers, kv heads, max_seq, head_dim) float32.
    ``length``: positions filled so far.
    """

    __slots__ = ("k", "v", "length", "max_seq")

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq: int):
        shape = (num_layers, num_kv_heads, max_seq, head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.length = 0
        self.max_seq = max_seq

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def inv_frequencies(config: LlamaConfig) -> np.ndarray:
    """RoPE's (head_dim // 2,) inverse frequencies, float64, after the config's scaling.

    The same formulas as Hugging Face's ``ROPE_INIT_FUNCTIONS`` for ``linear``
    and ``llama3``."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled)


def rope_tables(config: LlamaConfig, max_seq: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: (positions, head_dim // 2) float32.

    Hugging Face builds cos/sin of ``cat(freqs, freqs)``; both halves are
    equal, so one half is kept.  Computed in float64 and rounded once, each
    entry on its own: a longer table starts with the same bits.
    """
    n = config.max_position_embeddings if max_seq is None else max_seq
    freqs = np.outer(np.arange(n, dtype=np.float64), inv_frequencies(config))  # (n, hd/2)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


# RoPE tables cover this many positions at first and grow on demand: Llama 3.2 names 131072.
ROPE_INITIAL = 4096


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).

    x: (heads, T, head_dim); cos, sin: (T, head_dim // 2).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty(x.shape, dtype=np.float32)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """x: (T, D) float32 -> (T, D) float32."""
    var = np.sum(x * x, axis=-1, keepdims=True) * F32(1.0 / x.shape[-1])  # np.mean costs 3x the calls
    return x * (F32(1.0) / np.sqrt(var + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), with sigmoid via tanh: no overflow warning for large negative x
    return x * (F32(0.5) + F32(0.5) * np.tanh(F32(0.5) * x))


class _Layer:
    """One decoder layer's weights, q/k/v and gate/up fused so each is one product.

    Each weight is kept as the checkpoint stores it, (out, in) C-contiguous: the kernel
    behind ``rows_times`` reads it a row at a time.  A bias the config does not have is
    None, so the plain Llama layer adds nothing."""

    __slots__ = ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm",
                 "bqkv", "bo", "b_gate_up", "b_down", "window")

    def __init__(self, take: Callable[[str], np.ndarray], prefix: str, config: LlamaConfig, index: int):
        def get(name: str) -> np.ndarray:
            return np.ascontiguousarray(take(prefix + name), dtype=np.float32)

        def joined(*names: str) -> np.ndarray:  # weights stacked (or biases end to end), one copy
            return np.concatenate([get(n) for n in names])

        self.wqkv = joined("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                           "self_attn.v_proj.weight")  # (q + 2 kv, D)
        self.wo = get("self_attn.o_proj.weight")  # (D, q)
        self.w_gate_up = joined("mlp.gate_proj.weight", "mlp.up_proj.weight")  # (2I, D)
        self.w_down = get("mlp.down_proj.weight")  # (D, I)
        self.attn_norm = get("input_layernorm.weight")
        self.mlp_norm = get("post_attention_layernorm.weight")
        self.bqkv = self.bo = self.b_gate_up = self.b_down = None
        if config.qkv_bias:
            self.bqkv = joined("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
        if config.o_bias:
            self.bo = get("self_attn.o_proj.bias")
        if config.mlp_bias:
            self.b_gate_up = joined("mlp.gate_proj.bias", "mlp.up_proj.bias")
            self.b_down = get("mlp.down_proj.bias")
        self.window = config.window(index)


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    out = rows_times(x, weight)
    if bias is not None:
        out += bias
    return out


def attention_mask(start_pos: int, T: int, window: int | None) -> np.ndarray | None:
    """(T, start_pos + T) additive mask: query i (position start_pos + i) sees keys
    ``max(0, p - window + 1) .. p`` of p = start_pos + i; None when it sees every key."""
    end = start_pos + T
    q = np.arange(start_pos, end)[:, None]
    k = np.arange(end)[None, :]
    hidden = k > q
    if window is not None:
        hidden |= k <= q - window
    if not hidden.any():
        return None
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))


def _mask(masks: dict[tuple[int, int | None], np.ndarray | None], start_pos: int, T: int,
          window: int | None) -> np.ndarray | None:
    """``attention_mask(start_pos, T, window)``, kept in ``masks`` for the rest of the pass
    (one row without a window needs none, wherever it is)."""
    key = (start_pos, window) if T > 1 or window is not None else (-1, None)
    if key not in masks:
        masks[key] = attention_mask(start_pos, T, window)
    return masks[key]


# Where a pipeline cuts the LM head's rows between stage 0 and the last stage, as a
# fraction of the vocabulary for stage 0.  Stage 0 starts on its rows a hop after the last
# stage starts on its own, and the last stage's shortlist then has a hop to go: the two
# hops about cancel.  Measured on loopback (small preset, 3 stages, one process per node,
# a single stream's latency against the monolithic run's, two meshes in turn): 0.5 against
# 0.55, 1.326 against 1.355 (8 rounds of 8 pairs) and 1.533 against 1.561 (10 rounds, a
# slower hour).  With the stages pinned to CPUs (threads.stage_cpus) stage 0 then waited a
# median 0.17 ms for the last stage's shortlist in one slow hour, and 0.5, 0.53 and 0.55
# measured alike there (1.496, 1.523, 1.492; 5 rounds): where the two halves meet moves
# with the host's hour.
HEAD_CUT_FRACTION = 0.5
# The cut falls on a multiple of this many rows: BLAS computes rows in blocks, and the
# rows of a partial block another way (seen with OpenBLAS at 19199 and 19201 of 32000).
HEAD_CUT_ALIGN = 64


def head_cut(vocab: int) -> int:
    """The first token id of the last stage's share of the LM head.

    ``StageModel.logits`` computes the head in the same two blocks, so the
    pipeline's two halves give the very logits the whole model gives."""
    if vocab <= 2 * HEAD_CUT_ALIGN:
        return vocab // 2
    return max(HEAD_CUT_ALIGN, int(vocab * HEAD_CUT_FRACTION) // HEAD_CUT_ALIGN * HEAD_CUT_ALIGN)


class StageModel:
    """Layers [a, b) of a Llama model, plus the embedding and/or the head if this stage has them."""

    def __init__(self, config: LlamaConfig, weights: Mapping[str, np.ndarray], layers: range | None = None,
                 *, embed: bool | None = None, head: bool | None = None, release: bool = False):
        """``release``: ``weights`` is a dict of the caller's that this takes apart, dropping each
        layer's tensors as this takes them (a fused weight's parts once stacked), so a stage
        loading holds about one copy of its layers, not two."""
        n = config.num_hidden_layers
        layers = range(n) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= n:
            raise ValueError(f"layers {layers} is not a contiguous range within 0..{n}")
        self.config = config
        self.layer_range = layers
        self.has_embed = layers.start == 0 if embed is None else embed
        self.has_head = layers.stop == n if head is None else head
        self._eps = F32(config.rms_norm_eps)
        self._scale = F32(1.0 / np.sqrt(config.head_dim))
        # (cos, sin), replaced whole when it grows: a pass in another thread keeps the pair it took
        self._rope = rope_tables(config, min(ROPE_INITIAL, config.max_position_embeddings))
        take: Callable[[str], np.ndarray] = weights.__getitem__
        if release:
            if not isinstance(weights, dict):
                raise TypeError("release=True takes a dict apart; got " + type(weights).__name__)
            take = weights.pop
        self._layers = [_Layer(take, f"model.layers.{i}.", config, i) for i in layers]
        self._embed = None
        self._norm = self._head = None
        if self.has_head:
            self._norm = np.asarray(weights["model.norm.weight"], dtype=np.float32)
            name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            self._head = np.ascontiguousarray(weights[name], dtype=np.float32)  # (V, D)
        if self.has_embed:
            if self._head is not None and config.tie_word_embeddings:
                self._embed = self._head  # one copy of the tied table
            else:
                self._embed = np.asarray(weights["model.embed_tokens.weight"], dtype=np.float32)  # (V, D)
        warm()  # the kernel compiled (or read from its cache) now, not in the first request

    @classmethod
    def load(cls, model_dir: str | Path, layers: range | None = None, *, embed: bool | None = None,
             head: bool | None = None, config: LlamaConfig | None = None,
             progress: Progress | None = None) -> StageModel:
        """Read this stage's tensors only (see ``checkpoint.load_weights``)."""
        from .checkpoint import load_weights

        if config is None:
            config = LlamaConfig.load(model_dir)
        n = config.num_hidden_layers
        layers = range(n) if layers is None else layers
        embed = layers.start == 0 if embed is None else embed
        head = layers.stop == n if head is None else head
        weights = load_weights(model_dir, layers, embed=embed, head=head, config=config, progress=progress)
        return cls(config, weights, layers, embed=embed, head=head, release=True)

    def cache_bytes(self, max_seq: int) -> int:
        """What ``new_cache(max_seq)`` allocates."""
        return kv_cache_bytes(self.config, len(self._layers), max_seq)

    def new_cache(self, max_seq: int | None = None) -> KVCache:
        """A KV cache for one request, for this stage's layers."""
        c = self.config
        max_seq = c.max_position_embeddings if max_seq is None else max_seq
        if not 1 <= max_seq <= c.max_position_embeddings:
            raise ValueError(f"max_seq {max_seq} is outside 1..{c.max_position_embeddings}")
        return KVCache(len(self._layers), c.num_key_value_heads, c.head_dim, max_seq)

    def embed(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token ids (T,) -> hidden (T, D) float32."""
        if self._embed is None:
            raise RuntimeError(f"stage {self.layer_range} has no embedding")
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0]
            raise ValueError(f"token id {bad} is outside 0..{self.config.vocab_size - 1}")
        return np.ascontiguousarray(self._embed[ids])

    def forward(self, hidden: np.ndarray, cache: KVCache, start_pos: int) -> np.ndarray:
        """Run this stage's layers on positions [start_pos, start_pos + T).

        hidden: (T, D) float32.  Prefill passes the whole prompt (causal
        mask), decode one row.  Writes keys/values at those positions of
        ``cache`` and attends to everything before them.  More than
        PREFILL_CHUNK rows run as ``prefill_chunks``, one pass each.
        """
        if hidden.ndim != 2 or hidden.shape[0] <= PREFILL_CHUNK:
            return self.forward_batch(hidden, [(cache, start_pos)])
        return np.concatenate([self.forward_batch(hidden[rows], [(cache, start_pos + rows.start)])
                               for rows in prefill_chunks(hidden.shape[0])])

    def forward_batch(self, hidden: np.ndarray, parts: Sequence[tuple[KVCache, int]]) -> np.ndarray:
        """Several requests' rows in one pass: part i is a request's cache and the position of
        its first row; hidden holds every part's rows in order, one row each for a decode
        batch, all of them for one part.  The matrix products run once over every row (each
        weight read once per batch); attention runs per part, over its own cache.  One part
        runs the very operations ``forward`` runs."""
        c = self.config
        if hidden.dtype != np.float32 or hidden.ndim != 2 or hidden.shape[1] != c.hidden_size:
            raise ValueError(f"hidden must be (T, {c.hidden_size}) float32, "
                             f"got {hidden.shape} {hidden.dtype}")
        if not parts:
            raise ValueError("a batch of no requests")
        rows = hidden.shape[0] if len(parts) == 1 else 1
        if len(parts) > 1 and hidden.shape[0] != len(parts):
            raise ValueError(f"a batch of {len(parts)} requests needs one row each, got {hidden.shape[0]}")
        spans = []
        for cache, start_pos in parts:
            end = start_pos + rows
            if not 0 <= start_pos <= cache.length or end > cache.max_seq:
                raise ValueError(f"positions {start_pos}..{end} do not fit the cache "
                                 f"(filled {cache.length}, size {cache.max_seq})")
            spans.append((cache, start_pos, end))
        top = max(end for _, _, end in spans)
        rope = self._rope
        if top > rope[0].shape[0]:
            rope = self._rope = rope_tables(c, min(max(top, 2 * rope[0].shape[0]), c.max_position_embeddings))
        if rows == 1 and hidden.shape[0] <= KERNEL_ROWS:
            x = self._decode_layers(hidden, spans, rope)
        else:
            x = self._numpy_layers(hidden, rows, spans, rope)
        for cache, _, end in spans:
            cache.length = max(cache.length, end)
        return x

    def _decode_layers(self, hidden: np.ndarray, spans: Sequence[tuple[KVCache, int, int]],
                       rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """A decode step's layers: each layer's norms, products and residual sums in three
        compiled calls, attention per request between them, silu in numpy (vectorised)."""
        inter = self.config.intermediate_size
        x = np.array(hidden, order="C")  # the kernels add into it
        for li, layer in enumerate(self._layers):
            qkv = layer_in(x, layer.attn_norm, self._eps, layer.wqkv, layer.bqkv)
            attn = self._attend_rows(qkv, li, layer.window, spans, rope)
            gate_up = layer_mid(x, attn, layer.wo, layer.bo, layer.mlp_norm, self._eps, layer.w_gate_up,
                                layer.b_gate_up)
            layer_out(x, silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.w_down, layer.b_down)
        return x

    def _numpy_layers(self, hidden: np.ndarray, rows: int, spans: Sequence[tuple[KVCache, int, int]],
                      rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """The layers in numpy and BLAS: one part's ``rows`` rows (a prompt), or a decode step
        of more than KERNEL_ROWS requests (``rows`` 1)."""
        inter = self.config.intermediate_size
        masks: dict[tuple[int, int | None], np.ndarray | None] = {}
        x = hidden
        for li, layer in enumerate(self._layers):
            h = rms_norm(x, layer.attn_norm, self._eps)
            qkv = _linear(h, layer.wqkv, layer.bqkv)  # (T, qd + 2 kvd)
            if rows == 1:  # a decode step of more than KERNEL_ROWS requests
                attn = self._attend_rows(qkv, li, layer.window, spans, rope)
            else:
                attn = self._attend(qkv, li, layer.window, *spans[0], masks, rope)
            x = x + _linear(attn, layer.wo, layer.bo)
            h = rms_norm(x, layer.mlp_norm, self._eps)
            gate_up = _linear(h, layer.w_gate_up, layer.b_gate_up)  # (T, 2I)
            x = x + _linear(silu(gate_up[:, :inter]) * gate_up[:, inter:], layer.w_down, layer.b_down)
        return x

    def _attend(self, qkv: np.ndarray, li: int, window: int | None, cache: KVCache, start_pos: int, end: int,
                masks: dict[tuple[int, int | None], np.ndarray | None],
                rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Layer ``li``'s attention for one request's rows: (T, qd + 2 kvd) -> (T, qd).  Writes
        its keys and values at [start_pos, end) of ``cache``."""
        c = self.config
        H, KV, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        G, qd, kvd = H // KV, H * hd, KV * hd
        T = end - start_pos
        cos, sin = rope[0][start_pos:end], rope[1][start_pos:end]  # (T, hd/2)
        q = qkv[:, :qd].reshape(T, H, hd).transpose(1, 0, 2)  # (H, T, hd)
        k = qkv[:, qd:qd + kvd].reshape(T, KV, hd).transpose(1, 0, 2)  # (KV, T, hd)
        v = qkv[:, qd + kvd:].reshape(T, KV, hd).transpose(1, 0, 2)
        q = apply_rope(q, cos, sin)
        cache.k[li, :, start_pos:end] = apply_rope(k, cos, sin)
        cache.v[li, :, start_pos:end] = v
        attn = self._over_cache(q.reshape(KV, G, T, hd), li, cache, end, _mask(masks, start_pos, T, window))
        return attn.reshape(H, T, hd).transpose(1, 0, 2).reshape(T, qd)

    def _over_cache(self, q: np.ndarray, li: int, cache: KVCache, end: int, mask: np.ndarray | None
                    ) -> np.ndarray:
        """Queries (KV, G, T, hd) over layer ``li``'s keys and values [0, end) of ``cache``:
        softmax of the scaled, masked scores times the values, (KV, G, T, hd)."""
        keys = cache.k[li, :, :end]  # (KV, end, hd)
        values = cache.v[li, :, :end]
        # grouped-query: each kv head serves G query heads, no copy of k/v
        scores = q @ keys[:, None].transpose(0, 1, 3, 2)  # (KV, G, T, end)
        scores *= self._scale
        if mask is not None:
            scores += mask
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return scores @ values[:, None]

    def _attend_rows(self, qkv: np.ndarray, li: int, window: int | None,
                     spans: Sequence[tuple[KVCache, int, int]],
                     rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Layer ``li``'s attention for a decode step, one row per request: (B, qd + 2 kvd) ->
        (B, qd).  A row whose scores (query heads x the positions it sees) are at most
        ``ATTEND_KERNEL_SCORES`` is rotated and attends over its own cache in the compiled
        ``attend_rows``, which also writes its key and value there; a longer one runs
        ``_attend``, numpy's batched products and exponentials being the faster there.
        Which way a row goes depends on that row alone, so its result is the same bits in
        any batch, alone included."""
        c = self.config
        H, hd = c.num_attention_heads, c.head_dim
        B = len(spans)
        lows = [0 if window is None else max(0, start - window + 1) for _, start, _ in spans]
        short = [b for b, (_, start, _) in enumerate(spans)
                 if H * (start + 1 - lows[b]) <= ATTEND_KERNEL_SCORES]
        if len(short) == B:
            heads = qkv.reshape(B, H + 2 * c.num_key_value_heads, hd)
            out = attend_rows(heads, rope[0], rope[1], [(cache.k[li], cache.v[li]) for cache, _, _ in spans],
                              [start for _, start, _ in spans], lows, self._scale)
            return out.reshape(B, H * hd)
        out = np.empty((B, H * hd), dtype=np.float32)
        if short:
            out[short] = self._attend_rows(qkv[short], li, window, [spans[b] for b in short], rope)
        masks: dict[tuple[int, int | None], np.ndarray | None] = {}
        for b in sorted(set(range(B)) - set(short)):
            cache, start, end = spans[b]
            out[b] = self._attend(qkv[b:b + 1], li, window, cache, start, end, masks, rope)[0]
        return out

    def final_norm(self, hidden: np.ndarray) -> np.ndarray:
        """The final RMSNorm, hidden (T, D) -> (T, D): what the LM head multiplies."""
        if self._norm is None:
            raise RuntimeError(f"stage {self.layer_range} has no LM head")
        return rms_norm(hidden, self._norm, self._eps)

    def head_logits(self, normed: np.ndarray, rows: slice) -> np.ndarray:
        """Logits for the token ids in ``rows`` only: normed (T, D) -> (T, len(rows))."""
        if self._head is None:
            raise RuntimeError(f"stage {self.layer_range} has no LM head")
        return rows_times(normed, self._head[rows])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Final norm and LM head: hidden (T, D) -> logits (T, V) float32.

        Generation needs only the last row: pass ``hidden[-1:]``.
        """
        normed = self.final_norm(hidden)
        # In the same two row blocks as a pipeline that cuts the head between stage 0 and
        # the last stage: BLAS may round a row differently in another blocking.
        cut = head_cut(self.config.vocab_size)
        vocab = self.config.vocab_size
        return np.concatenate([self.head_logits(normed, slice(0, cut)),
                               self.head_logits(normed, slice(cut, vocab))], axis=-1)
