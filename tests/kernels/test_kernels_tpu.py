"""TPU Pallas kernels (Mosaic) under the TPU interpreter: DMAs and semaphores simulated,
out-of-bounds reads raise. Against the reference and JAX's shipped TPU op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu_op
from test_kernels_gpu import as_dtype, decode_seqs, ragged_seqs, tolerance
from test_kernels_reference import build_case, dense_oracle

from pagedjax.pallas_kernels import (IMPLEMENTATIONS, paged_decode_attention_reference,
                                     paged_decode_attention_tpu, ragged_paged_attention_reference,
                                     ragged_paged_attention_tpu)
from pagedjax.pallas_kernels.layout import NULL_BLOCK

# The TPU interpreter is slower than the GPU one: a smaller covering set.
CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, dtype
    (8, 4, 4, 64, "float32"),     # MHA
    (16, 8, 1, 80, "float32"),    # MQA, head dim not a power of two
    (32, 16, 2, 128, "bfloat16"),  # GQA 8
]


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype", CASES)
@pytest.mark.quick_variant('16-8-1-80-float32')  # the others: make test-slow
def test_decode_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(block_size + head_dim)
    case = build_case(rng, decode_seqs(block_size), block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=8,
                      padded_tokens=8)
    q, cache = as_dtype(case, dtype)
    args = (q, cache, case["kv_lens"], case["tables"], case["num_seqs"])
    got = np.asarray(paged_decode_attention_tpu(*args, scale=head_dim ** -0.5, interpret=True,
                                                pages_per_step=2), np.float32)
    want = np.asarray(paged_decode_attention_reference(*args, scale=head_dim ** -0.5),
                      np.float32)
    assert np.all(np.isfinite(got)), "a NaN page leaked"
    np.testing.assert_allclose(got[:5], want[:5], **tolerance(dtype))
    assert np.all(got[5:] == 0)


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype", CASES)
@pytest.mark.quick_variant('16-8-1-80-float32')  # the others: make test-slow
def test_ragged_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(block_size * head_dim)
    seqs = ragged_seqs(block_size)
    num_tokens = sum(q for _, q in seqs)
    case = build_case(rng, seqs, block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=8,
                      padded_tokens=num_tokens + 7)
    q, cache = as_dtype(case, dtype)
    args = (q, cache, case["kv_lens"], case["tables"], case["cu_q_lens"], case["num_seqs"])
    got = np.asarray(ragged_paged_attention_tpu(*args, scale=head_dim ** -0.5, interpret=True,
                                                tile_q=16, pages_per_step=2), np.float32)
    want = np.asarray(ragged_paged_attention_reference(*args, scale=head_dim ** -0.5),
                      np.float32)
    assert np.all(np.isfinite(got)), "a NaN page leaked"
    np.testing.assert_allclose(got[:num_tokens], want[:num_tokens], **tolerance(dtype))
    assert np.all(got[num_tokens:] == 0)


def test_window_and_soft_cap():
    rng = np.random.default_rng(5)
    seqs = [(30, 30), (19, 4), (50, 1)]
    case = build_case(rng, seqs, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32)
    opts = dict(scale=0.2, sliding_window=12, soft_cap=2.0)
    expected = dense_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                            [kv for kv, _ in seqs], **opts)
    got = ragged_paged_attention_tpu(
        jnp.asarray(case["q"]), jnp.asarray(case["cache"]), case["kv_lens"], case["tables"],
        case["cu_q_lens"], case["num_seqs"], interpret=True, tile_q=16, pages_per_step=2, **opts)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5)
    last = case["cu_q_lens"][1:] - 1
    got_decode = paged_decode_attention_tpu(
        jnp.asarray(case["q"][last]), jnp.asarray(case["cache"]), case["kv_lens"],
        case["tables"], case["num_seqs"], interpret=True, pages_per_step=2, **opts)
    np.testing.assert_allclose(np.asarray(got_decode), expected[last], rtol=2e-5, atol=2e-5)


def test_decode_kernel_matches_jax_shipped_tpu_op():
    """Independent oracle: jax.experimental.pallas.ops.tpu.paged_attention.

    That op rounds K/V to bf16 as it loads them, so both sides get K/V already rounded to bf16
    (then the rounding is exact and f32 tolerances apply). It reads masked positions through its
    dot without zeroing them, so unused pages hold zeros, not NaN.
    """
    rng = np.random.default_rng(4)
    seqs = [(9, 1), (16, 1), (31, 1)]
    case = build_case(rng, seqs, block_size=8, num_heads=8, num_kv_heads=2, head_dim=128,
                      num_blocks=24)
    cache = np.asarray(jnp.asarray(np.nan_to_num(case["cache"], nan=0.0))
                       .astype(jnp.bfloat16).astype(jnp.float32))
    tables = np.pad(case["tables"], ((0, 0), (0, 6 - case["tables"].shape[1])))
    q = jnp.asarray(case["q"])
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(out_of_bounds_reads="raise")):
        theirs = jax_tpu_op(q * 128 ** -0.5, jnp.asarray(cache[0]), jnp.asarray(cache[1]),
                            jnp.asarray(case["kv_lens"]), jnp.asarray(tables),
                            pages_per_compute_block=2)
    ours = paged_decode_attention_tpu(q, jnp.asarray(cache), case["kv_lens"], tables,
                                      case["num_seqs"], scale=128 ** -0.5, interpret=True,
                                      pages_per_step=2)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)


def engine_slots(block_size=8):
    """Slots as a step writes them: a prefill chunk that starts mid-page and crosses two pages,
    decode tokens at page ends and starts, the same page in two runs (a token written, then
    its neighbour after another sequence's), and padding into the null block."""
    pages = [5, 9, 2, 7, 11]
    slots = ([5 * block_size + o for o in range(3, 8)] + [9 * block_size + o for o in range(4)]
             + [2 * block_size + 7, 7 * block_size, 11 * block_size + 1, 2 * block_size + 6])
    assert all(s // block_size in pages for s in slots)
    return np.asarray(slots + [0, 0, 0], np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pattern", ["shuffled", "engine"])
@pytest.mark.quick_variant('shuffled-bfloat16')  # the others: make test-slow
def test_write_kv_tpu_matches_scatter(dtype, pattern):
    """Every slot pattern, in a 32-bit and a packed 16-bit cache (whose pages the kernel
    rewrites whole): exactly the scatter's result outside the null block."""
    from test_kernels_gpu import assert_same_write, write_case

    from pagedjax.pallas_kernels import write_kv_reference, write_kv_tpu
    cache, k, v, slots = write_case(np.random.default_rng(3), 80, 80, num_tokens=16)
    if pattern == "engine":
        slots = engine_slots()
    cache, k, v = (jnp.asarray(x).astype(dtype) for x in (cache, k, v))
    want = write_kv_reference(cache, k, v, slots)
    got = write_kv_tpu(cache, k, v, jnp.asarray(slots), interpret=True)
    assert_same_write(got, want, 8)


@pytest.mark.parametrize("dtype, pattern", [("int8", "engine"), ("float8_e4m3fn", "shuffled")])
@pytest.mark.quick_variant('int8-engine')  # the others: make test-slow
def test_write_kv_tpu_quantized_matches_scatter(dtype, pattern):
    """A quantized cache in the TPU layout (scale rows padded to 128 lanes, NaN past the block
    size): the kernel quantizes as the scatter does and puts values and scales in place, bit
    for bit, and leaves the padding lanes alone."""
    from test_kernels_gpu import write_case

    from pagedjax.pallas_kernels import write_kv_reference, write_kv_tpu
    from pagedjax.pallas_kernels.layout import scale_lanes
    from pagedjax.pallas_kernels.quant import QuantizedKV, quantize
    cache, k, v, slots = write_case(np.random.default_rng(5), 128, 128, num_tokens=16)
    if pattern == "engine":
        slots = engine_slots()
    data, scales = quantize(jnp.asarray(cache), jnp.dtype(dtype))
    lanes = scale_lanes(8, "tpu")
    padded = np.full((*scales.shape[:-1], lanes), np.nan, np.float32)
    padded[..., :8] = scales
    cache = QuantizedKV(data, jnp.asarray(padded))
    want = write_kv_reference(cache, jnp.asarray(k), jnp.asarray(v), slots)
    got = write_kv_tpu(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                       interpret=True)
    for got_array, want_array in zip(got, want):
        np.testing.assert_array_equal(np.asarray(got_array[:, :, 1:]).astype(np.float32),
                                      np.asarray(want_array[:, :, 1:]).astype(np.float32))
    assert np.isnan(np.asarray(got.scales)[..., 8:]).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_copy_blocks_tpu_matches_scatter(dtype):
    """Copy-on-write by DMA, every array of the cache, only the first num_copies pairs."""
    from pagedjax.pallas_kernels import init_kv_cache
    from pagedjax.pallas_kernels.layout import copy_blocks
    from pagedjax.pallas_kernels.tpu.write import copy_blocks_tpu
    rng = np.random.default_rng(6)
    cache = jax.tree.map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape) * 50).astype(a.dtype),
        init_kv_cache(1, 12, 8, 2, 128, jnp.dtype(dtype), "tpu"))
    src, dst = jnp.asarray([3, 5, 7, 0], jnp.int32), jnp.asarray([9, 4, 11, 0], jnp.int32)
    for num_copies in (0, 3):
        want = copy_blocks(cache, src, dst, jnp.int32(num_copies))
        got = copy_blocks_tpu(jax.tree.map(jnp.copy, cache), src, dst, jnp.int32(num_copies),
                              interpret=True)
        for got_array, want_array in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(got_array), np.asarray(want_array))


