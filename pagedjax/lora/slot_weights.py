"""The LoRA adapters' device slots (issue 53): every adaptable projection's pairs for max_loras
slots, stacked over the layers, and the one program that writes an adapter into a slot.

Per projection: `a` [L, S, I, R] and `b` [L, S, R, O] in the served dtype (R = max_lora_rank;
scaling folded into b; under tensor parallelism b of k/v has its KV heads' columns repeated as the
served k/v kernels do). Writing slot s takes the slot arrays donated and sets [:, s] of each from
the adapter's host arrays (zeros for a projection it leaves alone): XLA writes in place, and the
slot is an argument, so loading, swapping or evicting adapters compiles nothing after the first
write (compiled ahead of time when the slots are made). Over a TP mesh the slots split as their
projections do (slot_shardings). The model reads them through models/layers/lora.py's StepLoRA.

Axis letters: L layers, S slots, I a projection's input, O its output, R max_lora_rank.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from pagedjax.lora.peft_adapter import LoRAAdapter, module_dims
from pagedjax.models.layers.lora import LORA_MODULES
from pagedjax.models.paged_forward import repeat_kv_columns
from pagedjax.parallel.sharding import AXIS, ROW

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """The slots' shapes: which projections (a mixture-of-experts model's MLPs are not
    adapted), their (I, O), layers, slots, rank, dtype and the KV heads' TP repeats."""

    modules: tuple[str, ...]
    dims: dict  # name -> (I, O) as the model computes it (k/v: repeated columns)
    num_layers: int
    max_loras: int
    max_rank: int
    dtype: np.dtype
    kv_repeats: int = 1
    num_kv_heads: int = 1

    @classmethod
    def for_model(cls, config, max_loras: int, max_rank: int, dtype,
                  kv_repeats: int = 1) -> "SlotSpec":
        moe = any(config.layer_is_moe(i) for i in range(config.num_layers))
        modules = ATTENTION if moe else tuple(LORA_MODULES)
        dims = {name: (i, o * (kv_repeats if name in ("k_proj", "v_proj") else 1))
                for name, (i, o) in module_dims(config).items() if name in modules}
        return cls(modules, dims, config.num_layers, max_loras, max_rank, np.dtype(dtype),
                   kv_repeats, config.num_kv_heads)

    def shapes(self) -> dict:
        """name -> (a shape, b shape)."""
        l, s, r = self.num_layers, self.max_loras, self.max_rank
        return {name: ((l, s, i, r), (l, s, r, o)) for name, (i, o) in self.dims.items()}

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a) + np.prod(b)) for a, b in self.shapes().values()) \
            * self.dtype.itemsize

    def host_arrays(self, adapter: LoRAAdapter) -> dict:
        """An adapter as one slot's arrays: name -> (a [L, I, R], b [L, R, O]) in dtype, its
        rank padded to R with zeros, scaling folded into b, zeros for what it leaves alone."""
        out = {}
        for name, (i, o) in self.dims.items():
            a = np.zeros((self.num_layers, i, self.max_rank), self.dtype)
            b = np.zeros((self.num_layers, self.max_rank, o), self.dtype)
            pair = adapter.pairs.get(name)
            if pair is not None:
                a[:, :, :adapter.rank] = pair[0]
                scaled = adapter.scaling * pair[1]
                if name in ("k_proj", "v_proj") and self.kv_repeats > 1:
                    scaled = np.asarray(repeat_kv_columns(scaled, self.num_kv_heads,
                                                          self.kv_repeats))
                b[:, :adapter.rank, :] = scaled
            out[name] = (a, b)
        return out


def slot_shardings(spec: SlotSpec, device=None, mesh=None) -> dict:
    """name -> (a's sharding, b's): on one device, or over the mesh's TP axis as the base
    projection splits: a column-parallel projection's b on O (a replicated), a row-parallel
    one's a on I (b replicated), so each device adapts the features it computes."""
    if mesh is None:
        one = SingleDeviceSharding(device)
        return {name: (one, one) for name in spec.modules}
    whole, split_in = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, None, AXIS, None))
    split_out = NamedSharding(mesh, P(None, None, None, AXIS))
    return {name: (split_in, whole) if name in ROW else (whole, split_out)
            for name in spec.modules}


def zero_slots(spec: SlotSpec, shardings: dict) -> dict:
    """The slots, all zero (no adapter adds anything), placed with shardings (slot_shardings)."""
    def zeros():
        return {name: (jnp.zeros(a, spec.dtype), jnp.zeros(b, spec.dtype))
                for name, (a, b) in spec.shapes().items()}

    return jax.jit(zeros, out_shardings=shardings)()


def _write(slots: dict, slot: jax.Array, arrays: dict) -> dict:
    return {name: (a.at[:, slot].set(arrays[name][0].astype(a.dtype)),
                   b.at[:, slot].set(arrays[name][1].astype(b.dtype)))
            for name, (a, b) in slots.items()}


def slot_writer(spec: SlotSpec, slots: dict) -> jax.stages.Compiled:
    """The compiled write of one slot: (slots donated, i32 slot, host arrays) -> slots."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), slots)
    arrays = {name: (jax.ShapeDtypeStruct(a[:1] + a[2:], spec.dtype),
                     jax.ShapeDtypeStruct(b[:1] + b[2:], spec.dtype))
              for name, (a, b) in spec.shapes().items()}
    shardings = jax.tree.map(lambda x: x.sharding, slots)
    return jax.jit(_write, donate_argnums=(0,), out_shardings=shardings).lower(
        abstract, jax.ShapeDtypeStruct((), jnp.int32), arrays).compile()


def device_slots(spec: SlotSpec | None, device=None, mesh=None) -> tuple:
    """(the zeroed slots, their abstract values, their compiled writer) on device or over
    mesh (slot_shardings); (None, None, None) for an engine without adapters."""
    if spec is None:
        return None, None, None
    slots = zero_slots(spec, slot_shardings(spec, device, mesh))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=a.sharding), slots)
    return slots, abstract, slot_writer(spec, slots)
