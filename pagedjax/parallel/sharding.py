"""Tensor parallelism on one jax.sharding.Mesh: which axis of each tensor is split over "tp".

Megatron-style, over the serving form of the weights (pagedjax.models.paged_forward, layers stacked or not):
- q/k/v and gate/up projections column-parallel (their output features split: each device
  holds N/TP query heads, K/TP KV heads, F/TP of the MLP), o and down row-parallel (their input
  features split; XLA all-reduces their partial sums, two all-reduces a layer);
- the LM head split over the vocabulary (the sampler's sort sees them gathered), the token
  embedding and the norms replicated: a gather from a vocab-split table would need a masked
  lookup and an all-reduce a step for what is, at 8B, 4% of the weights;
- the KV cache split over KV heads, so attention (the Pallas kernels or the reference) runs per
  device on its heads under shard_map with the block tables and lengths replicated. With more
  devices than KV heads (Llama-3-8B's 8 on a 16-chip slice) each KV head is repeated TP / K
  times (k/v projections and the cache), vLLM's rule: every device holds the head its query
  heads read.
One BatchPlan drives every device: the scheduler does not change.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pagedjax.models import LlamaConfig

AXIS = "tp"
DATA_AXIS = "dp"
# output features split; a Gated DeltaNet's projections too (models/layers/gated_deltanet.py:
# its heads' q, k, v, z, b and a; in_proj_qkv's columns cut q|k|v unevenly, so its output is
# redistributed by heads before the per-device core; Qwen3-Next's fused ones group by key head)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z",
          "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "gate_up_proj",
          # latent attention's per-head up-projections (models/layers/mla.py): the query's
          # from its bottleneck, the latent's to each head's key and value; the bottleneck and
          # the latent's own projection (q_a_proj, kv_a_proj_with_mqa) replicated
          "q_b_proj", "kv_b_proj")
# a layer's [.., N] attention sinks split with the query heads; gpt-oss's expert biases
# (models/layers/moe.InterleavedExperts): gate_up's [.., E, 2F] with its columns (or experts),
# down's [.., E, D] replicated (added once, after the experts' all-reduce)
HEAD_VECTORS = ("sinks",)
ROW = ("o_proj", "down_proj", "out_proj")  # input features split


def check_tensor_parallel(config: LlamaConfig, tensor_parallel_size: int,
                          check_devices: bool = True, data_parallel_size: int = 1) -> None:
    """Raises ValueError naming the limit when the model (or, check_devices, this machine)
    cannot split tp ways, data_parallel_size replicas of it."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if dp < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {dp}")
    devices = len(jax.devices()) if check_devices else tp * dp
    if tp * dp > devices:
        raise ValueError(f"tensor_parallel_size ({tp}) x data_parallel_size ({dp}) = {tp * dp} "
                         f"exceeds the {devices} devices JAX sees")
    if tp == 1:
        return
    sizes = [("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)]
    if config.num_experts:  # each expert's MLP splits like a dense one (unless expert parallel)
        sizes.append(("expert MLP size (moe_intermediate_size)",
                      config.expert_intermediate_size))
        if config.shared_expert_intermediate_size:
            sizes.append(("shared_expert_intermediate_size",
                          config.shared_expert_intermediate_size))
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {name} "
                             f"({value})")
    if config.num_attention_layers < config.num_layers:  # linear attention: heads a device
        sizes = [("linear_num_key_heads", config.linear_num_key_heads),
                 ("linear_num_value_heads", config.linear_num_value_heads)]
        for name, value in sizes:
            if value % tp:
                raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's {name} "
                                 f"({value})")
    k = config.num_kv_heads
    if k % tp and tp % k:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's num_kv_heads "
                         f"({k}) or be a multiple of it")


def kv_head_repeats(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head the cache holds: TP / K past K devices, else 1."""
    return max(1, tensor_parallel_size // num_kv_heads)


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A "tp" mesh over the first tensor_parallel_size of devices (default: jax.devices())."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def make_data_parallel_mesh(data_parallel_size: int, tensor_parallel_size: int,
                            devices=None) -> Mesh:
    """A ("dp", "tp") mesh: row r is replica r's tensor-parallel group (disjoint devices)."""
    devices = jax.devices() if devices is None else list(devices)
    count = data_parallel_size * tensor_parallel_size
    if count > len(devices):
        raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) x data_parallel_size "
                         f"({data_parallel_size}) = {count} exceeds the {len(devices)} devices")
    grid = np.array(devices[:count]).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, (DATA_AXIS, AXIS))


