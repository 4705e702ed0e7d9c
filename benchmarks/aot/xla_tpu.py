"""Ahead-of-time compiles of the TPU kernels for a TPU topology, on a machine without a TPU.

libtpu compiles for a described topology (`jax.experimental.topologies.get_topology_desc`)
without a chip: Mosaic's whole pipeline runs, layout inference and the vector/memref checks
included, which the CPU-side lowering (tests/kernels/test_kernels_lowering.py) never reaches. A kernel
that passes every interpret-mode test can still fail here: an unsupported shape cast, a DMA
offset not aligned to the memory tiling. libtpu is a test dependency installed outside the
virtual environment's site-packages (`make test` puts it in .venv/libtpu), so that importing
jax elsewhere never tries to start a TPU; this module is run as its own process:

    python -m benchmarks.aot.xla_tpu --libtpu .venv/libtpu --topology v5e:2x2 CASES.json

CASES.json lists {"name", "module", "function", "args"} entries, where "args" names a function
of that module returning (fn, abstract args); each case prints one JSON line with its outcome.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

# libtpu reads these at start-up; without them it queries a GCE metadata server and waits.
QUIET_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
             "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
             "TF_CPP_MIN_LOG_LEVEL": "3",
             # Compiles only, no chip to share: two test workers may run at once.
             "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def compile_for_topology(build, topology: str) -> dict:
    """Compiles `fn(*abstract_args)` for the first chip of `topology` (fn as it is when already
    jitted, so that its donations hold); returns its device kind and arg_copies: for each
    argument of 256 KiB or more (a KV cache, its scales) that the compiled program copies
    whole, its HLO type and the number of copies (a donated cache updated in place has none)."""
    import jax
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    fn, args = build()
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        args)
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    # Pallas asks the default device which TPU generation it lowers for.
    with jax.default_device(device):
        hlo = jitted.trace(*args).lower().compile().as_text()
    return {"device_kind": device.device_kind, "arg_copies": whole_copies(hlo, args)}


def compile_sharded_for_topology(build, topology: str) -> dict:
    """Compiles `fn(*args)` from build(devices) -> (fn, abstract args carrying shardings over
    those devices), for every chip of `topology` as one program; returns per-device memory
    from XLA's memory analysis (arguments, outputs, aliased, temporaries) and the collectives
    XLA inserted (count and bytes of each kind's results)."""
    import jax
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    fn, args = build(devices)
    with jax.default_device(devices[0]):
        compiled = fn.trace(*args).lower().compile()
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    # One device's program: its arguments are the shards.
    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape),
                                                        a.dtype), args)
    return {"device_kind": devices[0].device_kind, "devices": len(devices),
            "arg_copies": whole_copies(hlo, local),
            "argument_gib": memory.argument_size_in_bytes / 2**30,
            "output_gib": memory.output_size_in_bytes / 2**30,
            "alias_gib": memory.alias_size_in_bytes / 2**30,
            "temp_gib": memory.temp_size_in_bytes / 2**30,
            "collectives": collectives(hlo)}


def collectives(hlo: str) -> dict:
    """{op: [count, MiB of their results]} of the collectives in an optimized HLO text (a
    while loop's body counted once: under a scan over layers, multiply by the layers)."""
    import re

    import numpy as np

    found: dict[str, list] = {}
    for m in re.finditer(r"= \(?((?:[a-z0-9]+\[[0-9,]*\][^ ]*,? ?)+)\)? "
                         r"(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(", hlo):
        shapes, op = m.group(1), m.group(2)
        size = 0
        for dtype, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shapes):
            width = re.match(r"[a-z]+(\d+)", dtype)  # f32, bf16, s8, f8e4m3fn; pred: 8
            bits = int(width.group(1)) if width else 8
            size += int(np.prod([int(d) for d in dims.split(",") if d])) * bits // 8
        entry = found.setdefault(op, [0, 0.0])
        entry[0] += 1
        entry[1] += size / 2**20
    return {op: [count, round(float(mib), 3)] for op, (count, mib) in found.items()}


HLO_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8",
             "int32": "s32", "uint32": "u32", "float8_e4m3fn": "f8e4m3fn", "bool": "pred"}


