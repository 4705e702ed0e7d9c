"""Weights read straight into the engine's placement: no whole model on one device or twice in
one host's memory.

`lazy_hf_model(dir)` and `lazy_checkpoint(dir)` check a checkpoint against its config (every
name, shape and dtype) and return a LazyModel: the config and a shape-only model, nothing read.
The engine's runner asks it for the serving form of the weights (pagedjax.models.paged_forward: layers stacked
on [L], KV heads repeated for tensor parallelism past the model's) with a sharding for each
leaf, and each leaf is built where it lives:

- Hugging Face safetensors: `jax.make_array_from_callback`; each device's shard is read from the
  mapped file by `safe_open(...).get_slice` (only that shard's rows and columns, layer by
  layer), cast, transposed and put on its device; the host holds one shard at a time.
- Orbax: the per-layer arrays are restored with the shardings of their stacked leaves (orbax
  reads each device's part), then stacked on the devices leaf by leaf, each layer's arrays freed
  as they are stacked (a device peaks at its share of the model plus one stacked leaf). k/v
  projections repeated past the KV heads are restored whole on each device, then repeated.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import LlamaForCausalLM
from pagedjax.models.loading.lazy_model import LazyModel
from pagedjax.models.paged_forward import repeat_kv_columns

FIELDS = {"embed": "embed_tokens", "layers": "layers", "norm": "norm", "lm_head": "lm_head"}
Placement = Callable[[tuple, jax.ShapeDtypeStruct], jax.sharding.Sharding]


def leaf_names(path: tuple) -> tuple[str, tuple]:
    """(serving field, the model-level path of layer 0 with "{layer}" for the layer) of a
    serving-form leaf: ("layers", ("layers", "{layer}", "self_attn", "q_proj", "kernel"))."""
    keys = [getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if keys[-1] == "value":
        keys = keys[:-1]
    field = keys[0]
    if field == "layers":
        indexed = isinstance(keys[1], int) or _PERIODIC.match(str(keys[1]))
        rest = keys[2:] if indexed else keys[1:]
        return field, ("layers", "{layer}", *rest)
    return field, (FIELDS[field], *keys[1:])


# The serving form's keys of layers that differ (pagedjax.models.paged_forward.ServingGraph.period).
_PERIODIC = re.compile(r"^(?:every(\d+)_from(\d+)|layer(\d+))$")


def layers_of(path: tuple, num_layers: int, leaf) -> tuple[range, bool]:
    """(the layers a leaf holds, whether they are stacked on its first axis); none for the
    leaves outside the decoder layers."""
    keys = [getattr(k, "name", getattr(k, "idx", getattr(k, "key", None))) for k in path]
    if keys[0] != "layers":
        return range(0), False
    if len(keys) > 1 and isinstance(keys[1], int):  # unrolled: layers[i]
        return range(keys[1], keys[1] + 1), False
    periodic = _PERIODIC.match(str(keys[1])) if len(keys) > 1 else None
    if periodic and periodic.group(3) is not None:  # a layer after the whole periods
        layer = int(periodic.group(3))
        return range(layer, layer + 1), False
    if periodic:  # layers j, j + p, ... stacked
        period, first = int(periodic.group(1)), int(periodic.group(2))
        return range(first, first + period * leaf.shape[0], period), True
    return range(num_layers), True


def kv_columns(config: LlamaConfig, width: int) -> np.ndarray | None:
    """For a k/v projection `width` columns wide: the model's column each one copies (head j of
    the repeated projection is head j // repeats of the model's), or None when not repeated."""
    native = config.num_kv_heads * config.head_dim
    if width == native:
        return None
    repeats = width // native
    heads = np.arange(config.num_kv_heads * repeats) // repeats
    return (heads[:, None] * config.head_dim + np.arange(config.head_dim)).reshape(-1)


def is_kv(model_path: tuple, config: LlamaConfig) -> bool:
    """Whether a weight spans the KV heads' columns (repeated with them under TP)."""
    names = ("k_proj", "v_proj") + (("k_norm",) if config.qk_norm_whole else ())
    return any(name in names for name in model_path)


# ---- Hugging Face safetensors ----------------------------------------------------------------