def test_write_kv_tpu_repeated_slots_keep_the_last_token():
    """Tokens sharing a slot: the last one's K/V stays, as a sequential scatter leaves it."""
    from pagedjax.pallas_kernels import write_kv_tpu
    rng = np.random.default_rng(4)
    cache = rng.standard_normal((2, 2, 12, 8, 128)).astype(np.float32)
    k, v = (rng.standard_normal((9, 2, 128)).astype(np.float32) for _ in range(2))
    slots = np.asarray([17, 40, 17, 41, 0, 95, 40, 18, 17], np.int32)
    want = cache.copy()
    for token, slot in enumerate(slots):
        want[0, :, slot // 8, slot % 8] = k[token]
        want[1, :, slot // 8, slot % 8] = v[token]
    got = np.asarray(write_kv_tpu(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v),
                                  jnp.asarray(slots), interpret=True))
    np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])


def test_null_block_agrees_with_the_scheduler():
    """The TPU write skips the null block's slots: it must be the scheduler's null block."""
    from pagedjax.pallas_kernels.layout import NULL_BLOCK
    from pagedjax.scheduler import NULL_BLOCK as SCHEDULER_NULL_BLOCK
    assert NULL_BLOCK == SCHEDULER_NULL_BLOCK


@pytest.mark.parametrize("backend", ["tpu", "gpu", "reference"])
@pytest.mark.quick_variant('tpu')  # the others: make test-slow
def test_pages_freed_out_of_the_window_are_never_read(backend):
    """With a sliding window the scheduler frees the pages no query can see any more and leaves
    the null block in their table slots (KVCacheManager.free_out_of_window); here that block
    holds NaN. The kernels skip whole compute blocks before the window and must zero V in the
    one the window starts in (tpu.pipeline.attend_blocks)."""
    impl = IMPLEMENTATIONS[backend]
    window, block_size = 12, 8
    rng = np.random.default_rng(6)
    seqs = [(45, 5), (40, 1), (33, 1)]
    case = build_case(rng, seqs, block_size=block_size, num_heads=4, num_kv_heads=2,
                      head_dim=32, backend=backend)
    for b, (kv_len, q_len) in enumerate(seqs):
        first_visible = kv_len - q_len - window + 1  # the first query's window
        case["tables"][b, :first_visible // block_size] = NULL_BLOCK
    assert np.all(np.isnan(case["cache"][:, :, NULL_BLOCK]))
    opts = dict(scale=0.2, sliding_window=window)
    kwargs = {} if backend == "reference" else dict(interpret=True, pages_per_step=2)
    expected = dense_oracle(case["q"], case["keys"], case["values"], case["q_lens"],
                            [kv for kv, _ in seqs], **opts)
    q, cache = jnp.asarray(case["q"]), jnp.asarray(case["cache"])
    got = impl.ragged(q, cache, case["kv_lens"], case["tables"], case["cu_q_lens"],
                      case["num_seqs"], **opts, **kwargs)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-5)
    last = case["cu_q_lens"][1:] - 1
    got = impl.decode(q[last], cache, case["kv_lens"], case["tables"], case["num_seqs"],
                      **opts, **kwargs)
    np.testing.assert_allclose(np.asarray(got), expected[last], rtol=2e-5, atol=2e-5)
