"""The serving form of a Llama model: the same weights, with the decoder layers' stacked on a
leading [L] axis and run under `jax.lax.scan`, so a step program traces and compiles one layer
whatever the model's depth (a 30-layer model costs what a 4-layer one does to compile).

The KV cache is carried through the scan whole (every layer's blocks in one array, see
pallas_kernels.layout) and each layer writes its slots in place: no layer's pool is sliced out
or copied. `serving_form(model, scan_layers=False)` keeps the layers as a tuple and unrolls them,
the program LlamaForCausalLM.forward_paged traces; both load from the same model (any
checkpoint the loaders read), and tests/models/test_models_llama.py checks they agree.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.families.llama import LlamaForCausalLM, embed, project_logits
from pagedjax.models.layers.kv_groups import KVCacheGroups
from pagedjax.models.layers.lora import StepLoRA
from pagedjax.models.layers.quantized import quantize_like
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, for_layer


@dataclasses.dataclass(frozen=True)
class ServingGraph:
    """The static half (hashable: a jit static argument): each part's nnx graph."""

    embed: nnx.GraphDef
    layer: nnx.GraphDef  # the first decoder layer; every layer's when they share a structure
    norm: nnx.GraphDef
    lm_head: nnx.GraphDef | None  # None: tied to the embedding
    num_layers: int
    scan_layers: bool
    # Each layer's graph when they differ (Gemma's sliding and global layers: their windows and
    # RoPE bases are static): the layers then run unrolled.
    layers: tuple[nnx.GraphDef, ...] | None = None
    scale_embeddings: bool = False
    final_logit_softcapping: float | None = None
    # KV cache groups (pagedjax.models.layers.kv_groups): each layer's (group, cache slot), and the cache's
    # slots; None: one group, layer l in slot l.
    layer_groups: tuple[tuple[int, int], ...] | None = None
    kv_slots: int | None = None
    # Layers that differ, scanned: the pattern's period (Gemma 3: 6), the layers' weights
    # stacked by position in the period ("every{period}_from{j}": layers j, j + period, ...)
    # under one scan over the whole periods, the rest unrolled ("layer{l}").
    period: int | None = None

    @property
    def num_kv_slots(self) -> int:
        return self.num_layers if self.kv_slots is None else self.kv_slots


class ServingWeights(NamedTuple):
    """The arrays: a pytree to pass, donate-free, into every step."""

    embed: nnx.State
    # stacked (leaves [L, ...]), a tuple of L per-layer states, or (graph.period) a dict of
    # stacks by position in the period and of the unrolled rest
    layers: nnx.State | tuple | dict
    norm: nnx.State
    lm_head: nnx.State | None


# On the CPU, XLA copies each layer's weights out of the stacked arrays every scan iteration
# (the CPU's dot reads whole buffers; a dynamic slice of the stack is a new one), so a scanned
# step moves every weight twice more than an unrolled one. Below this many bytes a layer, the
# copy is small against a step's fixed per-op costs and scanning's shorter compile wins.
# benchmarks/scan_layers.py's decode steps, scanned over unrolled (2 cores): the embedded model
# (0.9 MiB a layer) 0.88-1.10x (within noise, runs differ), SmolLM2-135M's shapes (13.5 MiB)
# 1.02-1.17x, Qwen3-0.6B's layers (60 MiB, f32) 1.10-1.24x; embeddings.py's batch-1 embedding
# call 1.4x.
CPU_SCAN_MAX_LAYER_BYTES = 8 * 2**20


def scan_by_default(model: LlamaForCausalLM, platform: str, shards: int = 1) -> bool:
    """scan_layers' default (EngineConfig.scan_layers None): scanned, except on the CPU when a
    device's share of a layer's weights (the largest layer's bytes over the shards tensor
    parallelism splits it into) takes CPU_SCAN_MAX_LAYER_BYTES or more (works on an abstract
    model)."""
    if platform != "cpu":
        return True
    return max(layer_bytes(layer) for layer in model.layers) // shards < CPU_SCAN_MAX_LAYER_BYTES