def lazy_hf_model(model_dir: str, dtype: str = "float32") -> LazyModel:
    from pagedjax.models.loading.hf import checked_hf_weights, compressed_scheme, mxfp4_experts

    abstract, _, files = checked_hf_weights(model_dir, dtype)
    compressed = compressed_scheme(model_dir)
    mxfp4 = mxfp4_experts(model_dir)

    @contextlib.contextmanager
    def opened():
        from safetensors import safe_open

        from pagedjax.models.loading import compressed_tensors, mxfp4_checkpoint

        with contextlib.ExitStack() as stack:
            handles = {}

            def tensor(name):
                if files[name] not in handles:
                    handles[files[name]] = stack.enter_context(
                        safe_open(files[name], framework="numpy"))
                return handles[files[name]].get_slice(name)

            if compressed is not None:  # its quantized weights, as stored
                tensor.quantized_parts = lambda name_and_transpose: compressed_tensors.parts(
                    files, name_and_transpose[0])
            if mxfp4:  # its experts' blocks and scales, as stored
                tensor.quantized_parts = lambda name_and_transpose: mxfp4_checkpoint.parts(
                    files, name_and_transpose[0])
            yield tensor

    return lazy_from_tensors(abstract, opened, np.dtype(jnp.dtype(dtype)), model_dir)


def lazy_from_tensors(abstract: LlamaForCausalLM, opened, np_dtype, source: str) -> LazyModel:
    """A LazyModel reading HF-named tensors ([out, in] for a Linear, as HF stores them):
    opened() is a context manager yielding tensor(name), anything indexable by a tuple of
    slices (a safetensors slice; a numpy array)."""
    config = abstract.config

    def place(weights, placement: Placement, modules: dict | None = None,
              scheme: str | None = None):
        """modules, scheme: the quantized modules (pagedjax.models.loading.quantized_loading) and the scheme
        a float checkpoint's are quantized by as they are read; default: the abstract
        model's own (a GGUF file's blocks)."""
        from pagedjax.models.layers.quantized import QuantizedWeight
        from pagedjax.models.loading.names import hf_weight_name
        from pagedjax.models.loading.quantized_loading import (QUANTIZED_PARTS, QuantizedReader,
                                                               columns_of, quantized_modules)
        from pagedjax.models.registry import hf_renames

        renames = hf_renames(config)
        modules = quantized_modules(abstract) if modules is None else modules

        def name_of(model_path):
            return hf_weight_name(model_path, renames)

        with opened() as tensor:
            reader = QuantizedReader(getattr(tensor, "quantized_parts", None)
                                     or _quantizing(tensor, scheme, config.num_experts))

            def build(path, leaf):
                field, model_path = leaf_names(path)
                layers, stacked = layers_of(path, config.num_layers, leaf)
                columns = (kv_columns(config, leaf.shape[-1]) if is_kv(model_path, config)
                           else None)
                module = modules.get(model_path[:-1])
                quantized = module is not None and model_path[-1] in QUANTIZED_PARTS
                # the HF tensor: a Linear's weight (its kernel's name), or stacked experts'
                stored = (model_path if not quantized else model_path[:-1]
                          if type(module) is QuantizedWeight else
                          model_path[:-1] + ("kernel",))

                def one(name, index):
                    if quantized:
                        return columns_of(reader(name, model_path[-1]), columns)[index]
                    return _read(tensor, name, index, columns, np_dtype, config.num_experts)

                def read(index):
                    index = tuple(index)
                    if field != "layers":
                        return one(name_of(stored), index)
                    chosen = layers[index[0]] if stacked else layers
                    inner = index[1:] if stacked else index
                    parts = [one(name_of(at_layer(stored, layer)), inner) for layer in chosen]
                    return np.stack(parts) if stacked else parts[0]

                return jax.make_array_from_callback(leaf.shape, placement(path, leaf), read)

            return jax.tree_util.tree_map_with_path(build, weights)

    place.reads_quantized = True  # type: ignore[attr-defined]  # read by quantize_lazy
    return LazyModel(config, abstract, place, source)


def _quantizing(tensor, scheme: str | None, num_experts: int = 0):
    """read_parts of a float checkpoint's tensor (stacked experts': every expert's), read
    whole, quantized by scheme."""
    from pagedjax.models.quantization.schemes import quantize

    def read_parts(name_and_transpose):
        if scheme is None:
            raise ValueError(f"{name_and_transpose[0]}: a quantized module without a scheme")
        from pagedjax.models.loading.names import EXPERT
        whole = (slice(None),) * (3 if EXPERT in name_and_transpose[0] else 2)
        weight = _read(tensor, name_and_transpose, whole, None, np.float32, num_experts)
        data, scale = quantize(weight, scheme)
        return {"kernel": data, "scale": scale, "zero": None}

    return read_parts


