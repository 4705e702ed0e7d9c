"""What the GPU kernels cost a chip, built ahead of time on a CPU (no GPU needed).

Each kernel is lowered for CUDA at the decode benchmark's shape (bf16, 32 query / 8 KV heads,
head dim 128, block 16, 4k context) as its wrapper sizes it for the chip, compiled to a cubin
with the triton package (benchmarks/aot/triton_gpu.py), and its resources are read from the cubin:
shared memory per block, registers and spills per thread. Beside it, JAX's shipped
`pallas.ops.gpu.paged_attention` at its defaults, built the same way.

`resident warps/SM` is derived, not measured: the warps one SM can hold given the registers,
shared memory and thread limits of the chip (CUDA occupancy rules, register allocation in units
of 256 per warp). A memory-bound decode kernel hides DRAM latency with the loads those warps
keep in flight, so it bounds what the kernel can reach; timings need the GPU
(benchmarks/gpu_kernels.py). `global_loads` counts the PTX's load instructions from global
memory by kind and width (a static count: an unrolled or pipelined copy counts each time it is
written out): K/V tiles want 16-byte `cp.async` copies, straight to shared memory.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = [ROOT / "tests", *sorted({p.parent for p in (ROOT / "tests").glob("*/test_*.py")})]
sys.path[:0] = [str(ROOT), *map(str, TESTS), str(ROOT / "benchmarks")]  # the test rooms' modules

from common import write_results  # noqa: E402
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_op  # noqa: E402
from test_kernels_lowering import KERNELS, kernel_args  # noqa: E402
from test_kernels_triton_compile import latent_args  # noqa: E402

from benchmarks.aot import triton_gpu  # noqa: E402
from pagedjax.pallas_kernels.gpu import common as gpu_common  # noqa: E402
from pagedjax.scheduler.chips import CHIPS, GpuLimits  # noqa: E402

# The chips built for (scheduler.chips), one per compute capability, and their rows' labels.
BUILD_CHIPS = {"h200": "sm_90 (H100/H200)", "a100-80gb": "sm_80 (A100)", "l4": "sm_89 (L4)"}
WIDTH = 4096 // 16  # pages of a 4k context
FINDINGS = """
What these builds changed in the kernels (2026-11-29, before any GPU run):

- An f32 cache at block 32 asked for 264 KB of shared memory (8 pages a step), more than any
  chip has: the wrappers now size pages per step, then pipeline stages, to the chip
  (gpu.triton.fit_pipeline).
- The ragged kernel at head dim 256 with a GQA group of 8 (16 tokens = 128 rows a program)
  spilled registers on every chip: it now takes fewer tokens a program when rows x head dim
  exceeds 64 x 128 (gpu.triton.choose_tile_q). A sweep over block sizes 8/16/32, head dims
  64/80/128/256, MHA/GQA/MQA and f32/bf16/int8/fp8 on sm_90/sm_80/sm_89 then leaves one build
  with a spill (8 bytes: int8, block 32, head dim 256, on an L4) and none over its chip's
  shared memory.
- A select zeroing K past the sequence's length cost 28 KB (the dot then reads K through a
  second buffer); scores are masked anyway, so only V is zeroed. A masked load of V instead of
  the select stopped Triton from pipelining V with cp.async, so the select stays.
- The decode kernel on 4 warps needed 237 registers a thread (255 with an int8 cache); on 8
  it needs 119 and is the default. The ragged kernel likewise moved to 8 warps (sm_80 spilled).
- fp8 (e4m3) caches do not build below sm_89: the wrappers refuse them there by name.

2026-12-01: jax 0.11's Triton lowering (the GPU image's) is told the target chip's compute
capability (triton_gpu.cuda_target); built from it (`.venv-gpu-image/bin/python
benchmarks/gpu_compile.py`, the table below) and from jax 0.10.2's lowering, every figure in this
table is the same.

