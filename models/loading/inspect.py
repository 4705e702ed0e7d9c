"""What `pagedjax inspect` reports of a model directory or a GGUF file without loading it: its
architecture, attention type, KV cache bytes a token and a block in an attention backend's
layout, the weights' bytes as served, and whether (or why not) this engine serves it."""

from __future__ import annotations

import collections
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.layers.quantized import quantize_model
from pagedjax.models.loading import mxfp4_checkpoint
from pagedjax.models.loading.compressed_tensors import quantized_abstract
from pagedjax.models.loading.gguf import _reader, checked_gguf, config_from_gguf, is_gguf, metadata
from pagedjax.models.loading.hf import (UnsupportedModelError, architecture_of, checkpoint_dtype,
                                        compressed_scheme, mxfp4_experts, read_hf_config, read_json)
from pagedjax.models.loading.quantized_loading import weight_report
from pagedjax.models.registry import model_class


def inspect_model_dir(model_dir: str, kv_dtype: str = "bfloat16", block_size: int = 16,
                      attention_backend: str = "reference",
                      quantization: str | None = None) -> dict[str, Any]:
    """What `pagedjax inspect` prints: architecture, attention type, KV bytes (in the cache
    layout of attention_backend: the GPU pads the head dim, the TPU a quantized cache's scale
    rows), the weights' bytes as served (quantized by quantization, a scheme of
    pagedjax.models.quantization.schemes), support. A `.gguf` file is inspected from its metadata
    (pagedjax.models.loading.gguf), its weights as its blocks are served."""
    _check_inspect_args(kv_dtype, block_size, attention_backend)
    if is_gguf(model_dir):
        if quantization is not None:
            raise ValueError(f"{model_dir}: a GGUF file is served as its own blocks; "
                             f"quantization must be unset, got {quantization!r}")
        return inspect_gguf(model_dir, kv_dtype, block_size, attention_backend)
    raw = read_json(os.path.join(model_dir, "config.json"))
    report: dict[str, Any] = {"architecture": architecture_of(raw),
                              "model_type": raw.get("model_type"),
                              "checkpoint_dtype": checkpoint_dtype(raw)}
    try:
        config = read_hf_config(model_dir)
    except UnsupportedModelError as e:
        heads = raw.get("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads and kv_heads:
            report["attention"] = attention_kind(heads, kv_heads)
        report.update(supported=False, reason=str(e))
        return report
    dtype = jnp.bfloat16 if report["checkpoint_dtype"] in ("bfloat16", "float16") \
        else jnp.float32
    abstract = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0),
                                                          dtype=dtype, param_dtype=dtype))
    compressed = compressed_scheme(model_dir)
    if compressed is not None:
        abstract = quantized_abstract(abstract, compressed)
    elif mxfp4_experts(model_dir) or quantization == "mxfp4":
        if not mxfp4_experts(model_dir):
            raise ValueError(f"quantization 'mxfp4' serves a checkpoint's MXFP4 experts; "
                             f"{model_dir} is not one")
        abstract = mxfp4_checkpoint.quantized_abstract(abstract)
    elif quantization is not None:
        abstract = quantize_model(abstract, quantization)
    return {**report, **config_report(config, kv_dtype, block_size, attention_backend),
            **weight_report(abstract)}


KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")


def _check_inspect_args(kv_dtype, block_size, attention_backend) -> None:
    from pagedjax.pallas_kernels import IMPLEMENTATIONS
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if attention_backend not in IMPLEMENTATIONS:
        raise ValueError(f"attention_backend must be one of {sorted(IMPLEMENTATIONS)}, "
                         f"got {attention_backend!r}")


def attention_kind(heads: int, kv_heads: int) -> str:
    return ("MHA" if kv_heads == heads else "MQA" if kv_heads == 1
            else f"GQA ({heads // kv_heads} query heads per KV head)")


