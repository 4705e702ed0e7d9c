"""GPU device script: compiled kernel correctness, then decode-attention speed and bandwidth.

Run on a GPU machine with `bash benchmarks/run_gpu.sh` (jax 0.11.x + CUDA, nothing installed).
`--smoke` runs tiny shapes through the Pallas interpreter, to check the script itself on a CPU
(tests/kernels/test_gpu_script.py runs a slice of it).

Sections, in order, each written to the results as soon as it ends (a device lease is short: a
run cut off by its time limit keeps what it finished; `--budget-s` makes the script stop itself
first, recording what it skipped):

1. decode: decode attention at batch 128/32/1 x context 32k/4k/512 (block 16, bf16, 32 query /
   8 KV heads, head dim 128): microseconds per call, achieved bandwidth (K/V bytes read / time)
   against the device's copy bandwidth measured in the same run, side by side with JAX's shipped
   `pallas.ops.gpu.paged_attention` and the reference XLA path, and each one's relative error
   against the reference at that shape.
2. checks: the kernel test cases (tests/kernels/test_kernels_gpu.py), compiled (not interpret), against
   the reference, under jax.default_matmul_precision("highest") so that both sides multiply f32
   in IEEE f32 (a GPU's default is TF32 for both), plus one f32 case at the default precision
   against the bf16 tolerance; and the KV write against the XLA scatter.
3. tuning: the decode kernel's launch parameters (pages per step, warps, stages, splits) at
   128 x 4k and 8 x 32k.
4. engine: the engine's greedy tokens with the gpu backend, tensor-parallel over every GPU
   (TP 1 on one), against the reference backend on one device.

Timing (METHOD: warm up, then many calls, median): `us` is the time per call of back-to-back
calls with one synchronisation at the end (device time once a call outlasts its dispatch),
`us_sync` the median of synchronised single calls (dispatch and sync included). Inputs smaller
than ROTATE_BYTES are rotated through disjoint copies of the pages, so repeated calls read
device memory rather than the 50 MB L2.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = [ROOT / "tests", *sorted({p.parent for p in (ROOT / "tests").glob("*/test_*.py")})]
sys.path[:0] = [str(ROOT), *map(str, TESTS), str(ROOT / "benchmarks")]  # the test rooms' modules

from common import RESULTS, write_results  # noqa: E402
from gpu_programs import (BLOCK_SIZE, HEADS, MOSAIC, TUNING_SHAPES, check_cases,  # noqa: E402
                          check_operands, decode_impls, decode_inputs, decode_shapes, kv_bytes,
                          precompile, rotations_for, tuning_configs, tuning_fn)

SECTIONS = ("checks", "decode", "tuning", "engine")
REPRODUCE = "bash benchmarks/run_gpu.sh (on a GPU; --smoke on a CPU)"


class Budget:
    """The script's own deadline: sections skip work they cannot finish before it."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in f32 (METHOD: bf16 operands land between 1e-3 and 1e-2)."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


def measure(fn, arg_sets: list[tuple], *, min_time: float):
    """(first output, us per call back to back, median us of synchronised calls), after a
    compile and a warm-up call; calls cycle through arg_sets."""
    out = jax.block_until_ready(fn(*arg_sets[0]))
    jax.block_until_ready(fn(*arg_sets[-1]))
    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    once = time.perf_counter() - start
    times = []
    for i in range(int(np.clip(min_time / max(once, 1e-6), 3, 200))):
        start = time.perf_counter()
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
        times.append(time.perf_counter() - start)
    sync = float(np.median(times))
    calls = int(np.clip(min_time / max(sync, 1e-6), 10, 2000))
    start = time.perf_counter()
    last = None
    for i in range(calls):
        last = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(last)
    return out, (time.perf_counter() - start) / calls * 1e6, sync * 1e6


