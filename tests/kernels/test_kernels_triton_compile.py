"""The GPU kernels build for real chips, checked here without one (benchmarks/aot/triton_gpu.py).

Each kernel is lowered for CUDA as the wrapper sizes it for the target chip, its Triton IR is
compiled to a cubin by the triton package, and the cubin's resources are checked: the shared
memory a block asks for fits the chip (a kernel that does not fit passes every interpret test
and fails at launch), and on sm_90 the serving dtypes build without register spills and load
K/V in 16-byte asynchronous copies.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton", reason="a test dependency: requirements/test.txt")

from test_kernels_lowering import (ESTIMATE_CASES, GPU_CASES as CASES, KERNELS,  # noqa: E402
                                   abstract_step, estimate_case, gpu_case, kernel_args)

from benchmarks.aot import triton_gpu  # noqa: E402
from pagedjax.pallas_kernels.gpu import common as gpu_common  # noqa: E402

H200, A100, L4 = (9, 0), (8, 0), (8, 9)

SERVING_DTYPES = ("bfloat16", "int8", "float8_e4m3fn")


@pytest.fixture
def target(monkeypatch):
    """Sizes kernels for a chosen chip: what the wrappers would pick on that GPU."""
    def use(capability):
        monkeypatch.setattr(gpu_common, "target_compute_capability", lambda: capability)
        jax.clear_caches()  # a cached trace would keep the previous chip's sizing
    yield use
    jax.clear_caches()


def build(case, capability):
    fn, args = gpu_case(case)
    lowered = triton_gpu.lower_cuda(lambda: jax.jit(fn).trace(*args), capability)
    [kernel] = triton_gpu.compile_lowered(lowered, capability)
    return kernel, jnp.dtype(CASES[case][2]).name


@pytest.mark.parametrize("case", CASES)
def test_kernel_builds_for_h200(case, target):
    target(H200)
    kernel, dtype = build(case, H200)
    assert kernel.fits, (f"{kernel.name} asks for {kernel.shared_bytes} B of shared memory, "
                         f"sm_90 allows {kernel.shared_limit}")
    if dtype in SERVING_DTYPES:
        assert kernel.spill_bytes == 0, (f"{kernel.name} spills {kernel.spill_bytes} B a "
                                         f"thread at {kernel.registers} registers")
    if dtype in SERVING_DTYPES and CASES[case][0] != "write":
        # Memory-bound: K/V pages reach shared memory in 16-byte asynchronous copies (the
        # widest a thread issues, pipelined with the dots); only an 8-bit cache's per-token f32
        # scales go 4 bytes at a time.
        copies = {k for k in kernel.global_loads if k.startswith("cp.async")}
        allowed = {"cp.async 16B"} | ({"cp.async 4B"} if dtype != "bfloat16" else set())
        assert "cp.async 16B" in copies and copies <= allowed, kernel.global_loads


@pytest.mark.parametrize("capability", [A100, L4], ids=["sm_80", "sm_89"])
@pytest.mark.parametrize("case", ["decode-bf16", "decode-f32-h80-block32", "ragged-bf16",
                                  "decode-f32-h256-block32"])
def test_kernel_fits_smaller_chips(case, capability, target):
    """Sized for an A100 (163 KB a block) or an L4 (99 KB, Colab's), a kernel fits it too."""
    target(capability)
    kernel, _ = build(case, capability)
    assert kernel.fits, (f"{kernel.name} asks for {kernel.shared_bytes} B of shared memory, "
                         f"sm_{capability[0]}{capability[1]} allows {kernel.shared_limit}")


@pytest.mark.parametrize("capability", [H200, L4], ids=["sm_90", "sm_89"])
@pytest.mark.parametrize("case", ["decode-f32-h80-block32", "ragged-f32-h80-block32"])
def test_ieee_f32_fits(case, capability, target):
    """Under jax.default_matmul_precision("highest") f32 dots are IEEE (FMA, not TF32 MMA):
    they take more shared memory and registers, and still fit. (They spill; f32 is no serving
    dtype.)"""
    target(capability)
    with jax.default_matmul_precision("highest"):
        kernel, _ = build(case, capability)
    assert kernel.fits, (f"{kernel.name} asks for {kernel.shared_bytes} B of shared memory, "
                         f"sm_{capability[0]}{capability[1]} allows {kernel.shared_limit}")


def test_oversized_tiles_are_caught():
    """The check can fail: 8 pages of 32 f32 keys, double-buffered, do not fit an H200."""
    args = kernel_args("decode", "gpu", 128, jnp.float32, block_size=32, width=8)
    lowered = triton_gpu.lower_cuda(lambda: jax.jit(functools.partial(
        KERNELS["gpu"][0], scale=0.1, pages_per_step=8, num_stages=2)).trace(*args))
    [kernel] = triton_gpu.compile_lowered(lowered, H200)
    assert not kernel.fits and kernel.shared_bytes > kernel.shared_limit


@pytest.mark.parametrize("case, pages_per_step, rows", ESTIMATE_CASES)
def test_shared_memory_estimate_bounds_the_build(case, pages_per_step, rows):
    """The wrappers size tiles with gpu.triton.shared_memory_bytes: it must never undercount
    (a tile sized by it would then fail to launch)."""
    fn, args, estimate = estimate_case(case, pages_per_step, rows)
    [kernel] = triton_gpu.compile_lowered(triton_gpu.lower_cuda(lambda: jax.jit(fn).trace(*args)),
                                       H200)
    assert kernel.shared_bytes <= estimate + 1024  # + the 1 KB sm_90 reserves per block


def test_fp8_cache_is_refused_below_sm89(target):
    """Triton has no e4m3 conversions on an A100: the wrapper says so instead of failing deep in
    Triton's LLVM lowering."""
    target(A100)
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*this one is 8.0"):
        build("decode-fp8", A100)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_engine_step_kernels_build_for_h200(kind, target):
    """Every Triton kernel of the engine's jitted step (gpu backend, a Llama-shaped attention:
    32 query / 8 KV heads of 128, block 16, bf16) builds and fits an H200."""
    from pagedjax.models import LlamaConfig

    target(H200)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=1,
                         num_heads=32, num_kv_heads=8, head_dim=128)
    step, args = abstract_step(config, kind, num_tokens=64 if kind == "prefill" else 8,
                               num_seqs=8, num_blocks=64, max_blocks_per_seq=32,
                               cache_dtype=jnp.bfloat16)
    lowered = triton_gpu.lower_cuda(lambda: step.trace(*args))
    kernels = triton_gpu.compile_lowered(lowered, H200)
    attention = {"prefill": "ragged_paged_attention_gpu", "decode": "paged_decode_attention_gpu"}
    assert sorted(k.name for k in kernels) == sorted([attention[kind], "write_kv_gpu"])
    for kernel in kernels:
        assert kernel.fits and kernel.spill_bytes == 0, kernel


