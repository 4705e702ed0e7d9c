"""The chip table: one datasheet entry per accelerator, read by the roofline cost model
(scheduler.cost_model.RooflineCost, `pagedjax plan --roofline`), XLA's compile-only GPU targets
(benchmarks/aot/xla_gpu.py), the Triton builds' device kinds (benchmarks/aot/triton_gpu.py) and
the occupancy estimates of benchmarks/gpu_compile.py.

Figures are datasheet peaks (dense bf16 FLOP/s; HBM bandwidth; NVLink / ICI per chip, one
direction; PCIe for the L4) and, for GPUs, the CUDA programming guide's per-compute-capability
limits. The kernels' own sizing rule (shared memory by compute capability, for any GPU JAX runs
on) is pallas_kernels.gpu.common.SHARED_MEMORY_LIMIT; tests/scheduler/test_chips.py checks the two agree.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuLimits:
    """What XLA's GPU compiler and an occupancy estimate need to know of a GPU."""
    device_kind: str  # as the device reports it (jax's Pallas lowering looks the SM up by it)
    capability: tuple[int, int]
    sms: int
    shared_per_sm: int  # bytes
    shared_per_block: int  # opt-in maximum of one block, bytes
    threads_per_sm: int
    registers_per_sm: int
    memory_bytes: int
    l2_bytes: int
    clock_ghz: float


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes_per_s: float
    flops_per_s: float  # dense bf16
    link_bytes_per_s: float  # a chip's interconnect (NVLink, ICI; PCIe for L4), one direction
    gpu: GpuLimits | None = None  # None for a TPU


_H100_SM: dict = dict(sms=132, shared_per_sm=228 << 10, shared_per_block=227 << 10,
                      threads_per_sm=2048, registers_per_sm=65536, l2_bytes=50 << 20,
                      clock_ghz=1.98)

CHIPS = {c.name: c for c in (
    Chip("h200", 4.8e12, 989e12, 450e9,
         GpuLimits("NVIDIA H200", (9, 0), memory_bytes=143771 << 20, **_H100_SM)),
    Chip("h100", 3.35e12, 989e12, 450e9,
         GpuLimits("NVIDIA H100 80GB HBM3", (9, 0), memory_bytes=81559 << 20, **_H100_SM)),
    Chip("a100-80gb", 2.039e12, 312e12, 300e9,
         GpuLimits("NVIDIA A100-SXM4-80GB", (8, 0), sms=108, shared_per_sm=164 << 10,
                   shared_per_block=163 << 10, threads_per_sm=2048, registers_per_sm=65536,
                   memory_bytes=81920 << 20, l2_bytes=40 << 20, clock_ghz=1.41)),
    Chip("l4", 0.3e12, 121e12, 32e9,
         GpuLimits("NVIDIA L4", (8, 9), sms=58, shared_per_sm=100 << 10,
                   shared_per_block=99 << 10, threads_per_sm=1536, registers_per_sm=65536,
                   memory_bytes=23034 << 20, l2_bytes=48 << 20, clock_ghz=2.04)),
    Chip("tpu-v5e", 0.819e12, 197e12, 200e9), Chip("tpu-v5p", 2.765e12, 459e12, 600e9),
    Chip("tpu-v6e", 1.64e12, 918e12, 448e9))}
GPU_CHIPS = {name: chip for name, chip in CHIPS.items() if chip.gpu is not None}


def gpu_chip(name: str) -> Chip:
    """CHIPS[name], refused by name unless it is a GPU."""
    if name not in GPU_CHIPS:
        raise ValueError(f"chip must be one of {sorted(GPU_CHIPS)}, got {name!r}")
    return GPU_CHIPS[name]
