"""LoRA training in JAX over the engine's own model classes (issue 53): a trainer's adapter
state, trained with optax while the base model stays frozen, saved as a PEFT directory the engine
(and peft, and vLLM) serves, or handed to a running engine in place (LLM.update_lora).

The state is the engine's layout: projection name -> (a [L, I, r], b [L, r, O]) with a scaling
(alpha / r); the adapted model is the base with W + scaling * a @ b in every targeted
projection of every layer (merged inside the loss, so the gradient reaches a and b only).
Initialised as PEFT initialises LoRA: a Kaiming-uniform, b zero (the adapter starts as the base).

    state = init_lora_state(model.config, rank=8, targets=["q_proj", "v_proj"], seed=0)
    state, losses = train_lora(model, state, batches, steps=100, lr=1e-3)
    save_peft_adapter(as_adapter(state), "adapters/mine")   # then LoRARequest("mine", 1, ...)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pagedjax.lora.peft_adapter import TARGETS, LoRAAdapter, module_dims


@dataclasses.dataclass(frozen=True)
class LoRAState:
    """A trainer's adapter: the pairs (a pytree of arrays) and its fixed rank and scaling."""

    pairs: dict  # name -> (a [L, I, r], b [L, r, O])
    rank: int
    scaling: float


def init_lora_state(config, rank: int, targets, seed: int = 0,
                    alpha: float | None = None) -> LoRAState:
    """PEFT's initialisation: a ~ U(-1/sqrt(I), 1/sqrt(I)) (Kaiming-uniform with a = sqrt(5)),
    b = 0; scaling alpha / rank (alpha: 2 * rank unless given)."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"targets must name projections among {sorted(TARGETS)}, got "
                         f"{list(targets)!r}")
    key = jax.random.key(seed)
    dims = module_dims(config)
    pairs = {}
    for name in sorted(targets):
        key, sub = jax.random.split(key)
        inputs, outputs = dims[name]
        bound = 1.0 / np.sqrt(inputs)
        pairs[name] = (jax.random.uniform(sub, (config.num_layers, inputs, rank), jnp.float32,
                                          -bound, bound),
                       jnp.zeros((config.num_layers, rank, outputs), jnp.float32))
    return LoRAState(pairs, rank, (2.0 * rank if alpha is None else alpha) / rank)


def adapted(model, pairs: dict, scaling: float):
    """A copy of model with every targeted kernel W + scaling * a @ b (traceable: the dense
    reference of the served adapter, and the model the trainer differentiates)."""
    graph, state = nnx.split(model)
    copy = nnx.merge(graph, jax.tree.map(lambda x: x, state))  # its own variables, this trace's
    for name, (a, b) in pairs.items():
        for layer, block in enumerate(copy.layers):
            kernel = getattr(getattr(block, TARGETS[name]), name).kernel
            delta = scaling * jnp.einsum("IR,RO->IO", a[layer], b[layer])
            kernel.set_value(kernel.get_value() + delta.astype(kernel.get_value().dtype))
    return copy


def lora_loss(pairs: dict, graph: nnx.GraphDef, base: nnx.State, scaling: float,
              token_ids: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """The mean cross-entropy of the masked next tokens of token_ids i32[R, S + 1]
    (loss_mask f32[R, S]) under the base model (graph, base: nnx.split's) adapted by pairs."""
    logits = adapted(nnx.merge(graph, base), pairs, scaling)(token_ids[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, token_ids[:, 1:])
    return jnp.sum(nll * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)


def train_lora(model, state: LoRAState, batches: Iterable, *, steps: int, lr: float = 1e-3,
               on_step: Callable[[int, float], None] | None = None
               ) -> tuple[LoRAState, list[float]]:
    """steps AdamW steps of the adapter on batches ((token_ids, loss_mask) pairs, reused in
    turn), the base model frozen; returns the trained state and the loss before each step."""
    transform = optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=0.0)
    graph, base = nnx.split(model)

    @jax.jit
    def step(pairs, opt_state, base, token_ids, loss_mask):
        loss, grads = jax.value_and_grad(lora_loss)(pairs, graph, base, state.scaling,
                                                    token_ids, loss_mask)
        updates, opt_state = transform.update(grads, opt_state, pairs)
        return optax.apply_updates(pairs, updates), opt_state, loss

    pairs, opt_state = state.pairs, transform.init(state.pairs)
    batches = list(batches)
    losses = []
    for i in range(steps):
        token_ids, loss_mask = batches[i % len(batches)]
        pairs, opt_state, loss = step(pairs, opt_state, base, jnp.asarray(token_ids),
                                      jnp.asarray(loss_mask))
        losses.append(float(loss))
        if on_step is not None:
            on_step(i, losses[-1])
    return dataclasses.replace(state, pairs=pairs), losses


def as_adapter(state: LoRAState, name: str = "trained") -> LoRAAdapter:
    """The state as a LoRAAdapter (host arrays): for save_peft_adapter or LLM.update_lora."""
    return LoRAAdapter(name, state.rank, float(state.scaling),
                       {k: (np.asarray(a, np.float32), np.asarray(b, np.float32))
                        for k, (a, b) in state.pairs.items()})
