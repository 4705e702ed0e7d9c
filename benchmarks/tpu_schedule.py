"""What the TPU kernels cost a TensorCore, read from libtpu's compiled schedule (no TPU needed).

Each kernel is compiled ahead of time for a TPU topology (benchmarks/aot/xla_tpu.py) with
libtpu's LLO dumps on (`--xla_jf_dump_to`), and its final VLIW schedule is read back: a bundle
is one instruction word, issued at most one a cycle. The kernel's innermost loop (one compute
block of keys: C pages x S tokens of one sequence and KV head) is what decode attention spends
its time in, so its length in bundles, against the K/V bytes one iteration brings in, says
whether the loop can keep up with HBM:

    issue ceiling = bytes per iteration / loop bundles x clock

is the most bandwidth the kernel can draw if every bundle took one cycle and nothing stalled
(a static bound: DMA latency and stalls only lower it). Where it is under the chip's HBM
bandwidth the kernel is bound by issuing instructions, not by memory. The clock is derived
from the chip's published peak, not measured: v5e 197 TFLOP/s bf16 = 4 MXUs x 128 x 128 x
2 x 1.5 GHz, HBM 819 GB/s. `fixed bundles` are the rest of the kernel (one program: table-row
fetch, query load, first DMAs, normalisation, output), paid once per (sequence, KV head).

Beside ours, JAX's shipped `pallas.ops.tpu.paged_attention` at the same shape and compute block,
compiled in the same run. Timings need a TPU.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = [ROOT / "tests", *sorted({p.parent for p in (ROOT / "tests").glob("*/test_*.py")})]
sys.path[:0] = [str(ROOT), *map(str, TESTS), str(ROOT / "benchmarks")]  # the test rooms' modules

from common import write_results  # noqa: E402

from benchmarks.aot import xla_tpu  # noqa: E402

LIBTPU = pathlib.Path(os.environ.get("PAGEDJAX_LIBTPU", ROOT / ".venv" / "libtpu"))
TOPOLOGIES = {"v5e:2x2": dict(clock_ghz=1.5, hbm_gbs=819), "v6e:2x2": {}}
BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 16, 128, 32, 8
WIDTH = 4096 // BLOCK_SIZE  # pages of a 4k context
# A production-sized pool (1 GB a layer in bf16): a small one may be placed in VMEM by XLA
# (memory_space=ANY), and the kernel's page DMAs then never touch HBM.
NUM_BLOCKS = 16384
PAGES_PER_STEP = 8  # compute block: 8 pages x 16 tokens = 128 keys (the kernels' default)


def ours(kind, dtype):
    import jax.numpy as jnp
    from test_kernels_lowering import KERNELS, kernel_args
    decode, ragged, _ = KERNELS["tpu"]
    fn = decode if kind == "decode" else ragged
    pages = PAGES_PER_STEP
    dtype = jnp.bfloat16 if dtype == "bfloat16" else dtype
    return (functools.partial(fn, scale=HEAD_DIM ** -0.5, pages_per_step=pages),
            kernel_args(kind, "tpu", HEAD_DIM, dtype, width=WIDTH, seqs=8, tokens=256,
                        num_blocks=NUM_BLOCKS))


def jax_shipped(kind, dtype):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    del kind, dtype
    q = jax.ShapeDtypeStruct((8, NUM_HEADS, HEAD_DIM), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), jnp.bfloat16)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    return (functools.partial(paged_attention, pages_per_compute_block=PAGES_PER_STEP),
            (q, pages, pages, i32((8,)), i32((8, WIDTH))))


# name: (builder, kind, cache dtype, keys per loop iteration, bytes per key and KV head as the
# DMAs move them: int8 data and its share of the page's scale row, padded to 128 lanes)
CASES = {
    "pagedjax decode (bf16)": (ours, "decode", "bfloat16", PAGES_PER_STEP * BLOCK_SIZE,
                               2 * HEAD_DIM * 2),
    "pagedjax decode (int8 cache)": (ours, "decode", "int8", PAGES_PER_STEP * BLOCK_SIZE,
                                     2 * (HEAD_DIM + 4 * 128 // BLOCK_SIZE)),
    "pagedjax ragged (bf16, 16 tokens a tile)": (ours, "ragged", "bfloat16",
                                                 PAGES_PER_STEP * BLOCK_SIZE,
                                                 2 * HEAD_DIM * 2),
    "jax pallas.ops.tpu.paged_attention (bf16)": (jax_shipped, "decode", "bfloat16",
                                                  PAGES_PER_STEP * BLOCK_SIZE,
                                                  2 * HEAD_DIM * 2),
}


def build(name):
    """(fn, abstract args) of one case: what xla_tpu's child process compiles."""
    builder, kind, dtype, *_ = CASES[name]
    return builder(kind, dtype)


