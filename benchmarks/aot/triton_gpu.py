"""Ahead-of-time build of the GPU kernels for a chosen SM, on a machine without a GPU.

Interpret mode checks what a Pallas kernel computes, not whether Triton can build it: a kernel
whose tiles need more shared memory than the chip has passes every interpret test and fails at
launch. This module takes the Triton modules out of a CUDA lowering (`lower_cuda`: a CPU-only
jaxlib lowers for CUDA and leaves the Triton IR in each `__gpu$xla.gpu.triton` custom call),
compiles them to a cubin with the `triton` package for the target compute capability, and reads
back shared memory, registers and spills (cuobjdump, bundled with triton). The `triton` package
is a test dependency only; the engine never imports this.

The triton package's compiler is not the fork XLA builds with, so its figures are an estimate of
what the GPU's compile will do; they have matched the layout of shared memory exactly on the
kernels measured (see benchmarks/results/gpu_compile.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import subprocess
import tempfile

import jax
from jax.sharding import AbstractDevice, AbstractMesh
from jaxlib.mlir import ir

from pagedjax.pallas_kernels.gpu.common import shared_memory_limit
from pagedjax.scheduler.chips import GPU_CHIPS

TRITON_CALL = "__gpu$xla.gpu.triton"
# A device kind of each compute capability in the chip table, as jax's Triton lowering knows it
# (jax >= 0.11 looks the capability up by kind: jax/_src/pallas/triton/gpu_info.py).
# The first chip of a capability names it (the H200 for sm_90).
DEVICE_KIND = {chip.gpu.capability: chip.gpu.device_kind
               for chip in reversed(list(GPU_CHIPS.values()))}


@contextlib.contextmanager
def cuda_target(capability: tuple[int, int] = (9, 0)):
    """Lowers Pallas Triton calls for a GPU of `capability` on a machine without one.

    jax >= 0.11 asks the device for its compute capability while lowering a Triton call (and
    fails with "No supported GPU devices found" on a CPU); an abstract mesh whose abstract
    device names the chip answers instead. jax 0.10's lowering asks nothing: there it is inert.
    """
    if capability not in DEVICE_KIND:
        raise ValueError(f"no known device kind for compute capability {capability}; "
                         f"known: {sorted(DEVICE_KIND)}")
    device = AbstractDevice(device_kind=DEVICE_KIND[capability], num_cores=None,
                            platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("_cuda_target",),
                                                     abstract_device=device)):
        yield


def lower_cuda(trace, capability: tuple[int, int] = (9, 0)):
    """`trace().lower(lowering_platforms=("cuda",))` for a GPU of `capability`, GPU or not.
    `trace` makes the `jax.jit(...).trace(...)`: under jax 0.11 a lowering keeps the context
    of its trace, so the chip must be named while tracing."""
    with cuda_target(capability):
        return trace().lower(lowering_platforms=("cuda",))


@dataclasses.dataclass(frozen=True)
class TritonModule:
    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    ttir: str  # the Triton IR, as text


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    name: str
    capability: tuple[int, int]
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    shared_bytes: int  # dynamic shared memory the launch asks for
    shared_limit: int  # what one block of this capability may use
    registers: int  # per thread
    spill_bytes: int  # stack + local memory per thread: 0 unless registers spilled
    # Global-memory load instructions in the PTX, by kind and bytes each ("cp.async 16B": n):
    # a static count (unrolled copies each count), not bytes per iteration.
    global_loads: dict = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= self.shared_limit


def triton_modules(lowered) -> list[TritonModule]:
    """The Triton modules of a CUDA lowering (`lower_cuda`)."""
    from jaxlib.triton import dialect as triton_dialect

    found = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if (child.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(child.attributes["call_target_name"]).value
                            == TRITON_CALL):
                        found.append(ir.DictAttr(child.attributes["mhlo.backend_config"]))
                    visit(child.operation)

    visit(lowered.compiler_ir("stablehlo").operation)
    if not found and "triton_kernel_call" in lowered.as_text():
        raise RuntimeError("this lowering compiled its Triton kernels already (a "
                           "triton_kernel_call, not Triton IR): nothing to build ahead of time")
    context = ir.Context()
    triton_dialect.register_dialect(context)
    modules = []
    for config in found:
        with context:
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            text = ttir.operation.get_asm(enable_debug_info=False)

        def integer(key, config=config):
            return ir.IntegerAttr(config[key]).value
        modules.append(TritonModule(
            name=ir.StringAttr(config["name"]).value, num_warps=integer("num_warps"),
            num_stages=integer("num_stages"),
            grid=(integer("grid_x"), integer("grid_y"), integer("grid_z")), ttir=text))
    return modules


def compile_module(module: TritonModule, capability: tuple[int, int] = (9, 0)) -> CompiledKernel:
    """Builds one module to a cubin for `capability` with the triton package."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:  # pragma: no cover - a test dependency
        raise RuntimeError("ahead-of-time builds need the triton package "
                           "(requirements/test.txt)") from e
    arch = capability[0] * 10 + capability[1]
    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp, f"{module.name}.ttir")
        source.write_text(module.ttir)
        kernel = triton.compile(str(source), target=GPUTarget("cuda", arch, 32), options=dict(
            num_warps=module.num_warps, num_stages=module.num_stages, enable_fp_fusion=True))
        cubin = pathlib.Path(tmp, f"{module.name}.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        usage = _resource_usage(cubin)
    return CompiledKernel(
        name=module.name, capability=capability, num_warps=module.num_warps,
        num_stages=module.num_stages, grid=module.grid,
        shared_bytes=int(kernel.metadata.shared) + usage["SHARED"],
        shared_limit=shared_memory_limit(capability), registers=usage["REG"],
        spill_bytes=usage["STACK"] + usage["LOCAL"], global_loads=global_loads(kernel.asm["ptx"]))


def global_loads(ptx: str) -> dict[str, int]:
    """{"cp.async 16B": n, "ld.global 4B": m, ...}: the PTX's loads from global memory by
    instruction and width. A memory-bound kernel wants its K/V tiles in 16-byte copies
    (cp.async: straight to shared memory, pipelined); narrower ones cost issue slots per byte."""
    found: dict[str, int] = {}
    for size in re.findall(r"cp\.async\.\w+\.shared\.global[^,;]*,[^,;]*,\s*(0x[0-9a-fA-F]+|\d+)",
                           ptx):
        key = f"cp.async {int(size, 0)}B"
        found[key] = found.get(key, 0) + 1
    loads = r"\bld\.global(?:\.[A-Za-z0-9_:]+)*?(?:\.v(\d))?\.[a-z](\d+)\s"
    for vector, bits in re.findall(loads, ptx):
        key = f"ld.global {int(vector or 1) * int(bits) // 8}B"
        found[key] = found.get(key, 0) + 1
    return dict(sorted(found.items()))


def _resource_usage(cubin: pathlib.Path) -> dict[str, int]:
    import triton
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    line = next(l for l in out.splitlines() if "REG:" in l)
    return {key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", line)}


def compile_lowered(lowered, capability: tuple[int, int] = (9, 0)) -> list[CompiledKernel]:
    """Every Triton kernel of a CUDA lowering, built for `capability`."""
    return [compile_module(m, capability) for m in triton_modules(lowered)]
