"""New values written into the weights an engine serves, in place (update_weights, issue 52).

The served weights are the serving form's leaves (pagedjax.models.paged_forward: layers stacked on
[L], KV heads repeated under tensor parallelism). An update is, per served leaf, a list of
`Part`s: an index into the leaf (() for all of it, (layer,) for one layer of a stack, (layer,
expert) for one expert's weight) and the value there, in the model's layout (a Linear's kernel
[in, out], the KV heads not repeated) or, `transpose`, in Hugging Face's ([out, in]).

`write_parts` writes each leaf's parts with one compiled program that takes the old leaf
donated: XLA writes the new values into the old leaf's buffers, so the engine never holds two
copies of a leaf (nor allocates fresh memory: on a CPU, writing into memory already touched is
about three times as fast as into new pages). A part is first moved onto the devices of the
slice it lands in (`jax.device_put`: device to device, a no-op when it is there already), cast
to the leaf's dtype, transposed and its KV heads repeated inside the program. The programs are
cached by the parts' places, shapes and the leaf's sharding: an engine's first update compiles
one small program per kind of leaf, later updates none; the step programs never recompile (the
leaves keep their shapes, dtypes and shardings).

A leaf the engine borrowed from the model it was built from (the same buffers: a device_put onto
the device they were on) is never donated: the caller's model keeps its arrays; the program
writes that leaf anew, and from then on the engine owns it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models.paged_forward import repeat_kv_columns


@dataclasses.dataclass(frozen=True)
class Part:
    """A value for leaf[index]: in the model's layout, or (transpose) Hugging Face's."""

    index: tuple[int, ...]
    value: Any  # a jax.Array on any devices, or a NumPy array
    transpose: bool = False


def buffer_pointers(leaf) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards}


def borrowed_leaves(params, model_leaves) -> frozenset[int]:
    """The positions (in params' flattened order) of the leaves sharing buffers with
    model_leaves (the arrays of the model an engine was built from)."""
    theirs = set()
    for leaf in model_leaves:
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            theirs |= buffer_pointers(leaf)
    return frozenset(i for i, leaf in enumerate(jax.tree.leaves(params))
                     if buffer_pointers(leaf) & theirs)


def part_shape(spec, part: Part, kv_repeats: int) -> tuple[int, ...]:
    """The shape a part must have to land at part.index of a leaf of spec's shape (kv_repeats:
    how many times its KV heads' columns are repeated there)."""
    shape = list(spec.shape[len(part.index):])
    shape[-1] //= kv_repeats
    if part.transpose:
        shape[-2:] = shape[-2:][::-1]
    return tuple(shape)


def check_part(name: str, spec, part: Part, kv_repeats: int) -> None:
    """ValueError naming the weight when a part's shape or dtype family does not fit (a float
    value fits a float leaf whatever its width: cast; a quantized leaf's data takes its own
    dtype only)."""
    value = part.value
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"weights: {name} must be an array, got {type(value).__name__}")
    expected = part_shape(spec, part, kv_repeats)
    floats = jnp.issubdtype(spec.dtype, jnp.floating)
    same_kind = (jnp.issubdtype(value.dtype, jnp.floating) if floats
                 else value.dtype == spec.dtype)
    if tuple(value.shape) != expected or not same_kind:
        kind = "a float dtype" if floats else str(spec.dtype)
        raise ValueError(f"weights: {name} is {value.dtype}{list(value.shape)}, the engine "
                         f"takes {kind} {list(expected)} there")


def _part_sharding(sharding, ndim: int, part: Part, kv_repeats: int):
    """Where a part goes before it is written: the devices and split of the slice it lands in
    (its KV columns whole when they are repeated there; HF's transposed axes swapped)."""
    if not hasattr(sharding, "spec"):
        return sharding
    spec = list(tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec)))[len(part.index):]
    if kv_repeats > 1:
        spec[-1] = None
    if part.transpose:
        spec[-2:] = spec[-2:][::-1]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


# How a leaf is written: into its old buffers (the engine's own leaf, donated), over a copy of
# it (a leaf the caller's model shares), or anew (asleep: the parts cover all of it).
WRITE_MODES = ("donate", "copy", "fresh")


