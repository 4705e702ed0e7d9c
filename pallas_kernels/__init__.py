"""Paged attention: the pure-jnp reference, the KV-cache layout and backend dispatch.

Pallas kernels sit beside the reference in `dispatch.IMPLEMENTATIONS`, one subpackage per
backend: gpu/triton (Triton lowering), gpu/mosaic (Mosaic GPU, Hopper), tpu (Mosaic TPU).
"""

from pagedjax.pallas_kernels.dispatch import (BACKEND_NAMES, IMPLEMENTATIONS, AttentionBackend,
                                              AttentionMetadata, Implementation, check_backend,
                                              copy_blocks, for_layer, paged_attention,
                                              resolve_backend)
from pagedjax.pallas_kernels.gpu.mosaic import (paged_decode_attention_mosaic_gpu,
                                                ragged_paged_attention_mosaic_gpu)
from pagedjax.pallas_kernels.gpu.triton import (paged_decode_attention_gpu,
                                                ragged_paged_attention_gpu, write_kv_gpu)
from pagedjax.pallas_kernels.layout import (cache_head_dim, check_num_slots, gather_blocks,
                                            init_kv_cache, kv_cache_bytes_per_block, kv_cache_shape,
                                            layer_blocks, scatter_blocks, write_kv_reference)
from pagedjax.pallas_kernels.reference import (paged_decode_attention_reference,
                                               ragged_paged_attention_reference)
from pagedjax.pallas_kernels.tpu import (paged_decode_attention_tpu, ragged_paged_attention_tpu,
                                         write_kv_tpu)

__all__ = [
    "BACKEND_NAMES", "IMPLEMENTATIONS", "AttentionBackend", "AttentionMetadata",
    "Implementation", "check_backend", "for_layer", "layer_blocks", "paged_attention",
    "resolve_backend", "paged_decode_attention_gpu", "ragged_paged_attention_gpu",
    "paged_decode_attention_mosaic_gpu", "ragged_paged_attention_mosaic_gpu",
    "paged_decode_attention_tpu", "ragged_paged_attention_tpu", "cache_head_dim",
    "check_num_slots", "copy_blocks", "gather_blocks", "scatter_blocks", "init_kv_cache",
    "kv_cache_bytes_per_block", "kv_cache_shape", "write_kv_reference", "write_kv_gpu",
    "write_kv_tpu", "paged_decode_attention_reference", "ragged_paged_attention_reference",
]
