"""The chip table (scheduler/chips.py) against the kernels' own sizing rule, and its lookups."""

import pytest

from pagedjax.pallas_kernels.gpu.common import shared_memory_limit
from pagedjax.scheduler.chips import CHIPS, GPU_CHIPS, gpu_chip


def test_gpu_chips_agree_with_the_kernels_shared_memory_rule():
    """The kernels size their tiles by compute capability (any GPU JAX runs on); the table's
    per-chip opt-in limit, which the compile-only targets use, must be the same figure."""
    assert set(GPU_CHIPS) == {"h200", "h100", "a100-80gb", "l4"}
    for chip in GPU_CHIPS.values():
        assert shared_memory_limit(chip.gpu.capability) == chip.gpu.shared_per_block, chip.name
        assert chip.gpu.shared_per_block < chip.gpu.shared_per_sm


def test_every_chip_has_the_roofline_figures():
    for chip in CHIPS.values():
        assert chip.hbm_bytes_per_s > 0 and chip.flops_per_s > 0 and chip.link_bytes_per_s > 0


def test_gpu_chip_refuses_a_tpu_by_name():
    assert gpu_chip("h200") is CHIPS["h200"]
    with pytest.raises(ValueError, match="chip must be one of .*got 'tpu-v5e'"):
        gpu_chip("tpu-v5e")
