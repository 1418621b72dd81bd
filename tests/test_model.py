"""The numpy Llama: stages chain to the whole model, the KV cache equals recomputation, float32 throughout."""

from __future__ import annotations

import types

import numpy as np
import pytest

from meshd.pipeline import Sampler, StageModel, kernels, split_layers, stub_model
from meshd.pipeline import model as model_module
from meshd.pipeline.checkpoint import preset_config, random_weights
from meshd.pipeline.generate import generate_ids
from meshd.pipeline.model import apply_rope, rope_tables

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # BOS "Hello, world"


def reference_logits(config, w, ids) -> np.ndarray:
    """Hugging Face's LlamaForCausalLM written plainly in float64: full recompute, repeat_kv, cat(freqs)."""
    T, H, KV, hd = len(ids), config.num_attention_heads, config.num_key_value_heads, config.head_dim
    f64 = {k: v.astype(np.float64) for k, v in w.items()}

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps) * weight

    def rotate_half(x):
        return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)

    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, axis=-1)  # (T, hd)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    x = f64["model.embed_tokens.weight"][ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, f64[p + "input_layernorm.weight"])
        q = (h @ f64[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd).transpose(1, 0, 2)
        k = (h @ f64[p + "self_attn.k_proj.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        v = (h @ f64[p + "self_attn.v_proj.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + (s @ v).transpose(1, 0, 2).reshape(T, H * hd) @ f64[p + "self_attn.o_proj.weight"].T
        h = norm(x, f64[p + "post_attention_layernorm.weight"])
        g, u = h @ f64[p + "mlp.gate_proj.weight"].T, h @ f64[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ f64[p + "mlp.down_proj.weight"].T
    head = f64["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return norm(x, f64["model.norm.weight"]) @ head.T


def chain_logits(stages, caches, ids, start_pos) -> np.ndarray:
    hidden = stages[0].embed(ids)
    for stage, cache in zip(stages, caches, strict=True):
        hidden = stage.forward(hidden, cache, start_pos)
    return stages[-1].logits(hidden)


@pytest.mark.parametrize("tied", [False, True])
def test_matches_float64_hugging_face_reference(tied):
    config = preset_config("tiny", tie_word_embeddings=tied)
    w = random_weights(config, seed=3)
    model = StageModel(config, w)
    got = model.logits(model.forward(model.embed(PROMPT), model.new_cache(32), 0))
    want = reference_logits(config, w, PROMPT)
    assert got.dtype == np.float32 and got.shape == (len(PROMPT), config.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_chained_stages_equal_the_whole_model(n_stages):
    full = stub_model()
    stages = [stub_model(r) for r in split_layers(full.config.num_hidden_layers, n_stages)]
    assert stages[0].has_embed and stages[-1].has_head
    assert not any(s.has_embed for s in stages[1:]) and not any(s.has_head for s in stages[:-1])
    full_cache = full.new_cache(64)
    caches = [s.new_cache(64) for s in stages]
    # prefill: every position's logits
    want = full.logits(full.forward(full.embed(PROMPT), full_cache, 0))
    got = chain_logits(stages, caches, PROMPT, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # decode greedily across per-stage caches
    token_full = token_chain = int(want[-1].argmax())
    for pos in range(len(PROMPT), len(PROMPT) + 30):
        lf = full.logits(full.forward(full.embed([token_full]), full_cache, pos))[0]
        lc = chain_logits(stages, caches, [token_chain], pos)[0]
        np.testing.assert_allclose(lc, lf, rtol=1e-5, atol=1e-6)
        token_full, token_chain = int(lf.argmax()), int(lc.argmax())
        assert token_full == token_chain
    assert [c.length for c in caches] == [len(PROMPT) + 30] * n_stages


def test_stage_without_embed_or_head_refuses_them():
    middle = stub_model(range(1, 3))
    assert not middle.has_embed and not middle.has_head
    with pytest.raises(RuntimeError, match="no embedding"):
        middle.embed([1])
    with pytest.raises(RuntimeError, match="no LM head"):
        middle.logits(np.zeros((1, 64), np.float32))


def test_kv_cache_decode_equals_recomputing_the_sequence():
    model = stub_model()
    gen = generate_ids(model, PROMPT, 20, Sampler(), keep_logits=True)
    seq = PROMPT + gen.tokens
    for step, logits in enumerate(gen.logits):
        upto = len(PROMPT) + step  # the sequence that produced this step's logits
        fresh = model.logits(model.forward(model.embed(seq[:upto]), model.new_cache(upto), 0))[-1]
        np.testing.assert_allclose(logits, fresh, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_equals_prefill_at_once():
    model = stub_model()
    once = model.logits(model.forward(model.embed(PROMPT), model.new_cache(32), 0))
    cache = model.new_cache(32)
    parts = [model.forward(model.embed(PROMPT[a:b]), cache, a) for a, b in [(0, 5), (5, 6), (6, len(PROMPT))]]
    np.testing.assert_allclose(model.logits(np.concatenate(parts)), once, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "mistral"])
def test_a_prompt_longer_than_a_chunk_runs_as_chunks_and_computes_what_one_pass_does(preset, monkeypatch):
    """``forward`` cuts a long prompt at PREFILL_CHUNK rows; each chunk attends to what the ones
    before it wrote (and, with a sliding window, only to the window)."""
    config = preset_config(preset)
    model = StageModel(config, random_weights(config, seed=5))
    ids = list(range(3, 3 + 40))  # 40 rows: chunks of 16, 16 and 8 (and past mistral's window of 16)
    whole = model.forward_batch(model.embed(ids), [(model.new_cache(48), 0)])
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 16)
    assert model_module.prefill_chunks(40) == [slice(0, 16), slice(16, 32), slice(32, 40)]
    passes: list[tuple[int, int]] = []
    one_pass = model.forward_batch

    def counted(hidden, parts):
        passes.append((parts[0][1], hidden.shape[0]))
        return one_pass(hidden, parts)

    monkeypatch.setattr(model, "forward_batch", counted)
    cache = model.new_cache(48)
    chunked = model.forward(model.embed(ids), cache, 0)
    assert passes == [(0, 16), (16, 16), (32, 8)]
    assert cache.length == 40
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)
    # the chunks are what a stage runs one by one: the same bits as forward's own cut
    cache2 = model.new_cache(48)
    rows = [model.forward(model.embed(ids)[s], cache2, s.start) for s in model_module.prefill_chunks(40)]
    np.testing.assert_array_equal(np.concatenate(rows), chunked)


def test_rope_matches_rotate_half_reference():
    config = preset_config("tiny")
    hd = config.head_dim
    cos, sin = rope_tables(config, 40)
    x = np.random.default_rng(1).standard_normal((3, 40, hd), dtype=np.float32)
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(40), inv_freq)] * 2, axis=-1)
    x64 = x.astype(np.float64)
    rotated = np.concatenate([-x64[..., hd // 2:], x64[..., :hd // 2]], axis=-1)
    want = x64 * np.cos(emb) + rotated * np.sin(emb)
    got = apply_rope(x, cos, sin)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # position 0 is the identity
    np.testing.assert_array_equal(got[:, 0], x[:, 0])


def test_no_float64_anywhere():
    model = stub_model()
    cache = model.new_cache(32)
    assert cache.k.dtype == np.float32 and cache.v.dtype == np.float32
    assert model._rope[0].dtype == np.float32 and model._rope[1].dtype == np.float32
    hidden = model.embed(PROMPT)
    assert hidden.dtype == np.float32
    out = model.forward(hidden, cache, 0)
    assert out.dtype == np.float32
    assert model.logits(out[-1:]).dtype == np.float32
    step = model.forward(model.embed([7]), cache, len(PROMPT))
    assert step.dtype == np.float32 and model.logits(step).dtype == np.float32
    for layer in model._layers:
        for name in layer.__slots__:
            value = getattr(layer, name)
            assert value is None or not isinstance(value, np.ndarray) or value.dtype == np.float32, name
    gen = generate_ids(model, PROMPT, 5, Sampler(0.8, 10, 1), keep_logits=True)
    assert all(lg.dtype == np.float32 for lg in gen.logits)


def test_forward_refuses_bad_input():
    model = stub_model()
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="float32"):
        model.forward(np.zeros((2, 64)), cache, 0)
    with pytest.raises(ValueError, match="do not fit the cache"):
        model.forward(model.embed(PROMPT), cache, 0)
    with pytest.raises(ValueError, match="token id 999"):
        model.embed([1, 999])


def test_seeded_sampling_is_reproducible():
    model = stub_model()

    def run(seed, temperature=1.0, top_k=0):
        return generate_ids(model, PROMPT, 30, Sampler(temperature, top_k, seed)).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(7, 0.7, 5) == run(7, 0.7, 5)
    assert run(3, 1.0, 1) == run(0, 0.0)  # top-1 is greedy


def test_top_k_only_picks_among_the_k_largest():
    logits = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    top = set(np.argsort(logits)[-5:].tolist())
    sampler = Sampler(temperature=2.0, top_k=5, seed=11)
    picks = [sampler(logits) for _ in range(500)]
    assert set(picks) <= top and len(set(picks)) == 5


def test_split_layers():
    assert split_layers(6, 1) == [range(0, 6)]
    assert split_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    with pytest.raises(ValueError):
        split_layers(3, 5)


def test_generation_stops_on_eos_without_emitting_it():
    model = stub_model()
    free = generate_ids(model, PROMPT, 10, Sampler())
    assert free.finish_reason == "length" and len(free.tokens) == 10
    eos = free.tokens[2]
    first = free.tokens.index(eos)
    stopped = generate_ids(model, PROMPT, 10, Sampler(), (eos,), keep_logits=True)
    assert stopped.finish_reason == "eos"
    assert stopped.tokens == free.tokens[:first]
    assert len(stopped.logits) == first + 1  # the step that chose EOS is kept


def test_the_head_cut_in_two_gives_the_same_logits_and_the_same_samples():
    """Stage 0 and the last stage each compute their rows of the LM head (model.head_cut);
    the halves must equal the whole head bit for bit, and sampling from the merged
    shortlists must pick what sampling from the whole vector picks."""
    from meshd.pipeline.model import HEAD_CUT_ALIGN, head_cut
    from meshd.pipeline.sampling import merge, shortlist

    config = preset_config("small")
    model = StageModel(config, random_weights(config, seed=0))
    vocab = config.vocab_size
    cut = head_cut(vocab)
    assert cut % HEAD_CUT_ALIGN == 0 and 0 < cut < vocab
    rng = np.random.default_rng(3)
    for temperature, top_k in ((0.0, 0), (0.9, 20), (1.5, 1), (0.7, vocab - 10)):
        whole, halves = Sampler(temperature, top_k, seed=5), Sampler(temperature, top_k, seed=5)
        for _ in range(20):
            hidden = rng.standard_normal((1, config.hidden_size), dtype=np.float32)
            normed = model.final_norm(hidden)
            low = model.head_logits(normed, slice(0, cut))[0]
            high = model.head_logits(normed, slice(cut, vocab))[0]
            logits = model.logits(hidden)[0]
            assert np.array_equal(np.concatenate([low, high]), logits)
            parts = [shortlist(low, temperature, top_k), shortlist(high, temperature, top_k, cut)]
            assert halves.choose(merge(parts, top_k)) == whole(logits)


@pytest.mark.parametrize("kernel_scores", [None, 32])
@pytest.mark.parametrize("preset", ["tiny", "mistral"])
def test_a_decode_batch_attends_as_each_request_would_alone(preset, kernel_scores, monkeypatch):
    # Each request at its own position (one near the start, others deep in a sliding window):
    # the batch's attention writes the same keys and values and gives the same rows, to the
    # bit, as each request's attention alone, and what numpy's attention over the cache gives
    # (a prompt's path) within float32 rounding.  With a low ATTEND_KERNEL_SCORES the rows
    # that see more positions take numpy's path, the others the kernel, in one batch.
    if kernel_scores is not None:
        monkeypatch.setattr(model_module, "ATTEND_KERNEL_SCORES", kernel_scores)
    config = preset_config(preset, max_position_embeddings=64, num_hidden_layers=1)
    model = StageModel(config, random_weights(config, seed=3))
    rng = np.random.default_rng(0)
    c = config
    width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    positions = [0, 3, 17, 40, 63]
    qkv = rng.standard_normal((len(positions), width)).astype(np.float32)

    def caches():
        out = []
        for pos in positions:
            cache = model.new_cache(64)
            cache.k[...] = rng.standard_normal(cache.k.shape).astype(np.float32)
            cache.v[...] = rng.standard_normal(cache.v.shape).astype(np.float32)
            cache.length = pos
            out.append(cache)
        return out

    state = rng.bit_generator.state
    batched = caches()
    rng.bit_generator.state = state
    alone = caches()
    rng.bit_generator.state = state
    numpy_path = caches()
    rope = rope_tables(c, 64)
    window = c.window(0)
    spans = [(cache, p, p + 1) for cache, p in zip(batched, positions, strict=True)]
    kernel_rows = []
    compiled = model_module.attend_rows
    monkeypatch.setattr(model_module, "attend_rows", lambda qkv, *rest: kernel_rows.append(len(qkv))
                        or compiled(qkv, *rest))
    got = model._attend_rows(qkv, 0, window, spans, rope)
    assert kernel_rows == [len(positions)] if kernel_scores is None else 0 < sum(kernel_rows) < len(positions)
    want = np.concatenate([model._attend_rows(qkv[i:i + 1], 0, window, [(cache, p, p + 1)], rope)
                           for i, (cache, p) in enumerate(zip(alone, positions, strict=True))])
    np.testing.assert_array_equal(got, want)
    for a, b in zip(batched, alone, strict=True):
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)
    reference = np.concatenate([model._attend(qkv[i:i + 1], 0, window, cache, p, p + 1, {}, rope)
                                for i, (cache, p) in enumerate(zip(numpy_path, positions, strict=True))])
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
    for a, b in zip(batched, numpy_path, strict=True):
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)


def test_compiled_attention_carries_nan_through_and_refuses_what_does_not_fit():
    H, KV, hd = 4, 2, 8
    qkv = np.ones((1, H + 2 * KV, hd), dtype=np.float32)
    cos, sin = np.ones((6, hd // 2), dtype=np.float32), np.zeros((6, hd // 2), dtype=np.float32)
    keys, values = np.zeros((KV, 6, hd), dtype=np.float32), np.zeros((KV, 6, hd), dtype=np.float32)
    values[0, 1, 3] = np.nan

    def attend(qkv=qkv, cos=cos, keys=keys, values=values, pos=2, lo=0):
        return kernels.attend_rows(qkv, cos, sin, [(keys, values)], [pos], [lo], np.float32(0.5))

    out = attend()[0]
    assert np.isnan(out[:2, 3]).all() and np.isfinite(out[2:]).all()  # heads 0-1 read kv head 0
    np.testing.assert_array_equal(keys[:, 2], qkv[0, H:H + KV])  # this position's key went into the cache
    assert np.isfinite(attend(lo=2)).all()  # a window that leaves the NaN out
    for bad in (dict(pos=6), dict(lo=3), dict(keys=keys[:, :, :4].copy()), dict(qkv=qkv[:, 1:].copy()),
                dict(keys=np.asfortranarray(keys)), dict(cos=cos[:2]), dict(values=values[:1].copy())):
        with pytest.raises(ValueError, match="do not fit"):
            attend(**bad)


@pytest.mark.parametrize("k", [1, 2, 20, 256, 500])
def test_the_kth_largest_is_partitions_value_ties_and_nan_included(k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal(17600).astype(np.float32)
    x[rng.integers(0, 17600, 300)] = x[:300]  # repeated values, some in the top
    assert kernels.top_k_floor(x, k) == np.partition(x, -k)[-k]
    same = np.full(50, 2.0, dtype=np.float32)
    assert kernels.top_k_floor(same, min(k, 50)) == 2.0
    x[7] = np.nan
    assert np.isnan(kernels.top_k_floor(x, k))
    with pytest.raises(ValueError):
        kernels.top_k_floor(x[:k - 1], k)


@pytest.mark.parametrize("rows", [*range(1, 14), kernels.KERNEL_ROWS, kernels.KERNEL_ROWS + 3])
def test_a_product_over_any_number_of_rows_gives_those_rows_and_the_same_bits_each_time(rows):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    # (out, in), as the model keeps it; 301 rows: a last tile whose rows do not make whole
    # pairs, so the kernel's leftover row is taken too (and in the cut's second block)
    w = rng.standard_normal((301, 96), dtype=np.float32)
    out = model_module.rows_times(x, w)
    assert out.shape == (rows, 301) and out.dtype == np.float32
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out, model_module.rows_times(x.copy(), w))
    # a weight cut into row blocks at a multiple of two rows (the LM head between two stages)
    # gives the whole's bits in the kernel (a decode step's rows: what keeps a single stream
    # bit-identical); past it, BLAS may pick another kernel for another block size, so the cut
    # holds to the batched rule
    cut = 132
    halves = np.concatenate([model_module.rows_times(x, w[:cut]), model_module.rows_times(x, w[cut:])],
                            axis=1)
    if rows <= kernels.KERNEL_ROWS:
        np.testing.assert_array_equal(out, halves)
    else:
        np.testing.assert_allclose(out, halves, rtol=1e-5, atol=1e-5)


def test_a_product_carries_nan_and_inf_through_and_refuses_mismatched_shapes():
    x = np.ones((3, 8), dtype=np.float32)
    x[1, 2], x[2, 5] = np.nan, np.inf
    w = np.ones((5, 8), dtype=np.float32)
    out = model_module.rows_times(x, w)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all() and np.isposinf(out[2]).all()
    with pytest.raises(ValueError, match="width"):
        model_module.rows_times(x, np.ones((5, 9), dtype=np.float32))  # never reads past a row
    with pytest.raises(ValueError, match="C-contiguous"):
        model_module.rows_times(x, np.ones((8, 5), dtype=np.float32).T)


@pytest.mark.parametrize("preset", ["tiny", "mistral"])
def test_a_model_built_by_taking_its_weights_apart_computes_what_one_built_from_a_copy_does(preset):
    """``release=True`` (how ``StageModel.load`` builds a stage) drops each layer's tensors from
    the loader's dict as it takes them, so loading holds one copy of the layers; the model is
    the same."""
    config = preset_config(preset)
    weights = random_weights(config, seed=7)
    kept = StageModel(config, dict(weights))
    taken_apart = dict(weights)
    released = StageModel(config, taken_apart, release=True)
    assert not [name for name in taken_apart if name.startswith("model.layers.")]
    ids = [3, 1, 4, 1, 5]
    for model in (kept, released):
        assert model.embed(ids).flags.c_contiguous
    np.testing.assert_array_equal(
        kept.logits(kept.forward(kept.embed(ids), kept.new_cache(8), 0)),
        released.logits(released.forward(released.embed(ids), released.new_cache(8), 0)))
    with pytest.raises(TypeError, match="dict"):
        StageModel(config, types.MappingProxyType(weights), release=True)  # read-only: not taken apart


@pytest.mark.parametrize("preset", ["tiny", "qwen2"])
def test_every_weight_is_kept_as_the_checkpoint_stores_it_contiguous_for_the_kernel(preset):
    config = preset_config(preset)
    weights = random_weights(config, seed=2)
    model = StageModel(config, weights)
    layer = model._layers[0]
    d, inter = config.hidden_size, config.intermediate_size
    qkv = np.concatenate([weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    np.testing.assert_array_equal(layer.wqkv, qkv)
    assert layer.w_gate_up.shape == (2 * inter, d) and layer.w_down.shape == (d, inter)
    for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, model._head):
        assert w.flags.c_contiguous and w.dtype == np.float32


@pytest.mark.parametrize("preset,biases", [("tiny", {}), ("qwen2", {}), ("mistral", {}),
                                           ("llama3", {"o_bias": True, "mlp_bias": True})])
def test_a_decode_step_in_the_compiled_layers_gives_numpys_rows_and_cache(preset, biases, monkeypatch):
    # Up to KERNEL_ROWS decode rows run each layer's norms, products and residual sums in three
    # compiled calls; past it the numpy path runs.  Both give the same rows and write the same
    # keys and values, within float32 rounding, biases (q/k/v, o, the MLP's) and windows included.
    config = preset_config(preset, max_position_embeddings=64, num_hidden_layers=2, **biases)
    model = StageModel(config, random_weights(config, seed=5))
    rng = np.random.default_rng(1)
    positions = [0, 5, 20, 41]
    hidden = rng.standard_normal((len(positions), config.hidden_size)).astype(np.float32)

    def run(numpy_path: bool) -> tuple[np.ndarray, list]:
        caches = []
        for pos in positions:
            cache = model.new_cache(64)
            cache.k[...] = np.random.default_rng(pos).standard_normal(cache.k.shape).astype(np.float32)
            cache.v[...] = np.random.default_rng(pos + 1).standard_normal(cache.v.shape).astype(np.float32)
            cache.length = pos
            caches.append(cache)
        with monkeypatch.context() as patch:
            calls = []
            compiled = model_module.layer_in
            patch.setattr(model_module, "layer_in", lambda *a: calls.append(1) or compiled(*a))
            if numpy_path:
                patch.setattr(model_module, "KERNEL_ROWS", 0)
            parts = [(cache, pos) for cache, pos in zip(caches, positions, strict=True)]
            out = model.forward_batch(hidden, parts)
        assert bool(calls) is not numpy_path
        return out, caches

    compiled_out, compiled_caches = run(False)
    numpy_out, numpy_caches = run(True)
    np.testing.assert_allclose(compiled_out, numpy_out, rtol=1e-4, atol=1e-5)
    for a, b in zip(compiled_caches, numpy_caches, strict=True):
        np.testing.assert_allclose(a.k, b.k, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(a.v, b.v, rtol=1e-4, atol=1e-5)
        assert a.length == b.length


def test_the_compiled_layers_refuse_shapes_that_do_not_fit():
    x, w, eps = np.ones((2, 8), dtype=np.float32), np.ones((6, 8), dtype=np.float32), np.float32(1e-5)
    a, w_down = np.ones((2, 6), dtype=np.float32), np.ones((8, 6), dtype=np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.layer_in(x, x[0], eps, np.ones((6, 7), dtype=np.float32), None)  # never reads past a row
    with pytest.raises(ValueError, match="do not fit"):
        kernels.layer_in(x, x[0], eps, w, np.ones(5, dtype=np.float32))  # a bias of another width
    with pytest.raises(ValueError, match="do not fit"):
        kernels.layer_mid(x, a, np.ones((8, 5), dtype=np.float32), None, x[0], eps, w, None)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.layer_out(x, np.ones((3, 6), dtype=np.float32), w_down, None)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.layer_out(np.asfortranarray(x), a, w_down, None)
    layer = x.copy()
    kernels.layer_out(layer, a, w_down, None)  # what fits runs: 1 + six ones
    np.testing.assert_array_equal(layer, np.full((2, 8), 7, dtype=np.float32))


def test_a_decode_batch_given_as_a_transposed_view_runs_as_its_copy_would():
    # A prefill's BLAS products come back as transposed views: a batch handed over in that
    # layout runs the compiled layers on a C-ordered copy, with the same rows.
    config = preset_config("tiny", max_position_embeddings=16)
    model = StageModel(config, random_weights(config, seed=2))
    rows = np.random.default_rng(3).standard_normal((config.hidden_size, 3)).astype(np.float32).T
    assert not rows.flags.c_contiguous
    got = model.forward_batch(rows, [(model.new_cache(16), 0) for _ in range(3)])
    want = model.forward_batch(np.ascontiguousarray(rows), [(model.new_cache(16), 0) for _ in range(3)])
    np.testing.assert_array_equal(got, want)
