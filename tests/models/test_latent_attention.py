"""The latent cache of multi-head latent attention (DeepSeek, models/layers/mla.py): one plane
whose rows [latent | RoPE key] are the key of one KV head and whose first value_dim values are
the value, through every path that takes it: the jnp reference against a float64 dense oracle,
the TPU kernels (decode, ragged, the KV write) and the GPU (Triton) ones interpreted against it,
with NaN in unused pages; on the TPU the row padded to whole 128-lane tiles (48 -> 128), on the
GPU unpadded (32 + 16, read as two tiles)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_reference import build_case

from pagedjax.pallas_kernels import (paged_decode_attention_gpu, paged_decode_attention_reference,
                                     paged_decode_attention_tpu, ragged_paged_attention_gpu,
                                     ragged_paged_attention_reference, ragged_paged_attention_tpu,
                                     write_kv_gpu, write_kv_reference)
from pagedjax.pallas_kernels.tpu import write_kv_tpu

SEQS = [(30, 30), (19, 4), (50, 1), (9, 9)]
LATENT, ROPE = 32, 16


def latent_oracle(q, keys, q_lens, kv_lens, *, scale):
    """float64 MQA per query token over contiguous latent rows [M, 1, LATENT + ROPE], the
    value each row's first LATENT values."""
    out = np.zeros((*q.shape[:2], LATENT), np.float64)
    start = 0
    for k, q_len, kv_len in zip(keys, q_lens, kv_lens):
        k = k[:, 0].astype(np.float64)
        for i in range(q_len):
            pos = kv_len - q_len + i
            s = q[start + i].astype(np.float64) @ k[:pos + 1].T * scale  # [N, M]
            p = np.exp(s - s.max(-1, keepdims=True))
            out[start + i] = (p / p.sum(-1, keepdims=True)) @ k[:pos + 1, :LATENT]
        start += q_len
    return out


def latent_case(backend="reference", num_heads=4):
    case = build_case(np.random.default_rng(0), SEQS, block_size=8, num_heads=num_heads,
                      num_kv_heads=1, head_dim=LATENT + ROPE, padded_seqs=6,
                      padded_tokens=sum(q for _, q in SEQS) + 5, backend=backend)
    case["cache"] = case["cache"][:1]  # the K plane alone: one plane, the latent's rows
    return case


def _run(ragged, decode, case, opts):
    q, cache = jnp.asarray(case["q"]), jnp.asarray(case["cache"])
    n = case["num_tokens"]
    want = latent_oracle(case["q"], case["keys"], case["q_lens"], [kv for kv, _ in SEQS],
                         scale=0.2)
    got = np.asarray(ragged(q, cache, case["kv_lens"], case["tables"], case["cu_q_lens"],
                            case["num_seqs"], scale=0.2, value_dim=LATENT, **opts[0]))
    assert got.shape == (*q.shape[:2], LATENT) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:n], want[:n], rtol=2e-5, atol=2e-5)
    assert np.all(got[n:] == 0)
    rows = np.zeros((6, *case["q"].shape[1:]), np.float32)
    last = case["cu_q_lens"][1:len(SEQS) + 1] - 1
    rows[:len(SEQS)] = case["q"][last]
    got = np.asarray(decode(jnp.asarray(rows), cache, case["kv_lens"], case["tables"],
                            case["num_seqs"], scale=0.2, value_dim=LATENT, **opts[1]))
    np.testing.assert_allclose(got[:len(SEQS)], want[last], rtol=2e-5, atol=2e-5)
    assert np.all(got[len(SEQS):] == 0)


def test_reference_matches_the_dense_oracle():
    _run(ragged_paged_attention_reference, paged_decode_attention_reference, latent_case(),
         ({}, {}))


def test_tpu_kernels_match_the_dense_oracle():
    _run(ragged_paged_attention_tpu, paged_decode_attention_tpu, latent_case("tpu"),
         (dict(tile_q=16, pages_per_step=2, interpret=True),
          dict(pages_per_step=2, interpret=True)))


def test_gpu_kernels_match_the_dense_oracle():
    """The Triton latent kernels (gpu.triton.latent) on the unpadded row, 4 heads padded to 16
    rows, two splits of the context in decode."""
    _run(ragged_paged_attention_gpu, paged_decode_attention_gpu, latent_case(),
         (dict(pages_per_step=2, interpret=True),
          dict(pages_per_step=2, num_splits=2, interpret=True)))


def test_gpu_kernels_tile_heads_and_tokens(monkeypatch):
    """With a row budget of 16 (as DeepSeek's Dl 512 makes it), 20 heads are two programs of
    16 rows (12 of them padding) and the ragged kernel takes one token a program."""
    from pagedjax.pallas_kernels.gpu.triton import latent
    monkeypatch.setattr(latent, "MAX_TILE_ELEMENTS", 16 * LATENT)
    assert latent.choose_tiles(20, LATENT, tokens=16) == (32, 16, 1)
    _run(ragged_paged_attention_gpu, paged_decode_attention_gpu, latent_case(num_heads=20),
         (dict(pages_per_step=4, interpret=True), dict(pages_per_step=1, interpret=True)))


