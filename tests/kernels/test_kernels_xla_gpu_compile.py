"""XLA's own GPU compile of the kernels and the engine's step, for chips this machine lacks.

benchmarks/aot/xla_gpu.py compiles for a compile-only H200 (and A100, L4) with the GPU
image's jax and XLA's GPU pipeline whole: XLA's Triton fork builds each Pallas kernel and ptxas
its cubin, which tests/kernels/test_kernels_triton_compile.py only estimates with the triton package.
These need jax >= 0.11 with the CUDA plugin: they run in `make test-gpu-image`
(requirements/gpu-image.txt) and are skipped in the main environment.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks.aot import xla_gpu
from pagedjax.scheduler.chips import CHIPS

if (problem := xla_gpu.available()) is not None:
    pytest.skip(problem, allow_module_level=True)

from test_kernels_lowering import (ESTIMATE_CASES, GPU_CASES, KERNELS, abstract_step,  # noqa: E402
                                   estimate_case, gpu_case, kernel_args)

KERNEL_NAMES = {"decode": "paged_decode_attention_gpu", "ragged": "ragged_paged_attention_gpu",
                "write": "write_kv_gpu"}


def nbytes(tree) -> int:
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_compiles_for_h200(case):
    """Every kernel case builds in XLA's compile for an H200, within its shared memory, and
    without a temporary the size of the cache (the pool is read where it lies); the KV write,
    its cache donated, updates it in place."""
    kind = GPU_CASES[case][0]
    fn, args = gpu_case(case, num_blocks=4096)
    cache = args[0] if kind == "write" else args[1]
    jitted = jax.jit(fn, donate_argnums=(0,)) if kind == "write" else fn
    build = xla_gpu.compile_for(jitted, args, "h200")
    [launch] = build.kernels
    assert launch.name == KERNEL_NAMES[kind]
    assert 0 <= launch.shared_bytes <= CHIPS["h200"].gpu.shared_per_block
    assert build.temp_bytes < nbytes(cache) / 2, (build.temp_bytes, nbytes(cache))
    if kind == "write":
        assert build.alias_bytes >= nbytes(cache)


@pytest.mark.parametrize("chip", ["a100-80gb", "l4"])
@pytest.mark.parametrize("case", ["decode-bf16", "ragged-bf16", "decode-f32-h80-block32",
                                  "decode-f32-h256-block32"])
def test_kernel_sized_for_the_chip_compiles(case, chip):
    """The wrappers size tiles for the default device's chip (gpu.common.
    target_compute_capability): compiled for an A100 or an L4 (Colab's), each fits it."""
    fn, args = gpu_case(case)
    with jax.default_device(xla_gpu.device(chip)):
        jax.clear_caches()  # a trace sized for another chip must not be reused
        build = xla_gpu.compile_for(fn, args, chip)
    [launch] = build.kernels
    assert launch.shared_bytes <= CHIPS[chip].gpu.shared_per_block


@pytest.mark.parametrize("case", ["decode-f32-h80-block32", "ragged-f32-h80-block32"])
def test_ieee_f32_compiles(case):
    """Under jax.default_matmul_precision("highest") the f32 dots are IEEE f32: more shared
    memory and registers than TF32, and still a build."""
    fn, args = gpu_case(case)
    with jax.default_matmul_precision("highest"):
        build = xla_gpu.compile_for(fn, args, "h200")
    assert len(build.kernels) == 1


def test_oversized_tiles_fail_to_compile():
    """The check can fail: 8 pages of 32 f32 keys, double-buffered, do not fit an H200, and
    XLA's compile refuses the launch as the GPU would."""
    args = kernel_args("decode", "gpu", 128, jnp.float32, block_size=32, width=8)
    fn = functools.partial(KERNELS["gpu"][0], scale=0.1, pages_per_step=8, num_stages=2)
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        xla_gpu.compile_for(fn, args, "h200")


@pytest.mark.parametrize("case, pages_per_step, rows", ESTIMATE_CASES)
def test_shared_memory_estimate_bounds_xla_build(case, pages_per_step, rows):
    """gpu.triton.shared_memory_bytes, with which the wrappers size tiles for a chip, never
    undercounts what XLA's build of the kernel asks (else a tile it sized would fail to
    launch)."""
    fn, args, estimate = estimate_case(case, pages_per_step, rows)
    [launch] = xla_gpu.compile_for(fn, args, "h200").kernels
    assert launch.shared_bytes <= estimate, (launch.shared_bytes, estimate)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_engine_step_compiles_for_h200(kind, dtype):
    """The engine's jitted step on the gpu backend (a Llama-shaped attention: 32 query / 8 KV
    heads of 128, block 16, 2 layers), its cache donated: the KV write and the step's
    attention kernel compiled once, in the body of the scan over layers, the cache updated
    where it lies (no temporary the size of a layer's pool, the output aliasing it), int8
    caches included."""
    from pagedjax.models import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=32, num_kv_heads=8, head_dim=128)
    step, args = abstract_step(config, kind, num_tokens=64 if kind == "prefill" else 8,
                               num_seqs=8, num_blocks=4096, max_blocks_per_seq=32,
                               cache_dtype=dtype)
    caches = args[1]
    build = xla_gpu.compile_for(step, args, "h200")
    attention = KERNEL_NAMES["ragged" if kind == "prefill" else "decode"]
    # A quantized cache is written by XLA's scatter, which quantizes as it writes.
    writes = ["write_kv_gpu"] if dtype == "bfloat16" else []
    names = [launch.name for launch in build.kernels]
    assert sorted(names) == sorted([attention, *writes]), names
    layer_pool = nbytes(caches) / config.num_layers
    assert build.temp_bytes < layer_pool / 2, (build.temp_bytes, layer_pool)
    assert build.alias_bytes >= nbytes(caches)
