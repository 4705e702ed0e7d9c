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

from pagedjax.models.loading.quantized_loading import for_serving as quantized_for_serving
from pagedjax.models.paged_forward import serving_form
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
    return quantized_for_serving(model, quantization, quantize_lm_head)


def check_weights(model, runner) -> None:
    """ValueError naming the first leaf of a prepared model's serving form (abstract: nothing
    computed) whose path, shape or dtype differs from the weights the runner serves
    (runner.params, or their specs while they sleep)."""
    graph, params = serving_form(nnx.eval_shape(lambda m: m, model), *runner.serving_args)
    if graph != runner.graph:
        raise ValueError("weights: their serving graph differs from the engine's (another "
                         "quantization or layer layout)")
    new = dict(jax.tree_util.tree_leaves_with_path(params))
    old = dict(jax.tree_util.tree_leaves_with_path(runner.params))
    if new.keys() != old.keys():
        missing = sorted(_path_name(p) for p in old.keys() - new.keys())
        extra = sorted(_path_name(p) for p in new.keys() - old.keys())
        raise ValueError(f"weights: the served weights' names differ (missing: {missing[:4]}, "
                         f"unknown: {extra[:4]})")
    for path, leaf in new.items():
        served = old[path]
        if leaf.shape != served.shape or leaf.dtype != served.dtype:
            raise ValueError(f"weights: {_path_name(path)} is {leaf.dtype}{list(leaf.shape)}, "
                             f"the engine serves {served.dtype}{list(served.shape)}")


def serving_weights(model, runner) -> list:
    """A prepared model's weights in the runner's serving form (check_weights passed): its
    leaves, in the order of the served tree's, each with whether it is one of the model's arrays
    (a layer stack made here is not: it needs no copy of its own)."""
    _, params = serving_form(model, *runner.serving_args)
    callers = {id(leaf) for leaf in jax.tree.leaves(nnx.state(model))}
    return [(leaf, id(leaf) in callers) for leaf in jax.tree_util.tree_leaves(params)]


def place_into(runner, params: list, on_leaf=None) -> None:
    """runner.params replaced by params, leaf by leaf, each moved into the sharding of the leaf it
    replaces (the caller's arrays copied: they stay theirs, a trainer may donate them next);
    the engine drops each old leaf as its replacement lands (freed unless someone else, e.g. the
    model the engine was built from, still holds it). params: serving_weights' (leaf, the
    caller's) pairs, emptied as they are placed (a leaf made here is the engine's from then on:
    no second copy). on_leaf(index) after each (measurement). A
    placement that fails part way (device memory) leaves the weights mixed: RuntimeError, and
    another update must follow."""
    served, treedef = jax.tree_util.tree_flatten(runner.params)
    runner.params = None
    total, done = len(params), 0
    try:
        for done in range(total):
            (new, callers), params[done] = params[done], None
            leaf = jax.device_put(new, served[done].sharding, may_alias=False if callers else None)
            leaf.block_until_ready()
            served[done] = leaf
            del new
            if on_leaf is not None:
                on_leaf(done)
        done = total
    except Exception as error:  # noqa: BLE001 - re-raised, the weights named as mixed
        raise RuntimeError(f"update_weights failed after {done} of {total} leaves "
                           f"({type(error).__name__}: {error}); the engine's weights are mixed "
                           f"until an update succeeds") from error
    finally:
        runner.params = jax.tree_util.tree_unflatten(treedef, served)
