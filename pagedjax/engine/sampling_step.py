"""The sampler as its own program: the step's logits in, its sampled tokens out.

The model's forward and the sampler are two programs so that what only some steps need
(penalties' token counts, a token bitmask) changes the small program, never the model's: a
penalized or masked step compiles a sampler variant (seconds at most), and the host computes a
step's grammar masks while the device runs its forward (vLLM's overlap). The logits stay on
device between the two. Programs are compiled ahead of time and shared by every runner of the
process (keyed by shapes, the device and K).
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from pagedjax.engine.sampler import sample_values, token_ranks, top_values
from pagedjax.engine.spec_decode import rejection_sampler
from pagedjax.scheduler import SAMPLING_FIELDS, BatchPlan

_programs: dict[tuple, jax.stages.Compiled] = {}
_locks: dict[tuple, threading.Lock] = {}
_locks_lock = threading.Lock()
_num_compiles = 0


def num_sampler_compiles() -> int:
    """How many sampler programs this process has compiled."""
    return _num_compiles


def clear_programs() -> None:
    """Forgets the compiled sampler programs (their executables are freed once no runner
    holds them): a long-lived process that compiled thousands, as a test worker does."""
    with _locks_lock:
        _programs.clear()
        _locks.clear()


def sample_fn(num_top_logprobs: int, logprobs_mode: str, logits: jax.Array, inputs: dict,
              token_mask: jax.Array) -> tuple[jax.Array, ...]:
    """sample() on a plan's sampling fields; an empty penalty_tokens (H = 0) or token_mask
    (W = 0) leaves their work out of the program. Returns sample()'s four arrays and the
    sampled tokens' ranks i32[B] (1 = the most likely; vLLM's Logprob.rank).

    A speculative plan (K draft columns, logits f32[B * (K + 1), V], token_mask one row a
    position or none) verifies its drafts: every array gains a position axis after B
    ([B, K + 1, ...]) and a row's ids are its tokens, -1 after them
    (rejection_sampler.verified_tokens)."""
    k = inputs["draft_token_ids"].shape[1]
    if k:
        batch = inputs["draft_token_ids"].shape[0]
        out = sample_fn(num_top_logprobs, logprobs_mode, logits,
                        rejection_sampler.expand_rows(inputs, k), token_mask)
        out = tuple(x.reshape((batch, k + 1) + x.shape[1:]) for x in out)
        ids = rejection_sampler.verified_tokens(out[0], inputs["draft_token_ids"],
                                                inputs["num_draft_tokens"])
        return (ids,) + out[1:]
    penalties = None
    if inputs["penalty_tokens"].shape[1]:
        penalties = (inputs["penalty_tokens"], inputs["penalty_prompt_lens"],
                     inputs["presence_penalty"], inputs["frequency_penalty"],
                     inputs["repetition_penalty"])
    ids, values = sample_values(
        logits, inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["seeds"],
        inputs["kv_lens"], min_p=inputs["min_p"],
        logit_bias=(inputs["bias_ids"], inputs["bias_values"]), penalties=penalties,
        token_mask=token_mask if token_mask.shape[1] else None, logprobs_mode=logprobs_mode)
    chosen, top_ids, top_logprobs = top_values(ids, values, num_top_logprobs)
    if not num_top_logprobs:  # no request can ask for logprobs: no rank work
        return ids, chosen, top_ids, top_logprobs, jnp.zeros_like(ids)
    rank = token_ranks(values, chosen)
    return ids, chosen, top_ids, top_logprobs, rank


_sample = jax.jit(sample_fn, static_argnums=(0, 1))


def sampling_inputs(plan: BatchPlan) -> dict:
    return {name: getattr(plan, name) for name in SAMPLING_FIELDS}


def no_token_mask(num_seqs: int) -> np.ndarray:
    return np.zeros((num_seqs, 0), np.int32)


def unsampled(num_seqs: int, num_top_logprobs: int) -> tuple[np.ndarray, ...]:
    """sample_fn's five arrays for rows whose token nobody reads (a pooling runner's, whose
    logits are one zero column: what sampling them picks): token 0, logprob 0, rank 1."""
    top = (np.zeros((num_seqs, num_top_logprobs), np.int32),
           np.zeros((num_seqs, num_top_logprobs), np.float32))
    return (np.zeros(num_seqs, np.int32), np.zeros(num_seqs, np.float32)) + top + (
        np.ones(num_seqs, np.int32),)


def program(num_top_logprobs: int, logits: jax.ShapeDtypeStruct, inputs: dict,
            token_mask: np.ndarray, device: jax.Device,
            logprobs_mode: str = "raw_logprobs") -> jax.stages.Compiled:
    """The sampler program for these shapes on device (compiled once per process)."""
    signature = tuple((k, np.shape(v), np.asarray(v).dtype.str) for k, v in inputs.items())
    key = (num_top_logprobs, logprobs_mode, logits.shape, device, signature, token_mask.shape)
    compiled = _programs.get(key)
    if compiled is not None:
        return compiled
    with _locks_lock:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        if key not in _programs:
            global _num_compiles
            _num_compiles += 1
            sharding = SingleDeviceSharding(device)

            def abstract(x):
                return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)

            _programs[key] = _sample.lower(
                num_top_logprobs, logprobs_mode, jax.ShapeDtypeStruct(logits.shape, logits.dtype,
                                                       sharding=sharding),
                jax.tree.map(abstract, inputs), abstract(token_mask)).compile()
    return _programs[key]