def copy_bandwidth(num_bytes: int) -> float:
    """Device copy bandwidth, bytes moved (read + write) per second."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    _, us, _ = measure(jax.jit(lambda a: a + jnp.bfloat16(1)), [(x,)], min_time=0.2)
    del x
    return 2 * num_bytes / (us * 1e-6)


def check_kernels(args, budget: Budget) -> list[dict]:
    from test_kernels_gpu import reference_layout, tolerance
    rows = []
    for name, kind, case, precision in check_cases():
        if args.checks not in name:
            continue
        head_dim, dtype = case[3], case[4]
        if budget.left() < 20:
            rows.append({"check": name, "passed": False, "error": "skipped: time budget"})
            continue
        try:
            kernel, reference, operands, n = check_operands(kind, case)
            scale = head_dim ** -0.5
            with jax.default_matmul_precision(precision):
                got = kernel(*operands, scale=scale, interpret=args.smoke)
            with jax.default_matmul_precision("highest"):
                want = reference(*reference_layout(operands, head_dim), scale=scale)
            got = np.asarray(got, np.float32)
            want = np.asarray(want, np.float32)
            # TF32 keeps 10 mantissa bits, bf16 8: the bf16 tolerance bounds TF32 products.
            tol = tolerance("bfloat16" if precision is None else dtype)
            ok = bool(np.all(np.isfinite(got)) and np.allclose(got[:n], want[:n], **tol)
                      and np.all(got[n:] == 0))
            rows.append({"check": name, "passed": ok,
                         "max_abs_err": float(np.abs(got[:n] - want[:n]).max()),
                         "rel_err": relative_error(got[:n], want[:n])})
        except Exception as e:  # keep going: every case is reported
            traceback.print_exc()
            rows.append({"check": name, "passed": False,
                         "error": f"{type(e).__name__}: {e}"[:300]})
        print(rows[-1], flush=True)
    rows.append(check_write(args) if budget.left() >= 20 else {
        "check": "write_kv_gpu == XLA scatter", "passed": False, "error": "skipped: time budget"})
    print(rows[-1], flush=True)
    return rows


def check_write(args) -> dict:
    from test_kernels_gpu import write_case

    from pagedjax.pallas_kernels import write_kv_gpu, write_kv_reference
    name = "write_kv_gpu == XLA scatter (H=80 in a 128 cache)"
    try:
        cache, k, v, slots = write_case(np.random.default_rng(0), 80, 128)
        want = np.asarray(write_kv_reference(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v),
                                             slots))
        got = np.asarray(write_kv_gpu(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(slots), interpret=args.smoke))
        err = float(np.abs(got[:, :, 1:] - want[:, :, 1:]).max())  # block 0: padding races
        return {"check": name, "passed": err == 0.0, "max_abs_err": err}
    except Exception as e:
        traceback.print_exc()
        return {"check": name, "passed": False, "error": f"{type(e).__name__}: {e}"[:300]}


def usable_tensor_parallel(config, devices: int) -> int:
    """The largest tensor_parallel_size up to devices that the model splits into."""
    from pagedjax.parallel.sharding import check_tensor_parallel
    for tp in range(devices, 0, -1):
        try:
            check_tensor_parallel(config, tp)
            return tp
        except ValueError:
            continue
    return 1


def check_engine(args, backends=("reference", "gpu"), dtype="float32") -> dict:
    """The engine's greedy tokens on two backends: f32 at the highest precision (reference vs
    gpu), or bf16 (gpu vs mosaic_gpu: both round the same operands to bf16). The second runs
    tensor-parallel over every GPU the model splits over (TP 1 on one GPU), and its device 0's
    bytes of weights and KV are reported."""
    from pagedjax import EngineConfig, LLMEngine, SamplingParams, load_model
    try:
        model = load_model("demo-small")
        tp = usable_tensor_parallel(model.config, len(jax.devices()))
    except Exception as e:
        traceback.print_exc()
        return {"check": "engine greedy tokens", "passed": False,
                "error": f"{type(e).__name__}: {e}"[:300]}
    name = (f"engine greedy tokens, {backends[1]} backend at TP {tp} == {backends[0]} at TP 1 "
            f"({dtype}{', highest precision' if dtype == 'float32' else ''})")
    device0 = {}
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 512, n).tolist() for n in (3, 40, 1, 130, 17, 64)]
        outs = []
        with jax.default_matmul_precision("highest"):
            for backend, size in zip(backends, (1, tp)):
                engine = LLMEngine(model, EngineConfig(
                    max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                    attention_backend=backend, dtype=dtype, tensor_parallel_size=size,
                    attention_interpret=args.smoke and backend != "reference"))
                runner = engine.runner
                device0 = {f"device0_{what}_bytes": sum(
                    s.data.nbytes for leaf in jax.tree.leaves(tree)
                    for s in leaf.addressable_shards if s.device == jax.devices()[0])
                    for what, tree in (("weight", runner.params), ("kv", runner.kv_cache))}
                ids = [engine.add_request(p, SamplingParams(max_tokens=16, temperature=0))
                       for p in prompts]
                done = {}
                while engine.has_unfinished():
                    done.update({o.request_id: o.output_token_ids for o in engine.step()
                                 if o.finished})
                outs.append([done[i] for i in ids])
        same = sum(a == b for a, b in zip(*outs))
        return {"check": name, "passed": outs[0] == outs[1], "tensor_parallel_size": tp,
                **device0,
                "error": "" if same == len(prompts) else f"{same}/{len(prompts)} requests equal"}
    except Exception as e:
        traceback.print_exc()
        return {"check": name, "passed": False, "error": f"{type(e).__name__}: {e}"[:300]}


def bench_decode(args, bandwidth: float, budget: Budget) -> list[dict]:
    rows = []
    jobs = {}
    for batch in args.batches:
        for context in args.contexts:
            rotations = 1 if args.smoke else rotations_for(batch, context)
            shapes = decode_shapes(batch, context, rotations)
            for name, (fn, kv_kind) in decode_impls(batch, context,
                                                    interpret=args.smoke).items():
                jobs[batch, context, name] = (fn, shapes[kv_kind])
    start = time.perf_counter()
    compiled = precompile(jobs, args.compile_workers) if budget.left() >= 30 else {}
    print(f"compiled {len(compiled)} decode programs in {time.perf_counter() - start:.1f} s "
          f"({args.compile_workers} at a time)", flush=True)
    for batch in args.batches:
        for context in args.contexts:
            if budget.left() < 30:
                rows.append({"batch": batch, "context": context, "impl": "all",
                             "error": "skipped: time budget"})
                continue
            rotations = 1 if args.smoke else rotations_for(batch, context)
            q, k_pages, v_pages, tables, lens = decode_inputs(batch, context, rotations=rotations,
                                                              seed=batch + context)
            cache = jnp.stack([k_pages, v_pages])
            num_bytes = kv_bytes(batch, context)
            impls = decode_impls(batch, context, interpret=args.smoke)
            want, shape_rows = None, []
            for name, (_, kv_kind) in impls.items():
                row = {"batch": batch, "context": context, "impl": name}
                kv = cache if kv_kind == "stacked" else (k_pages, v_pages)
                try:
                    fn = compiled[batch, context, name]
                    if isinstance(fn, Exception):
                        raise fn
                    out, us, us_sync = measure(fn, [(q, kv, t, lens) for t in tables],
                                               min_time=0.02 if args.smoke else 0.2)
                    want = out if want is None else want
                    row.update(us=us, us_sync=us_sync, kv_gb_per_s=num_bytes / us / 1e3,
                               pct_of_copy_bw=100 * num_bytes / (us * 1e-6) / bandwidth,
                               rel_err_vs_reference=relative_error(out, want))
                except Exception as e:
                    traceback.print_exc()
                    row.update(error=f"{type(e).__name__}: {e}"[:160])
                shape_rows.append(row)
                print(row, flush=True)
            base = next((r["us"] for r in shape_rows if r["impl"].startswith("jax") and "us" in r),
                        None)
            for row in shape_rows:
                if base and "us" in row:
                    row["speedup_vs_jax_op"] = base / row["us"]
            rows += shape_rows
            del impls, q, k_pages, v_pages, cache, tables, want
    return rows


def bench_tuning(args, bandwidth: float, budget: Budget) -> list[dict]:
    """The decode kernels' launch parameters at a large batch and at a long context, then the
    number of context splits around the default (gpu.common.choose_num_splits): the Triton
    kernel's, then the Mosaic GPU kernel's (4 warps: one warpgroup)."""
    rows = []
    shapes = [(2, 128)] if args.smoke else TUNING_SHAPES
    jobs = {(batch, context, config): (
        tuning_fn(batch, *config, interpret=args.smoke),
        decode_shapes(batch, context, rotations=1)["stacked"])
        for batch, context in shapes for config in tuning_configs(batch, context)[0]}
    compiled = precompile(jobs, args.compile_workers) if budget.left() >= 10 else {}
    for batch, context in shapes:
        q, k_pages, v_pages, tables, lens = decode_inputs(batch, context, seed=7)
        cache = jnp.stack([k_pages, v_pages])
        del k_pages, v_pages
        configs, auto = tuning_configs(batch, context)
        for config in configs:
            kernel, pages, warps, stages, splits = config
            row = {"kernel": kernel, "batch": batch, "context": context,
                   "pages_per_step": pages, "num_warps": warps or 4, "num_stages": stages,
                   "num_splits": splits or f"auto ({auto})"}
            if budget.left() < 10:
                rows.append({**row, "error": "skipped: time budget"})
                continue
            fn = compiled[batch, context, config]
            try:
                if isinstance(fn, Exception):
                    raise fn
                _, us, _ = measure(fn, [(q, cache, tables[0], lens)],
                                   min_time=0.02 if args.smoke else 0.2)
                row.update(us=us, pct_of_copy_bw=100 * kv_bytes(batch, context) / (us * 1e-6)
                           / bandwidth)
            except Exception as e:  # a configuration that does not build is a row too
                row.update(error=f"{type(e).__name__}: {e}"[:120])
            rows.append(row)
            print(row, flush=True)
        del q, cache
    return rows


class Results:
    """gpu_kernels{,_tuning}.{json,md}, rewritten after every section and copied to $OUT (the
    device tool's folder) when that is set."""

    def __init__(self, args):
        self.args = args
        self.name = "gpu_kernels_smoke" if args.smoke else "gpu_kernels"
        self.checks: list[dict] = []
        self.decode: list[dict] = []
        self.tuning: list[dict] = []
        self.params = {"smoke": args.smoke, "sections": list(args.sections),
                       "block_size": BLOCK_SIZE, "dtype": "bfloat16", **HEADS}

    def write(self) -> None:
        out = self.args.out_dir
        passed = sum(bool(c.get("passed")) for c in self.checks)
        params = {**self.params, "checks_passed": passed, "checks_total": len(self.checks)}
        notes = ("Checks (kernels vs the reference: compiled on a GPU, interpreted with "
                 "--smoke):\n\n" + "\n".join(
            f"- {'PASS' if c.get('passed') else 'FAIL'} {c['check']}"
            + (f" (max abs err {c['max_abs_err']:.3g}, rel err {c.get('rel_err', 0):.3g})"
               if "max_abs_err" in c else "")
            + (f" {c['error']}" if c.get("error") else "")
            for c in self.checks)) if self.checks else ""
        write_results(self.name, "Paged decode attention on GPU", self.decode, params,
                      notes=notes, results_dir=out, reproduce=REPRODUCE)
        write_results(f"{self.name}_tuning", "Decode kernel launch parameters on GPU",
                      self.tuning, params, results_dir=out, reproduce=REPRODUCE)
        device_out = os.environ.get("OUT")
        if device_out and pathlib.Path(device_out).resolve() != out.resolve():
            for suffix in ("", "_tuning"):
                for ext in ("json", "md"):
                    shutil.copy(out / f"{self.name}{suffix}.{ext}", device_out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes through the Pallas interpreter (CPU check)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, default=260.0,
                        help="the script's own deadline; sections skip what would overrun it")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="programs of a section compiled at once, before it is timed")
    parser.add_argument("--batches", default=None, help="decode batches (default 128,32,1)")
    parser.add_argument("--contexts", default=None, help="decode contexts (default 32768,4096,512)")
    parser.add_argument("--checks", default="",
                        help="run only the kernel checks whose name contains this")
    args = parser.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known: {list(SECTIONS)}")
    default_batches, default_contexts = ("2,1", "128,64") if args.smoke else \
        ("128,32,1", "32768,4096,512")
    args.batches = [int(b) for b in (args.batches or default_batches).split(",")]
    args.contexts = [int(c) for c in (args.contexts or default_contexts).split(",")]
    budget = Budget(args.budget_s)
    print(jax.devices(), flush=True)
    results = Results(args)
    bandwidth = None
    if {"decode", "tuning"} & set(args.sections):
        bandwidth = copy_bandwidth(2**24 if args.smoke else 2**32)
        results.params["copy_bandwidth_gb_per_s"] = bandwidth / 1e9
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    # The headline first (it carries its own error against the reference), then the test cases.
    if "decode" in args.sections:
        results.decode = bench_decode(args, bandwidth, budget)
        results.write()
    if "checks" in args.sections:
        results.checks = check_kernels(args, budget)
        results.write()
    if "tuning" in args.sections:
        results.tuning = bench_tuning(args, bandwidth, budget)
        results.write()
    if "engine" in args.sections:
        if budget.left() > 60:
            results.checks.append(check_engine(args))
        else:
            results.checks.append({"check": "engine greedy tokens", "passed": False,
                                   "error": "skipped: time budget"})
        print(results.checks[-1], flush=True)
        if MOSAIC:  # the Mosaic GPU kernels on the chip, end to end
            results.checks.append(
                check_engine(args, ("gpu", "mosaic_gpu"), "bfloat16") if budget.left() > 40
                else {"check": "engine greedy tokens, mosaic_gpu", "passed": False,
                      "error": "skipped: time budget"})
            print(results.checks[-1], flush=True)
    results.write()
    print(f"done, {budget.left():.0f} s of the budget left", flush=True)


if __name__ == "__main__":
    main()
