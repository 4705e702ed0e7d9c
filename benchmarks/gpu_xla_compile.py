"""Rehearsal of the GPU device script without a GPU: each of its programs compiled by XLA for an H200.

benchmarks/gpu_programs.py runs on a GPU lent for minutes; a program that fails to compile there
costs the lease. This compiles the programs it runs, at its shapes, with the GPU image's jax
(0.11) and XLA's own GPU compiler for a compile-only H200 (benchmarks/aot/xla_gpu.py): the
decode benchmark's implementations (four with jax >= 0.11's Mosaic GPU kernel) at every
batch x context, the launch-parameter sweep,
the kernel checks, and the engine's prefill and decode steps on the gpu backend. Each row gives
the compile's outcome, the Pallas kernel's launch (grid, threads per block, shared memory per
block, all as XLA built it) and the program's temporary memory beside its operands (a whole
copy of a cache would show there). A last section compiles the engine's step for Llama-3-8B at
serving sizes. Nothing runs: speed and results still need the GPU.

Run in the GPU image's environment: `make .venv-gpu-image/.installed` then
`JAX_PLATFORMS=cpu .venv-gpu-image/bin/python benchmarks/gpu_xla_compile.py`.
"""

from __future__ import annotations

import collections
import functools
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = [ROOT / "tests", *sorted({p.parent for p in (ROOT / "tests").glob("*/test_*.py")})]
sys.path[:0] = [str(ROOT), *map(str, TESTS), str(ROOT / "benchmarks")]  # the test rooms' modules

import gpu_programs  # noqa: E402
from common import write_results  # noqa: E402
from test_kernels_lowering import abstract_step  # noqa: E402

from benchmarks.aot import xla_gpu  # noqa: E402
from pagedjax.scheduler.chips import CHIPS  # noqa: E402


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def row_for(section: str, program: str, fn, args, chip: str) -> dict:
    row = {"section": section, "program": program}
    try:
        build = xla_gpu.compile_for(fn, args, chip)
    except Exception as e:  # a program that does not compile is the finding
        traceback.print_exc()
        return {**row, "compiled": False, "error": f"{type(e).__name__}: {e}"[:300]}
    kernels = build.kernels
    operand_bytes = sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(args))
    descriptions = [f"{k.name} grid {'x'.join(map(str, k.grid))}, {k.threads[0]} threads, "
                    f"{k.shared_bytes / 1024:.1f} KiB shared" for k in kernels]
    # Mosaic GPU kernels are custom calls: what ptxas and Mosaic GPU report of them instead.
    descriptions += [f"{k.name} ({k.arch}, Mosaic GPU) {k.registers} registers, "
                     f"{k.spill_bytes} B spilled, {k.shared_bytes / 1024:.1f} KiB shared"
                     for k in build.mosaic]
    shared = [k.shared_bytes for k in kernels] + [k.shared_bytes for k in build.mosaic]
    return {**row, "compiled": True, "compile_s": build.seconds,
            "pallas_kernels": "; ".join(
                f"{desc}{f' (x{n})' if n > 1 else ''}"
                for desc, n in collections.Counter(descriptions).items()),
            "max_shared_kib": max(shared, default=0) / 1024,
            "launches": len(build.launches), "operand_mib": operand_bytes / 2**20,
            "temp_mib": build.temp_bytes / 2**20, "aliased_mib": build.alias_bytes / 2**20}


def decode_rows(chip: str) -> list[dict]:
    rows = []
    for batch in (128, 32, 1):
        for context in (32768, 4096, 512):
            shapes = gpu_programs.decode_shapes(batch, context,
                                               gpu_programs.rotations_for(batch, context))
            for name, (fn, kv_kind) in gpu_programs.decode_impls(batch, context,
                                                                interpret=False).items():
                rows.append(row_for("decode", f"{name}, batch {batch} x {context}", fn,
                                    shapes[kv_kind], chip))
                print(rows[-1], flush=True)
    return rows


def tuning_rows(chip: str) -> list[dict]:
    rows = []
    for batch, context in gpu_programs.TUNING_SHAPES:
        args = gpu_programs.decode_shapes(batch, context, rotations=1)["stacked"]
        configs, auto = gpu_programs.tuning_configs(batch, context)
        for kernel, pages_per_step, warps, stages, splits in configs:
            fn = gpu_programs.tuning_fn(batch, kernel, pages_per_step, warps, stages, splits,
                                       interpret=False)
            rows.append(row_for("tuning", f"{kernel}, batch {batch} x {context}: "
                                f"{pages_per_step} pages, {warps or 4} warps, {stages} stages, "
                                f"{splits or f'auto ({auto})'} splits", fn, args, chip))
            print(rows[-1], flush=True)
    return rows