def whole_copies(hlo: str, args) -> dict:
    """{HLO type: count} of the copies (copy or copy-start, any layout) in an optimized HLO
    text whose result has the type of an argument of 256 KiB or more."""
    import re

    import jax
    import numpy as np

    names = {f"{HLO_TYPES.get(np.dtype(a.dtype).name, np.dtype(a.dtype).name)}"
             f"[{','.join(map(str, a.shape))}]"
             for a in jax.tree.leaves(args) if a.size * np.dtype(a.dtype).itemsize >= 2 ** 18}
    copies = {name: len(re.findall(rf"= {re.escape(name)}{{[^}}]*}} copy(-start)?\(", hlo))
              for name in sorted(names)}  # each type once: the layers' caches share one
    return {name: count for name, count in copies.items() if count}


def run_in_child(cases: list[dict], cases_file, *, libtpu, topology: str, pythonpath: list,
                 cwd, env: dict | None = None, timeout: float = 600) -> tuple[list[dict], str]:
    """Runs this module on `cases` in a child process (what a test or benchmark calls, so that
    its own process never loads libtpu); returns the cases' JSON outcomes and the child's
    stderr, and raises if the child failed. `env` adds variables (e.g. LIBTPU_INIT_ARGS) to the child's environment."""
    import pathlib
    import subprocess

    pathlib.Path(cases_file).write_text(json.dumps(cases))
    child_env = dict(os.environ, **(env or {}),
                     PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
    # The test suite's CPU-only XLA flag (tests/conftest.py) is no TPU compile's business.
    child_env["XLA_FLAGS"] = " ".join(
        flag for flag in child_env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_backend_optimization_level"))
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.aot.xla_tpu", str(cases_file), "--libtpu",
         str(libtpu), "--topology", topology],
        capture_output=True, text=True, env=child_env, cwd=cwd, timeout=timeout)
    if run.returncode:
        raise RuntimeError(f"xla_tpu child exited with {run.returncode}:\n{run.stderr[-3000:]}")
    return ([json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")],
            run.stderr)


def libtpu_mismatch(folder) -> str | None:
    """Why the libtpu in `folder` cannot compile for this jax, or None. Mosaic kernels travel
    to libtpu as MLIR bytecode that only the libtpu jax[tpu] pins reads (another one fails with
    "unknown attribute code")."""
    import importlib.metadata as metadata
    import re

    import jax

    found = [d.version for d in metadata.distributions(path=[str(folder)])
             if (d.metadata["Name"] or "").lower() == "libtpu"]
    if not found:
        return f"no libtpu package in {folder} (make test installs it there)"
    wanted = [re.match(r"libtpu\s*==\s*([\w.*]+)", r) for r in metadata.requires("jax") or []]
    wanted = [m.group(1) for m in wanted if m]
    if not wanted:
        return None
    pattern = re.escape(wanted[0]).replace(r"\*", ".*")
    if re.fullmatch(pattern, found[0]):
        return None
    return (f"libtpu {found[0]} in {folder} does not match jax {jax.__version__}, which "
            f"compiles for libtpu=={wanted[0]} (what jax[tpu] pins); install that one there")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="JSON file: [{name, module, function}]")
    parser.add_argument("--libtpu", required=True, help="folder holding the libtpu package")
    parser.add_argument("--topology", default="v5e:2x2")
    args = parser.parse_args()
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if problem := libtpu_mismatch(args.libtpu):
        sys.exit(f"xla_tpu: {problem}")
    sys.path.insert(0, os.path.abspath(args.libtpu))
    with open(args.cases) as f:
        cases = json.load(f)
    for case in cases:
        start = time.perf_counter()
        result = {"name": case["name"], "topology": args.topology}
        try:
            module = importlib.import_module(case["module"])
            build = getattr(module, case["function"])
            if case.get("sharded"):
                result.update(ok=True, **compile_sharded_for_topology(
                    lambda devices: build(case["name"], devices),  # noqa: B023 - called now
                    args.topology))
            else:
                result.update(ok=True, **compile_for_topology(
                    lambda: build(case["name"]), args.topology))  # noqa: B023 - called now
        except Exception as e:  # every case reports, the run goes on
            result.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        result["seconds"] = round(time.perf_counter() - start, 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
