"""GPU Pallas kernels (Triton lowering) in interpret mode against the reference and JAX's op."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_paged_attention
from test_kernels_reference import build_case, dense_oracle

from pagedjax.pallas_kernels import (paged_decode_attention_gpu, paged_decode_attention_reference,
                                     ragged_paged_attention_gpu, ragged_paged_attention_reference)

# A covering set rather than the full product (interpret mode is slow): every block size, head
# dim, GQA ratio and dtype appears, lengths 1 / a block / a block + 1 / long, plus padded rows.
CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, dtype
    (8, 4, 4, 64, "float32"),     # MHA
    (16, 8, 2, 128, "float32"),   # GQA 4
    (32, 8, 1, 80, "float32"),    # MQA, head dim not a power of two
    (16, 16, 2, 64, "bfloat16"),  # GQA 8
    (8, 4, 1, 80, "bfloat16"),
]


def decode_seqs(block_size):
    return [(1, 1), (block_size, 1), (block_size + 1, 1), (3 * block_size + 5, 1), (70, 1)]


def ragged_seqs(block_size):
    return [(1, 1), (block_size, block_size), (block_size + 1, 3), (40, 40), (70, 1),
            (2 * block_size + 1, block_size + 1)]


def tolerance(dtype):
    # f32: accumulation-order differences only. bf16: both sides read the same bf16 K/V and
    # round q and p to bf16 for the dots (2**-8 relative), on O(1) outputs.
    return dict(rtol=2e-5, atol=2e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)


def as_dtype(case, dtype):
    return (jnp.asarray(case["q"]).astype(dtype), jnp.asarray(case["cache"]).astype(dtype))


def reference_layout(args, head_dim):
    """Kernel operands with the cache's head-dim padding (GPU layout) cut off, for the
    reference, which reads the unpadded layout."""
    q, cache, *rest = args
    return (q, cache[..., :head_dim], *rest)


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype", CASES)
@pytest.mark.quick_variant('8-4-1-80-bfloat16')  # the others: make test-slow
def test_decode_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(block_size + head_dim)
    case = build_case(rng, decode_seqs(block_size), block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=8, backend="gpu",
                      padded_tokens=8)
    q, cache = as_dtype(case, dtype)
    args = (q, cache, case["kv_lens"], case["tables"], case["num_seqs"])
    got = np.asarray(paged_decode_attention_gpu(*args, scale=head_dim ** -0.5, interpret=True,
                                                num_splits=2, pages_per_step=2), np.float32)
    want = np.asarray(paged_decode_attention_reference(*reference_layout(args, head_dim),
                                                       scale=head_dim ** -0.5), np.float32)
    assert np.all(np.isfinite(got)), "a NaN page leaked"
    np.testing.assert_allclose(got[:5], want[:5], **tolerance(dtype))
    assert np.all(got[5:] == 0)


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype", CASES)
@pytest.mark.quick_variant('8-4-1-80-bfloat16')  # the others: make test-slow
def test_ragged_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(block_size * head_dim)
    seqs = ragged_seqs(block_size)
    num_tokens = sum(q for _, q in seqs)
    case = build_case(rng, seqs, block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=8, backend="gpu",
                      padded_tokens=num_tokens + 7)
    q, cache = as_dtype(case, dtype)
    args = (q, cache, case["kv_lens"], case["tables"], case["cu_q_lens"], case["num_seqs"])
    got = np.asarray(ragged_paged_attention_gpu(*args, scale=head_dim ** -0.5, interpret=True,
                                                tile_q=16, pages_per_step=2), np.float32)
    want = np.asarray(ragged_paged_attention_reference(*reference_layout(args, head_dim),
                                                       scale=head_dim ** -0.5), np.float32)
    assert np.all(np.isfinite(got)), "a NaN page leaked"
    np.testing.assert_allclose(got[:num_tokens], want[:num_tokens], **tolerance(dtype))
    assert np.all(got[num_tokens:] == 0)


# A window of 20 over 8-token blocks starts the 50-token sequence at page 3: not aligned to the
# 2-page steps, so a split's last step reaches into the next split's pages.
@pytest.mark.parametrize("sliding_window, soft_cap", [(7, None), (None, 3.0), (12, 2.0),
                                                      (20, None)])
@pytest.mark.quick_variant('12-2.0')  # the others: make test-slow
def test_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng(5)
    seqs = [(30, 30), (19, 4), (50, 1)]
    case = build_case(rng, seqs, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32)
    opts = dict(scale=0.2, sliding_window=sliding_window, soft_cap=soft_cap)
    expected = dense_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                            [kv for kv, _ in seqs], **opts)
    got = ragged_paged_attention_gpu(
        jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["cu_q_lens"], case["num_seqs"], interpret=True, tile_q=16, pages_per_step=2, **opts)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5)
    # The decode kernel on the last token of each sequence.
    last = case["cu_q_lens"][1:] - 1
    got_decode = paged_decode_attention_gpu(
        jnp.asarray(case["q"][last]), jnp.asarray(case["cache"]), case["kv_lens"],
        case["tables"], case["num_seqs"], interpret=True, num_splits=2, pages_per_step=2, **opts)
    np.testing.assert_allclose(np.asarray(got_decode), expected[last], rtol=2e-5, atol=2e-5)


def test_large_pool_high_block_ids():
    """Blocks at the top of a 20k-block pool: block ids and offsets must not wrap."""
    rng = np.random.default_rng(9)
    seqs = [(37, 1), (5, 1)]
    case = build_case(rng, seqs, block_size=8, num_heads=2, num_kv_heads=1, head_dim=16,
                      num_blocks=20_000)
    assert case["tables"].max() > 10_000  # build_case draws blocks across the whole pool
    args = (jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
            case["num_seqs"])
    got = paged_decode_attention_gpu(*args, scale=0.25, interpret=True)
    want = paged_decode_attention_reference(*args, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_decode_kernel_matches_jax_shipped_gpu_op():
    """Independent oracle: jax.experimental.pallas.ops.gpu.paged_attention, interpret mode.

    That op reads masked positions through its dot without zeroing them, so unused pages hold
    zeros here rather than NaN; it wants a table width divisible by its k_splits.
    """
    rng = np.random.default_rng(2)
    seqs = [(9, 1), (16, 1), (31, 1)]
    case = build_case(rng, seqs, block_size=8, num_heads=8, num_kv_heads=2, head_dim=32,
                      num_blocks=24)
    cache = np.nan_to_num(case["cache"], nan=0.0)
    width = case["tables"].shape[1]
    tables = np.pad(case["tables"], ((0, 0), (0, 8 - width)))  # 2 splits x 2 x 2 pages
    q = jnp.asarray(case["q"])
    theirs = jax_gpu_paged_attention.paged_attention(
        q * 32 ** -0.5, jnp.asarray(cache[0]), jnp.asarray(cache[1]), jnp.asarray(tables),
        jnp.asarray(case["kv_lens"]), k_splits=2, pages_per_compute_block=2, interpret=True)
    ours = paged_decode_attention_gpu(q, jnp.asarray(cache), case["kv_lens"], tables,
                                      case["num_seqs"], scale=32 ** -0.5, interpret=True)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)


def write_case(rng, head_dim, cache_head_dim, num_blocks=40, block_size=8, num_tokens=13):
    """A cache, new K/V and shuffled slots; the last 3 tokens are padding (null-block slot 0)."""
    cache = rng.standard_normal((2, 2, num_blocks, block_size, cache_head_dim)).astype(np.float32)
    if cache_head_dim > head_dim:
        cache[..., head_dim:] = 0.0  # the padded layout keeps zeros there
    k = rng.standard_normal((num_tokens, 2, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, 2, head_dim)).astype(np.float32)
    real = num_tokens - 3
    slots = np.zeros(num_tokens, np.int32)
    slots[:real] = rng.choice(np.arange(block_size, num_blocks * block_size), real, replace=False)
    return cache, k, v, slots


def assert_same_write(got, want, block_size):
    keep = np.ones(got.shape, bool)
    keep[:, :, 0] = False  # the null block: padding tokens race there, nobody reads it
    np.testing.assert_array_equal(np.asarray(got)[keep], np.asarray(want)[keep])


@pytest.mark.parametrize("head_dim, cache_head_dim", [(64, 64), (80, 128)])
def test_write_kv_gpu_matches_scatter(head_dim, cache_head_dim):
    from pagedjax.pallas_kernels import write_kv_gpu, write_kv_reference
    cache, k, v, slots = write_case(np.random.default_rng(head_dim), head_dim, cache_head_dim)
    want = write_kv_reference(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v), slots)
    got = write_kv_gpu(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                       interpret=True)
    assert_same_write(got, want, 8)


def test_layouts_triton_cannot_build_are_refused_by_name():
    """Triton's tensors have power-of-two dims: a cache whose head dim is not padded (the
    reference layout at head dim 80) or a tile of 3 pages would pass the interpreter and fail
    to lower on a GPU, so the wrappers refuse them on either."""
    from pagedjax.pallas_kernels import write_kv_gpu
    rng = np.random.default_rng(3)
    case = build_case(rng, [(20, 1)], block_size=8, num_heads=4, num_kv_heads=2, head_dim=80)
    assert case["cache"].shape[-1] == 80  # the reference layout
    q, cache = jnp.asarray(case["q"]), jnp.asarray(case["cache"])
    decode_args = (q, cache, case["kv_lens"], case["tables"], case["num_seqs"])
    with pytest.raises(ValueError, match="head dim padded to a power of two.*got a cache head "
                                         "dim of 80"):
        paged_decode_attention_gpu(*decode_args, scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="head dim padded to a power of two"):
        ragged_paged_attention_gpu(q, cache, case["kv_lens"], case["tables"], case["cu_q_lens"],
                                   case["num_seqs"], scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="head dim padded to a power of two"):
        write_kv_gpu(cache, q[:, :2], q[:, :2], jnp.zeros(1, jnp.int32), interpret=True)
    padded = build_case(rng, [(20, 1)], block_size=8, num_heads=4, num_kv_heads=2, head_dim=80,
                        backend="gpu")
    args = (q, jnp.asarray(padded["cache"]), padded["kv_lens"], padded["tables"],
            padded["num_seqs"])
    with pytest.raises(ValueError, match="pages_per_step must be a power of two.*got 3"):
        paged_decode_attention_gpu(*args, scale=0.1, pages_per_step=3, interpret=True)
    with pytest.raises(ValueError, match="tile_q must be a power of two.*got 12"):
        ragged_paged_attention_gpu(*args[:4], padded["cu_q_lens"], padded["num_seqs"],
                                   scale=0.1, tile_q=12, interpret=True)
