"""New weights for a running engine (LLMEngine.update_weights, issue 52): a model of the engine's
own family and config (what a JAX trainer built on pagedjax.models holds) or its nnx.State, made
into the engine's serving form (quantized as the engine's were, layers stacked, KV heads
repeated for tensor parallelism), checked leaf by leaf against the weights the engine serves
(the same structure, each leaf's shape and dtype, named by its path; on the abstract form,
nothing computed) before anything changes; then, once the engine let go of its old weights, made
for real and moved into the served leaves' shardings, device to device (a stack of layers made
here becomes the engine's as it is): the engine never holds two copies of its weights. The
compiled step programs read the same shapes, dtypes and shardings: nothing recompiles.

A checkpoint path is the frontend's to read (pagedjax.frontend.llm.LLM.update_weights loads it
with the loaders an LLM is built with, then hands the model here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from pagedjax.engine.weight_writer import Part, check_part
from pagedjax.models.loading.placed_weights import (at_layer, is_kv, kv_columns, layers_of,
                                                    leaf_names)
from pagedjax.models.loading.quantized_loading import for_serving as quantized_for_serving
from pagedjax.models.registry import init_model


def _path_name(path) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def model_of(weights: Any, config, dtype) -> nnx.Module:
    """The model `weights` stands for: a model (checked against config, the engine's model
    config), or an nnx.State of one filled into an abstract model of config computing in
    dtype (the engine's)."""
    if isinstance(weights, nnx.State):
        model = nnx.eval_shape(lambda: init_model(config, dtype=dtype))
        try:
            nnx.update(model, weights)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"weights: the nnx.State does not fit the engine's model "
                             f"({type(error).__name__}: {str(error)[:300]})") from None
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
            raise ValueError("weights: the nnx.State misses some of the model's parameters "
                             "(give a whole state; a partial update names what it changes)")
        return model
    if not isinstance(weights, nnx.Module) or not hasattr(weights, "config"):
        raise ValueError(f"weights must be a model of the engine's family, its nnx.State or "
                         f"(LLM.update_weights) a checkpoint path, got {type(weights).__name__}")
    if weights.config != config:
        differ = [f.name for f in dataclasses.fields(config)
                  if getattr(weights.config, f.name, None) != getattr(config, f.name)]
        raise ValueError(f"weights: a model of another config than the engine's (differs in "
                         f"{', '.join(differ[:6]) or type(weights.config).__name__})")
    return weights


def prepared(model, quantization: str | None, quantize_lm_head: bool):
    """model as the engine serves it: quantized by the engine's scheme (a new, smaller copy),
    or itself."""
    if quantization is None:  # (a quantized model's parts do not fit a float engine's leaves)
        return model
    return quantized_for_serving(model, quantization, quantize_lm_head)


def check_checkpoint(lazy, runner) -> None:
    """ValueError naming the first leaf of a checkpoint's serving form (lazy: a LazyModel,
    prepared; nothing read) whose shape or dtype differs from the weights the runner serves."""
    from pagedjax.models.paged_forward import serving_form

    graph, params = serving_form(lazy.abstract, *runner.serving_args)
    if graph != runner.graph:
        raise ValueError(f"weights: {lazy.source} has another serving graph than the engine's "
                         f"(another model, quantization or layer layout)")
    served = dict(jax.tree_util.tree_leaves_with_path(runner.weight_specs))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        spec = served.get(path)
        if spec is None or leaf.shape != spec.shape or leaf.dtype != spec.dtype:
            have = "nothing" if spec is None else f"{spec.dtype}{list(spec.shape)}"
            raise ValueError(f"weights: {_path_name(path)} of {lazy.source} is "
                             f"{leaf.dtype}{list(leaf.shape)}, the engine serves {have}")


def served_sources(runner, config) -> list[tuple[tuple, list[tuple[tuple, tuple]], int]]:
    """For each served leaf (in the flattened order): its model-level path of layer 0 (with
    "{layer}"), the (index into the leaf, the model-level path) of each layer it holds, and
    how many times its KV heads' columns are repeated (1: not a k/v projection, or not
    repeated)."""
    sources = []
    for path, spec in jax.tree_util.tree_leaves_with_path(runner.weight_specs):
        field, model_path = leaf_names(path)
        layers, stacked = layers_of(path, config.num_layers, spec)
        if field != "layers":
            places: list[tuple[tuple[int, ...], Any]] = [((), model_path)]
        else:
            places = [((i,) if stacked else (), at_layer(model_path, layer))
                      for i, layer in enumerate(layers)]
        columns = kv_columns(config, spec.shape[-1]) if is_kv(model_path, config) else None
        repeats = 1 if columns is None else len(columns) // (config.num_kv_heads
                                                              * config.head_dim)
        sources.append((model_path, places, repeats))
    return sources


def model_parts(model, runner, config) -> tuple[dict[int, list[Part]], dict[int, int]]:
    """A prepared model's arrays as the parts of every served leaf (pagedjax.engine.weight_writer),
    and the leaves' KV repeats; checked (ValueError naming the first weight missing, or whose
    shape or dtype family does not fit) before anything changes."""
    arrays = {path: variable.get_value()
              for path, variable in nnx.to_flat_state(nnx.state(model))}
    specs = jax.tree.leaves(runner.weight_specs)
    parts, repeats = {}, {}
    for position, (_, places, kv_repeats) in enumerate(sources_of(runner, config)):
        leaf_parts = []
        for index, path in places:
            if path not in arrays:
                raise ValueError(f"weights: {_path_name(path)} is missing (the engine serves "
                                 f"it; another quantization or layer layout?)")
            part = Part(index, arrays[path])
            check_part(_path_name(path), specs[position], part, kv_repeats)
            leaf_parts.append(part)
        parts[position], repeats[position] = leaf_parts, kv_repeats
    return parts, repeats


def sources_of(runner, config):
    """served_sources, kept on the runner (its weights' layout never changes)."""
    return runner.cached_layout("sources", lambda: served_sources(runner, config))