def check_rows(chip: str) -> list[dict]:
    rows = []
    for name, kind, case, precision in gpu_programs.check_cases():
        kernel, _, operands, _ = gpu_programs.check_operands(kind, case)
        fn = functools.partial(kernel, scale=case[3] ** -0.5)
        with jax.default_matmul_precision(precision):
            rows.append(row_for("checks", name, fn, abstract(operands), chip))
        print(rows[-1], flush=True)
    return rows


def engine_rows(chip: str) -> list[dict]:
    """The device script's engine check: demo-small, block 16, the gpu backend, f32 (its jitted
    step at the buckets it runs: 64 prefill tokens, 8 decode sequences; a pool of 129 blocks)."""
    from pagedjax.models import CONFIGS
    rows = []
    for kind, tokens in (("prefill", 64), ("decode", 8)):
        step, args = abstract_step(CONFIGS["demo-small"], kind, num_tokens=tokens, num_seqs=8,
                                   num_blocks=8 * 256 // 16 + 1, max_blocks_per_seq=256 // 16,
                                   cache_dtype=jnp.float32, param_dtype=None)
        with jax.default_matmul_precision("highest"):
            rows.append(row_for("engine", f"demo-small {kind} step ({tokens} tokens), caches "
                                "donated", step, args, chip))
        print(rows[-1], flush=True)
    return rows


def serving_step(kind: str, tokens: int, **options):
    """abstract_step of Llama-3-8B (bf16, block 16) at serving sizes: 256 sequences with 32k-
    token block tables over a 30,000-block pool."""
    from pagedjax.models import CONFIGS
    return abstract_step(CONFIGS["llama-3-8b"], kind, num_tokens=tokens, num_seqs=256,
                         num_blocks=30000, max_blocks_per_seq=32768 // 16,
                         cache_dtype=jnp.bfloat16, **options)


def production_rows(chip: str) -> list[dict]:
    """The engine's step for Llama-3-8B (bf16, block 16) at serving sizes: 256 decode sequences
    with 32k-token block tables, and an 8192-token prefill, over a pool of 30,000 blocks (480k
    tokens, 58.6 GiB of KV beside 15 GiB of weights: what an H200 holds). Caches donated. On
    the gpu backend, and on mosaic_gpu where jax has it."""
    rows = []
    backends = ["gpu"] + (["mosaic_gpu"] if gpu_programs.MOSAIC else [])
    for backend in backends:
        for kind, tokens in (("decode", 256), ("prefill", 8192)):
            step, args = serving_step(kind, tokens, backend=backend)
            rows.append(row_for("production", f"llama-3-8b {kind} step ({backend}), {tokens} "
                                "tokens of 256 sequences, 30,000-block pool, caches donated",
                                step, args, chip))
            print(rows[-1], flush=True)
    return rows


def quantized_rows(chip: str) -> list[dict]:
    """production_rows' steps (gpu backend) with int8 / int4 weights (models/quantization/schemes.py,
    LM head too): each layer dequantizes its weights inside the scan, so temp_mib stays far
    below the 15 GiB a full-precision copy of the weights would take."""
    rows = []
    for scheme in ("int8", "int4"):
        for kind, tokens in (("decode", 256), ("prefill", 8192)):
            step, args = serving_step(kind, tokens, quantization=scheme)
            rows.append(row_for("quantized", f"llama-3-8b {scheme} weights, {kind} step "
                                f"(gpu), {tokens} tokens of 256 sequences, 30,000-block pool",
                                step, args, chip))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    if problem := xla_gpu.available():
        sys.exit(problem)
    chip = "h200"
    if "--quantized" in sys.argv:  # its quantized-weights section alone
        rows = quantized_rows(chip)
        write_results("gpu_xla_compile_quantized", "The engine's Llama-3-8B steps with "
                      "quantized weights compiled by XLA for an H200, without a GPU", rows,
                      {"chip": chip, "target": str(CHIPS[chip])},
                      notes=quantized_rows.__doc__,
                      reproduce="JAX_PLATFORMS=cpu .venv-gpu-image/bin/python "
                                "benchmarks/gpu_xla_compile.py --quantized")
        return
    rows = (decode_rows(chip) + tuning_rows(chip) + check_rows(chip) + engine_rows(chip)
            + production_rows(chip) + quantized_rows(chip))
    failed = [row for row in rows if not row["compiled"]]
    params = {"chip": chip, "target": str(CHIPS[chip]),
              "programs": len(rows), "compiled": len(rows) - len(failed)}
    write_results("gpu_xla_compile", "The GPU device script's programs compiled by XLA for an "
                  "H200, without a GPU", rows, params, notes=__doc__.split("\n\n", 1)[1],
                  reproduce="JAX_PLATFORMS=cpu .venv-gpu-image/bin/python "
                            "benchmarks/gpu_xla_compile.py")
    print(f"{len(rows) - len(failed)}/{len(rows)} programs compiled", flush=True)


if __name__ == "__main__":
    main()
