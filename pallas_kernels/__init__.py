"""Paged attention: the pure-jnp reference, the KV-cache layout and backend dispatch.

Pallas kernels for GPU and TPU register themselves in `attention.BACKENDS` beside the reference.
"""

from pallas_kernels.attention import (BACKENDS, AttentionMetadata, Backend, paged_attention,
                                      resolve_backend)
from pallas_kernels.layout import (init_kv_cache, kv_cache_bytes_per_block, kv_cache_shape,
                                   write_kv_reference)
from pallas_kernels.reference import (paged_decode_attention_reference,
                                      ragged_paged_attention_reference)

__all__ = [
    "BACKENDS", "AttentionMetadata", "Backend", "paged_attention", "resolve_backend",
    "init_kv_cache", "kv_cache_bytes_per_block", "kv_cache_shape", "write_kv_reference",
    "paged_decode_attention_reference", "ragged_paged_attention_reference",
]