def test_gpu_kernels_read_an_int8_latent_cache_as_the_reference_does():
    """An int8 latent cache on the GPU layout (one plane, one scale a token for its whole row),
    read by the Triton kernels and by the reference: the same dequantized attention."""
    from pagedjax.pallas_kernels import init_kv_cache
    case = latent_case()
    cache = init_kv_cache(1, 97, 8, 1, LATENT + ROPE, "int8", "gpu", planes=1)
    for b, k in enumerate(case["keys"]):
        positions = np.arange(k.shape[0])
        slots = case["tables"][b, positions // 8] * 8 + positions % 8
        cache = write_kv_gpu(cache, jnp.asarray(k), None, jnp.asarray(slots, jnp.int32),
                             interpret=True)
    q, n = jnp.asarray(case["q"]), case["num_tokens"]
    args = (case["kv_lens"], case["tables"], case["cu_q_lens"], case["num_seqs"])
    opts = dict(scale=0.2, value_dim=LATENT)
    want = np.asarray(ragged_paged_attention_reference(q, cache, *args, **opts))
    got = np.asarray(ragged_paged_attention_gpu(q, cache, *args, interpret=True, **opts))
    np.testing.assert_allclose(got[:n], want[:n], rtol=2e-5, atol=2e-5)
    exact = latent_oracle(case["q"], case["keys"], case["q_lens"], [kv for kv, _ in SEQS],
                          scale=0.2)
    assert 1e-4 < np.max(np.abs(want[:n] - exact[:n])) < 0.1  # int8's rounding, and no more


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_write_puts_one_plane_where_the_reference_does(dtype):
    """The Triton write on a one-plane cache (v None), its unpadded row of 48 stored as 32 + 16;
    padding tokens land in the null block, as the reference's."""
    from pagedjax.pallas_kernels import init_kv_cache
    from pagedjax.pallas_kernels.gpu.triton.write import row_chunks
    assert row_chunks(576) == ((0, 512), (512, 64)) and row_chunks(128) == ((0, 128),)
    rng = np.random.default_rng(3)
    cache = init_kv_cache(1, 12, 8, 1, LATENT + ROPE, dtype, "gpu", planes=1)
    assert cache.shape == (1, 1, 12, 8, LATENT + ROPE)  # not padded to 64
    k = jnp.asarray(rng.standard_normal((11, 1, LATENT + ROPE)), jnp.float32)
    slots = jnp.asarray([9, 10, 11, 40, 41, 83, 0, 0, 95, 17, 12], jnp.int32)
    want = np.asarray(write_kv_reference(cache, k, None, slots))
    got = np.asarray(write_kv_gpu(cache, k, None, slots, interpret=True))
    np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])
    assert np.all(got[0, 0, 10, 3] == np.asarray(k[5, 0], dtype))  # slot 83, both chunks


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.quick_variant('float32')  # the others: make test-slow
def test_tpu_write_puts_one_plane_where_the_reference_does(dtype):
    """The TPU write kernel on a one-plane cache (v None) equals the XLA scatter, padding
    tokens (slots in the null block) dropped; int8 with its scale rows too."""
    from pagedjax.pallas_kernels import init_kv_cache
    rng = np.random.default_rng(2)
    cache = init_kv_cache(1, 12, 8, 1, LATENT + ROPE, dtype, "tpu", planes=1)
    k = jnp.asarray(rng.standard_normal((11, 1, LATENT + ROPE)), jnp.float32)
    slots = jnp.asarray([9, 10, 11, 40, 41, 83, 0, 0, 95, 17, 12], jnp.int32)  # 0: padding
    want = write_kv_reference(cache, k, None, slots)
    got = write_kv_tpu(cache, k, None, slots, interpret=True)
    assert jax.tree.leaves(got)[0].shape == (1, 1, 12, 8, 128)  # one plane, lanes padded
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # (the null block aside)
        np.testing.assert_array_equal(np.asarray(a)[:, :, 1:], np.asarray(b)[:, :, 1:])
    assert np.any(np.asarray(jax.tree.leaves(got)[0])[0, 0, 10] != 0)  # slot 83 was written


@pytest.mark.slow  # 7 s in the TPU interpreter: make test-slow
def test_tpu_kernels_read_an_int8_latent_cache_as_the_reference_does():
    """An int8 latent cache (one plane of values and of f32 scale rows) written by the TPU write
    kernel, read by the TPU kernels and by the reference: the same dequantized attention."""
    from pagedjax.pallas_kernels import init_kv_cache
    from pagedjax.pallas_kernels.quant import QuantizedKV
    case = latent_case("tpu")
    cache = init_kv_cache(1, 97, 8, 1, LATENT + ROPE, "int8", "tpu", planes=1)
    for b, k in enumerate(case["keys"]):  # each sequence's rows into its table's slots
        positions = np.arange(k.shape[0])
        slots = case["tables"][b, positions // 8] * 8 + positions % 8
        cache = write_kv_tpu(cache, jnp.asarray(k), None, jnp.asarray(slots, jnp.int32),
                             interpret=True)
    args = (case["kv_lens"], case["tables"], case["cu_q_lens"], case["num_seqs"])
    q, n = jnp.asarray(case["q"]), case["num_tokens"]
    opts = dict(scale=0.2, value_dim=LATENT)
    unpadded = QuantizedKV(cache.data[..., :LATENT + ROPE], cache.scales)  # the reference's
    want = np.asarray(ragged_paged_attention_reference(q, unpadded, *args, **opts))
    got = np.asarray(ragged_paged_attention_tpu(q, cache, *args, tile_q=16, pages_per_step=2,
                                                interpret=True, **opts))
    np.testing.assert_allclose(got[:n], want[:n], rtol=2e-5, atol=2e-5)
    exact = latent_oracle(case["q"], case["keys"], case["q_lens"], [kv for kv, _ in SEQS],
                          scale=0.2)
    assert 1e-4 < np.max(np.abs(want[:n] - exact[:n])) < 0.1  # int8's rounding, and no more
