"""Attention sinks (gpt-oss: one learned logit a query head joining every softmax's denominator,
with no value) through every paged attention path: the jnp reference against a float64 dense
oracle, the TPU and Triton kernels interpreted against the reference, with sinks that dominate
the softmax and sliding windows that cut pages."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_reference import build_case

from pagedjax.pallas_kernels import (paged_decode_attention_reference, paged_decode_attention_tpu,
                                     ragged_paged_attention_reference, ragged_paged_attention_tpu)
from pagedjax.pallas_kernels.gpu.triton import (paged_decode_attention_gpu,
                                                ragged_paged_attention_gpu)

SEQS = [(30, 30), (19, 4), (50, 1), (9, 9)]


def sink_oracle(q, keys, values, q_lens, kv_lens, sinks, *, scale, sliding_window=None):
    """float64 attention per query token over contiguous K/V with the sink as one more logit
    column whose probability is dropped (transformers' gpt-oss eager_attention_forward)."""
    num_heads = q.shape[1]
    out = np.zeros(q.shape, np.float64)
    start = 0
    for k, v, q_len, kv_len in zip(keys, values, q_lens, kv_lens):
        group = num_heads // k.shape[1]
        k = np.repeat(k.astype(np.float64), group, axis=1)
        v = np.repeat(v.astype(np.float64), group, axis=1)
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            s = np.einsum("NH,MNH->NM", q[start + i].astype(np.float64), k[lo:pos + 1]) * scale
            logits = np.concatenate([s, np.asarray(sinks, np.float64)[:, None]], axis=1)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p = p / p.sum(-1, keepdims=True)
            out[start + i] = np.einsum("NM,MNH->NH", p[:, :-1], v[lo:pos + 1])
        start += q_len
    return out


def _case(rng, block_size=8, num_heads=8, num_kv_heads=2, head_dim=32, backend="reference"):
    case = build_case(rng, SEQS, block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=6,
                      padded_tokens=sum(q for _, q in SEQS) + 5, backend=backend)
    # heads whose sink dominates (4 against scores of about 1), heads where it hardly counts
    sinks = np.asarray([4.0, -3.0, 0.5, 6.0, -8.0, 1.5, 2.5, 0.0][:num_heads], np.float32)
    return case, sinks


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_reference_matches_the_dense_oracle(sliding_window):
    case, sinks = _case(np.random.default_rng(0))
    opts = dict(scale=0.3, sliding_window=sliding_window)
    want = sink_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                       [kv for kv, _ in SEQS], sinks, **opts)
    n = case["num_tokens"]
    got = ragged_paged_attention_reference(
        jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["cu_q_lens"], case["num_seqs"], sinks=jnp.asarray(sinks), **opts)
    np.testing.assert_allclose(np.asarray(got)[:n], want[:n], rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got)[n:] == 0)
    last = case["cu_q_lens"][1:len(SEQS) + 1] - 1
    q_last = np.zeros((6, *case["q"].shape[1:]), np.float32)
    q_last[:len(SEQS)] = case["q"][last]
    decode = paged_decode_attention_reference(
        jnp.asarray(q_last), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["num_seqs"], sinks=jnp.asarray(sinks), **opts)
    np.testing.assert_allclose(np.asarray(decode)[:len(SEQS)], want[last], rtol=2e-5,
                               atol=2e-5)
    # the sinks change the output: without them it is another answer
    plain = ragged_paged_attention_reference(
        jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["cu_q_lens"], case["num_seqs"], **opts)
    assert np.max(np.abs(np.asarray(plain)[:n] - want[:n])) > 0.1


# whole prompts and long chunks over FRESH_MIN_TOKENS: the reference's tiled prefill path
PREFILL_SEQS = [(40, 40), (29, 29), (36, 20)]


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_the_tiled_prefill_path_matches_the_dense_oracle(sliding_window):
    """The reference's tiled prefill (reference_prefill, taken by steps of >= 64 tokens of
    whole prompts or long chunks) with sinks that dominate some heads' softmax: the sink joins
    each query's running max, so the accumulator is rescaled when it raises it."""
    from pagedjax.pallas_kernels import reference
    rng = np.random.default_rng(3)
    case = build_case(rng, PREFILL_SEQS, block_size=8, num_heads=8, num_kv_heads=2,
                      head_dim=32, padded_seqs=4, padded_tokens=96)
    assert case["num_tokens"] >= reference.FRESH_MIN_TOKENS
    sinks = np.asarray([4.0, -3.0, 0.5, 6.0, -8.0, 1.5, 2.5, 0.0], np.float32)
    opts = dict(scale=0.3, sliding_window=sliding_window)
    want = sink_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                       [kv for kv, _ in PREFILL_SEQS], sinks, **opts)
    got = ragged_paged_attention_reference(
        jnp.asarray(case["q"]), jnp.asarray(np.nan_to_num(case["cache"])), case["kv_lens"],
        case["tables"], case["cu_q_lens"], case["num_seqs"], sinks=jnp.asarray(sinks), **opts)
    n = case["num_tokens"]
    np.testing.assert_allclose(np.asarray(got)[:n], want[:n], rtol=2e-5, atol=2e-5)


KERNELS = {
    "tpu": (ragged_paged_attention_tpu, paged_decode_attention_tpu,
            dict(tile_q=16, pages_per_step=2), dict(pages_per_step=2)),
    "gpu": (ragged_paged_attention_gpu, paged_decode_attention_gpu,
            dict(tile_q=16, pages_per_step=2), dict(pages_per_step=2, num_splits=2)),
}


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("sliding_window", [None, 12])
@pytest.mark.quick_variant('12-tpu')  # the others: make test-slow
def test_kernels_match_the_reference(backend, sliding_window):
    ragged, decode, ragged_opts, decode_opts = KERNELS[backend]
    case, sinks = _case(np.random.default_rng(1), backend=backend)
    opts = dict(scale=0.3, sliding_window=sliding_window, sinks=jnp.asarray(sinks))
    q, cache = jnp.asarray(case["q"]), jnp.asarray(case["cache"])
    args = (case["kv_lens"], case["tables"], case["cu_q_lens"], case["num_seqs"])
    n = case["num_tokens"]
    want = sink_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                       [kv for kv, _ in SEQS], sinks, scale=0.3, sliding_window=sliding_window)
    got = np.asarray(ragged(q, cache, *args, interpret=True, **ragged_opts, **opts))
    assert np.all(np.isfinite(got)), "a NaN page leaked"
    np.testing.assert_allclose(got[:n], want[:n], rtol=2e-5, atol=2e-5)
    assert np.all(got[n:] == 0)
    rows = np.zeros((6, *case["q"].shape[1:]), np.float32)
    last = case["cu_q_lens"][1:len(SEQS) + 1] - 1
    rows[:len(SEQS)] = case["q"][last]
    got_decode = np.asarray(decode(jnp.asarray(rows), cache, case["kv_lens"], case["tables"],
                                   case["num_seqs"], interpret=True, **decode_opts, **opts))
    np.testing.assert_allclose(got_decode[:len(SEQS)], want[last], rtol=2e-5, atol=2e-5)
    assert np.all(got_decode[len(SEQS):] == 0)
