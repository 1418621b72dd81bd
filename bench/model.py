#!/usr/bin/env python3
"""Monolithic tokens/s of the numpy Llama on the ``small`` preset (stories15M's shapes).

One run = prefill of the prompt + DECODE greedy tokens (64 by default, EOS
ignored).  Prints the median over RUNS runs for:

- meshd's StageModel (the whole model, what ``meshd generate`` runs);
- the same, cut into 3 chained StageModels in one process (what stages cost
  without any network);
- a naive reference in the style of llama3.np: unfused projections, repeated
  k/v heads, a KV cache allocated without a dtype (float64).

    .venv/bin/python bench/model.py [--runs 5] [--decode 64] [--threads N]

``--threads`` sets OPENBLAS_NUM_THREADS for this process (tests never do).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--decode", type=int, default=64, help="decode tokens per run (default %(default)s)")
    p.add_argument("--threads", type=int, help="OPENBLAS_NUM_THREADS for this process")
    p.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily who loved to")
    return p.parse_args()


args = parse()
if args.threads:
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)

import numpy as np  # noqa: E402  (after the thread setting)

from meshd.pipeline import StageModel, init_checkpoint, load_tokenizer, load_weights, split_layers  # noqa: E402


class NaiveLlama:
    """llama3.np's way: one matmul per projection, np.repeat for GQA, float64 KV cache."""

    def __init__(self, config, w):
        self.c, self.w = config, w
        inv = 1.0 / (config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim))
        f = np.outer(np.arange(config.max_position_embeddings), inv)
        self.cos, self.sin = np.cos(f), np.sin(f)  # float64, as llama3.np
        self.head = w["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]

    def new_cache(self, n):
        c = self.c
        shape = (c.num_hidden_layers, n, c.num_key_value_heads, c.head_dim)
        return [np.zeros(shape), np.zeros(shape)]  # no dtype: float64

    def norm(self, x, weight):
        return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + self.c.rms_norm_eps) * weight

    def rope(self, x, pos):  # x: (T, heads, hd)
        half = x.shape[-1] // 2
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def step(self, ids, cache, start):
        c, w = self.c, self.w
        T, H, KV, hd = len(ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim
        pos = np.arange(start, start + T)
        x = w["model.embed_tokens.weight"][ids]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = self.norm(x, w[p + "input_layernorm.weight"])
            q = self.rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd), pos)
            k = self.rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KV, hd), pos)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KV, hd)
            cache[0][i, start:start + T], cache[1][i, start:start + T] = k, v
            ks = np.repeat(cache[0][i, :start + T], H // KV, axis=1).transpose(1, 2, 0)
            vs = np.repeat(cache[1][i, :start + T], H // KV, axis=1).transpose(1, 0, 2)
            s = q.transpose(1, 0, 2) @ ks / np.sqrt(hd)
            if T > 1:
                s = s + np.triu(np.full((T, start + T), -np.inf), k=start + 1)
            s = np.exp(s - s.max(-1, keepdims=True))
            s = s / s.sum(-1, keepdims=True)
            x = x + (s @ vs).transpose(1, 0, 2).reshape(T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
            h = self.norm(x, w[p + "post_attention_layernorm.weight"])
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
        return self.norm(x[-1:], w["model.norm.weight"]) @ self.head.T


def run_meshd(stages, ids, decode):
    """Prefill + decode greedily through chained stages; returns (prefill s, decode s, tokens)."""
    caches = [s.new_cache(len(ids) + decode) for s in stages]

    def through(tokens, pos):
        hidden = stages[0].embed(tokens)
        for stage, cache in zip(stages, caches, strict=True):
            hidden = stage.forward(hidden, cache, pos)
        return stages[-1].logits(hidden[-1:])[0]

    t0 = time.perf_counter()
    token = int(np.argmax(through(ids, 0)))
    t1 = time.perf_counter()
    out = [token]
    for pos in range(len(ids), len(ids) + decode):
        token = int(np.argmax(through([token], pos)))
        out.append(token)
    return t1 - t0, time.perf_counter() - t1, out


def run_naive(model, ids, decode):
    cache = model.new_cache(len(ids) + decode)
    t0 = time.perf_counter()
    token = int(np.argmax(model.step(ids, cache, 0)))
    t1 = time.perf_counter()
    out = [token]
    for pos in range(len(ids), len(ids) + decode):
        token = int(np.argmax(model.step([token], cache, pos)))
        out.append(token)
    return t1 - t0, time.perf_counter() - t1, out


def report(name, runs, ids, decode):
    prefill = statistics.median(r[0] for r in runs)
    dec = statistics.median(r[1] for r in runs)
    total = statistics.median(r[0] + r[1] for r in runs)
    print(f"{name:<28} prefill {prefill * 1e3:7.1f} ms ({len(ids)} tokens)   "
          f"decode {dec / decode * 1e3:6.2f} ms/token = {decode / dec:6.1f} tokens/s   "
          f"end to end {(decode + 1) / total:6.1f} tokens/s")
    return decode / dec


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="meshd-bench-") as d:
        t = time.perf_counter()
        config = init_checkpoint(d, "small", seed=0)
        init_s = time.perf_counter() - t
        t = time.perf_counter()
        whole = StageModel.load(d)
        load_s = time.perf_counter() - t
        three = [StageModel.load(d, r) for r in split_layers(config.num_hidden_layers, 3)]
        naive = NaiveLlama(config, load_weights(d, embed=True, head=True))
        tok = load_tokenizer(d, config.bos_token_id, config.eos_token_ids)
    ids = [config.bos_token_id, *tok.encode(args.prompt)]
    print(f"small preset: dim {config.hidden_size}, {config.num_hidden_layers} layers, "
          f"vocab {config.vocab_size}; init {init_s:.2f}s, load {load_s * 1e3:.0f} ms; OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, cores {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"prefill {len(ids)} tokens + {args.decode} greedy decode tokens, median of {args.runs} runs")
    run_meshd([whole], ids, 4)  # warm up BLAS threads and page in the weights
    variants = {"meshd StageModel (whole)": lambda: run_meshd([whole], ids, args.decode),
                "meshd 3 chained stages": lambda: run_meshd(three, ids, args.decode),
                "naive (float64 creep)": lambda: run_naive(naive, ids, args.decode)}
    runs: dict[str, list] = {name: [] for name in variants}
    for _ in range(args.runs):  # round robin, so a busy moment on the machine hits every variant
        for name, fn in variants.items():
            runs[name].append(fn())
    results = {name: r[0][2] for name, r in runs.items()}
    for name, r in runs.items():
        report(name, r, ids, args.decode)
    same = results["meshd StageModel (whole)"] == results["meshd 3 chained stages"]
    whole_tokens, naive_tokens = results["meshd StageModel (whole)"], results["naive (float64 creep)"]
    agree = sum(a == b for a, b in zip(whole_tokens, naive_tokens, strict=True))
    print(f"3 stages give the same tokens: {same}; naive agrees on {agree}/{args.decode + 1} tokens")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
