"""Next-token choice: greedy, or seeded temperature / top-k sampling.

A ``Sampler`` owns the request's ``np.random.Generator``; it draws exactly one
float32 per sampled step, so the same seed and the same logits give the same
tokens, wherever the sampler runs (the pipeline's last stage or one process).
"""

from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, seed: int = 0):
        if not temperature >= 0:
            raise ValueError(f"temperature {temperature!r} must be >= 0")
        if top_k < 0:
            raise ValueError(f"top_k {top_k!r} must be >= 0")
        self.temperature = np.float32(temperature)
        self.top_k = int(top_k)
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def __call__(self, logits: np.ndarray) -> int:
        """logits: (V,) float32 -> the next token id."""
        if self.greedy:
            return int(np.argmax(logits))
        scaled = np.asarray(logits, dtype=np.float32) / self.temperature
        if 0 < self.top_k < scaled.shape[0]:
            # keep the k largest; ties at the threshold stay in, deterministically
            kth = np.partition(scaled, -self.top_k)[-self.top_k]
            candidates = np.flatnonzero(scaled >= kth)
        else:
            candidates = np.arange(scaled.shape[0])
        chosen = scaled[candidates]
        probs = np.exp(chosen - chosen.max())  # float32
        cdf = np.cumsum(probs)
        u = self._rng.random(dtype=np.float32) * cdf[-1]
        i = min(int(np.searchsorted(cdf, u, side="right")), len(candidates) - 1)
        return int(candidates[i])


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))
