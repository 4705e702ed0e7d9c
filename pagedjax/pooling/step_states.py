"""A step's hidden states for pooling requests: on the device, the final hidden states of the
rows the plan names (BatchPlan.pooling_rows, a forward variant compiled on first use); on the
host, each pooling request's rows fed to its PooledSequence in position order, as chunked
prefill computes them (a prompt recomputed after a preemption adds nothing)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pagedjax.models import paged_forward
from pagedjax.pooling.poolers import PooledSequence
from pagedjax.scheduler import Request


def pooled_states(graph, params, hidden: jax.Array, rows: jax.Array, mesh=None) -> jax.Array:
    """The final hidden states (after the model's last norm: transformers' last_hidden_state)
    f32[T, D] of the rows a pooling request reads (rows i32[T] = 1), zero elsewhere."""
    states = paged_forward.final_norm(graph, params, hidden).astype(jnp.float32)
    states = jnp.where(rows[:, None] > 0, states, 0.0)
    if mesh is not None:  # whole rows on every device, for the host to read
        states = jax.lax.with_sharding_constraint(states, NamedSharding(mesh, P()))
    return states


def record(output, states: np.ndarray | None,
           pool_of: Callable[[Request], PooledSequence | None]) -> None:
    """Feeds a finished step's pooled states (pooled_states on the host, or None) to the
    scheduled pooling requests' PooledSequences (pool_of: a scheduled request's, or None)."""
    if states is None:
        return
    offset = 0
    for request, start, num_new in output.scheduled:
        pool = pool_of(request) if request.pooling is not None else None
        if pool is not None:
            first, last = _pooled_span(request.num_prompt_tokens, start, num_new,
                                       pool.needs_every_token)
            first = max(first, pool.count)
            if first < last:
                pool.add(states[offset + first - start:offset + last - start], first)
        offset += num_new


def _pooled_span(num_prompt: int, start: int, num_new: int,
                 every_token: bool) -> tuple[int, int]:
    """The prompt positions [first, last) of a scheduled chunk whose states a pooling request
    reads: each prompt position in it, or (lasttoken alone) the prompt's last one if in it."""
    last = min(start + num_new, num_prompt)
    if every_token:
        return start, last
    return (num_prompt - 1, num_prompt) if start + num_new >= num_prompt > start else (0, 0)