def layer_bytes(layer) -> int:
    """The bytes of one layer's weights (arrays or their shapes)."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(nnx.state(layer)))


def serving_form(model: LlamaForCausalLM, scan_layers: bool = True,
                 kv_head_repeats: int = 1,
                 groups: KVCacheGroups | None = None) -> tuple[ServingGraph, ServingWeights]:
    """Splits a model into (static graph, weights); scan_layers stacks the layers' weights (a
    copy: the model's own arrays stay as they are, freed with the model). kv_head_repeats > 1
    repeats each KV head that many times in the k/v projections (tensor parallelism past the
    model's KV heads, pagedjax.parallel.sharding). groups (pagedjax.models.layers.kv_groups): the KV cache
    groups the layers read, when there are several. Works on an abstract model (nnx.eval_shape)
    too, stacking shapes."""
    embed_def, embed = nnx.split(model.embed_tokens)
    norm_def, norm = nnx.split(model.norm)
    head_def, head = (None, None) if model.lm_head is None else nnx.split(model.lm_head)
    splits = [nnx.split(layer) for layer in model.layers]
    layer_defs = tuple(graph for graph, _ in splits)
    states = tuple(state for _, state in splits)
    if kv_head_repeats > 1:
        layer_defs, states = _repeat_kv_heads(model, states, kv_head_repeats)
    uniform = all(graph == layer_defs[0] for graph in layer_defs)
    hybrid = groups is not None and groups.hybrid
    period = None
    if scan_layers and (not uniform or hybrid):
        period = _period(layer_defs)
        scan_layers = 2 * period <= len(layer_defs)  # else nothing repeats: unrolled
        period = period if scan_layers else None
    layers: nnx.State | tuple | dict
    if period is not None:
        layers = _periodic_stacks(states, period)
    else:
        layers = jax.tree.map(_stack, *states) if scan_layers else states
    config = model.config
    placed = groups if groups is not None and groups.hybrid else None
    graph = ServingGraph(
        embed_def, layer_defs[0], norm_def, head_def, len(states), scan_layers,
        layers=None if uniform else layer_defs, scale_embeddings=config.scale_embeddings,
        final_logit_softcapping=config.final_logit_softcapping,
        layer_groups=None if placed is None else tuple(zip(placed.layer_group,
                                                           placed.layer_slot)),
        kv_slots=None if placed is None else placed.num_slots, period=period)
    return graph, ServingWeights(embed, layers, norm, head)


def _repeat_kv_heads(model: LlamaForCausalLM, states: tuple, repeats: int):
    """(the graphs of the layers with K * repeats KV heads, the layers' states with each KV
    head's k/v projection columns repeated `repeats` times in place: head j of the result is
    head j // repeats of the model)."""
    config = model.config
    wide = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * repeats)
    param_dtype = model.norm.weight.get_value().dtype  # abstract too
    layer_defs = tuple(nnx.split(nnx.eval_shape(lambda i=i, layer=layer: quantize_like(
        layer, type(layer)(wide, i, rngs=nnx.Rngs(0), dtype=model.dtype,
                           param_dtype=param_dtype))))[0]
        for i, layer in enumerate(model.layers))

    def repeat(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[:-1] + (x.shape[-1] * repeats,), x.dtype)
        return repeat_kv_columns(x, config.num_kv_heads, repeats)

    def widen(state):
        if "self_attn" not in state:  # a linear-attention layer: no KV heads
            return state
        state = jax.tree.map(lambda x: x, state)  # a copy of the mapping to edit
        names = ("k_proj", "v_proj") + (("k_norm",) if config.qk_norm_whole else ())
        # (latent attention keeps one latent, no KV head's columns: each copy computes it)
        for name in (name for name in names if name in state["self_attn"]):  # OLMoE's k_norm spans the whole projection: repeated with it
            projection = state["self_attn"][name]
            for parameter in list(projection.keys()):  # kernel [D, K*H], bias [K*H]
                variable = projection[parameter]
                variable.set_value(repeat(variable.get_value()))
        return state

    return layer_defs, tuple(widen(state) for state in states)


def repeat_kv_columns(x: jax.Array, num_kv_heads: int, repeats: int) -> jax.Array:
    """[..., K * H] -> [..., K * repeats * H]: each KV head's columns `repeats` times in place."""
    if repeats == 1:
        return x
    shape = x.shape[:-1] + (num_kv_heads, x.shape[-1] // num_kv_heads)
    return jnp.repeat(x.reshape(shape), repeats, axis=-2).reshape(x.shape[:-1] + (-1,))


def _period(layer_defs: tuple) -> int:
    """The smallest p with every layer's graph that of layer i % p."""
    return next(p for p in range(1, len(layer_defs) + 1)
                if all(g == layer_defs[i % p] for i, g in enumerate(layer_defs)))


def _periodic_stacks(states: tuple, period: int) -> dict:
    """The layers' states by position in the period, stacked over the whole periods, and the
    layers after them one by one (ServingGraph.period)."""
    whole = len(states) // period * period
    stacks = {f"every{period}_from{j}": jax.tree.map(_stack, *states[j:whole:period])
              for j in range(period)}
    return {**stacks, **{f"layer{i}": states[i] for i in range(whole, len(states))}}


def _stack(*leaves):
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype)
    return jnp.stack(leaves)


def forward_paged(
    graph: ServingGraph, weights: ServingWeights,
    kv_cache: jax.Array,  # [2, K, L * NB, S, Hc]
    token_ids: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    metadata: AttentionMetadata,
    backend: AttentionBackend = AttentionBackend(),
    lora: StepLoRA | None = None,
) -> tuple[jax.Array, jax.Array]:  # ([T, D] pre-norm hidden, new cache)
    """LlamaForCausalLM.forward_paged on the serving form: scanned or unrolled by graph.
    lora: the engine's adapter slots and each token's (models/layers/lora.py), or None."""
    x = embed(nnx.merge(graph.embed, weights.embed), token_ids, graph.scale_embeddings)
    blocks_per_layer = kv_cache.shape[2] // graph.num_kv_slots
    block_size = kv_cache.shape[3]

    def run(x, kv_cache, layer_def, state, group, slot, index):
        """One layer (index: an int, or traced) reading its KV cache group at its slot."""
        return nnx.merge(layer_def, state).forward_paged(
            x, positions, kv_cache,
            for_layer(metadata, slot, blocks_per_layer, block_size, group), backend,
            None if lora is None else lora.layer(index))

    def layer_step(x, kv_cache, index, state):
        group, slot = (0, index) if graph.layer_groups is None else graph.layer_groups[index]
        layer_def = graph.layer if graph.layers is None else graph.layers[index]
        return run(x, kv_cache, layer_def, state, group, slot, index)

    if not graph.scan_layers:
        for index, state in enumerate(weights.layers):
            x, kv_cache = layer_step(x, kv_cache, index, state)
        return x, kv_cache
    if graph.period is not None:
        return _forward_periods(graph, weights, x, kv_cache, run, layer_step)

    def body(carry, xs):
        return layer_step(*carry, *xs), None

    layer_ids = jnp.arange(graph.num_layers, dtype=jnp.int32)
    (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (layer_ids, weights.layers))
    return x, kv_cache


def _forward_periods(graph: ServingGraph, weights: ServingWeights, x, kv_cache, run,
                     layer_step):
    """forward_paged's layers for graph.period: one scan over the whole periods, each step
    running the period's layers in order (their graphs, windows and RoPE static; their KV
    cache group and slot traced), then the remaining layers unrolled (layer_step)."""
    period, num_layers, layers = graph.period, graph.num_layers, weights.layers
    if period is None or not isinstance(layers, dict):
        raise ValueError("_forward_periods runs a graph with a period (stacks by position)")
    placement = jnp.asarray(graph.layer_groups or [(0, i) for i in range(num_layers)],
                            jnp.int32)  # [L, 2]: each layer's (group, slot)

    def body(carry, xs):
        x, kv_cache = carry
        period_index, states = xs
        for j in range(period):
            index = period_index * period + j
            group = 0 if graph.layer_groups is None else placement[index, 0]
            layer_def = graph.layer if graph.layers is None else graph.layers[j]
            x, kv_cache = run(x, kv_cache, layer_def, states[j], group, placement[index, 1],
                              index)
        return (x, kv_cache), None

    whole = num_layers // period
    stacks = tuple(layers[f"every{period}_from{j}"] for j in range(period))
    (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache),
                                    (jnp.arange(whole, dtype=jnp.int32), stacks))
    for index in range(whole * period, num_layers):
        x, kv_cache = layer_step(x, kv_cache, index, layers[f"layer{index}"])
    return x, kv_cache


def final_norm(graph: ServingGraph, weights: ServingWeights,
               hidden: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
    """The model's last norm: the final hidden states pooling models read (transformers'
    last_hidden_state)."""
    return nnx.merge(graph.norm, weights.norm)(hidden)


def logits(graph: ServingGraph, weights: ServingWeights,
           hidden: jax.Array) -> jax.Array:  # [..., D] -> f32[..., V]
    head = None if graph.lm_head is None else nnx.merge(graph.lm_head, weights.lm_head)
    return project_logits(nnx.merge(graph.norm, weights.norm),
                          nnx.merge(graph.embed, weights.embed), head, hidden,
                          graph.final_logit_softcapping)
