"""Backend 'mosaic_gpu': paged attention and the KV write with Pallas' Mosaic GPU lowering (TMA +
WGMMA), for Hopper GPUs and newer with jax >= 0.11."""

from pagedjax.pallas_kernels.gpu.mosaic.attend import fit_pipeline, shared_memory_bytes
from pagedjax.pallas_kernels.gpu.mosaic.common import DTYPES, ROWS, check_config, problem
from pagedjax.pallas_kernels.gpu.mosaic.decode import paged_decode_attention_mosaic_gpu
from pagedjax.pallas_kernels.gpu.mosaic.prefill import ragged_paged_attention_mosaic_gpu
from pagedjax.pallas_kernels.gpu.mosaic.write import write_kv_mosaic_gpu

__all__ = ["DTYPES", "ROWS", "check_config", "fit_pipeline", "paged_decode_attention_mosaic_gpu",
           "problem", "ragged_paged_attention_mosaic_gpu", "shared_memory_bytes",
           "write_kv_mosaic_gpu"]
