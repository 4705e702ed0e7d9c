"""The GPU device script's programs: what it compiles and at which shapes, apart from how it
times them (benchmarks/gpu_kernels.py), so that benchmarks/gpu_xla_compile.py can compile the
very same programs ahead of time for a GPU that is not there.

The decode benchmark's shape: block 16, bf16, 32 query / 8 KV heads, head dim 128. Inputs smaller
than ROTATE_BYTES are rotated through disjoint copies of the pages, so that repeated calls read
device memory rather than the 50 MB L2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.pallas_kernels import (paged_decode_attention_gpu, paged_decode_attention_mosaic_gpu,
                                     paged_decode_attention_reference, ragged_paged_attention_gpu,
                                     ragged_paged_attention_mosaic_gpu,
                                     ragged_paged_attention_reference)
from pagedjax.pallas_kernels.gpu import mosaic

MOSAIC = mosaic.problem() is None  # the Mosaic GPU kernel needs jax >= 0.11

HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128)
BLOCK_SIZE = 16
ROTATE_BYTES = 256 << 20  # > 4x an H100/H200's 50 MB L2


def check_cases() -> list[tuple]:
    """[(name, kind, (block size, query heads, KV heads, head dim, dtype), precision)]: the
    kernel test grid (tests/kernels/test_kernels_gpu.py) in IEEE f32, plus one f32 case at the default
    precision (TF32), and the Mosaic GPU kernel's grid (tests/kernels/test_kernels_mosaic_gpu.py, 16-bit
    caches) where jax has it."""
    from test_kernels_gpu import CASES
    cases = [(case, "highest") for case in CASES] + [((16, 8, 2, 128, "float32"), None)]
    checks = [(f"{kind} S={case[0]} N={case[1]} K={case[2]} H={case[3]} {case[4]}"
               f"{'' if precision else ' default precision (TF32)'}", kind, case, precision)
              for case, precision in cases for kind in ("decode", "ragged")]
    if MOSAIC:
        from test_kernels_mosaic_gpu import CASES as MOSAIC_CASES
        checks += [(f"mosaic {kind} S={case[0]} N={case[1]} K={case[2]} H={case[3]} {case[4]} "
                    f"{case[5]}", f"mosaic {kind}", case, None)
                   for case in MOSAIC_CASES for kind in ("decode", "ragged")]
    return checks


def check_operands(kind: str, case: tuple):
    """(kernel, reference, operands, rows to compare) of one check: a shuffled, NaN-padded
    cache built as the kernel tests build theirs."""
    from test_kernels_gpu import as_dtype, decode_seqs, ragged_seqs
    from test_kernels_reference import build_case
    if kind.startswith("mosaic"):
        import functools

        from test_kernels_mosaic_gpu import kernel_options, make_args
        *shape, tunables = case
        kind = kind.split()[1]
        operands, n = make_args(np.random.default_rng(sum(shape[:4])), *shape,
                                ragged=kind == "ragged")
        if kind == "decode":
            return (functools.partial(paged_decode_attention_mosaic_gpu, **tunables),
                    paged_decode_attention_reference, operands, n)
        return (functools.partial(ragged_paged_attention_mosaic_gpu,
                                  **kernel_options(kind, tunables)),
                ragged_paged_attention_reference, operands, n)
    block_size, num_heads, num_kv_heads, head_dim, dtype = case
    rng = np.random.default_rng(block_size + head_dim)
    seqs = decode_seqs(block_size) if kind == "decode" else ragged_seqs(block_size)
    n = sum(q for _, q in seqs)
    built = build_case(rng, seqs, block_size=block_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, padded_seqs=8,
                       padded_tokens=8 if kind == "decode" else n + 7, backend="gpu")
    q, cache = as_dtype(built, dtype)
    if kind == "decode":
        return (paged_decode_attention_gpu, paged_decode_attention_reference,
                (q, cache, built["kv_lens"], built["tables"], built["num_seqs"]), len(seqs))
    return (ragged_paged_attention_gpu, ragged_paged_attention_reference,
            (q, cache, built["kv_lens"], built["tables"], built["cu_q_lens"], built["num_seqs"]),
            n)


def decode_inputs(batch, context, *, seed, rotations=1, dtype=jnp.bfloat16):
    """q, K pages, V pages ([K, NB, S, H] each) and `rotations` block tables over disjoint pages
    (rotation r reads only its own pages), lengths."""
    rng = np.random.default_rng(seed)
    pages = context // BLOCK_SIZE
    num_blocks = rotations * batch * pages + 1
    tables = (1 + rng.permutation(rotations * batch * pages)).reshape(rotations, batch, pages)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shape = (HEADS["num_kv_heads"], num_blocks, BLOCK_SIZE, HEADS["head_dim"])
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    q = jax.random.normal(kq, (batch, HEADS["num_heads"], HEADS["head_dim"]), dtype)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k_pages, v_pages, [jnp.asarray(t, jnp.int32) for t in tables.astype(np.int32)], lens


def decode_shapes(batch: int, context: int, rotations: int) -> dict:
    """Abstract operands of decode_impls' programs at one shape, by kv kind: what
    decode_inputs makes, as shapes (for compiling ahead of the inputs)."""
    pages = context // BLOCK_SIZE
    page = jax.ShapeDtypeStruct((HEADS["num_kv_heads"], rotations * batch * pages + 1,
                                 BLOCK_SIZE, HEADS["head_dim"]), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((batch, HEADS["num_heads"], HEADS["head_dim"]), jnp.bfloat16)
    rest = (jax.ShapeDtypeStruct((batch, pages), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
    return {"stacked": (q, jax.ShapeDtypeStruct((2, *page.shape), page.dtype), *rest),
            "pair": (q, (page, page), *rest)}


def precompile(jobs: dict, workers: int) -> dict:
    """{key: compiled program, or the exception its compile raised} for jobs {key: (jitted fn,
    abstract args)}, compiled `workers` at a time. XLA compiles outside the GIL: on the GPU
    host's cores the section's compiles overlap instead of queueing in front of each
    measurement (a device lease is minutes long). Nothing is timed while this runs."""
    from concurrent.futures import ThreadPoolExecutor

    def build(fn, args):
        try:
            return fn.trace(*args).lower().compile()
        except Exception as e:  # reported on the program's row
            return e
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = {key: pool.submit(build, fn, args) for key, (fn, args) in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def kv_bytes(batch, context) -> int:
    """K and V bytes a decode step must read: 2 x B x context x K x H x 2 (bf16)."""
    return 2 * batch * context * HEADS["num_kv_heads"] * HEADS["head_dim"] * 2


def rotations_for(batch, context) -> int:
    return int(np.clip(-(-ROTATE_BYTES // kv_bytes(batch, context)), 1, 64))


def decode_impls(batch: int, context: int, *, interpret: bool) -> dict:
    """{name: (jitted fn of (q, kv, tables, lens), kv kind)}: the reference, ours and JAX's
    shipped op at one shape. kv is the stacked cache [2, K, NB, S, H] ("stacked") or a
    (K pages, V pages) pair ("pair", JAX's op). Every operand is an argument (a closed-over
    array would be baked into the program); benchmarks/gpu_xla_compile.py compiles these."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_op
    scale = HEADS["head_dim"] ** -0.5
    return {
        "reference (XLA)": (jax.jit(lambda q, c, t, l: paged_decode_attention_reference(
            q, c, l, t, jnp.int32(batch), scale=scale)), "stacked"),
        "pagedjax gpu kernel": (jax.jit(lambda q, c, t, l: paged_decode_attention_gpu(
            q, c, l, t, jnp.int32(batch), scale=scale, interpret=interpret)), "stacked"),
        # JAX's op takes no scale: q is scaled inside the timed program (B x N x H elements).
        "jax pallas.ops.gpu.paged_attention": (jax.jit(
            lambda q, kv, t, l: jax_gpu_op.paged_attention(
                q * jnp.asarray(scale, q.dtype), kv[0], kv[1], t, l, interpret=interpret,
                k_splits=min(16, context // BLOCK_SIZE))), "pair"),
    } | ({
        "pagedjax mosaic_gpu kernel": (jax.jit(
            lambda q, c, t, l: paged_decode_attention_mosaic_gpu(
                q, c, l, t, jnp.int32(batch), scale=scale, interpret=interpret)), "stacked"),
    } if MOSAIC else {})


# (pages_per_step, num_warps, num_stages); the first is the default at block 16 / bf16 / head
# dim 128 (benchmarks/results/gpu_compile.md has what each costs in registers and shared memory).
TUNING = [(8, 8, 2), (8, 4, 2), (4, 8, 2), (4, 4, 3), (8, 8, 3), (2, 4, 4)]


# The Mosaic GPU decode kernel's (pages_per_step, num_stages), one warpgroup a program; the first
# is its default (128 keys, 2 stages: 195 KiB of shared memory); 1 stage fetches nothing ahead
# (what the pipeline is worth). 256 keys x 1 stage fits but spills ~3 KB (the rehearsal).
TUNING_MOSAIC = [(8, 2), (4, 2), (4, 3), (8, 1)]


TUNING_SHAPES = [(128, 4096), (8, 32768)]  # (batch, context)


def tuning_configs(batch: int, context: int) -> tuple[list[tuple], int]:
    """[(kernel, pages_per_step, num_warps, num_stages, num_splits or None for auto)]: the
    Triton kernel's ("triton"), then where jax has it the Mosaic GPU kernel's ("mosaic", no
    warps); and the auto number of splits (gpu.common.choose_num_splits) at this shape."""
    from pagedjax.pallas_kernels.gpu.common import choose_num_splits
    auto = choose_num_splits(batch * HEADS["num_kv_heads"], context // BLOCK_SIZE, 8)
    configs = [("triton", p, w, s, None) for p, w, s in TUNING] + [
        ("triton", 8, 8, 2, splits) for splits in (auto // 2, auto * 2) if splits >= 1]
    if MOSAIC:
        configs += [("mosaic", p, None, s, None) for p, s in TUNING_MOSAIC] + [
            ("mosaic", 8, None, 2, splits) for splits in (auto // 2, auto * 2) if splits >= 1]
    return configs, auto


def tuning_fn(batch: int, kernel: str, pages: int, warps: int | None, stages: int,
              splits: int | None, *, interpret: bool):
    """A decode kernel with these launch parameters, jitted, of (q, cache, tables, lens)."""
    scale = HEADS["head_dim"] ** -0.5
    if kernel == "mosaic":
        return jax.jit(lambda q, c, t, l: paged_decode_attention_mosaic_gpu(
            q, c, l, t, jnp.int32(batch), scale=scale, pages_per_step=pages,
            num_stages=stages, num_splits=splits, interpret=interpret))
    return jax.jit(lambda q, c, t, l: paged_decode_attention_gpu(
        q, c, l, t, jnp.int32(batch), scale=scale, pages_per_step=pages, num_warps=warps,
        num_stages=stages, num_splits=splits, interpret=interpret))
