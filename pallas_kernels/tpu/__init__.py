"""Backend 'tpu': paged attention, the KV write and block copies with Pallas' Mosaic (TPU)
lowering; pipeline.py holds the page pipeline both attention kernels run."""

from pagedjax.pallas_kernels.tpu.decode import paged_decode_attention_tpu
from pagedjax.pallas_kernels.tpu.prefill import ragged_paged_attention_tpu
from pagedjax.pallas_kernels.tpu.write import copy_blocks_tpu, write_kv_tpu

__all__ = ["copy_blocks_tpu", "paged_decode_attention_tpu", "ragged_paged_attention_tpu",
           "write_kv_tpu"]