def weight_spec(path: tuple, leaf, vocab_size: int, tp: int,
                expert_parallel: bool = False) -> P:
    """The PartitionSpec of one weight, from its path in the serving form's pytree; a mixture's
    stacked experts [.., E, in, out] split on E under expert parallelism, else as the MLP's
    projections (each expert's F)."""
    names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
    ndim = len(leaf.shape)
    parameter = names[-1] if names[-1] != "value" else names[-2]
    if parameter in HEAD_VECTORS:
        return P(*([None] * (ndim - 1)), AXIS)
    if parameter == "down_proj_bias":
        return P()
    if parameter == "gate_up_proj_bias":
        return P(*([None] * (ndim - 2)), AXIS, None) if expert_parallel else P(
            *([None] * (ndim - 1)), AXIS)
    if expert_parallel and "experts" in names:
        return P(*([None] * (ndim - 3)), AXIS, None, None)
    module = next((n for n in reversed(names)
                   if n.endswith("_proj") or n.startswith("in_proj_") or n == "lm_head"), None)
    if module in COLUMN or (module == "lm_head" and vocab_size % tp == 0):
        return P(*([None] * (ndim - 1)), AXIS)  # kernel [.., D, out], bias, scale [.., G, out]
    if module in ROW and parameter in ("scale", "zero"):  # a quantized kernel's [.., G, out]
        return _row_groups(names, leaf.shape, tp)
    # a Linear's kernel, or a mixture's stacked experts (models/layers/moe.py: [.., E, in, out])
    if module in ROW and (parameter == "kernel" or "experts" in names):
        return P(*([None] * (ndim - 2)), AXIS, None)  # kernel [.., in, D]
    return P()  # norms, embedding, row-parallel biases


def _row_groups(names: list[str], shape: tuple, tp: int) -> P:
    """A row-parallel quantized kernel's scales [.., G, out]: split with its rows by group
    (ValueError when G does not split tp ways), or replicated when per output channel."""
    groups = shape[-2]
    if groups == 1:
        return P()
    if groups % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the {groups} quantization "
                         f"groups of {'/'.join([n for n in names if n != 'value'][-3:-1])}'s "
                         f"rows")
    return P(*([None] * (len(shape) - 2)), AXIS, None)


def weight_sharding(mesh: Mesh, vocab_size: int, expert_parallel: bool = False):
    """(path, leaf) -> the NamedSharding weight_spec gives that serving-form weight."""
    tp = mesh.shape[AXIS]
    return lambda path, leaf: NamedSharding(
        mesh, weight_spec(path, leaf, vocab_size, tp, expert_parallel))


def shard_weights(weights, mesh: Mesh, vocab_size: int, expert_parallel: bool = False):
    """The weights placed on the mesh by weight_spec."""
    sharding = weight_sharding(mesh, vocab_size, expert_parallel)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.device_put(leaf, sharding(path, leaf)), weights)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """[2, K, L*NB, S, Hc] (and a quantized cache's scales [2, K, L*NB, Ss]): over K."""
    return NamedSharding(mesh, P(None, AXIS))


def weight_bytes_per_device(config: LlamaConfig, tensor_parallel_size: int,
                            itemsize: int, quantization: str | None = None,
                            quantize_lm_head: bool = False, expert_parallel: bool = False) -> int:
    """Bytes of weights one device holds under weight_spec (from the shapes: nothing built):
    float weights at itemsize, a quantized model's (EngineConfig.quantization) stored values
    and f32 scales at theirs."""
    from flax import nnx

    from pagedjax.models import serving_form
    from pagedjax.models.layers.quantized import quantize_model
    from pagedjax.models.registry import model_class

    tp = tensor_parallel_size
    model = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0)))
    if quantization == "mxfp4":  # a checkpoint's MXFP4 experts, the rest floats
        from pagedjax.models.loading.mxfp4_checkpoint import quantized_abstract
        model = quantized_abstract(model)
    elif quantization is not None:
        model = quantize_model(model, quantization, quantize_lm_head)
    _, weights = serving_form(model, kv_head_repeats=kv_head_repeats(config.num_kv_heads, tp))
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(weights):
        split = any(axis is not None for axis in weight_spec(path, leaf, config.vocab_size, tp,
                                                             expert_parallel))
        floating = np.issubdtype(leaf.dtype, np.floating) and leaf.dtype.itemsize == 4 and (
            str(getattr(path[-1], "key", path[-1])) not in ("scale", "zero"))
        size = itemsize if floating else leaf.dtype.itemsize
        total += int(np.prod(leaf.shape)) * size // (tp if split else 1)
    return total


def kv_bytes_per_block_per_device(config: LlamaConfig, block_size: int,
                                  tensor_parallel_size: int, dtype,
                                  backend: str = "reference", num_slots: int | None = None) -> int:
    """One block's bytes (all layers, or num_slots: a KV cache group's, pagedjax.models.layers.kv_groups) on
    one device: its share of the (repeated) KV heads."""
    from pagedjax.pallas_kernels import kv_cache_bytes_per_block

    tp = tensor_parallel_size
    heads = config.num_kv_heads * kv_head_repeats(config.num_kv_heads, tp)
    return kv_cache_bytes_per_block(num_slots or config.num_layers, block_size, heads,
                                    config.kv_head_dim, dtype, backend, config.kv_planes) // tp