def attention_description(config: LlamaConfig) -> str:
    if config.kv_lora_rank:
        return (f"MLA (latent attention: a latent of {config.kv_lora_rank} and a RoPE key of "
                f"{config.qk_rope_head_dim} a token, served as MQA over them)")
    return attention_kind(config.num_heads, config.num_kv_heads) + (
        ", attention sinks" if config.attention_sinks else "")


def config_report(config: LlamaConfig, kv_dtype: str, block_size: int,
                  attention_backend: str) -> dict[str, Any]:
    """The served shape of a supported config: heads, RoPE, parameters, KV bytes."""
    import ml_dtypes

    from pagedjax.pallas_kernels import kv_cache_bytes_per_block
    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8,
              "fp8": ml_dtypes.float8_e4m3fn}
    # int8 / fp8 add an f32 scale per token and KV head (on the TPU, per 128-lane row slot)
    per_block = kv_cache_bytes_per_block(config.num_attention_layers, block_size,
                                         config.num_kv_heads, config.kv_head_dim,
                                         dtypes[kv_dtype], attention_backend, config.kv_planes)
    from pagedjax.models.layers.kv_groups import kv_cache_groups
    groups = kv_cache_groups(config)
    group_block = kv_cache_bytes_per_block(groups.num_slots, block_size, config.num_kv_heads,
                                           config.kv_head_dim, dtypes[kv_dtype],
                                           attention_backend, config.kv_planes)
    return dict(
        kv_cache_groups=[{"window": w, "blocks": group_block} for w in groups.windows]
        if groups.hybrid else None, layers_a_group=groups.num_slots,
        supported=True, attention=attention_description(config),
        num_layers=config.num_layers, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        sliding_window=config.sliding_window,
        sliding_layers=sum(config.layer_window(i) is not None for i in range(config.num_layers))
        if config.sliding_window else None,
        rope=(config.rope_scaling.rope_type if config.rope_scaling else "default"),
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        num_params=config.num_params, kv_dtype=kv_dtype, attention_backend=attention_backend,
        kv_bytes_per_token=per_block // block_size, block_size=block_size,
        kv_bytes_per_block=per_block, eos_token_ids=list(config.eos_token_ids),
        **moe_report(config), **linear_report(config, dtypes[kv_dtype]))


def linear_report(config: LlamaConfig, dtype) -> dict[str, Any]:
    """A hybrid linear-attention model's fixed state (empty for others): its layers and the
    bytes one sequence's state takes over them, whatever its length (its KV bytes a token
    count the attention layers only)."""
    linear = config.num_layers - config.num_attention_layers
    if not linear:
        return {}
    return dict(linear_attention_layers=linear,
                state_bytes_per_sequence=config.state_bytes_per_sequence(
                    np.dtype(dtype).itemsize))


def moe_report(config: LlamaConfig) -> dict[str, Any]:
    """A mixture of experts' shape (empty for a dense model): experts, k, the sparse layers,
    and the parameters a token's forward reads."""
    if not config.num_experts:
        return {}
    return dict(num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                sparse_layers=config.num_sparse_layers,
                shared_expert=config.shared_expert_intermediate_size or None,
                num_active_params=config.num_active_params)


def inspect_gguf(path: str, kv_dtype: str, block_size: int, attention_backend: str) -> dict:
    """inspect_model_dir's report of a GGUF file, from its metadata and tensor
    headers (nothing dequantized)."""
    reader = _reader(path)
    meta = metadata(reader)
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    report = {"architecture": meta.get("general.architecture"), "model_type": "gguf",
              "checkpoint_dtype": ", ".join(f"{k} x{n}" for k, n in types.most_common())}
    try:
        abstract = checked_gguf(path, reader=reader, blocks=True)[0]
        config = config_from_gguf(meta, {t.name for t in reader.tensors}, path)
    except ValueError as e:
        return {**report, "supported": False, "reason": str(e)}
    return {**report, **config_report(config, kv_dtype, block_size, attention_backend),
            **weight_report(abstract)}
