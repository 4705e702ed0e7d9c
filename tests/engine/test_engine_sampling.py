"""Sampling on device: seeded reproducibility, the top-k / top-p / min-p filters and
logit_bias."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.engine.sampler import _filter_min_p, _filter_top_k_top_p, sample

CONFIG = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, min_seq_bucket=8,
              block_size=4)


def generate(model, requests):
    engine = LLMEngine(model, EngineConfig(**CONFIG))
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model):
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    alone = generate(tiny_model, [(prompt, params)])[0]
    others = [(list(range(i, i + 7 * i + 1)), SamplingParams(max_tokens=8, temperature=0.7,
                                                            seed=i)) for i in range(1, 5)]
    in_batch = generate(tiny_model, others[:2] + [(prompt, params)] + others[2:])[2]
    assert alone == in_batch
    other_seed = generate(tiny_model, [(prompt, SamplingParams(
        max_tokens=10, temperature=1.0, top_k=50, top_p=0.95, seed=4321))])[0]
    assert other_seed != alone


def test_top_k_1_and_tiny_top_p_are_greedy(tiny_model):
    prompt = list(range(40, 60))
    greedy = generate(tiny_model, [(prompt, SamplingParams(max_tokens=8, temperature=0.0))])[0]
    top1 = generate(tiny_model, [(prompt, SamplingParams(max_tokens=8, temperature=2.0, top_k=1,
                                                         seed=3))])[0]
    tiny_p = generate(tiny_model, [(prompt, SamplingParams(max_tokens=8, temperature=2.0,
                                                           top_p=1e-6, seed=3))])[0]
    assert greedy == top1 == tiny_p


def test_filters_keep_exactly_the_expected_sets():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = _filter_top_k_top_p(logits, jnp.array([2, -1, -1]), jnp.array([1.0, 0.8, 0.86]))
    kept = np.isfinite(np.asarray(out))
    np.testing.assert_array_equal(kept, [[1, 1, 0, 0, 0],   # top-2
                                         [1, 1, 1, 0, 0],   # 0.5+0.2 < 0.8 <= 0.85
                                         [1, 1, 1, 1, 0]])  # 0.85 < 0.86 <= 0.95


def test_sampled_frequencies_follow_the_distribution():
    probs = np.array([0.6, 0.3, 0.1, 0.0])
    logits = jnp.log(jnp.asarray(np.tile(probs, (4000, 1)), jnp.float32))
    n = logits.shape[0]
    ids, logprobs, _, _ = sample(logits, jnp.ones(n), jnp.full(n, -1), jnp.ones(n),
                                 jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))
    ids = np.asarray(ids)
    np.testing.assert_allclose(np.asarray(logprobs), np.log(probs[ids]), rtol=1e-5)
    freq = np.bincount(ids, minlength=4) / n
    # 4000 draws: the standard error of a frequency is at most 0.008; allow 4 sigma.
    np.testing.assert_allclose(freq, probs, atol=0.032)
    assert freq[3] == 0


def test_temperature_reshapes_the_sampled_distribution():
    """At T the frequencies follow softmax(logits / T): sharper at T = 0.5, flatter at T = 2
    (a sampler that ignores temperature samples the T = 1 distribution and fails both)."""
    probs = np.array([0.6, 0.3, 0.1])
    n = 4000
    logits = jnp.log(jnp.asarray(np.tile(probs, (n, 1)), jnp.float32))
    for temperature in (0.5, 2.0):
        ids, _, _, _ = sample(logits, jnp.full(n, temperature), jnp.full(n, -1), jnp.ones(n),
                              jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))
        scaled = probs ** (1 / temperature)
        expected = scaled / scaled.sum()  # T=0.5: [.78, .20, .02]; T=2: [.47, .33, .19]
        freq = np.bincount(np.asarray(ids), minlength=3) / n
        # Standard error at most 0.008 per frequency; 4 sigma, far below the T=1 gaps (>= 0.09).
        np.testing.assert_allclose(freq, expected, atol=0.032)


def test_min_p_keeps_what_the_numpy_definition_keeps():
    """vLLM's min-p on a fixed row, against its definition in NumPy: a token stays when its
    probability (after temperature) is at least min_p x the largest."""
    rng = np.random.default_rng(0)
    row = rng.normal(size=64).astype(np.float32) * 3
    for min_p, temperature in ((0.0, 1.0), (0.05, 1.0), (0.3, 0.7), (0.9, 2.0), (1.0, 1.0)):
        scaled = row / temperature
        probs = np.exp(scaled - scaled.max())
        want = probs >= min_p * probs.max()
        got = np.isfinite(np.asarray(_filter_min_p(jnp.asarray(scaled)[None],
                                                   jnp.asarray([min_p], jnp.float32))))[0]
        np.testing.assert_array_equal(got, want, err_msg=f"min_p={min_p}")


def test_min_p_sampling_draws_from_the_renormalised_survivors():
    probs = np.array([0.5, 0.3, 0.15, 0.05])  # min_p 0.25: 0.125 is the bar, 0.05 drops
    n = 4000
    logits = jnp.log(jnp.asarray(np.tile(probs, (n, 1)), jnp.float32))
    ids, _, _, _ = sample(logits, jnp.ones(n), jnp.full(n, -1), jnp.ones(n),
                          jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32),
                          min_p=jnp.full(n, 0.25, jnp.float32))
    freq = np.bincount(np.asarray(ids), minlength=4) / n
    expected = np.array([0.5, 0.3, 0.15, 0.0]) / 0.95
    np.testing.assert_allclose(freq, expected, atol=0.032)  # 4 sigma, as above
    assert freq[3] == 0


def test_min_p_1_is_greedy_through_the_engine(tiny_model):
    prompt = list(range(40, 60))
    greedy = generate(tiny_model, [(prompt, SamplingParams(max_tokens=8, temperature=0.0))])[0]
    only_top = generate(tiny_model, [(prompt, SamplingParams(max_tokens=8, temperature=1.5,
                                                             min_p=1.0, seed=5))])[0]
    free = generate(tiny_model, [(prompt, SamplingParams(max_tokens=8, temperature=1.5,
                                                         seed=5))])[0]
    assert only_top == greedy
    assert free != greedy  # the seed samples something else without min_p


def test_logit_bias_shifts_exactly_the_named_logits():
    """Greedy rows take argmax(logits + bias) as NumPy computes it; the sampled frequencies
    follow softmax(logits + bias); the logprobs stay the model's."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 32)).astype(np.float32)
    ids = np.zeros((3, 4), np.int32)
    values = np.zeros((3, 4), np.float32)
    ids[0, :2], values[0, :2] = [5, 9], [8.0, -100.0]
    ids[1, :1], values[1, :1] = [int(np.argmax(logits[1]))], [-100.0]  # ban the argmax
    biased = logits.copy()
    for row in range(3):
        np.add.at(biased[row], ids[row], values[row])  # unused slots add 0 to token 0
    n = 3
    got, logprobs, _, _ = sample(jnp.asarray(logits), jnp.zeros(n), jnp.full(n, -1),
                                 jnp.ones(n), jnp.zeros(n, jnp.uint32), jnp.zeros(n, jnp.int32),
                                 logit_bias=(jnp.asarray(ids), jnp.asarray(values)))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(biased, axis=-1))
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logprobs), raw[np.arange(n), np.asarray(got)],
                               rtol=1e-5, atol=1e-6)
    probs = np.array([0.6, 0.3, 0.1])
    draws = 4000
    tiled = jnp.log(jnp.asarray(np.tile(probs, (draws, 1)), jnp.float32))
    bias = (jnp.zeros((draws, 1), jnp.int32) + 2, jnp.full((draws, 1), np.log(6.0), jnp.float32))
    ids, _, _, _ = sample(tiled, jnp.ones(draws), jnp.full(draws, -1), jnp.ones(draws),
                          jnp.arange(draws, dtype=jnp.uint32), jnp.zeros(draws, jnp.int32),
                          logit_bias=bias)
    freq = np.bincount(np.asarray(ids), minlength=3) / draws
    expected = np.array([0.6, 0.3, 0.6]) / 1.5  # token 2's weight x 6
    np.testing.assert_allclose(freq, expected, atol=0.032)  # 4 sigma


