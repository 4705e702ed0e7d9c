"""Backend 'gpu': paged attention and the KV write with Pallas' Triton lowering."""

from pagedjax.pallas_kernels.gpu.triton.decode import paged_decode_attention_gpu
from pagedjax.pallas_kernels.gpu.triton.prefill import choose_tile_q, ragged_paged_attention_gpu
from pagedjax.pallas_kernels.gpu.triton.tiling import (check_config, fit_pipeline,
                                                       shared_memory_bytes)
from pagedjax.pallas_kernels.gpu.triton.write import write_kv_gpu

__all__ = ["check_config", "choose_tile_q", "fit_pipeline", "paged_decode_attention_gpu",
           "ragged_paged_attention_gpu", "shared_memory_bytes", "write_kv_gpu"]