def parse_schedule(text: str) -> dict:
    """Total bundles and the innermost loop's length, from a final_bundles dump.

    Bundles are lines `  0x1a2 [LB:] >> { ... }`; a loop body starts at an `LB:` bundle, which
    opens a region, and runs to the bundle that closes that region (after the back branch)."""
    bundles = []  # (address, line)
    for line in text.splitlines():
        match = re.match(r"\s*0x([0-9a-f]+)\s", line)
        if match:
            bundles.append((int(match.group(1), 16), line))
    loops = []
    for i, (address, line) in enumerate(bundles):
        if " LB:" not in line:
            continue
        region = re.search(r"Start region (\d+)", line)
        end = next((a for a, later in bundles[i:]
                    if re.search(rf"End region {region.group(1)}\b", later)), None)
        if end is not None:
            loops.append((address, end))
    # The loop that computes attention: the innermost one holding the matmuls.
    def has_matmul(loop):  # and the next block's DMAs (the loop for a sequence's last
        # block computes without prefetching: attend_blocks)
        text = "".join(line for a, line in bundles if loop[0] <= a <= loop[1])
        return "vmatmul" in text and "dma.hbm_to_vmem" in text

    start, end = min(filter(has_matmul, loops), key=lambda loop: loop[1] - loop[0])
    # Ops only: a bounds check's comment names the DMA it guards.
    body = [re.sub(r"/\*.*?(\*/|$)", "", line) for a, line in bundles if start <= a <= end]
    return {"total": len(bundles), "loop": end - start + 1,
            "fixed": len(bundles) - (end - start + 1),
            "dmas_in_loop": sum(len(re.findall(r"= dma\.hbm_to_vmem", line)) for line in body),
            # DMAs issued once the block's matmuls have begun: overlapped with its vector work
            "dmas_beside_compute": sum(
                len(re.findall(r"= dma\.hbm_to_vmem", line))
                for line in body[next((i for i, line in enumerate(body)
                                       if re.search(r"= vmat(push|mul)", line)), len(body)):]),
            "matmuls_in_loop": sum(len(re.findall(r"= vmatmul", line)) for line in body),
            "bounds_checks_in_loop": sum(line.count("shalt.err") for line in body)}


def kernel_schedule(dump: pathlib.Path) -> dict:
    """The schedule of the Pallas kernel (the tpu_custom_call) among a compile's dumps."""
    for analysis in dump.glob("*schedule-analysis_final_bundles.txt"):
        # The kernel's own program, not the top-level one (TLP) that calls it.
        if "-TLP-" not in analysis.name and "tpu_custom_call" in analysis.read_text():
            prefix = re.sub(r"-\d+-schedule-analysis_final_bundles\.txt$", "", analysis.name)
            bundles, = dump.glob(f"{glob.escape(prefix)}-*-final_bundles.txt")
            return parse_schedule(bundles.read_text())
    raise RuntimeError(f"no Pallas kernel schedule among the dumps in {dump}")