2026-12-05: the latent (MLA, DeepSeek) kernels, gpu.triton.latent, at DeepSeek's dims: the
576-value row (512 latent + 64 RoPE) kept unpadded in the cache and read as two tiles of 512
and 64 (one plane: the latent tile is both K and V, loaded once), 16 heads a program (a 16 x
512 f32 accumulator), 4 pages of 16 tokens a step double-buffered on an H100/H200 (8 would need
295 KB). Padding the row to a power of two, as the GQA kernels pad head dims, would have read
and stored 1,024 values a token: 78% more of the pool's bytes for the same attention.
"""


def resident_warps(kernel: triton_gpu.CompiledKernel, gpu: GpuLimits) -> int:
    registers, shared, threads = gpu.registers_per_sm, gpu.shared_per_sm, gpu.threads_per_sm
    per_warp = -(-kernel.registers // 8) * 8 * 32
    by_registers = registers // per_warp // kernel.num_warps
    by_shared = shared // max(kernel.shared_bytes, 1)
    by_threads = threads // (32 * kernel.num_warps)
    return min(by_registers, by_shared, by_threads) * kernel.num_warps


def ours(kind, dtype, **options):
    fn = dict(zip(("decode", "ragged", "write"), KERNELS["gpu"]))[kind]
    kwargs = options if kind == "write" else dict(scale=128 ** -0.5, **options)
    args = kernel_args(kind, "gpu", 128, dtype, width=WIDTH)
    return jax.jit(functools.partial(fn, **kwargs)).trace(*args)


def latent(kind, num_heads, dtype):
    """A latent (MLA) kernel at DeepSeek's dims: a 512 latent and a 64 RoPE key, one plane."""
    fn = dict(zip(("decode", "ragged"), KERNELS["gpu"]))[kind]
    args = latent_args(kind, num_heads, dtype, width=WIDTH)
    return jax.jit(functools.partial(fn, scale=0.1, value_dim=512)).trace(*args)


def jax_shipped():
    q = jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((8, 64, 16, 128), jnp.bfloat16)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    return jax.jit(functools.partial(jax_gpu_op.paged_attention, k_splits=16)).trace(
        q, pages, pages, i32((4, WIDTH)), i32((4,)))


KERNELS_TO_BUILD = {
    "pagedjax decode (bf16)": lambda: ours("decode", jnp.bfloat16),
    "pagedjax decode (bf16, 4 warps)": lambda: ours("decode", jnp.bfloat16, num_warps=4),
    "pagedjax decode (int8 cache)": lambda: ours("decode", "int8"),
    "pagedjax decode (fp8 cache)": lambda: ours("decode", "float8_e4m3fn"),
    "pagedjax ragged prefill (bf16)": lambda: ours("ragged", jnp.bfloat16),
    "pagedjax ragged prefill (bf16, 4 warps)": lambda: ours("ragged", jnp.bfloat16,
                                                            num_warps=4),
    "pagedjax KV write (bf16)": lambda: ours("write", jnp.bfloat16),
    "pagedjax latent decode (V2-Lite: 16 heads, bf16)": lambda: latent("decode", 16,
                                                                       jnp.bfloat16),
    "pagedjax latent decode (V2-Lite: 16 heads, int8)": lambda: latent("decode", 16, "int8"),
    "pagedjax latent decode (V3: 128 heads, bf16)": lambda: latent("decode", 128, jnp.bfloat16),
    "pagedjax latent ragged (V2-Lite: 16 heads, bf16)": lambda: latent("ragged", 16,
                                                                       jnp.bfloat16),
    "jax pallas.ops.gpu.paged_attention (bf16)": jax_shipped,
}


def main() -> None:
    rows = []
    for chip_name, chip in BUILD_CHIPS.items():
        gpu = CHIPS[chip_name].gpu
        capability = gpu.capability
        gpu_common.target_compute_capability = lambda capability=capability: capability
        jax.clear_caches()
        for name, trace in KERNELS_TO_BUILD.items():
            try:
                kernels = triton_gpu.compile_lowered(triton_gpu.lower_cuda(trace, capability),
                                                  capability)
            except Exception as e:  # a refusal (fp8 below sm_89) is a row too
                rows.append({"chip": chip, "kernel": name, "warps": "", "stages": "",
                             "grid": "", "shared_kib": float("nan"),
                             "limit_kib": gpu_common.shared_memory_limit(capability) / 1024,
                             "registers": "", "spill_bytes": "",
                             "resident_warps_per_sm": f"not built: {str(e).splitlines()[0]}",
                             "global_loads": ""})
                print(rows[-1], flush=True)
                continue
            for kernel in kernels:
                rows.append({
                    "chip": chip, "kernel": name, "warps": kernel.num_warps,
                    "stages": kernel.num_stages, "grid": "x".join(map(str, kernel.grid)),
                    "shared_kib": kernel.shared_bytes / 1024,
                    "limit_kib": kernel.shared_limit / 1024, "registers": kernel.registers,
                    "spill_bytes": kernel.spill_bytes,
                    "resident_warps_per_sm": resident_warps(kernel, gpu),
                    "global_loads": ", ".join(f"{k} x{n}"
                                              for k, n in kernel.global_loads.items())})
                print(rows[-1], flush=True)
    import triton
    params = {"shape": "q bf16[4, 32, 128], cache block 16, 8 KV heads, head dim 128, "
                       f"table width {WIDTH} pages (4k context)",
              "triton": triton.__version__}
    write_results("gpu_compile", "GPU kernels built ahead of time (no GPU): resources per chip",
                  rows, params, notes=__doc__.split("\n\n", 1)[1] + FINDINGS)


if __name__ == "__main__":
    main()
