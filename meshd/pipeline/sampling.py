"""Next-token choice: greedy, or seeded temperature / top-k / top-p sampling.

A ``Sampler`` owns the request's ``np.random.Generator``; it draws exactly one
float32 per sampled step, so the same seed and the same logits give the same
tokens, wherever the sampler runs.

Choosing is split in two so that the LM head can be cut by vocabulary rows
across two stages: ``shortlist`` keeps, from one slice of the logits, the only
entries that can win (the argmax, or every entry at or above the slice's k-th
largest scaled value); ``merge`` joins the slices' shortlists and ``choose``
picks from them.  The global top-k lies within the union of the slices'
top-k, so the pick equals the one over the whole vector, bit for bit; the
single-process reference runs the same three steps on one slice.

Top-p (nucleus) comes last, as in Hugging Face's and vLLM's samplers: of the
temperature-scaled, top-k-cut candidates, ``choose`` keeps the most likely
ones whose probability reaches ``top_p`` together, and draws among them.  It
needs every candidate's probability, so it runs on the merged shortlist only.
"""

from __future__ import annotations

import numpy as np

from .kernels import top_k_floor

# Up to this k the k-th largest comes from ``top_k_floor``'s pass with a heap of k entries;
# past it np.partition is the faster.  Either gives the same value.
HEAP_TOP_K = 256

Shortlist = tuple[np.ndarray, np.ndarray]  # (token ids int64 ascending, values float32)


def is_greedy(temperature: float | np.floating, top_k: int) -> bool:
    return temperature == 0 or top_k == 1


def shortlist(logits: np.ndarray, temperature: float | np.floating, top_k: int, offset: int = 0
              ) -> Shortlist:
    """From ``logits`` (V_slice,) float32 for token ids offset.., the entries that can be chosen."""
    if is_greedy(temperature, top_k):
        i = int(np.argmax(logits))
        return np.array([offset + i], dtype=np.int64), np.asarray(logits[i:i + 1], dtype=np.float32)
    scaled = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    if 0 < top_k < scaled.shape[0]:
        # keep the k largest; ties at the threshold stay in, deterministically
        kth = top_k_floor(scaled, top_k) if top_k <= HEAP_TOP_K else None
        if kth is None or np.isnan(kth):  # with a NaN among them, partition's order: NaN ranks largest
            kth = np.partition(scaled, -top_k)[-top_k]
        candidates = np.flatnonzero(scaled >= kth)
    else:
        candidates = np.arange(scaled.shape[0])
    return candidates.astype(np.int64) + offset, scaled[candidates]


def merge(parts: list[Shortlist], top_k: int) -> Shortlist:
    """Join shortlists of consecutive slices (given in slice order) into one."""
    ids = np.concatenate([p[0] for p in parts])
    values = np.concatenate([p[1] for p in parts])
    if 0 < top_k < values.shape[0]:
        keep = values >= np.partition(values, -top_k)[-top_k]
        ids, values = ids[keep], values[keep]
    return ids, values


def nucleus(ids: np.ndarray, probs: np.ndarray, top_p: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of the most likely candidates whose share of ``probs`` (float32,
    unnormalised) reaches ``top_p``, in id order; ties go to the lower id."""
    order = np.argsort(-probs, kind="stable")  # ids ascend, so a stable sort ranks equal ones by id
    mass = np.cumsum(probs[order])
    keep = int(np.searchsorted(mass, top_p * mass[-1], side="left")) + 1
    chosen = np.sort(order[:keep])
    return ids[chosen], probs[chosen]


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, seed: int = 0, top_p: float = 1.0):
        if not temperature >= 0:
            raise ValueError(f"temperature {temperature!r} must be >= 0")
        if top_k < 0:
            raise ValueError(f"top_k {top_k!r} must be >= 0")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p {top_p!r} must be within (0, 1]")
        self.temperature = np.float32(temperature)
        self.top_k = int(top_k)
        self.top_p = np.float32(top_p)
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def skip(self, steps: int) -> Sampler:
        """Advance past ``steps`` sampled steps: a sampler rebuilt for a request that already
        has ``steps`` tokens (a failover replay) draws what the first one would draw next."""
        if not self.greedy:
            for _ in range(steps):
                self._rng.random(dtype=np.float32)
        return self

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature, self.top_k)

    def __call__(self, logits: np.ndarray) -> int:
        """logits: (V,) float32 -> the next token id."""
        return self.choose(merge([shortlist(logits, self.temperature, self.top_k)], self.top_k))

    def choose(self, merged: Shortlist) -> int:
        """The next token id from the merged shortlist of every slice of the logits."""
        ids, values = merged
        if self.greedy:
            return int(ids[int(np.argmax(values))])  # the first maximum: the lowest id, as argmax over all
        probs = np.exp(values - values.max())  # float32
        if self.top_p < 1:
            ids, probs = nucleus(ids, probs, self.top_p)
        cdf = np.cumsum(probs)
        u = self._rng.random(dtype=np.float32) * cdf[-1]
        i = min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)
        return int(ids[i])


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))
