"""The KV pool an engine sizes before it serves: its KV cache groups (one block id is a page in
each layer slot of every group), the bytes of a block over the devices and on each, the number of
blocks (EngineConfig's num_blocks or memory budget, or gpu_memory_utilization measured on the
built runner), the step shapes, and the ModelRunner holding the weights and that pool."""

from __future__ import annotations

import dataclasses
import logging

from pagedjax.engine import memory_budget
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.runner import ModelRunner
from pagedjax.lora.slot_weights import SlotSpec
from pagedjax.models.layers.kv_groups import LINEAR, KVCacheGroups, kv_cache_groups
from pagedjax.pallas_kernels import check_num_slots, kv_cache_bytes_per_block
from pagedjax.pallas_kernels.layout import cache_head_dim
from pagedjax.pallas_kernels.state_pages import state_blocks
from pagedjax.parallel.sharding import kv_head_repeats
from pagedjax.scheduler import ShapeBuckets
from pagedjax.scheduler.kv_cache_groups import blocks_for
from pagedjax.scheduler.state_group import StateWindow

logger = logging.getLogger("pagedjax.engine")


@dataclasses.dataclass
class KVPool:
    kv_groups: KVCacheGroups
    layer_windows: tuple  # each layer's attention window (None: full), for step-time features
    bytes_per_block: int  # over all devices
    bytes_per_block_per_device: int  # each device holds 1/TP of every block (its KV heads)
    num_blocks: int
    buckets: ShapeBuckets
    runner: ModelRunner
    memory_budget: object = None  # how gpu_memory_utilization sized the pool, if it did


def size_kv_pool(model, config: EngineConfig, devices, backend) -> KVPool:
    """The pool of `model` served under config on devices (placement's) with backend's layout."""
    model_config, tp = model.config, config.tensor_parallel_size
    kv_groups = kv_cache_groups(model_config, not config.disable_hybrid_kv_cache_manager)
    num_slots = kv_groups.num_slots
    kv_heads = model_config.num_kv_heads * kv_head_repeats(model_config.num_kv_heads, tp)
    bytes_per_block = kv_cache_bytes_per_block(
        num_slots, config.block_size, kv_heads, model_config.kv_head_dim, config.kv_np_dtype,
        backend.name, model_config.kv_planes)
    kv_groups = sized_state_groups(kv_groups, model_config, config.block_size, kv_heads,
                                   backend.name)
    per_device = bytes_per_block // tp  # the pool's budget is a device's
    num_blocks = config.resolve_num_blocks(
        per_device, blocks_for(kv_groups.windows, config.block_size, config.max_model_len,
                               config.max_num_batched_tokens))
    check_num_slots(num_slots, num_blocks, config.block_size)
    buckets = config.buckets(kv_groups.windows)
    lora_spec = SlotSpec.for_model(
        model_config, config.max_loras, config.max_lora_rank, config.np_dtype,
        kv_head_repeats(model_config.num_kv_heads, tp)) if config.enable_lora else None
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size,
                         dtype=config.kv_np_dtype, backend=backend,
                         num_top_logprobs=config.max_logprobs, scan_layers=config.scan_layers,
                         device=devices[0], kv_groups=kv_groups, lora_spec=lora_spec,
                         with_logits=config.runner != "pooling",  # pooling samples nothing
                         logprobs_mode=config.logprobs_mode)
    budget = None
    if config.gpu_memory_utilization is not None:
        budget = memory_budget.measure(runner, config, buckets, per_device)
        num_blocks = budget.num_blocks
        check_num_slots(num_slots, num_blocks, config.block_size)
        runner.resize_kv_cache(num_blocks)
    windows = tuple(model_config.layer_window(i) for i in range(model_config.num_layers))
    return KVPool(kv_groups, windows, bytes_per_block, per_device, num_blocks, buckets, runner,
                  budget)


def sized_state_groups(kv_groups: KVCacheGroups, model_config, block_size: int, kv_heads: int,
                       backend: str = "reference") -> KVCacheGroups:
    """kv_groups with each linear-attention group's window (LINEAR) the scheduler's
    StateWindow: the blocks of a page of kv_heads heads that one sequence's state of a layer
    takes (pallas_kernels.state_pages)."""
    if LINEAR not in kv_groups.windows:
        return kv_groups
    page = 2 * kv_heads * block_size * cache_head_dim(model_config.head_dim, backend)
    window = StateWindow(state_blocks(model_config.linear_state_values(), page))
    return dataclasses.replace(kv_groups, windows=tuple(
        window if w == LINEAR else w for w in kv_groups.windows))


def check_linear_attention(model_config, config: EngineConfig) -> EngineConfig:
    """A model with linear-attention layers (Qwen3.5, Qwen3-Next) served as its state group can
    be: the features that cannot hold a state are refused by name, and prefix caching is
    turned off (a state block is no function of one block's tokens: scheduler.state_group),
    said in the log. Returns the config to serve with."""
    if model_config.num_attention_layers == model_config.num_layers:
        return config
    name = f"{model_config.model_type} (linear-attention layers)"
    refused = {"kv_cache_dtype": config.kv_cache_dtype != "auto",
               "speculative_config": config.speculative_config is not None,
               "enable_lora": config.enable_lora,
               "async_scheduling": config.async_scheduling}
    why = {"kv_cache_dtype": "their state is kept in the cache's dtype, unquantized",
           "speculative_config": "a rejected draft would stay in the recurrent state",
           "enable_lora": "adapters of their projections are not served yet",
           "async_scheduling": "a fork's state copy would land a step after its parent "
                               "moved on"}
    for field, bad in refused.items():
        if bad:
            raise ValueError(f"{field}={getattr(config, field)!r} is not supported for "
                             f"{name}: {why[field]}")
    if config.enable_prefix_caching:
        logger.warning("prefix caching is off for %s: their state blocks hold the state "
                       "after a sequence's latest token, not a block's", name)
        config = dataclasses.replace(config, enable_prefix_caching=False)
    return config
