"""XLA's own GPU compile of a program, for a described GPU, on a machine without one.

benchmarks/aot/triton_gpu.py builds each kernel's Triton IR with the `triton` package, an estimate
of what the GPU's compile does. This module runs the compile itself: jax >= 0.11's CUDA plugin
(requirements/gpu-image.txt: jax-cuda13-plugin, and ptxas from nvidia-cuda-nvcc) creates a
compile-only device from a GPU target description (XLA's GpuTargetConfigProto, written here from
the chips' published figures), and `jit(...).lower().compile()` for it runs XLA's GPU pipeline
whole: its Triton fork builds the Pallas kernels, ptxas the cubins, and a kernel whose launch
needs more shared memory than the chip allows fails here ("RESOURCE_EXHAUSTED: Shared memory size
limit exceeded") as it would at the first call on the GPU. Every kernel launch of the compiled
program (XLA's fusions and the Pallas kernels: grid, threads, shared memory) is read back from
XLA's thunk sequence.

Pallas' Mosaic GPU kernels are custom calls that XLA's compile builds with Mosaic GPU's own
pipeline (MLIR -> PTX -> ptxas); `compile_for` reads what ptxas and Mosaic GPU report of each
(registers, spills, shared memory) from Mosaic GPU's dumps.

Nothing is run: a GPU is still what measures speed and checks results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import tempfile
import time

from pagedjax.scheduler.chips import Chip, gpu_chip


def target_config(chip: Chip) -> str:
    """The chip (a GPU of scheduler.chips) as an XLA GpuTargetConfigProto, in protobuf text
    format."""
    gpu = chip.gpu
    major, minor = gpu.capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {gpu.shared_per_sm}
  shared_memory_per_block_optin: {gpu.shared_per_block}
  threads_per_core_limit: {gpu.threads_per_sm}
  core_count: {gpu.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_s)}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  name: "{gpu.device_kind}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{gpu.device_kind}"
"""


def available() -> str | None:
    """None if this jax can compile for a described GPU here, else why not."""
    import jax
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        return ("XLA's GPU compiler without a GPU needs jax >= 0.11 with jax-cuda13-plugin "
                f"(requirements/gpu-image.txt; this is jax {jax.__version__})")
    return None


@functools.cache
def device(chip: str = "h200"):
    """A compile-only device of `chip` (a GPU of scheduler.chips.CHIPS)."""
    target = gpu_chip(chip)
    if problem := available():
        raise RuntimeError(problem)
    from jax.experimental import topologies
    return topologies.get_topology_desc(chip, "cuda", target_config=target_config(target),
                                        topology="1x1x1").devices[0]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a compiled program."""
    name: str
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_bytes: int


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    """One Mosaic GPU kernel as its compile built it."""
    name: str
    arch: str  # e.g. sm_90a
    registers: int  # a thread
    spill_bytes: int  # stores + loads
    shared_bytes: int  # dynamic shared memory a block (Mosaic GPU's scratch)


@dataclasses.dataclass(frozen=True)
class Build:
    launches: tuple[Launch, ...]
    seconds: float
    # XLA's memory analysis of the compiled program: its temporaries (a whole copy of an
    # operand would be one), and the bytes of outputs that alias (donated) inputs.
    temp_bytes: int
    alias_bytes: int
    triton_names: frozenset  # the launches that are Triton kernels (Pallas calls), by name
    # Mosaic GPU kernels (custom calls, not in the thunk sequence's launches).
    mosaic: tuple[MosaicKernel, ...] = ()

    @property
    def kernels(self) -> tuple[Launch, ...]:
        """The Pallas (Triton) kernel launches, without XLA's own fusions."""
        return tuple(launch for launch in self.launches if launch.name in self.triton_names)

    def launch(self, name: str) -> Launch:
        found = [launch for launch in self.launches if launch.name == name]
        if len(found) != 1:
            raise KeyError(f"{len(found)} launches named {name!r} in "
                           f"{[launch.name for launch in self.launches]}")
        return found[0]


PTXAS = re.compile(r"entry function '([^']+)' for '(sm_\w+)'.*?(\d+) bytes spill stores, "
                   r"(\d+) bytes spill loads.*?Used (\d+) registers", re.S)


@contextlib.contextmanager
def mosaic_dumps():
    """Has Mosaic GPU's compiles write their ptxas report and resources into a directory
    (MOSAIC_GPU_DUMP_*, read at each compile); yields that directory."""
    names = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS")
    saved = {name: os.environ.get(name) for name in names}
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1")
        try:
            yield pathlib.Path(dump)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def read_mosaic_dumps(dump: pathlib.Path) -> tuple[MosaicKernel, ...]:
    kernels = []
    for report in sorted(dump.glob("*.ptxas")):
        match = PTXAS.search(report.read_text())
        if match is None:
            raise RuntimeError(f"no ptxas report in {report.name}: {report.read_text()[:400]}")
        name, arch, stores, loads, registers = match.groups()
        resources = report.with_suffix(".resources.txt")
        shared = re.search(r"smem_scratch_bytes=(\d+)", resources.read_text())
        kernels.append(MosaicKernel(name, arch, int(registers), int(stores) + int(loads),
                                    int(shared.group(1)) if shared else 0))
    return tuple(kernels)


LAUNCH = re.compile(r"\]\s+(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                    r"shared_memory: (\d+) bytes")


def compile_for(fn, args, chip: str = "h200") -> Build:
    """Compiles `fn(*args)` (abstract args; fn as it is when already jitted, so that its
    donations hold) with XLA's GPU compiler for `chip`; returns its kernel launches. Raises what
    the compile raises."""
    import jax
    target = device(chip)
    sharding = jax.sharding.SingleDeviceSharding(target)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        args)
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump, mosaic_dumps() as mosaic_dump:
        # Pallas' Triton lowering asks the default device which SM it lowers for.
        with jax.default_device(target):
            compiled = jitted.trace(*args).lower().compile({"xla_dump_to": dump})
        mosaic = read_mosaic_dumps(mosaic_dump)
        seconds = time.perf_counter() - start
        [sequence] = pathlib.Path(dump).glob("*.thunk_sequence.txt")
        text = sequence.read_text()
    launches = tuple(
        Launch(name, tuple(map(int, grid.split(","))), tuple(map(int, threads.split(","))),
               int(shared))
        for name, grid, threads, shared in LAUNCH.findall(text))
    memory = compiled.memory_analysis()
    triton = frozenset(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?'
                                  r'\bname = "([^"]+)"', compiled.as_text()))
    return Build(launches, seconds, temp_bytes=int(memory.temp_size_in_bytes),
                 alias_bytes=int(memory.alias_size_in_bytes), triton_names=triton, mosaic=mosaic)