@functools.lru_cache(maxsize=512)
def _writer(places: tuple, kv: tuple[int, int], spec: tuple, sharding, mode: str):
    """The program writing parts at places (each part's index) into a leaf of spec
    ((shape, dtype)) as mode says; kv: (the model's KV heads, the repeats). On a CPU the writes
    move the bits as unsigned integers of the dtype's width (XLA's CPU backend copies bfloat16
    element by element: 0.7 GB/s against 8 GB/s for the same bytes as uint16); elsewhere as
    they are (libtpu makes a whole-leaf temporary of the bitcasts:
    benchmarks/results/weight_update_tpu.md)."""
    shape, dtype = spec
    on_cpu = all(device.platform == "cpu" for device in sharding.device_set)
    bits = jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}") if on_cpu else dtype

    def as_bits(x):
        return jax.lax.bitcast_convert_type(x, bits) if x.dtype != bits else x

    def write(old, *values):
        leaf = as_bits(jnp.zeros(shape, dtype) if mode == "fresh" else old)
        for index, value in zip(places, values):
            leaf = leaf.at[index].set(repeat_kv_columns(as_bits(value.astype(dtype)), *kv))
        return jax.lax.bitcast_convert_type(leaf, dtype) if leaf.dtype != dtype else leaf

    return jax.jit(write, donate_argnums=(0,) if mode == "donate" else (),
                   out_shardings=sharding)


_transposed = jax.jit(lambda value: jnp.swapaxes(value, -1, -2))


def write_program(spec, parts: list[Part], kv: tuple[int, int], mode: str):
    """(the compiled-on-first-call program writing parts into a leaf of spec as mode says,
    the sharding each part is moved to first): write_leaf's, and what an ahead-of-time compile
    for a TPU topology measures (benchmarks/weight_update_tpu.py)."""
    shardings = [_part_sharding(spec.sharding, len(spec.shape), p, kv[1]) for p in parts]
    places = tuple(p.index for p in parts)  # HF's layout transposed before (write_leaf)
    program = _writer(places, kv, (spec.shape, jnp.dtype(spec.dtype)), spec.sharding, mode)
    return program, shardings


def write_leaf(old, spec, parts: list[Part], kv: tuple[int, int], mode: str) -> jax.Array:
    """spec's leaf with parts written into old (the leaf now; None when mode is fresh)."""
    program, shardings = write_program(spec, parts, kv, mode)
    moved = [jax.device_put(np.asarray(p.value) if not isinstance(p.value, jax.Array)
                            else p.value, sharding) for p, sharding in zip(parts, shardings)]
    # HF's [out, in] transposed by a program of its own: XLA's CPU backend transposes a
    # bfloat16 [8192, 2048] in 17 ms alone, in 140 ms fused into the write
    moved = [_transposed(value) if p.transpose else value for p, value in zip(parts, moved)]
    return program(old, *moved)


def write_parts(runner, parts: dict[int, list[Part]], kv_repeats: dict[int, int],
                num_kv_heads: int) -> None:
    """runner.params with parts (leaf position -> its parts) written, leaf by leaf (the engine's
    own leaves donated). runner.params may be its specs (asleep: every leaf must be covered
    whole). A write that fails part way (device memory) leaves the weights mixed: RuntimeError,
    and another update must follow."""
    served, treedef = jax.tree_util.tree_flatten(runner.params)
    specs = jax.tree.leaves(runner.weight_specs)
    runner.set_params(None)
    done, total = 0, len(parts)
    try:
        for position, leaf_parts in parts.items():
            old = served[position]
            mode = ("fresh" if not isinstance(old, jax.Array) else
                    "copy" if position in runner.borrowed else "donate")
            kv = (num_kv_heads, kv_repeats.get(position, 1))
            served[position] = write_leaf(None if mode == "fresh" else old, specs[position],
                                          leaf_parts, kv, mode)
            served[position].block_until_ready()
            del old
            done += 1
    except Exception as error:  # noqa: BLE001 - re-raised, the weights named as mixed
        raise RuntimeError(f"update_weights failed after {done} of {total} leaves "
                           f"({type(error).__name__}: {error}); the engine's weights are mixed "
                           f"until an update succeeds") from error
    finally:
        runner.set_params(jax.tree_util.tree_unflatten(treedef, served),
                          borrowed=runner.borrowed - set(parts))
