"""The Mosaic GPU kernels (pallas_kernels/gpu/mosaic/): decode, ragged prefill, KV write.

Through the Mosaic GPU interpreter (it simulates shared memory, TMA copies, barriers and WGMMA on
the CPU) against the reference and the Triton kernel, and built by XLA for an H200 that is not
there (benchmarks/aot/xla_gpu.py). Both need jax >= 0.11: these tests run in
`make test-gpu-image` and are skipped under the main environment's jax.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_gpu import assert_same_write, ragged_seqs, reference_layout, write_case
from test_kernels_reference import build_case

from benchmarks.aot import xla_gpu
from pagedjax.pallas_kernels.gpu import mosaic
from pagedjax.pallas_kernels.gpu.mosaic import (paged_decode_attention_mosaic_gpu,
                                                ragged_paged_attention_mosaic_gpu,
                                                write_kv_mosaic_gpu)
from pagedjax.pallas_kernels.gpu.triton import (paged_decode_attention_gpu,
                                                ragged_paged_attention_gpu)
from pagedjax.pallas_kernels.layout import write_kv_reference
from pagedjax.pallas_kernels.quant import QuantizedKV
from pagedjax.pallas_kernels.reference import (paged_decode_attention_reference,
                                               ragged_paged_attention_reference)
from pagedjax.scheduler.chips import CHIPS

pytestmark = pytest.mark.skipif(mosaic.problem() is not None,
                                reason=str(mosaic.problem()))

# Block sizes 8 / 16 / 32, MHA / GQA 4 / GQA 8 / MQA, head dims 64, 128 and 80 (the GPU layout
# pads it to 128), bf16 and f16, 64 and 128 keys a step (neither divides every sequence), one to
# three stages, split contexts. Each case also builds for an H200 (test_cases_build_for_h200).
CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, dtype, tunables
    (8, 4, 4, 64, "bfloat16", dict(pages_per_step=8, num_splits=2)),
    (16, 8, 2, 128, "bfloat16", dict()),
    (32, 8, 1, 80, "bfloat16", dict(pages_per_step=2, num_stages=3)),
    (16, 16, 2, 64, "float16", dict(pages_per_step=4, num_stages=1, num_splits=4)),
    (8, 32, 8, 128, "bfloat16", dict(num_stages=3)),  # 3 stages of 128 keys do not fit: 64
]


def decode_seqs(block_size):
    # 1 token, exactly a block, one past, several blocks and a remainder, long.
    return [(1, 1), (block_size, 1), (block_size + 1, 1), (3 * block_size + 5, 1), (150, 1)]


def tolerance(dtype):
    # Both sides read the same 16-bit K/V. The kernel rounds q and the probabilities to the
    # cache's type for its two WGMMAs (2**-8 relative in bf16, 2**-11 in f16) on O(1) outputs,
    # and takes exp2 in the approximate form (a few ulp of f32).
    return dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=4e-3, atol=4e-3)


def make_args(rng, block_size, num_heads, num_kv_heads, head_dim, dtype, ragged=False):
    """(kernel operands, live rows): decode rows, or ragged tokens (and 7 padding tokens)."""
    seqs = ragged_seqs(block_size) if ragged else decode_seqs(block_size)
    live = sum(q for _, q in seqs)
    case = build_case(rng, seqs, block_size=block_size, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, num_blocks=160,
                      padded_seqs=len(seqs) + 3, backend="gpu",
                      padded_tokens=live + 7 if ragged else len(seqs) + 3)
    ragged_operands = (jnp.asarray(case["cu_q_lens"]),) if ragged else ()
    return (jnp.asarray(case["q"], dtype), jnp.asarray(case["cache"], dtype),
            jnp.asarray(case["kv_lens"]), jnp.asarray(case["tables"]), *ragged_operands,
            jnp.asarray(case["num_seqs"])), live


def reference(args, head_dim, **options):
    q, cache, *rest = reference_layout(args, head_dim)
    fn = (ragged_paged_attention_reference if len(args) == 6
          else paged_decode_attention_reference)
    return np.asarray(fn(q.astype(jnp.float32), cache.astype(jnp.float32), *rest,
                         scale=head_dim ** -0.5, **options), np.float32)


KERNELS = {"decode": paged_decode_attention_mosaic_gpu,
           "ragged": ragged_paged_attention_mosaic_gpu}


def kernel_options(kind, tunables):
    """The ragged kernel has no splits: a tile of queries is its unit of work."""
    return {k: v for k, v in tunables.items() if kind == "decode" or k != "num_splits"}


@pytest.mark.parametrize("kind", ["decode", "ragged"])
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype, tunables", CASES)
def test_kernel_matches_reference(kind, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                  tunables):
    rng = np.random.default_rng(block_size + head_dim + num_heads)
    args, live = make_args(rng, block_size, num_heads, num_kv_heads, head_dim, dtype,
                           ragged=kind == "ragged")
    got = np.asarray(KERNELS[kind](*args, scale=head_dim ** -0.5, interpret=True,
                                   **kernel_options(kind, tunables)), np.float32)
    assert np.all(np.isfinite(got)), "a NaN page leaked"
    np.testing.assert_allclose(got[:live], reference(args, head_dim)[:live], **tolerance(dtype))
    assert np.all(got[live:] == 0), "padding rows must be zero"


@pytest.mark.parametrize("kind", ["decode", "ragged"])
@pytest.mark.parametrize("sliding_window, soft_cap, tunables", [
    (7, None, dict()),
    (None, 3.0, dict(pages_per_step=4)),
    (40, 2.0, dict(pages_per_step=4, num_splits=2)),  # a window that starts mid-step and split
])
def test_window_and_soft_cap(kind, sliding_window, soft_cap, tunables):
    # Pages wholly before every window of a sequence's queries are NaN here (the engine frees
    # them): the kernel must neither read them into a score nor let them reach the output
    # through V.
    rng = np.random.default_rng(7)
    args, live = make_args(rng, 16, 8, 2, 64, "bfloat16", ragged=kind == "ragged")
    q, cache, kv_lens, tables, *rest = args
    if sliding_window is not None:
        cu_q_lens = np.asarray(rest[0]) if kind == "ragged" else np.arange(len(kv_lens) + 1)
        cache = np.asarray(cache.astype(jnp.float32)).copy()
        for b in range(int(rest[-1])):
            first_query = int(kv_lens[b]) - int(cu_q_lens[b + 1] - cu_q_lens[b])
            first_seen = max(first_query + 1 - sliding_window, 0) // 16
            cache[:, :, np.asarray(tables[b, :first_seen])] = np.nan
        args = (q, jnp.asarray(cache, jnp.bfloat16), kv_lens, tables, *rest)
    options = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    got = np.asarray(KERNELS[kind](*args, scale=64 ** -0.5, interpret=True, **options,
                                   **kernel_options(kind, tunables)), np.float32)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:live], reference(args, 64, **options)[:live],
                               **tolerance("bfloat16"))


@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_agrees_with_the_triton_kernel(kind):
    """Two kernels, two lowerings, one algorithm: at bf16 they round the same operands."""
    rng = np.random.default_rng(3)
    args, live = make_args(rng, 16, 8, 2, 128, "bfloat16", ragged=kind == "ragged")
    mosaic = KERNELS[kind](*args, scale=0.1, interpret=True)
    triton = (paged_decode_attention_gpu if kind == "decode"
              else ragged_paged_attention_gpu)(*args, scale=0.1, interpret=True)
    np.testing.assert_allclose(np.asarray(mosaic, np.float32), np.asarray(triton, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_large_pool_high_block_ids():
    """Pages near the top of a 40k-block pool: the TMA source index is not truncated."""
    rng = np.random.default_rng(11)
    num_blocks, block_size, head_dim = 40_000, 8, 64
    cache = np.full((2, 1, num_blocks, block_size, head_dim), np.nan, np.float32)
    blocks = np.array([num_blocks - 1, 5, num_blocks - 2, 32_769])
    cache[:, :, blocks] = rng.standard_normal((2, 1, 4, block_size, head_dim))
    tables = jnp.asarray(blocks[None], jnp.int32)
    args = (jnp.asarray(rng.standard_normal((1, 4, head_dim)), jnp.bfloat16),
            jnp.asarray(cache, jnp.bfloat16), jnp.array([29], jnp.int32), tables,
            jnp.int32(1))
    got = paged_decode_attention_mosaic_gpu(*args, scale=0.125, interpret=True)
    want = paged_decode_attention_reference(args[0].astype(jnp.float32),
                                            args[1].astype(jnp.float32), *args[2:], scale=0.125)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **tolerance("bfloat16"))


@pytest.mark.parametrize("head_dim, cache_head_dim", [(64, 64), (80, 128)])
def test_write_kv_matches_scatter(head_dim, cache_head_dim):
    cache, k, v, slots = write_case(np.random.default_rng(head_dim), head_dim, cache_head_dim)
    cache, k, v, slots = (jnp.asarray(cache, jnp.bfloat16), jnp.asarray(k), jnp.asarray(v),
                          jnp.asarray(slots))
    want = write_kv_reference(cache, k, v, slots)
    got = write_kv_mosaic_gpu(cache.copy(), k, v, slots, interpret=True)
    assert_same_write(np.asarray(got, np.float32), np.asarray(want, np.float32), 8)


def test_what_it_cannot_read_is_refused_by_name():
    q = jnp.zeros((1, 4, 64), jnp.bfloat16)
    tables, lens, n = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), jnp.int32(1)
    call = functools.partial(paged_decode_attention_mosaic_gpu, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="float32"):
        call(q, jnp.zeros((2, 1, 4, 8, 64), jnp.float32), lens, tables, n)
    with pytest.raises(ValueError, match="quantized"):
        call(q, QuantizedKV(jnp.zeros((2, 1, 4, 8, 64), jnp.int8),
                            jnp.ones((2, 1, 4, 8), jnp.float32)), lens, tables, n)
    with pytest.raises(ValueError, match="multiple of 8"):
        call(q, jnp.zeros((2, 1, 4, 4, 64), jnp.bfloat16), lens, tables, n)
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        call(q, jnp.zeros((2, 3, 4, 8, 64), jnp.bfloat16), lens, tables, n)
    with pytest.raises(ValueError, match=r"\(2 x 16\) must be a multiple of 64 keys"):
        call(q, jnp.zeros((2, 1, 4, 16, 64), jnp.bfloat16), lens, tables, n, pages_per_step=2)


def test_engine_config_refuses_what_it_cannot_serve():
    from pagedjax import EngineConfig

    with pytest.raises(ValueError, match="bfloat16 KV cache.*dtype='float32'"):
        EngineConfig(attention_backend="mosaic_gpu")
    with pytest.raises(ValueError, match="bfloat16 KV cache.*kv_cache_dtype='int8'"):
        EngineConfig(attention_backend="mosaic_gpu", dtype="bfloat16", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="block_size must be a multiple of 8"):
        EngineConfig(attention_backend="mosaic_gpu", dtype="bfloat16", block_size=4)
    EngineConfig(attention_backend="mosaic_gpu", dtype="bfloat16")


def test_engine_greedy_tokens_match_the_reference(tiny_model):
    """The engine on the mosaic_gpu backend (Mosaic GPU ragged and decode attention and KV
    writes, interpreted; chunked prefill and mixed steps), bf16 throughout, against the
    reference backend in bf16."""
    from test_engine_equivalence import run_engine

    # 4 prompts of 3, 17, 1 and 40 tokens: the 40 is prefilled in chunks beside decodes.
    common = dict(dtype="bfloat16", block_size=8, max_num_batched_tokens=16, max_tokens=6,
                  num_prompts=4, max_num_seqs=4, min_seq_bucket=4)
    want, _ = run_engine(tiny_model, attention_backend="reference", **common)
    got, engine = run_engine(tiny_model, attention_backend="mosaic_gpu",
                             attention_interpret=True, **common)
    assert engine.stats.num_decode_steps > 0 and engine.stats.num_prefill_steps >= 3
    assert got == want
    assert engine.scheduler.kv_manager.num_used_blocks == 0


# Built for an H200 by XLA (jax 0.11's CUDA plugin, ptxas), as the device script runs it.
H200_SHAPES = [
    # batch, num_heads, num_kv_heads, head_dim, block_size, table width (pages)
    (128, 32, 8, 128, 16, 32),  # the benchmark's batch 128 x 512 tokens
    (1, 32, 8, 128, 16, 2048),  # batch 1 x 32k: split-K
    (16, 64, 8, 64, 32, 64),  # GQA 8, head dim 64, blocks of 32
]


@pytest.mark.skipif(xla_gpu.available() is not None, reason=str(xla_gpu.available()))
@pytest.mark.parametrize("batch, num_heads, num_kv_heads, head_dim, block_size, width",
                         H200_SHAPES)
def test_builds_for_h200(batch, num_heads, num_kv_heads, head_dim, block_size, width):
    args = (jax.ShapeDtypeStruct((batch, num_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((2, num_kv_heads, 4096, block_size, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
            jax.ShapeDtypeStruct((batch, width), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32))
    build = xla_gpu.compile_for(
        functools.partial(paged_decode_attention_mosaic_gpu, scale=head_dim ** -0.5), args)
    [kernel] = build.mosaic
    assert kernel.name.startswith("paged_decode_attention_mosaic_gpu")
    assert kernel.arch == "sm_90a"  # TMA and WGMMA: Hopper's arch-specific target
    assert kernel.spill_bytes == 0 and kernel.registers <= 255
    group = num_heads // num_kv_heads
    rows = -(-group // mosaic.ROWS) * mosaic.ROWS
    pages, stages = mosaic.fit_pipeline(None, None, rows=rows, block_size=block_size,
                                                   head_dim=head_dim, itemsize=2)
    assert kernel.shared_bytes == mosaic.shared_memory_bytes(
        rows=rows, keys=pages * block_size, head_dim=head_dim, itemsize=2, num_stages=stages)
    assert kernel.shared_bytes <= CHIPS["h200"].gpu.shared_per_block


@pytest.mark.skipif(xla_gpu.available() is not None, reason=str(xla_gpu.available()))
@pytest.mark.parametrize("kind", ["decode", "ragged"])
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim, dtype, tunables", CASES)
def test_cases_build_for_h200(kind, block_size, num_heads, num_kv_heads, head_dim, dtype,
                              tunables):
    """What the interpreter checks also builds for the chip: the interpreter ignores register
    layouts, index alignment and shared-memory limits; Mosaic GPU's lowering and the launch do
    not."""
    args, _ = make_args(np.random.default_rng(0), block_size, num_heads, num_kv_heads, head_dim,
                        dtype, ragged=kind == "ragged")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    build = xla_gpu.compile_for(functools.partial(
        KERNELS[kind], scale=0.1, **kernel_options(kind, tunables)), abstract)
    [kernel] = build.mosaic
    assert kernel.name.startswith(KERNELS[kind].__name__)
    assert kernel.spill_bytes == 0
    assert kernel.shared_bytes <= CHIPS["h200"].gpu.shared_per_block


@pytest.mark.skipif(xla_gpu.available() is not None, reason=str(xla_gpu.available()))
def test_write_kv_builds_for_h200_in_place():
    cache = jax.ShapeDtypeStruct((2, 8, 4096, 16, 128), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((512, 8, 128), jnp.bfloat16)
    build = xla_gpu.compile_for(write_kv_mosaic_gpu, (
        cache, rows, rows, jax.ShapeDtypeStruct((512,), jnp.int32)))
    [kernel] = build.mosaic
    assert kernel.name.startswith("write_kv_mosaic_gpu") and kernel.spill_bytes == 0
    cache_bytes = cache.size * 2
    assert build.alias_bytes >= cache_bytes and build.temp_bytes < cache_bytes / 100


@pytest.mark.skipif(xla_gpu.available() is not None, reason=str(xla_gpu.available()))
def test_fit_pipeline_keeps_to_the_chip():
    """Four stages of 128 keys overflow an H200's 227 KiB: the wrapper halves the step instead
    of failing at launch, and the build fits."""
    kwargs = dict(rows=64, head_dim=128, itemsize=2)
    limit = CHIPS["h200"].gpu.shared_per_block
    pages, stages = mosaic.fit_pipeline(None, 4, limit=limit, block_size=16,
                                                   **kwargs)
    assert (pages, stages) == (4, 4)
    assert mosaic.shared_memory_bytes(keys=pages * 16, num_stages=stages,
                                                 **kwargs) <= limit
    assert mosaic.shared_memory_bytes(keys=128, num_stages=4, **kwargs) > limit


@pytest.mark.skipif(xla_gpu.available() is not None, reason=str(xla_gpu.available()))
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_engine_step_builds_for_h200_in_place(kind):
    """The engine's steps on the mosaic_gpu backend (Mosaic GPU KV writes and attention in every
    layer, no Triton kernel) build for an H200 with the donated caches updated where they
    lie."""
    from test_kernels_lowering import abstract_step

    from pagedjax.models import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=32, num_kv_heads=8, head_dim=128)
    step, args = abstract_step(config, kind, num_tokens=8 if kind == "decode" else 64,
                               num_seqs=8, num_blocks=4096, max_blocks_per_seq=32,
                               cache_dtype=jnp.bfloat16, backend="mosaic_gpu")
    build = xla_gpu.compile_for(step, args, "h200")
    assert build.kernels == ()  # no Triton kernel
    # The layers' identical kernels are built once each.
    names = sorted(k.name.split("_mosaic_gpu")[0] for k in build.mosaic)
    attention = KERNELS["decode" if kind == "decode" else "ragged"].__name__
    assert names == sorted([attention.split("_mosaic_gpu")[0], "write_kv"]), names
    assert all(k.spill_bytes == 0 for k in build.mosaic)
    caches = sum(a.size * 2 for a in jax.tree.leaves(args[1]))
    assert build.temp_bytes < caches / config.num_layers / 2
    assert build.alias_bytes >= caches
