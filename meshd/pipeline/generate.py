"""The single-process reference: one model, no network.  The pipelined run must equal it token for token.

Token accounting, which the pipeline must follow too: the prompt is
``[BOS] + encode(prompt)``; prefill runs it at once and the last row's
logits pick the first token; each later token is fed back at the next
position.  An EOS token ends generation and is not part of ``tokens``;
otherwise generation stops after ``max_tokens`` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import LlamaConfig
from .model import StageModel
from .sampling import Sampler
from .tokenizer import Tokenizer, load_tokenizer


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "eos" or "length"
    # logits[i]: (V,) float32 that chose step i's token (one more than tokens if it ended on EOS)
    logits: list[np.ndarray] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's ids as the model reads them, BOS first where it wants one."""
    ids = tokenizer.encode_prompt(prompt)
    if not ids:
        raise ValueError("empty prompt and the tokenizer has no BOS token")
    return ids


def check_context(config: LlamaConfig, n_prompt: int, max_tokens: int) -> int:
    """Positions the request needs (the last token is never fed back); raises if they do not fit."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    need = n_prompt + max_tokens - 1
    if need > config.max_position_embeddings:
        most = config.max_position_embeddings - n_prompt + 1
        fits = f"max_tokens {most} fits" if most >= 1 else "the prompt alone does not fit"
        raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens {max_tokens} exceeds the model's "
                         f"context of {config.max_position_embeddings} positions (it takes {need}: the "
                         f"last token is never fed back; {fits})")
    return need


def generate_ids(model: StageModel, ids: list[int], max_tokens: int, sampler: Sampler,
                 eos_token_ids: tuple[int, ...] = (), *, keep_logits: bool = False) -> Generation:
    """Prefill ``ids``, then decode one token at a time on a whole model (embedding through head)."""
    cache = model.new_cache(check_context(model.config, len(ids), max_tokens))
    t0 = time.perf_counter()
    hidden = model.forward(model.embed(ids), cache, 0)
    logits = model.logits(hidden[-1:])[0]  # (V,)
    t1 = time.perf_counter()
    out = Generation(tokens=[], finish_reason="length")
    pos = len(ids)
    while True:
        if keep_logits:
            out.logits.append(logits)
        token = sampler(logits)
        if token in eos_token_ids:
            out.finish_reason = "eos"
            break
        out.tokens.append(token)
        if len(out.tokens) == max_tokens:
            break
        hidden = model.forward(model.embed([token]), cache, pos)
        logits = model.logits(hidden)[0]
        pos += 1
    out.prefill_s, out.decode_s = t1 - t0, time.perf_counter() - t1
    return out


def generate(model_dir: str | Path, prompt: str | list[int], max_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, *, top_p: float = 1.0, return_logits: bool = False,
             model: StageModel | None = None, tokenizer: Tokenizer | None = None) -> dict:
    """Generate from ``prompt``: {"tokens", "text", "finish_reason", "timings"[, "logits"]}.

    ``prompt`` is text, or token ids taken as they are (a chat template's prompt).
    ``model``/``tokenizer`` skip loading them from ``model_dir`` (benchmarks,
    repeated calls).  ``logits`` is (steps, V) float32, one row per sampled step.
    """
    t0 = time.perf_counter()
    if model is None:
        model = StageModel.load(model_dir)
    config = model.config
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir, config.bos_token_id, config.eos_token_ids)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("an empty prompt")
    gen = generate_ids(model, ids, max_tokens, Sampler(temperature, top_k, seed, top_p), config.eos_token_ids,
                       keep_logits=return_logits)
    n = len(gen.tokens)
    run_s = gen.prefill_s + gen.decode_s
    # decode steps: every token after the first costs one forward
    decode_steps = max(n - 1, 0) + (1 if gen.finish_reason == "eos" and n else 0)
    result = {
        "tokens": gen.tokens,
        "text": tokenizer.decode(gen.tokens),
        "finish_reason": gen.finish_reason,
        "timings": {
            "load_ms": load_s * 1e3,
            "prefill_ms": gen.prefill_s * 1e3,
            "decode_ms": gen.decode_s * 1e3,
            "total_ms": (load_s + run_s) * 1e3,
            "prompt_tokens": len(ids),
            "generated_tokens": n,
            "tokens_per_s": n / run_s if run_s > 0 else 0.0,
            "decode_tokens_per_s": decode_steps / gen.decode_s if gen.decode_s > 0 and decode_steps else 0.0,
        },
    }
    if return_logits:
        empty = np.zeros((0, config.vocab_size), np.float32)
        result["logits"] = np.stack(gen.logits) if gen.logits else empty
    return result


# What counts as the same generation (README, "Correctness and throughput").  One request alone, or any
# with ``--max-batch 1``, gives `meshd generate`'s very bits.  Batched, a row's floats may
# differ in the last bits with the batch's size (BLAS picks kernels by shape), so: at every
# step max |delta logits| <= LOGITS_TOLERANCE * max |reference logits|, and the same token
# wherever the reference's top-2 logit margin exceeds NEAR_TIE.
LOGITS_TOLERANCE = 1e-4
NEAR_TIE = 1e-3


def near_ties(logits: np.ndarray) -> list[int]:
    """The steps of ``logits`` (steps, V) whose two largest logits are within NEAR_TIE."""
    if logits.shape[0] == 0 or logits.shape[1] < 2:
        return []
    top2 = np.partition(logits, -2, axis=1)[:, -2:]
    return [int(i) for i in np.flatnonzero(np.abs(top2[:, 1] - top2[:, 0]) <= NEAR_TIE)]


def diverges(tokens: list[int], reference: list[int]) -> int | None:
    """The first step where ``tokens`` and ``reference`` differ (one ending first counts), or None."""
    for step, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return step
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))