def compile_case(name: str, topology: str, workdir: pathlib.Path) -> dict:
    dump = workdir / re.sub(r"\W+", "_", f"{topology}_{name}")
    lines, stderr = xla_tpu.run_in_child(
        [{"name": name, "module": "tpu_schedule", "function": "build"}],
        dump.with_suffix(".json"), libtpu=LIBTPU, topology=topology,
        pythonpath=[ROOT / "benchmarks", *TESTS, ROOT], cwd=ROOT,
        env={"LIBTPU_INIT_ARGS": f"--xla_jf_dump_to={dump}"})
    if not lines or not lines[0]["ok"]:
        raise RuntimeError(lines[0].get("error") if lines else stderr[-2000:])
    return {"device": lines[0]["device_kind"], **kernel_schedule(dump)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--topologies", nargs="*", default=list(TOPOLOGIES))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for topology in args.topologies:
            chip = TOPOLOGIES[topology]
            for name in args.cases:
                _, kind, dtype, keys, bytes_per_key = CASES[name]
                try:
                    sched = compile_case(name, topology, pathlib.Path(tmp))
                except Exception as e:  # a failed build is a row too
                    rows.append({"topology": topology, "kernel": name,
                                 "error": str(e).splitlines()[0][:200]})
                    print(rows[-1], flush=True)
                    continue
                loop_bytes = keys * bytes_per_key
                row = {"topology": topology, "device": sched["device"], "kernel": name,
                       "keys_per_iteration": keys, "loop_bundles": sched["loop"],
                       "dmas_in_loop": sched["dmas_in_loop"],
                       "dmas_beside_compute": sched["dmas_beside_compute"],
                       "matmuls_in_loop": sched["matmuls_in_loop"],
                       "bounds_checks_in_loop": sched["bounds_checks_in_loop"],
                       "fixed_bundles": sched["fixed"],
                       "kv_bytes_per_bundle": loop_bytes / sched["loop"]}
                if chip:
                    ceiling = loop_bytes / sched["loop"] * chip["clock_ghz"]
                    row.update(issue_ceiling_gbs=ceiling,
                               ceiling_vs_hbm=ceiling / chip["hbm_gbs"])
                rows.append(row)
                print(row, flush=True)
    if args.no_write:
        return
    params = {"shape": f"q bf16[8, {NUM_HEADS}, {HEAD_DIM}], {NUM_KV_HEADS} KV heads, block "
                       f"{BLOCK_SIZE}, table width {WIDTH} pages (4k context), decode compute "
                       f"block {PAGES_PER_STEP} pages, ragged tiles of 16 tokens",
              "libtpu": libtpu_version()}
    write_results("tpu_schedule", "TPU kernels compiled ahead of time (no TPU): static schedule",
                  rows, params, notes=__doc__.split("\n\n", 1)[1] + FINDINGS)


def libtpu_version() -> str:
    for meta in LIBTPU.glob("libtpu*.dist-info"):
        return meta.name.removesuffix(".dist-info")
    return "unknown"


FINDINGS = """
What this schedule changed in the kernels (2026-12-01, v5e, innermost loop in bundles per
iteration: decode bf16 / decode int8 / ragged bf16; JAX's shipped op 631 throughout):

- Start: 375 / 737 / 476. Each page DMA was preceded by two bounds checks (source in HBM,
  destination in VMEM), each a serial chain of scalar compares ending in `shalt.err`: two
  thirds of the decode loop. Compiled kernels now turn them off (tpu.pipeline.compiler_params;
  interpret mode still raises on any out-of-bounds read): 150 / 316 / 350.
- K and V were widened to f32 and multiplied in f32 (32 unpacks and 32 MXU pushes a block in
  decode). The dots now take the cache's 16-bit type with f32 accumulation, as the GPU kernels
  do (f32 caches follow jax.default_matmul_precision), and V is zeroed past the sequence only
  in the last block (and, with a sliding window, the first), since a select on bf16 tiles cost
  more than the f32 cast it replaced: 134 / 353 / 338.
- One DMA a page now carries K and V together (the cache's leading K/V axis, strided), and a
  slot is waited on once: 126 / 310 / 319. The decode loop's issue ceiling is then 95% of
  v5e's HBM bandwidth, from 32%.
- The block-table row is fetched once a sequence (KV-head grid axis sequential), not once a
  (sequence, KV head): one HBM round trip, not in these bundle counts, per sequence instead of
  eight at 8 KV heads.

- Each program starts the next KV head's first compute block once its own loop is done
  (PagePipeline.prefetch_next_head; same sequence, same pages), so only a sequence's first
  program waits for a cold DMA: 46 more fixed bundles, not counted against the loop.
- Compute blocks are 128 keys in both kernels (tpu.pipeline.default_pages_per_step; the
  ragged kernel took 4 pages of 16): per query row x key its loop takes 21.6 bundles per
  thousand instead of 38.9 (16 tokens a tile; 256 keys: 16.0, 32 tokens and 128 keys: 17.0).
  Decode at 256 keys issues for 136% of HBM but fetches up to 255 keys of a sequence's last
  block for nothing, so 128 stays.

Tried and reverted: fetching only the pages that hold keys (a branch per page, and a wait
per page in a sequence's last block) to save the DMA traffic of a last block's empty pages:
the decode loop went from 125 to 176 bundles.

Then (2026-12-01, later): 125 / 310 / 354 -> 91 / 163 / 344.

- The int8 loop took its compute block page by page (scales read as [1, S] rows, 16 small
  matmuls a block). Mosaic cannot reshape the [C, S] scale buffer into a row, but it joins the
  pages' [1, S] rows along lanes (jnp.concatenate), and 8-bit pages widened through f32 (whose
  tiles hold whole pages) join into one [C*S, H] tile for free: one chunk of 128 keys, two
  matmuls, as in bf16: 310 -> 205.
- The next block's DMAs were issued under a branch (`block + 1 < num_blocks`) and before the
  wait, so the loop was the DMA issue (scalar) followed by the compute (vector), never both at
  once. attend_blocks already splits off a sequence's last block, so the steady-state loop
  now prefetches unconditionally, and does so after loading the current slot's tiles (the
  scheduler keeps DMA starts after loads of the same buffer, and the compute after the loads
  touches no memory): every page DMA is now issued beside the block's matmuls
  (`dmas_beside_compute`), decode bf16 125 -> 91 (issue ceiling 96% -> 132% of HBM), int8
  205 -> 163. `fixed_bundles` grew: the last block's loop is a copy of the body.

Then (2026-12-01, a later session): 91 / 163 / 344 -> 85 / 156 / 344.

- Each iteration opened with eight serial scalar bundles: the buffer slot was
  `(block - first_block) % 2`, and a signed remainder lowers to a chain that fixes up negative
  operands. The operand is never negative; its low bit (`bitwise_and(..., 1)`) is one op. The
  ragged loop, bound by its matmuls, hid the chain and is unchanged.
- What the int8 loop spends its bundles on (op counts in the loop): address arithmetic for its
  16 DMAs (about 11 scalar ops a DMA, two scalar slots a bundle: some 90 bundles' worth), then
  widening K and V (32 unpacks, 32 int-to-float converts, 16 packs to bf16) and joining the
  pages' scale rows (16 single-row loads, 14 lane rotations, 7 selects). Widening int8 straight
  to bf16 (a bf16 tile holds a 16-row page, so the join would stay free) was tried: 176.

Not changed: the int8 loop still issues 16 DMAs a block (each page's scale row is its own DMA:
a row at a lane offset inside a 128-lane row is no DMA source for Mosaic, which wants the
offset a multiple of 128 elements), and per key it is 1.8x the bf16 loop; the ragged loop
multiplies 128 query rows a tile and is meant to be compute-heavy. The int8 row's bytes count
each page's scale row as the TPU layout stores it, padded to 128 lanes (layout.scale_lanes: with
16-wide rows XLA laid the scales out transposed and the step copied them whole, 12 copies of a
layer's pool a step; tests/kernels/test_kernels_tpu_compile.py now checks for none).
"""

if __name__ == "__main__":
    main()
