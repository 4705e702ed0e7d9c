"""Orbax checkpoints of a Flax model: the training-to-serving path.

A checkpoint directory holds `pagedjax_config.json` (the LlamaConfig and the parameter dtype) and
`params/`, the parameters as an Orbax StandardCheckpointer pytree. `load_checkpoint` builds the
model abstractly (no random init), restores every array with its shape and dtype checked against
the config, and only then merges: a mismatching checkpoint raises and leaves nothing half-built.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import LlamaForCausalLM
from pagedjax.models.loading.user_files import read_user_json

CONFIG_FILE = "pagedjax_config.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


def is_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, CONFIG_FILE))


def save_checkpoint(model: LlamaForCausalLM, directory: str,
                    metadata: dict[str, Any] | None = None) -> None:
    """Writes model's config and parameters under directory (created; must not hold a
    checkpoint already). metadata (JSON-serialisable) is stored beside the config."""
    import orbax.checkpoint as ocp

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"model must be a LlamaForCausalLM, got {type(model).__name__}")
    directory = os.path.abspath(directory)
    if os.path.exists(os.path.join(directory, PARAMS_DIR)):
        raise ValueError(f"{directory} already holds a checkpoint; choose a new directory")
    os.makedirs(directory, exist_ok=True)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    param_dtypes = {str(x.dtype) for x in jax.tree.leaves(state)}
    if len(param_dtypes) != 1:
        raise ValueError(f"parameters must share one dtype, got {sorted(param_dtypes)}")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, PARAMS_DIR), state)
    checkpointer.wait_until_finished()
    record = {"format_version": FORMAT_VERSION, "model_config": model.config.to_dict(),
              "param_dtype": param_dtypes.pop(), "metadata": metadata or {}}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)


def read_checkpoint_config(directory: str) -> tuple[LlamaConfig, dict[str, Any]]:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.lexists(path):
        raise ValueError(f"{directory} is not a pagedjax checkpoint: {CONFIG_FILE} missing")
    record = read_user_json(path, CONFIG_FILE)
    if record.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {record.get('format_version')!r} is not "
                         f"supported (expected {FORMAT_VERSION})")
    return LlamaConfig.from_dict(record["model_config"]), record


def checked_checkpoint(directory: str, dtype=jnp.float32, param_dtype=None):
    """(abstract model, the dtype the parameters were saved in, restore): restore(targets)
    restores {model path: jax.ShapeDtypeStruct, sharding included} (a path per parameter, as
    nnx.to_pure_dict's keys: ("layers", 0, "mlp", "up_proj", "kernel")) into {path: array},
    each array read into its sharding. Nothing is read before restore."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    config, record = read_checkpoint_config(directory)
    saved_dtype = jnp.dtype(record["param_dtype"])
    param_dtype = saved_dtype if param_dtype is None else jnp.dtype(param_dtype)
    from pagedjax.models.registry import model_class
    abstract = nnx.eval_shape(lambda: model_class(config)(
        config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    params_path = os.path.join(directory, PARAMS_DIR)
    if not os.path.isdir(params_path):
        raise ValueError(f"{directory}: parameter directory {PARAMS_DIR}/ is missing")

    def path_of(path):
        return tuple(getattr(k, "key", k) for k in path)

    def restore(targets: dict) -> dict:
        target = jax.tree_util.tree_map_with_path(lambda p, _: targets[path_of(p)], params)
        try:
            restored = ocp.StandardCheckpointer().restore(params_path, target)
        except Exception as e:  # orbax raises several types for a mismatch or bad files
            raise ValueError(f"{params_path}: cannot restore parameters for {config}: "
                             f"{e}") from e
        return {path_of(p): x for p, x in jax.tree_util.tree_leaves_with_path(restored)}

    return abstract, saved_dtype, restore


def load_checkpoint(directory: str, dtype=jnp.float32, param_dtype=None) -> LlamaForCausalLM:
    """The model saved by save_checkpoint, on jax.devices()[0]. dtype is the activation dtype;
    param_dtype defaults to the dtype the parameters were saved in. (pagedjax.models.loading.placed_weights
    reads it straight into an engine's shardings.)"""
    abstract, saved_dtype, restore = checked_checkpoint(directory, dtype, param_dtype)
    param_dtype = jax.tree.leaves(nnx.state(abstract.embed_tokens))[0].dtype
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {tuple(getattr(k, "key", k) for k in p): jax.ShapeDtypeStruct(
        x.shape, saved_dtype, sharding=device) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    flat = restore(targets)
    restored = jax.tree_util.tree_map_with_path(
        lambda p, _: jnp.asarray(flat[tuple(getattr(k, "key", k) for k in p)], param_dtype),
        params)
    param_state = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(param_state, restored)
    nnx.update(abstract, param_state)
    return abstract
