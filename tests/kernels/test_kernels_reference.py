"""The pure-jnp paged attention against a dense NumPy oracle that never sees the paged cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels import (AttentionMetadata, init_kv_cache, kv_cache_shape,
                                     paged_attention, paged_decode_attention_reference,
                                     ragged_paged_attention_reference, write_kv_reference)


def dense_oracle(q, keys, values, q_lens, kv_lens, *, scale, sliding_window=None, soft_cap=None):
    """float64 attention per sequence over contiguous K/V. q: [T, N, H]; keys[b]: [kv_len, K, H]."""
    num_heads = q.shape[1]
    out = np.zeros(q.shape, np.float64)
    start = 0
    for k, v, q_len, kv_len in zip(keys, values, q_lens, kv_lens):
        group = num_heads // k.shape[1]
        k = np.repeat(k.astype(np.float64), group, axis=1)  # [kv_len, N, H]
        v = np.repeat(v.astype(np.float64), group, axis=1)
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            s = np.einsum("NH,MNH->NM", q[start + i].astype(np.float64), k[lo:pos + 1]) * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[start + i] = np.einsum("NM,MNH->NH", p, v[lo:pos + 1])
        start += q_len
    return out


def build_case(rng, seqs, *, block_size, num_heads, num_kv_heads, head_dim, num_blocks=97,
               padded_seqs=None, padded_tokens=None, dtype=np.float32, backend="reference"):
    """A paged cache holding each sequence's K/V in shuffled blocks; every other page is NaN.

    seqs: (kv_len, q_len) pairs. Returns the kernel inputs and the contiguous K/V for the oracle.
    The cache has `backend`'s layout: for "gpu" a head dim padded to a power of two, the padding
    columns of written rows zero (as the engine's KV write leaves them).
    """
    num_seqs = len(seqs)
    padded_seqs = padded_seqs or num_seqs
    num_tokens = sum(q for _, q in seqs)
    padded_tokens = padded_tokens or num_tokens
    max_blocks = max(-(-kv // block_size) for kv, _ in seqs) + 1
    cache = np.full(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, backend),
                    np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((padded_seqs, max_blocks), np.int32)
    keys, values = [], []
    for b, (kv_len, _) in enumerate(seqs):
        k = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(dtype)
        v = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(dtype)
        keys.append(k.astype(np.float32))
        values.append(v.astype(np.float32))
        for j in range(-(-kv_len // block_size)):
            block = free.pop()
            tables[b, j] = block
            rows = slice(j * block_size, min((j + 1) * block_size, kv_len))
            n = rows.stop - rows.start
            cache[:, :, block, :n, head_dim:] = 0.0
            cache[0, :, block, :n, :head_dim] = k[rows].astype(np.float32).transpose(1, 0, 2)
            cache[1, :, block, :n, :head_dim] = v[rows].astype(np.float32).transpose(1, 0, 2)
    q = rng.standard_normal((padded_tokens, num_heads, head_dim)).astype(np.float32)
    kv_lens = np.zeros(padded_seqs, np.int32)
    kv_lens[:num_seqs] = [kv for kv, _ in seqs]
    q_lens = np.zeros(padded_seqs, np.int32)
    q_lens[:num_seqs] = [ql for _, ql in seqs]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, cache=cache, kv_lens=kv_lens, tables=tables, cu_q_lens=cu_q_lens,
                num_seqs=np.int32(num_seqs), keys=keys, values=values,
                q_lens=[ql for _, ql in seqs], num_tokens=num_tokens)


SEQS = [(1, 1), (8, 8), (9, 3), (37, 37), (50, 1), (17, 16)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 32), (8, 2, 80), (4, 1, 64)])
@pytest.mark.quick_variant('4-4-32-4')  # the others: make test-slow
def test_ragged_matches_dense_oracle(block_size, num_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng(block_size * 100 + num_heads * 10 + num_kv_heads)
    case = build_case(rng, SEQS, block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=8,
                      padded_tokens=80)
    scale = head_dim ** -0.5
    out = ragged_paged_attention_reference(
        jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["cu_q_lens"], case["num_seqs"], scale=scale)
    out = np.asarray(out)
    n = case["num_tokens"]
    expected = dense_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                            [kv for kv, _ in SEQS], scale=scale)
    assert np.all(np.isfinite(out)), "a NaN page leaked into the output"
    # f32 accumulation over <= 50 keys: errors ~1e-6 relative; 2e-5 leaves margin.
    np.testing.assert_allclose(out[:n], expected[:n], rtol=2e-5, atol=2e-5)
    assert np.all(out[n:] == 0), "padding tokens must produce zeros"


@pytest.mark.parametrize("block_size", [1, 8])
def test_decode_matches_dense_oracle(block_size):
    rng = np.random.default_rng(block_size)
    seqs = [(1, 1), (block_size, 1), (block_size + 1, 1), (29, 1), (3 * block_size, 1)]
    case = build_case(rng, seqs, block_size=block_size, num_heads=8, num_kv_heads=2,
                      head_dim=32, padded_seqs=8, padded_tokens=8)
    out = np.asarray(paged_decode_attention_reference(
        jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["num_seqs"], scale=0.2))
    expected = dense_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                            [kv for kv, _ in seqs], scale=0.2)
    np.testing.assert_allclose(out[:5], expected[:5], rtol=2e-5, atol=2e-5)
    assert np.all(out[5:] == 0)


def test_decode_and_ragged_agree_on_one_token_rows():
    rng = np.random.default_rng(7)
    seqs = [(5, 1), (33, 1), (16, 1)]
    case = build_case(rng, seqs, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
    args = (jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"])
    ragged = ragged_paged_attention_reference(*args, case["cu_q_lens"], case["num_seqs"],
                                              scale=0.25)
    decode = paged_decode_attention_reference(*args, case["num_seqs"], scale=0.25)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sliding_window, soft_cap", [(5, None), (None, 2.0), (7, 1.5)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng(3)
    seqs = [(20, 20), (13, 2), (3, 1)]
    case = build_case(rng, seqs, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
    out = np.asarray(ragged_paged_attention_reference(
        jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["cu_q_lens"], case["num_seqs"], scale=0.25, sliding_window=sliding_window,
        soft_cap=soft_cap))
    expected = dense_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                            [kv for kv, _ in seqs], scale=0.25, sliding_window=sliding_window,
                            soft_cap=soft_cap)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


def test_bf16_cache_within_bf16_tolerance():
    rng = np.random.default_rng(11)
    seqs = [(40, 40), (9, 1)]
    case = build_case(rng, seqs, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32)
    cache = jnp.asarray(case["cache"]).astype(jnp.bfloat16)
    out = ragged_paged_attention_reference(
        jnp.asarray(case["q"]).astype(jnp.bfloat16), cache, case["kv_lens"], case["tables"],
        case["cu_q_lens"], case["num_seqs"], scale=32 ** -0.5)
    def rounded(xs):
        return [np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) for x in xs]

    q32 = np.asarray(jnp.asarray(case["q"]).astype(jnp.bfloat16).astype(jnp.float32))
    expected = dense_oracle(q32, rounded(case["keys"]), rounded(case["values"]), case["q_lens"],
                            [kv for kv, _ in seqs], scale=32 ** -0.5)
    # Inputs are rounded identically; the only extra error is the bf16 output rounding
    # (relative 2**-8), so 1e-2 absolute on O(1) outputs.
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-2, atol=1e-2)


def test_write_kv_hits_only_the_mapped_slots():
    block_size, num_blocks = 4, 9
    cache = jnp.asarray(np.random.default_rng(0).standard_normal(
        kv_cache_shape(num_blocks, block_size, 2, 8)).astype(np.float32))
    k = jnp.arange(5 * 2 * 8, dtype=jnp.float32).reshape(5, 2, 8)
    v = -k
    slots = np.array([4 * 5 + 3, 4 * 2 + 0, 4 * 2 + 1, 0, 0], np.int32)  # two padding tokens
    new = np.asarray(write_kv_reference(cache, k, v, slots))
    old = np.asarray(cache)
    for t, slot in enumerate(slots[:3]):
        block, off = divmod(int(slot), block_size)
        np.testing.assert_array_equal(new[0, :, block, off], np.asarray(k[t]))
        np.testing.assert_array_equal(new[1, :, block, off], np.asarray(v[t]))
    touched = np.zeros((num_blocks, block_size), bool)
    touched[0, 0] = True
    for slot in slots[:3]:
        touched[divmod(int(slot), block_size)] = True
    np.testing.assert_array_equal(new[:, :, ~touched], old[:, :, ~touched])


def test_paged_attention_writes_then_attends():
    """The dispatch entry: a one-sequence prefill into an empty cache equals dense attention."""
    rng = np.random.default_rng(5)
    num_tokens, block_size = 11, 4
    q = rng.standard_normal((num_tokens, 4, 16)).astype(np.float32)
    k = rng.standard_normal((num_tokens, 2, 16)).astype(np.float32)
    v = rng.standard_normal((num_tokens, 2, 16)).astype(np.float32)
    cache = init_kv_cache(1, 8, block_size, 2, 16, jnp.float32)
    table = np.array([[5, 2, 7, 0]], np.int32)
    slots = table[0, np.arange(num_tokens) // block_size] * block_size + np.arange(
        num_tokens) % block_size
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(table),
        kv_lens=jnp.array([num_tokens], jnp.int32),
        cu_q_lens=jnp.array([0, num_tokens], jnp.int32), num_seqs=jnp.int32(1),
        decode_only=False)
    out, new_cache = jax.jit(lambda *a: paged_attention(*a, scale=0.25))(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache, metadata)
    expected = dense_oracle(q, [k], [v], [num_tokens], [num_tokens], scale=0.25)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)
    assert np.asarray(new_cache)[:, :, 5].any() and not np.asarray(new_cache)[:, :, 1].any()


def test_backend_names_are_checked():
    from pagedjax.pallas_kernels import AttentionBackend, resolve_backend
    assert resolve_backend("auto") == AttentionBackend("reference")  # on CPU
    assert resolve_backend("gpu", interpret=True) == AttentionBackend("gpu", True)
    with pytest.raises(ValueError, match="attention backend"):
        resolve_backend("cuda-magic")
    with pytest.raises(ValueError, match="attention_interpret"):
        resolve_backend("reference", interpret=True)


FRESH = [(40, 40), (1, 1), (29, 29), (17, 17)]  # 87 tokens, no row with earlier context
# 70 tokens; three rows continue a prompt (16, 21 and 4 tokens cached before this step's
# chunk; the last one's context read runs past its blocks, onto NaN pages)
CHUNKED = [(40, 24), (1, 1), (50, 29), (20, 16)]
STEPS = {"fresh": FRESH, "chunked": CHUNKED}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("tile", [128, 16])
@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (6, 1.5)])
@pytest.mark.quick_variant('6-1.5-16-chunked')  # the others: make test-slow
def test_prefill_steps_match_dense_oracle(sliding_window, soft_cap, tile, step, monkeypatch):
    """A step of >= FRESH_MIN_TOKENS tokens whose rows compute whole prompts or chunks of
    >= PREFILL_MIN_CHUNK tokens takes reference_prefill (tiled queries: one tile of all 96
    tokens, or tiles of 16; a row's cached context read a few blocks at a time for its tile),
    NaN pages and padding tokens included; equal to the oracle and to the paged path it
    replaces."""
    from pagedjax.pallas_kernels import reference

    monkeypatch.setattr(reference, "FRESH_TILE", tile)
    # contexts over several reads of 8 keys, or one of 32 running past the context
    monkeypatch.setattr(reference, "KV_TOKENS_PER_ITER", 8 if tile == 16 else 32)

    rng = np.random.default_rng(11)
    case = build_case(rng, STEPS[step], block_size=4, num_heads=8, num_kv_heads=2,
                      head_dim=32, padded_seqs=6, padded_tokens=96)
    assert case["num_tokens"] >= reference.FRESH_MIN_TOKENS
    args = (jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"],
            case["tables"], case["cu_q_lens"], case["num_seqs"])
    options = dict(scale=0.2, sliding_window=sliding_window, soft_cap=soft_cap)
    out = np.asarray(ragged_paged_attention_reference(*args, **options))
    n = case["num_tokens"]
    expected = dense_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                            [kv for kv, _ in STEPS[step]], **options)
    np.testing.assert_allclose(out[:n], expected[:n], rtol=2e-5, atol=2e-5)
    assert np.all(out[n:] == 0), "padding tokens must produce zeros"
    original = reference.FRESH_MIN_TOKENS
    try:  # the paged path on the same step
        reference.FRESH_MIN_TOKENS = 10 ** 9
        paged = np.asarray(ragged_paged_attention_reference(*args, **options))
    finally:
        reference.FRESH_MIN_TOKENS = original
    np.testing.assert_allclose(out, paged, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("variant", ["sinks", "int8", "latent"])
@pytest.mark.quick_variant('latent-chunked')  # the others: make test-slow
def test_prefill_steps_equal_the_paged_path(variant, step):
    """Sinks (gpt-oss), an int8 cache and a latent cache (value_dim): the prefill path against
    the paged one, which the oracle tests above and their own files hold."""
    from pagedjax.pallas_kernels import reference
    from pagedjax.pallas_kernels.quant import QuantizedKV, quantize

    rng = np.random.default_rng(12)
    case = build_case(rng, STEPS[step], block_size=4, num_heads=4, num_kv_heads=2,
                      head_dim=32, padded_tokens=90)
    cache = jnp.asarray(np.nan_to_num(case["cache"]))
    options = dict(scale=0.2)
    if variant == "sinks":
        options["sinks"] = jnp.asarray(rng.standard_normal(4), jnp.float32)
    elif variant == "int8":
        cache = QuantizedKV(*quantize(cache))
    else:
        cache, options["value_dim"] = cache[:1], 24
    args = (jnp.asarray(case["q"]), cache, case["kv_lens"], case["tables"], case["cu_q_lens"],
            case["num_seqs"])
    fresh = np.asarray(ragged_paged_attention_reference(*args, **options))
    original = reference.FRESH_MIN_TOKENS
    try:
        reference.FRESH_MIN_TOKENS = 10 ** 9
        paged = np.asarray(ragged_paged_attention_reference(*args, **options))
    finally:
        reference.FRESH_MIN_TOKENS = original
    np.testing.assert_allclose(fresh, paged, rtol=2e-5, atol=2e-5)