def at_layer(model_path: tuple, layer: int) -> tuple:
    return tuple(layer if part == "{layer}" else part for part in model_path)


def file_slice(stored, index: tuple) -> np.ndarray:
    """The elements of a stored tensor (a safetensors slice) at index: the only read."""
    return np.asarray(stored[index])


def _read(tensor, name_and_transpose, index: tuple, columns, np_dtype,
          num_experts: int = 0) -> np.ndarray:
    """One shard of a weight in the serving layout ([in, out] for a Linear kernel), read from
    its HF tensor ([out, in]): only the shard's rows and columns (a column range spanning the
    repeated KV heads' originals, when repeated). A stacked experts' weight (pagedjax.models.loading.hf.EXPERT
    in its name) reads the shard's experts (index[0]) one tensor each."""
    from pagedjax.models.loading.names import EXPERT

    name, transpose = name_and_transpose
    if EXPERT in name:
        experts = range(num_experts)[index[0]]
        return np.stack([_read(tensor, (name.replace(EXPERT, str(e)), transpose), index[1:],
                               columns, np_dtype) for e in experts])
    last = index[-1]
    take = None
    if columns is not None:
        wanted = columns[last]
        lo, hi = int(wanted.min()), int(wanted.max()) + 1
        last, take = slice(lo, hi), wanted - lo
    index = index[:-1] + (last,)
    part = file_slice(tensor(name), tuple(reversed(index)) if transpose else index)
    if transpose:
        part = part.T
    if take is not None:
        part = part[..., take]
    return np.ascontiguousarray(part, dtype=np_dtype)


# ---- orbax checkpoints -----------------------------------------------------------------------

def lazy_checkpoint(directory: str, dtype=jnp.float32) -> LazyModel:
    from pagedjax.models.loading.checkpoint import checked_checkpoint

    abstract, saved_dtype, restore = checked_checkpoint(directory, dtype)
    config = abstract.config
    param_dtype = jax.tree.leaves(nnx.state(abstract.embed_tokens))[0].dtype

    def place(weights, placement: Placement):
        targets, plans = {}, []  # model path -> restore target; (path, leaf, how to build)
        for path, leaf in jax.tree_util.tree_leaves_with_path(weights):
            field, model_path = leaf_names(path)
            layers, stacked = layers_of(path, config.num_layers, leaf)
            sharding = placement(path, leaf)
            repeated = (is_kv(model_path, config)
                        and kv_columns(config, leaf.shape[-1]) is not None)
            per_layer = _drop_leading(sharding, leaf) if stacked else sharding
            if repeated:  # restored whole on each device, repeated there
                mesh = sharding.mesh  # type: ignore[attr-defined]  # a NamedSharding (sharded kv)
                per_layer = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            shape = leaf.shape[1:] if stacked else leaf.shape
            if repeated:
                shape = shape[:-1] + (config.num_kv_heads * config.head_dim,)
            names = ([at_layer(model_path, layer) for layer in layers] if field == "layers"
                     else [model_path])
            for name in names:
                targets[name] = jax.ShapeDtypeStruct(shape, saved_dtype, sharding=per_layer)
            plans.append((path, leaf, sharding, names, stacked, repeated))
        restored = restore(targets)
        built = {}
        for path, leaf, sharding, names, stacked, repeated in plans:
            parts = [restored.pop(name) for name in names]
            built[path] = _assemble(parts, leaf, stacked, repeated, config, param_dtype,
                                    sharding)
            del parts
        return jax.tree_util.tree_map_with_path(lambda path, _: built[path], weights)

    return LazyModel(config, abstract, place, directory)


def _drop_leading(sharding, leaf):
    """The sharding of one layer of a stacked leaf (its spec without the [L] entry)."""
    if not hasattr(sharding, "spec"):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))


def _assemble(parts, leaf, stacked: bool, repeated: bool, config: LlamaConfig, dtype,
              sharding):
    """A serving leaf from its restored per-layer arrays, built on its devices."""
    repeats = leaf.shape[-1] // (config.num_kv_heads * config.head_dim) if repeated else 1

    def build(*xs):
        xs = [repeat_kv_columns(x.astype(dtype), config.num_kv_heads, repeats) for x in xs]
        return jnp.stack(xs) if stacked else xs[0]

    return jax.jit(build, out_shardings=sharding)(*parts)
