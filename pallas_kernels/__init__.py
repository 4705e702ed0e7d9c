"""Paged attention: the pure-jnp reference, the KV-cache layout and backend dispatch.

Pallas kernels (GPU: Triton lowering, and a Mosaic GPU decode kernel; TPU: Mosaic) sit beside
the reference in `attention.IMPLEMENTATIONS`.
"""

from pallas_kernels.attention import (BACKEND_NAMES, IMPLEMENTATIONS, AttentionBackend,
                                      AttentionMetadata, Implementation, copy_blocks, for_layer,
                                      paged_attention, resolve_backend)
from pallas_kernels.gpu_decode import paged_decode_attention_gpu
from pallas_kernels.gpu_mosaic import (paged_decode_attention_mosaic_gpu,
                                       ragged_paged_attention_mosaic_gpu)
from pallas_kernels.gpu_prefill import ragged_paged_attention_gpu
from pallas_kernels.tpu_decode import paged_decode_attention_tpu
from pallas_kernels.tpu_prefill import ragged_paged_attention_tpu
from pallas_kernels.kv_write import write_kv_gpu, write_kv_tpu
from pallas_kernels.layout import (cache_head_dim, check_num_slots, gather_blocks, init_kv_cache, layer_blocks,
                                   scatter_blocks, kv_cache_bytes_per_block,
                                   kv_cache_shape, write_kv_reference)
from pallas_kernels.reference import (paged_decode_attention_reference,
                                      ragged_paged_attention_reference)

__all__ = [
    "BACKEND_NAMES", "IMPLEMENTATIONS", "AttentionBackend", "AttentionMetadata",
    "Implementation", "for_layer", "layer_blocks", "paged_attention", "resolve_backend", "paged_decode_attention_gpu",
    "ragged_paged_attention_gpu", "paged_decode_attention_mosaic_gpu",
    "ragged_paged_attention_mosaic_gpu", "paged_decode_attention_tpu", "ragged_paged_attention_tpu",
    "cache_head_dim", "check_num_slots", "copy_blocks", "gather_blocks", "scatter_blocks", "init_kv_cache", "kv_cache_bytes_per_block",
    "kv_cache_shape", "write_kv_reference", "write_kv_gpu", "write_kv_tpu",
    "paged_decode_attention_reference", "ragged_paged_attention_reference",
]
