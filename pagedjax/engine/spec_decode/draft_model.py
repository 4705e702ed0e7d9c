"""The draft-model proposer of speculative decoding (vLLM's `method: "draft_model"`): a smaller
model with the target's vocabulary drafts k tokens greedily for each decoding request.

Its KV is paged in a pool of its own, with a block table per request in its own
KVCacheManager (the scheduler's classes, driven here), not a KV cache group of the target's:
the draft's layers have other shapes (a group's pages are one size), the target's scheduler and
its plans stay as they are (a target step never waits on the draft's allocations), and the
draft's pool can be sized for the draft alone. The price: a request's tokens are computed twice,
once by each model. The draft's KV holds every token of its requests that the target holds
(a request joining catches up through the draft's ragged programs, chunked by the token
budget); its k drafts are written past that, never counted as computed, and overwritten by the
next catch-up, which recomputes the accepted ones (at most k + 1 tokens a request a step).

A proposal is one ragged step (each request's catch-up, sampling d1 at its last token) then
k - 1 decode steps over the requests still drafting, fused into one program (lax.scan: each
greedy token fed back on device, its slot from the block table), every draft greedy (argmax):
the drafts are deterministic, so the target verifies them by coupling with its own sampling
(pagedjax.engine.spec_decode.rejection_sampler). The draft runs on the target's first device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.runner import ModelRunner
from pagedjax.engine.step_functions import forward_fn
from pagedjax.engine.warmup import warm
from pagedjax.scheduler import (DECODE, FORWARD_FIELDS, PREFILL, KVCacheManager, Request,
                                SamplingParams, ScheduledSeq, SchedulerOutput, ShapeBuckets,
                                build_plan)
from pagedjax.scheduler.plan import padding_plan

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def draft_loop_fn(graph, backend, num_steps: int, block_size: int, params, kv_cache,
                  inputs: dict):
    """num_steps decode steps of a model, each row's greedy token the next step's input (its
    slot from its block table), as one pure function: (i32[B, num_steps], kv_cache). inputs:
    the first step's decode plan (FORWARD_FIELDS); padding rows, and positions past the block
    tables (steps whose drafts no row keeps), write into the null block."""
    rows = jnp.arange(inputs["kv_lens"].shape[0])
    real = rows < inputs["num_seqs"]
    width = inputs["block_tables"].shape[1] * block_size

    def step(carry: Any, _) -> tuple[Any, jax.Array]:
        kv_cache, tokens, positions, kv_lens = carry
        slots = (inputs["block_tables"][rows, positions // block_size] * block_size
                 + positions % block_size)
        step_inputs = dict(inputs, token_ids=tokens, positions=positions, kv_lens=kv_lens,
                           slot_mapping=jnp.where(real & (positions < width), slots, 0))
        logits, _, kv_cache = forward_fn(graph, backend, DECODE, 0, params, kv_cache,
                                         step_inputs)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (kv_cache, tokens, positions + 1, jnp.where(real, kv_lens + 1, 0)), tokens

    carry = (kv_cache, inputs["token_ids"], inputs["positions"], inputs["kv_lens"])
    # (jax's scan overloads read a 4-tuple carry as a mismatch)
    scanned = jax.lax.scan(step, carry, None, length=num_steps)  # type: ignore[arg-type]
    (kv_cache, *_), tokens = scanned
    return tokens.T, kv_cache


_draft_loop = jax.jit(draft_loop_fn, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))


class DraftModelProposer:
    def __init__(self, model, config, num_speculative_tokens: int, *, backend, device,
                 num_blocks: int):
        """config: the target engine's EngineConfig (block size, limits, dtypes); num_blocks:
        the draft's pool (its null block included)."""
        self.k = num_speculative_tokens
        self.budget = config.max_num_batched_tokens
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=config.block_size,
                                  dtype=config.kv_np_dtype, backend=backend,
                                  scan_layers=config.scan_layers, device=device)
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.buckets = ShapeBuckets.create(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            block_size=config.block_size, min_token_bucket=config.min_token_bucket,
            prefill_seqs=config.prefill_seqs)
        self._shadows: dict[str, Request] = {}  # request_id -> the draft's view of it
        self.num_steps = 0

    @classmethod
    def for_engine(cls, engine, draft_model) -> "DraftModelProposer":
        """The draft of engine's speculative_config, on the engine's first device, its pool as
        large as the target's and a block of lookahead a sequence; ValueError naming
        speculative_config.model when the draft cannot serve this engine."""
        config = engine.config
        if draft_model is None:
            raise ValueError("speculative_config.model: pass the loaded draft as draft_model= "
                             "(LLM and `pagedjax serve` load it from the path)")
        if draft_model.config.vocab_size != engine.model_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocab_size "
                             f"({draft_model.config.vocab_size}) is not the target's "
                             f"({engine.model_config.vocab_size})")
        if config.max_model_len > draft_model.config.max_position_embeddings:
            raise ValueError(f"speculative_config.model: the draft's max_position_embeddings "
                             f"({draft_model.config.max_position_embeddings}) is below "
                             f"max_model_len ({config.max_model_len})")
        if config.tensor_parallel_size > 1 or engine.multihost:
            raise ValueError("speculative_config.model: a draft model runs with "
                             "tensor_parallel_size 1 on one host (use method ngram)")
        return cls(draft_model, config, config.speculative.num_speculative_tokens,
                   backend=engine.backend, device=engine.devices[0],
                   num_blocks=engine.num_blocks + config.max_num_seqs)

    def forget(self, request_id: str) -> None:
        """Frees the draft's blocks of a request that finished (or was aborted)."""
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def propose(self, requests: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for (request, at most this many) pairs: request_id -> up to k tokens. A
        request still catching up, or whose draft blocks the pool cannot hold, gets none."""
        scheduled, drafting = self._catch_up(requests)
        if not scheduled:
            return {}
        ids = self._run(scheduled)
        drafts = {}
        for row, (shadow, start, num_new) in enumerate(scheduled):
            shadow.num_computed_tokens = start + num_new
            if shadow.request_id in drafting:
                drafts[shadow.request_id] = [int(ids[row])]
        rows = [(self._shadows[r], d) for r, d in drafts.items() if drafting[r] > 1]
        if rows:
            more = self._draft_loop(rows, self.k - 1)  # one program whatever each row's room
            for (shadow, d), tokens in zip(rows, more):
                d.extend(int(t) for t in tokens[:drafting[shadow.request_id] - 1])
        return drafts

    def _draft_loop(self, rows, num_steps: int) -> np.ndarray:
        """num_steps more drafts for each row (a shadow and its first draft): one program that
        feeds each greedy token back (the k - 1 decode steps fused under lax.scan); i32[rows,
        num_steps]. The plan is the first of those decode steps, its block tables holding every
        block taken for the drafts."""
        for shadow, d in rows:
            shadow.prompt_token_ids.append(d[0])  # for this plan (reset at the next proposal)
        scheduled = [ScheduledSeq(s, s.num_tokens - 1, 1) for s, _ in rows]
        plan = build_plan(SchedulerOutput(scheduled, [], DECODE, len(rows), 0.0), self.kv,
                          self.buckets)
        for i, (shadow, _) in enumerate(rows):
            table = self.kv.get_block_table(shadow.request_id)
            plan.block_tables[i, :len(table)] = table
        runner = self.runner
        inputs = {name: getattr(plan, name) for name in FORWARD_FIELDS}
        ids, kv_cache = _draft_loop(runner.graph, runner.backend, num_steps,
                                    self.kv.block_size, runner.params, runner.kv_cache, inputs)
        runner.swap_kv_cache(kv_cache)
        self.num_steps += num_steps
        return np.asarray(ids)[:len(rows)]

    def _catch_up(self, requests):
        """The rows of the first step (each request's tokens the draft has not computed, as
        many as the budget allows) and, of those that catch up whole, how many drafts each
        may have (request_id -> count), their slots allocated."""
        scheduled, drafting, budget = [], {}, self.budget
        for request, most in requests:
            shadow = self._shadow(request)
            start = shadow.num_computed_tokens
            num_new = min(shadow.num_tokens - start, budget)
            if num_new <= 0:
                continue
            whole = start + num_new == shadow.num_tokens and most > 0
            if self.kv.allocate_slots(shadow, num_new + (most - 1 if whole else 0)) is None:
                if self.kv.allocate_slots(shadow, num_new) is None:
                    continue  # no room even to catch up: it drafts nothing this step
                whole = False
            scheduled.append(ScheduledSeq(shadow, start, num_new))
            budget -= num_new
            if whole:
                drafting[shadow.request_id] = most
        return scheduled, drafting

    def _shadow(self, request: Request) -> Request:
        shadow = self._shadows.get(request.request_id)
        tokens = request.prompt_token_ids + request.output_token_ids
        if shadow is None:
            shadow = self._shadows[request.request_id] = Request(
                request.request_id, tokens, _GREEDY, seed=0, arrival_time=0.0)
        else:
            shadow.prompt_token_ids = tokens
        return shadow

    def _run(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        """One draft step over scheduled (a decode program when each row brings one token);
        each row's greedy token."""
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        kind = DECODE if num_tokens == len(scheduled) else PREFILL
        output = SchedulerOutput(scheduled, [], kind, num_tokens, 0.0)
        plan = build_plan(output, self.kv, self.buckets)
        self.num_steps += 1
        return self.runner.step(plan)[0]

    def warmup(self) -> int:
        """Compiles the draft's step programs and its fused loop for every seq bucket (the
        loop by running it on padding: every write lands in the null block); returns how
        many programs."""
        count = warm(self.runner, self.buckets)
        if self.k > 1:
            runner = self.runner
            for b in self.buckets.seq_buckets:
                plan = padding_plan(DECODE, b, b, self.buckets.max_blocks_per_seq)
                inputs = {name: getattr(plan, name) for name in FORWARD_FIELDS}
                _, kv_cache = _draft_loop(runner.graph, runner.backend, self.k - 1,
                                          self.kv.block_size, runner.params,
                                          runner.kv_cache, inputs)
                runner.swap_kv_cache(kv_cache)
                count += 1
        return count
