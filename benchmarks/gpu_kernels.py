"""GPU device script: compiled kernel correctness, then decode-attention speed and bandwidth.

Run on a GPU machine with `bash benchmarks/run_gpu.sh` (jax 0.11.x + CUDA, nothing installed).
`--smoke` runs tiny shapes through the Pallas interpreter, to check the script itself on a CPU.

1. Correctness, compiled (not interpret): the kernel test cases (tests/test_kernels_gpu.py) against
   the reference, and the engine's greedy tokens with the gpu backend against the reference.
2. Decode attention at batch 1/32/128 x context 512/4k/32k, block 16, bf16, 32 query / 8 KV heads,
   head dim 128: microseconds per call; achieved bandwidth (K/V bytes read / time) against the
   device's copy bandwidth measured in the same run; side by side with JAX's shipped
   `pallas.ops.gpu.paged_attention` and the reference XLA path.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from common import write_results  # noqa: E402
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_op  # noqa: E402

from pallas_kernels import (paged_decode_attention_gpu, paged_decode_attention_reference,  # noqa
                            ragged_paged_attention_gpu, ragged_paged_attention_reference)


def timed(fn, *args, min_time: float = 0.2, max_iters: int = 200) -> float:
    """Median seconds per call of a jitted fn after warmup."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    iters = int(np.clip(min_time / max(once, 1e-6), 3, max_iters))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(num_bytes: int) -> float:
    """Device copy bandwidth, bytes moved (read + write) per second."""
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    seconds = timed(copy, x)
    del x
    return 2 * num_bytes / seconds


def check_kernels(interpret: bool) -> list[dict]:
    from test_kernels_gpu import CASES, as_dtype, decode_seqs, ragged_seqs, tolerance
    from test_kernels_reference import build_case
    rows = []
    for block_size, num_heads, num_kv_heads, head_dim, dtype in CASES:
        for kind in ("decode", "ragged"):
            name = f"{kind} S={block_size} N={num_heads} K={num_kv_heads} H={head_dim} {dtype}"
            try:
                rng = np.random.default_rng(block_size + head_dim)
                seqs = decode_seqs(block_size) if kind == "decode" else ragged_seqs(block_size)
                n = sum(q for _, q in seqs)
                case = build_case(rng, seqs, block_size=block_size, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=8,
                                  padded_tokens=8 if kind == "decode" else n + 7)
                q, cache = as_dtype(case, dtype)
                scale = head_dim ** -0.5
                if kind == "decode":
                    args = (q, cache, case["kv_lens"], case["tables"], case["num_seqs"])
                    got = paged_decode_attention_gpu(*args, scale=scale, interpret=interpret)
                    want = paged_decode_attention_reference(*args, scale=scale)
                    n = len(seqs)
                else:
                    args = (q, cache, case["kv_lens"], case["tables"], case["cu_q_lens"],
                            case["num_seqs"])
                    got = ragged_paged_attention_gpu(*args, scale=scale, interpret=interpret)
                    want = ragged_paged_attention_reference(*args, scale=scale)
                got = np.asarray(got, np.float32)
                want = np.asarray(want, np.float32)
                tol = tolerance(dtype)
                ok = bool(np.all(np.isfinite(got)) and np.allclose(got[:n], want[:n], **tol)
                          and np.all(got[n:] == 0))
                rows.append({"check": name, "max_abs_err": float(np.abs(got - want).max()),
                             "passed": ok})
            except Exception as e:  # keep going: every case is reported
                rows.append({"check": name, "max_abs_err": float("nan"),
                             "passed": False, "error": f"{type(e).__name__}: {e}"[:300]})
                traceback.print_exc()
    return rows


def check_write(interpret: bool) -> dict:
    from test_kernels_gpu import write_case
    from pallas_kernels import write_kv_gpu, write_kv_reference
    name = "write_kv_gpu == XLA scatter (H=80 in a 128 cache)"
    try:
        cache, k, v, slots = write_case(np.random.default_rng(0), 80, 128)
        want = np.asarray(write_kv_reference(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v),
                                             slots))
        got = np.asarray(write_kv_gpu(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(slots), interpret=interpret))
        err = float(np.abs(got[:, :, 1:] - want[:, :, 1:]).max())  # block 0: padding races
        return {"check": name, "max_abs_err": err, "passed": err == 0.0}
    except Exception as e:
        traceback.print_exc()
        return {"check": name, "max_abs_err": float("nan"), "passed": False, "error": str(e)[:300]}


