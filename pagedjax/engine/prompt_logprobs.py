"""vLLM's prompt_logprobs: the logprob of each prompt token given the tokens before it, and the
most likely tokens at its position.

The forward program of a step with such tokens (a variant compiled on first use) projects every
query token's hidden state, not only the sampled ones, in chunks of CHUNK tokens (so the [T, V]
logits never exist at once), and returns per token the target's logprob and rank and the K most
likely tokens; the host then appends one entry a prompt position to the requests that asked.
The plan's prompt_targets (scheduler.plan_rows.prompt_targets) names each token's target: the prompt
token that follows it, -1 for tokens nobody asked about.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pagedjax.engine.sampler import token_ranks
from pagedjax.models import paged_forward
from pagedjax.scheduler.request import Logprob

CHUNK = 128  # tokens projected to the vocabulary at once


def compute(graph, params, hidden: jax.Array, targets: jax.Array, num_top: int,
            mesh=None) -> tuple[jax.Array, ...]:
    """hidden f32[T, D], targets i32[T] (-1: none) -> (target logprobs f32[T], their ranks
    i32[T] (1 = the most likely), top ids i32[T, K], top logprobs f32[T, K]): the model's
    logprobs (raw logits), as the sampler reports a sampled token's."""
    num_tokens, dim = hidden.shape
    chunk = min(CHUNK, num_tokens)
    num_chunks = -(-num_tokens // chunk)
    pad = num_chunks * chunk - num_tokens
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num_chunks, chunk, dim)
    targets = jnp.pad(targets, (0, pad), constant_values=-1).reshape(num_chunks, chunk)

    def one_chunk(args):
        h, t = args
        logits = paged_forward.logits(graph, params, h)  # f32[C, V]
        if mesh is not None:  # vocab-split: whole rows on every device
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(log_probs, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        rank = token_ranks(log_probs, chosen)
        top_logprobs, top_ids = jax.lax.top_k(log_probs, num_top)
        return chosen, rank, top_ids.astype(jnp.int32), top_logprobs

    out = jax.lax.map(one_chunk, (hidden, targets))
    return tuple(x.reshape((num_chunks * chunk,) + x.shape[2:])[:num_tokens] for x in out)


def record(output, arrays, tokenizer=None) -> None:
    """Appends a finished step's prompt logprobs (compute's arrays on the host, or None) to the
    scheduled requests that asked for them: one {token id: Logprob} a prompt position not
    recorded yet (a prompt recomputed after a preemption adds nothing), the prompt's token and
    the request's prompt_logprobs most likely ones."""
    if arrays is None:
        return
    chosen, ranks, top_ids, top_logprobs = arrays
    offset = 0
    for request, start, num_new in output.scheduled:
        num_top = request.sampling_params.prompt_logprobs
        if num_top is not None:
            entries = request.prompt_logprobs
            last = min(start + num_new, request.num_prompt_tokens - 1)
            for position in range(max(start, len(entries) - 1), last):
                row = offset + position - start
                target = request.prompt_token_ids[position + 1]
                entry = {int(t): Logprob(float(lp), rank) for rank, (t, lp) in enumerate(
                    zip(top_ids[row][:num_top], top_logprobs[row][:num_top]), start=1)}
                if target not in entry:
                    entry[target] = Logprob(float(chosen[row]), int(ranks[row]))
                if tokenizer is not None:
                    for token_id, logprob in entry.items():
                        logprob.decoded_token = tokenizer.decode([token_id],
                                                                 skip_special_tokens=False)
                entries.append(entry)
        offset += num_new