def test_logit_bias_forces_a_token_through_the_engine(tiny_model):
    prompt = list(range(40, 60))
    greedy = generate(tiny_model, [(prompt, SamplingParams(max_tokens=6, temperature=0.0))])[0]
    token = next(t for t in range(3, 200) if t not in greedy)
    forced = generate(tiny_model, [(prompt, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={token: 100.0}))])[0]
    assert forced == [token] * 6
    banned = generate(tiny_model, [(prompt, SamplingParams(
        max_tokens=6, temperature=0.0, logit_bias={greedy[0]: -100.0}))])[0]
    assert banned[0] != greedy[0]


def _reference_kept(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """vLLM's top-k then top-p in NumPy (float64): the tokens a row keeps."""
    vocab = logits.shape[0]
    if top_k <= 0 and top_p >= 1.0:
        return np.ones(vocab, bool)
    ordered = np.sort(logits.astype(np.float64))[::-1]
    k = min(top_k, vocab) if top_k > 0 else vocab
    head = ordered[:k]
    probs = np.exp(head - head.max())
    probs /= probs.sum()
    keep = (np.cumsum(probs) - probs) < top_p
    return logits >= head[max(int(keep.sum()), 1) - 1]


@pytest.mark.slow  # a large vocabulary: make test-slow
def test_filters_over_a_large_vocabulary_match_the_reference():
    """Past TOP_CANDIDATES tokens the filter looks at the top candidates only, sorting the row
    when a filter reaches past them (top_k 600; a flat row's 0.999 nucleus) or when no row does
    filter-free: each row keeps exactly the reference's set, alone or batched with rows that
    force the sort."""
    from pagedjax.engine.sampler import TOP_CANDIDATES

    rng = np.random.default_rng(0)
    vocab = 3000
    assert vocab > TOP_CANDIDATES
    logits = rng.standard_normal((8, vocab)).astype(np.float32) * 3
    logits[5] = rng.standard_normal(vocab).astype(np.float32) * 0.01  # flat: a wide nucleus
    logits[7] = rng.standard_normal(vocab).astype(np.float32)  # its top 600 hold part of it
    rows = [(50, 1.0), (-1, 0.9), (20, 0.5), (-1, 1.0), (TOP_CANDIDATES, 0.95), (-1, 0.999),
            (600, 1.0), (600, 0.3)]  # top_k 600: top-p over its 600, not the whole row
    for subset in ([0, 1, 2, 3, 4], [0, 5], [1, 6], [2, 7], list(range(8))):
        top_k = jnp.array([rows[i][0] for i in subset])
        top_p = jnp.array([rows[i][1] for i in subset], jnp.float32)
        out = np.asarray(_filter_top_k_top_p(jnp.asarray(logits[subset]), top_k, top_p))
        for row, i in enumerate(subset):
            expected = _reference_kept(logits[i], *rows[i])
            np.testing.assert_array_equal(np.isfinite(out[row]), expected, err_msg=str(rows[i]))
            assert expected.sum() < vocab or rows[i] == (-1, 1.0)