def check_engine(interpret: bool) -> dict:
    from pagedjax import EngineConfig, LLMEngine, SamplingParams, load_model
    try:
        model = load_model("demo-small")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 512, n).tolist() for n in (3, 40, 1, 130, 17, 64)]
        outs = []
        for backend in ("reference", "gpu"):
            engine = LLMEngine(model, EngineConfig(
                max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                attention_backend=backend, attention_interpret=interpret and backend != "reference"))
            ids = [engine.add_request(p, SamplingParams(max_tokens=16, temperature=0))
                   for p in prompts]
            done = {}
            while engine.has_unfinished():
                done.update({o.request_id: o.output_token_ids for o in engine.step()
                             if o.finished})
            outs.append([done[i] for i in ids])
        return {"check": "engine greedy tokens, gpu backend == reference", "max_abs_err": 0.0,
                "passed": outs[0] == outs[1]}
    except Exception as e:
        traceback.print_exc()
        return {"check": "engine greedy tokens, gpu backend == reference",
                "max_abs_err": float("nan"), "passed": False, "error": str(e)[:300]}


def decode_inputs(batch, context, *, block_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)
    pages = context // block_size
    num_blocks = batch * pages + 1
    tables = (1 + rng.permutation(batch * pages)).reshape(batch, pages).astype(np.int32)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), dtype)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k_pages, v_pages, jnp.asarray(tables), lens


