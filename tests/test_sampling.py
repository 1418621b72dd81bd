"""Top-p (nucleus) sampling: it draws only among the most likely tokens that reach ``top_p``
together, it is the same draw for the same seed wherever it runs (the whole vocabulary in one
process, or the LM head cut between two stages), and ``top_p`` 1 changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from meshd.pipeline.generate import generate_ids
from meshd.pipeline.sampling import Sampler, merge, nucleus, shortlist
from meshd.pipeline.stub import stub_model

PROMPT = [256, 72, 101, 108, 108, 111]


def test_the_nucleus_is_the_smallest_set_of_likeliest_tokens_reaching_top_p():
    ids = np.arange(5, dtype=np.int64)
    probs = np.array([0.1, 0.4, 0.05, 0.3, 0.15], dtype=np.float32)
    assert nucleus(ids, probs, np.float32(0.5))[0].tolist() == [1, 3]  # 0.4 + 0.3 reach 0.5
    assert nucleus(ids, probs, np.float32(0.4))[0].tolist() == [1]
    assert nucleus(ids, probs, np.float32(0.71))[0].tolist() == [1, 3, 4]
    assert nucleus(ids, probs, np.float32(1.0))[0].tolist() == [0, 1, 2, 3, 4]
    # Equal probabilities: the lower id comes first.
    assert nucleus(ids, np.full(5, 0.2, np.float32), np.float32(0.3))[0].tolist() == [0, 1]


def test_top_p_draws_only_within_the_nucleus_and_all_of_it():
    logits = np.log(np.array([0.02, 0.5, 0.03, 0.25, 0.2] + [0.0001] * 50, dtype=np.float32))
    sampler = Sampler(temperature=1.0, seed=4, top_p=0.9)
    picks = {sampler(logits) for _ in range(2000)}
    assert picks == {1, 3, 4}
    free = Sampler(temperature=1.0, seed=4)
    assert len({free(logits) for _ in range(2000)}) > 5


def test_top_p_of_one_draws_what_no_top_p_draws():
    model = stub_model()
    for temperature, top_k in ((0.8, 0), (1.2, 10)):
        plain = generate_ids(model, PROMPT, 20, Sampler(temperature, top_k, 9)).tokens
        assert generate_ids(model, PROMPT, 20, Sampler(temperature, top_k, 9, top_p=1.0)).tokens == plain


def test_the_same_seed_gives_the_same_tokens_and_top_p_changes_them():
    model = stub_model()
    def run(seed: int, top_p: float) -> list[int]:
        return generate_ids(model, PROMPT, 30, Sampler(1.0, 0, seed, top_p)).tokens

    assert run(7, 0.6) == run(7, 0.6)
    assert run(7, 0.6) != run(8, 0.6)
    assert run(7, 0.6) != run(7, 1.0)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.9, 20, 0.5), (1.5, 200, 0.9), (0.7, 3, 0.99),
                                                       (1.0, 4000, 0.3)])
def test_top_p_on_the_head_cut_in_two_picks_what_the_whole_head_picks(temperature, top_k, top_p):
    """Stage 0 and the last stage each shortlist their rows' top-k; the merged shortlist's
    nucleus must be the whole vector's, so the pipeline's draws equal ``meshd generate``'s."""
    rng = np.random.default_rng(1)
    vocab, cut = 5000, 2560
    whole = Sampler(temperature, top_k, 5, top_p)
    halves = Sampler(temperature, top_k, 5, top_p)
    for _ in range(200):
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        parts = [shortlist(logits[:cut], temperature, top_k),
                 shortlist(logits[cut:], temperature, top_k, cut)]
        assert halves.choose(merge(parts, top_k)) == whole(logits)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01, float("nan")])
def test_a_top_p_outside_zero_to_one_is_refused(top_p):
    with pytest.raises(ValueError, match="top_p"):
        Sampler(1.0, 0, 0, top_p)


@pytest.mark.parametrize("top_k", [2, 20, 256, 300])
def test_a_shortlist_keeps_what_a_partition_keeps_ties_and_nan_included(top_k):
    # The k-th largest comes from a heap pass up to HEAP_TOP_K and from np.partition past it
    # or when a NaN is in the row; the shortlist is the same either way.
    rng = np.random.default_rng(top_k)
    logits = (rng.standard_normal(3000) * 4).astype(np.float32)
    logits[rng.integers(0, 3000, 200)] = logits[:200]  # repeated values, some at the cut
    for row in (logits, np.where(np.arange(3000) == 17, np.float32(np.nan), logits).astype(np.float32)):
        scaled = row / np.float32(0.7)
        kth = np.partition(scaled, -top_k)[-top_k]
        want = np.flatnonzero(scaled >= kth)
        ids, values = shortlist(row, 0.7, top_k, offset=100)
        np.testing.assert_array_equal(ids, want + 100)
        np.testing.assert_array_equal(values, scaled[want])
