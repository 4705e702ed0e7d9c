"""Dense full-recompute greedy decoding: the correctness reference for the paged engine."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.families.llama import LlamaForCausalLM


@nnx.jit
def _dense_logits(model: LlamaForCausalLM, token_ids: jax.Array) -> jax.Array:
    return model(token_ids)


def dense_greedy_generate(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]],
                          max_tokens: int, padded_len: int | None = None) -> list[list[int]]:
    """Greedy tokens by recomputing the whole sequence densely at every step.

    Sequences are right-padded to one fixed length, so one program serves every step: causal
    attention means padding after a position never changes that position's logits.
    """
    longest = max(len(p) for p in prompts) + max_tokens
    padded_len = padded_len or longest
    if padded_len < longest:
        raise ValueError(f"padded_len ({padded_len}) must be >= longest prompt + max_tokens "
                         f"({longest})")
    tokens = np.zeros((len(prompts), padded_len), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
    rows = np.arange(len(prompts))
    for _ in range(max_tokens):
        logits = _dense_logits(model, jnp.asarray(tokens))
        next_ids = np.asarray(jnp.argmax(logits[rows, lengths - 1], axis=-1))
        tokens[rows, lengths] = next_ids
        lengths += 1
    return [tokens[i, len(p):len(p) + max_tokens].tolist() for i, p in enumerate(prompts)]
