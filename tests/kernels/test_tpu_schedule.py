"""benchmarks/tpu_schedule.py reads libtpu's compiled schedule of the TPU decode kernel back.

Structure, not speed: the compiled decode loop issues one DMA a page (K and V together), each
beside the block's matmuls rather than before them, two matmuls a block, and no bounds-check
halts (they took two thirds of the loop). A parser that lost the loop, or a kernel change
that brought the checks, per-K/V DMAs or DMAs issued ahead of the compute back, fails here.
"""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tpu_schedule  # noqa: E402


def test_decode_loop_schedule(tmp_path):
    if not (tpu_schedule.LIBTPU / "libtpu").is_dir():
        pytest.fail(f"libtpu is not installed in {tpu_schedule.LIBTPU}: `make test` installs it")
    sched = tpu_schedule.compile_case("pagedjax decode (bf16)", "v5e:2x2", tmp_path)
    assert sched["device"] == "TPU v5 lite"
    assert sched["dmas_in_loop"] == tpu_schedule.PAGES_PER_STEP
    # The next block's DMAs are issued beside this block's matmuls, not before them.
    assert sched["dmas_beside_compute"] == sched["dmas_in_loop"]
    assert sched["matmuls_in_loop"] == 2
    assert sched["bounds_checks_in_loop"] == 0
    assert 0 < sched["loop"] < sched["total"]


def test_parser_finds_the_matmul_loop():
    text = "\n".join([
        "  0x0   :  { %1 = smov 0 }",
        "  0x1 LB: > { %2 = sadd.s32 1, %1 } /* Start region 7 */",
        "  0x2 LB: >> { %3 = vld [vmem:[%s1]] } /* Start region 9 */",
        "  0x3   : >> { %4 = vmatmul.f32 %3 ;; %5 = dma.hbm_to_vmem [thread:$0] }",
        "  0x4   : >> { %6 = shalt.err (!%p1) /* BoundsCheck for %5 = dma.hbm_to_vmem",
        "hlo: kernel",
        " */ }",
        "  0x5   : > { %7 = sbr.rel target = $region9 } /* End region 9 */",
        "  0x6   : > { %8 = sbr.rel target = $region7 } /* End region 7 */",
    ])
    assert tpu_schedule.parse_schedule(text) == {
        "total": 7, "loop": 4, "fixed": 3, "dmas_in_loop": 1, "dmas_beside_compute": 1,
        "matmuls_in_loop": 1, "bounds_checks_in_loop": 1}