def latent_args(kind, num_heads, dtype, *, latent=512, rope=64, width=64):
    """Abstract operands of the latent (MLA) kernels at DeepSeek's dims: one plane of one KV
    head, the row 512 + 64 unpadded."""
    from pagedjax.pallas_kernels import init_kv_cache
    q_dtype = jnp.bfloat16 if dtype in ("int8", "float8_e4m3fn") else dtype
    cache = jax.eval_shape(lambda: init_kv_cache(1, 64, 16, 1, latent + rope, jnp.dtype(dtype),
                                                 "gpu", planes=1))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    if kind == "write":
        return (cache, jax.ShapeDtypeStruct((24, 1, latent + rope), q_dtype), None, i32((24,)))
    tokens = 4 if kind == "decode" else 24
    q = jax.ShapeDtypeStruct((tokens, num_heads, latent + rope), q_dtype)
    tail = (i32((4,)), i32((4, width))) + ((i32((5,)),) if kind == "ragged" else ()) + (i32(()),)
    return (q, cache) + tail


@pytest.mark.slow  # 25 s of builds: make test-slow here, every run in make test-gpu-image
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("num_heads", [16, 128], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("kind", ["decode", "ragged", "write"])
def test_latent_kernels_build_for_h200(kind, num_heads, dtype, target):
    """DeepSeek-V2-Lite's 16 heads and V3's 128 over a latent of 512 and a RoPE key of 64
    (gpu.triton.latent): each kernel fits an H200's shared memory without spilling, and reads
    the 576-value rows in 16-byte asynchronous copies of two tiles, not a 1,024-wide padded
    one."""
    from pagedjax.pallas_kernels.gpu.triton import write_kv_gpu
    if kind == "write" and (num_heads == 128 or dtype == "int8"):
        pytest.skip("the write does not depend on the heads; int8 is written by XLA's scatter")
    target(H200)
    fn = dict(decode=KERNELS["gpu"][0], ragged=KERNELS["gpu"][1], write=write_kv_gpu)[kind]
    kwargs = {} if kind == "write" else dict(scale=0.1, value_dim=512)
    args = latent_args(kind, num_heads, dtype)
    lowered = triton_gpu.lower_cuda(lambda: jax.jit(functools.partial(fn, **kwargs)).trace(*args))
    [kernel] = triton_gpu.compile_lowered(lowered, H200)
    assert kernel.fits and kernel.spill_bytes == 0, kernel
    if kind != "write":
        copies = {k for k in kernel.global_loads if k.startswith("cp.async")}
        assert "cp.async 16B" in copies, kernel.global_loads
        # The wrapper's estimate (one plane: the latent tile is K and V) bounds the build, at
        # the 4 pages of 16 keys it fits (8 would need 295 KB double-buffered).
        from pagedjax.pallas_kernels.gpu import triton
        estimate = triton.shared_memory_bytes(
            rows=16, keys=64, head_dim=576, cache_itemsize=jnp.dtype(dtype).itemsize,
            compute_itemsize=2, num_stages=2, quantized=dtype == "int8", planes=1)
        assert kernel.shared_bytes <= estimate + 1024 < 227 * 1024