def bench_decode(args, bandwidth: float) -> list[dict]:
    rows = []
    heads = dict(num_heads=32, num_kv_heads=8, head_dim=128)
    scale = heads["head_dim"] ** -0.5
    for batch in args.batches:
        for context in args.contexts:
            q, k_pages, v_pages, tables, lens = decode_inputs(
                batch, context, block_size=16, dtype=jnp.bfloat16, seed=batch + context,
                **heads)
            cache = jnp.stack([k_pages, v_pages])
            kv_bytes = 2 * batch * context * heads["num_kv_heads"] * heads["head_dim"] * 2
            # Every operand is an argument (a closed-over array would be baked into the program).
            impls = {
                "pagedjax gpu kernel": (jax.jit(lambda q, c, t, l: paged_decode_attention_gpu(
                    q, c, l, t, jnp.int32(batch), scale=scale, interpret=args.smoke)),
                    (q, cache)),
                "jax pallas.ops.gpu.paged_attention": (jax.jit(
                    lambda q, kv, t, l: jax_gpu_op.paged_attention(
                        q, kv[0], kv[1], t, l, interpret=args.smoke,
                        k_splits=min(16, context // 16))), (q * scale, (k_pages, v_pages))),
                "reference (XLA)": (jax.jit(
                    lambda q, c, t, l: paged_decode_attention_reference(
                        q, c, l, t, jnp.int32(batch), scale=scale)), (q, cache)),
            }
            base = None
            for name, (fn, operands) in impls.items():
                row = {"batch": batch, "context": context, "impl": name}
                try:
                    seconds = timed(fn, *operands, tables, lens,
                                    min_time=0.02 if args.smoke else 0.2)
                    row.update(us=seconds * 1e6, kv_gb_per_s=kv_bytes / seconds / 1e9,
                               pct_of_copy_bw=100 * kv_bytes / seconds / bandwidth)
                    if name.startswith("jax"):
                        base = seconds
                except Exception as e:
                    traceback.print_exc()
                    row.update(us=float("nan"), kv_gb_per_s=float("nan"),
                               pct_of_copy_bw=float("nan"), error=f"{type(e).__name__}"[:100])
                rows.append(row)
            for row in rows[-len(impls):]:
                row["speedup_vs_jax_op"] = (base / (row["us"] * 1e-6)) if base else float("nan")
            print(rows[-3:], flush=True)
            del impls, q, k_pages, v_pages, cache
    return rows


# (pages_per_step, num_warps, num_stages) tried for the decode kernel; the first is the default
# at block 16 / bf16 / head dim 128 (benchmarks/results/gpu_compile.md has what each costs).
TUNING = [(8, 8, 2), (8, 4, 2), (4, 8, 2), (4, 4, 3), (8, 8, 3), (2, 4, 4)]


def bench_tuning(args, bandwidth: float) -> list[dict]:
    """The decode kernel's launch parameters at a large batch and a long context."""
    rows = []
    heads = dict(num_heads=32, num_kv_heads=8, head_dim=128)
    scale = heads["head_dim"] ** -0.5
    shapes = [(2, 128)] if args.smoke else [(128, 4096), (8, 32768)]
    for batch, context in shapes:
        q, k_pages, v_pages, tables, lens = decode_inputs(
            batch, context, block_size=16, dtype=jnp.bfloat16, seed=7, **heads)
        cache = jnp.stack([k_pages, v_pages])
        del k_pages, v_pages
        kv_bytes = 2 * batch * context * heads["num_kv_heads"] * heads["head_dim"] * 2
        for pages, warps, stages in TUNING:
            row = {"batch": batch, "context": context, "pages_per_step": pages,
                   "num_warps": warps, "num_stages": stages}
            fn = jax.jit(lambda q, c, t, l, pages=pages, warps=warps, stages=stages:
                         paged_decode_attention_gpu(
                             q, c, l, t, jnp.int32(batch), scale=scale, pages_per_step=pages,
                             num_warps=warps, num_stages=stages, interpret=args.smoke))
            try:
                seconds = timed(fn, q, cache, tables, lens, min_time=0.02 if args.smoke else 0.2)
                row.update(us=seconds * 1e6, pct_of_copy_bw=100 * kv_bytes / seconds / bandwidth)
            except Exception as e:  # a configuration that does not build is a row too
                row.update(us=float("nan"), pct_of_copy_bw=float("nan"),
                           error=f"{type(e).__name__}: {e}"[:120])
            rows.append(row)
            print(row, flush=True)
        del q, cache
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes through the Pallas interpreter (CPU check)")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    args.batches = [1, 2] if args.smoke else [1, 32, 128]
    args.contexts = [64, 128] if args.smoke else [512, 4096, 32768]
    print(jax.devices(), flush=True)
    checks = []
    if not args.skip_checks:
        checks = check_kernels(interpret=args.smoke) + [check_write(interpret=args.smoke),
                                                       check_engine(interpret=args.smoke)]
        for row in checks:
            print(row, flush=True)
    bandwidth = copy_bandwidth(2**24 if args.smoke else 2**32)
    rows = bench_decode(args, bandwidth)
    tuning = bench_tuning(args, bandwidth)
    name = "gpu_kernels_smoke" if args.smoke else "gpu_kernels"
    params = {"smoke": args.smoke, "copy_bandwidth_gb_per_s": bandwidth / 1e9,
              "block_size": 16, "dtype": "bfloat16", "num_heads": 32, "num_kv_heads": 8,
              "head_dim": 128, "checks_passed": sum(c["passed"] for c in checks),
              "checks_total": len(checks)}
    write_results(name, "Paged decode attention on GPU", rows, params, notes=(
        "Checks (compiled kernels vs reference):\n\n" + "\n".join(
            f"- {'PASS' if c['passed'] else 'FAIL'} {c['check']} (max abs err "
            f"{c['max_abs_err']:.3g}){' ' + c.get('error', '') if 'error' in c else ''}"
            for c in checks)))
    write_results(f"{name}_tuning", "Decode kernel launch parameters on GPU", tuning,
                  {"copy_bandwidth_gb_per_s": bandwidth / 1e9, "dtype": "bfloat16",
                   "block_size": 16, **{k: params[k] for k in ("num_heads", "num_kv_heads",
                                                                "head_dim")}})


if __name__ == "__main__":
    main()
