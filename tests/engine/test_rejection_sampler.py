"""The speculative-decoding rejection sampler (pagedjax/engine/spec_decode/rejection_sampler.py): greedy rows
give plain greedy decoding's tokens; random rows give tokens distributed as the target's (a
chi-square test over 20,000 rows on a 5-token vocabulary, for one-hot drafts right half the
time, drafts the target never samples, and drafts from a draft model's own distribution); a
seeded row draws the same tokens in any batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.engine.spec_decode.rejection_sampler import (rejection_sample, target_probs,
                                                           verified_tokens)

# chi-square, 4 degrees of freedom (5 tokens), at p = 0.001: a correct sampler fails one run in
# a thousand; a distribution off by a few percent of 20,000 draws fails every time.
CHI2_4DF_999 = 18.47
ROWS = 20000


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=probs.size)
    expected = probs * tokens.size
    seen = expected > 0
    assert counts[~seen].sum() == 0  # nothing drawn where the target has no mass
    return float((((counts - expected) ** 2)[seen] / expected[seen]).sum())


def test_greedy_rows_take_the_argmax_chain():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 7)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))  # [B, K + 1]
    drafts = argmax[:, :3].copy()
    drafts[1, 1] = (drafts[1, 1] + 1) % 7  # row 1: the second draft is wrong
    drafts[2, 0] = (drafts[2, 0] + 1) % 7  # row 2: the first one
    flat = logits.reshape(12, 7)
    probs = target_probs(flat, jnp.zeros(12), jnp.full(12, -1), jnp.ones(12)).reshape(3, 4, 7)
    tokens, count = rejection_sample(probs, jnp.asarray(drafts), jnp.asarray([3, 3, 3]),
                                     jnp.arange(3, dtype=jnp.uint32), jnp.zeros(3, jnp.int32))
    assert np.asarray(count).tolist() == [4, 2, 1]
    tokens = np.asarray(tokens)
    assert tokens[0].tolist() == argmax[0].tolist()  # three accepted and the bonus
    assert tokens[1].tolist() == [argmax[1, 0], argmax[1, 1], -1, -1]
    assert tokens[2].tolist() == [argmax[2, 0], -1, -1, -1]


def test_padding_past_a_rows_drafts_is_never_accepted():
    """A row with fewer drafts than the plan's K columns: its padding (id 0, as
    scheduler.plan.draft_columns pads) is not a draft even where the target's sample there is
    that id, in the coupled verification and in the general rule alike."""
    samples = jnp.asarray([[5, 0, 0, 0], [0, 0, 0, 0]], jnp.int32)  # [B, K + 1], K = 3
    drafts = jnp.asarray([[5, 0, 0], [0, 0, 0]], jnp.int32)
    num_drafts = jnp.asarray([1, 0], jnp.int32)
    assert np.asarray(verified_tokens(samples, drafts, num_drafts)).tolist() == [
        [5, 0, -1, -1], [0, -1, -1, -1]]
    probs = jnp.asarray(np.eye(7, dtype=np.float32)[np.asarray(samples)])  # greedy: one-hot
    tokens, count = rejection_sample(probs, drafts, num_drafts, jnp.arange(2, dtype=jnp.uint32),
                                     jnp.zeros(2, jnp.int32))
    assert np.asarray(count).tolist() == [2, 1]
    assert np.asarray(tokens).tolist() == [[5, 0, -1, -1], [0, -1, -1, -1]]


def _target():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(2, 5)) * 1.5
    logits[:, 4] = -np.inf  # the target never samples token 4
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)  # [K + 1 = 2, V = 5]


@pytest.mark.parametrize("drafter", ["right_half_the_time", "always_wrong", "draft_model"])
def test_random_rows_are_distributed_as_the_target(drafter):
    p = _target()
    rng = np.random.default_rng(11)
    draft_probs = None
    if drafter == "right_half_the_time":  # one-hot drafts: the target's mode, or another token
        drafts = np.where(rng.random(ROWS) < 0.5, p[0].argmax(), rng.integers(0, 4, ROWS))
    elif drafter == "always_wrong":  # a token the target never samples
        drafts = np.full(ROWS, 4)
    else:  # a draft model's distribution q (unlike p), its drafts drawn from it
        q = np.asarray([0.1, 0.4, 0.1, 0.2, 0.2])
        drafts = rng.choice(5, ROWS, p=q)
        draft_probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (ROWS, 1, 5))
    probs = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (ROWS, 2, 5))
    tokens, count = rejection_sample(
        probs, jnp.asarray(drafts[:, None], jnp.int32), jnp.ones(ROWS, jnp.int32),
        jnp.arange(ROWS, dtype=jnp.uint32), jnp.full(ROWS, 9, jnp.int32), draft_probs)
    tokens, count = np.asarray(tokens), np.asarray(count)
    assert chi_square(tokens[:, 0], p[0]) < CHI2_4DF_999
    accepted = count == 2  # the bonus token after an accepted draft: from p at position 1
    if drafter == "always_wrong":
        assert not accepted.any()
    else:
        assert accepted.sum() > 2000
        assert chi_square(tokens[accepted, 1], p[1]) < CHI2_4DF_999


def test_a_broken_sampler_fails_the_test():
    """The chi-square bound has teeth: accepting every draft is caught."""
    p = _target()
    tokens = np.where(np.random.default_rng(0).random(ROWS) < 0.5, p[0].argmax(), 1)
    assert chi_square(tokens, p[0]) > CHI2_4DF_999


def test_a_seeded_row_draws_the_same_in_any_batch():
    p = jnp.asarray(_target(), jnp.float32)
    drafts = jnp.asarray([[1], [2], [3], [0]], jnp.int32)
    seeds = jnp.asarray([5, 6, 7, 8], jnp.uint32)
    positions = jnp.asarray([3, 4, 5, 6], jnp.int32)

    def run(order):
        order = jnp.asarray(order)
        tokens, count = rejection_sample(jnp.broadcast_to(p, (4, 2, 5)), drafts[order],
                                         jnp.ones(4, jnp.int32), seeds[order], positions[order])
        return np.asarray(tokens)[np.argsort(np.asarray(order))]

    first = run([0, 1, 2, 3])
    assert (run([3, 1, 0, 2]) == first).all()
    assert (run([0, 1, 2, 3]) == first).all()


@pytest.mark.parametrize("drafter", ["right_half_the_time", "always_wrong"])
def test_the_engines_coupled_verification_is_distributed_as_the_target(drafter):
    """The engine's path (sampling_step.sample_fn on a plan with one draft column): each
    position sampled as plain sampling would, drafts kept while they agree. The first token is
    p0's, and after an accepted draft the next is p1's (chi-square as above)."""
    import dataclasses

    from pagedjax.engine import sampling_step
    from pagedjax.scheduler.plan import padding_plan

    p = _target()
    rng = np.random.default_rng(13)
    drafts = (np.where(rng.random(ROWS) < 0.5, p[0].argmax(), rng.integers(0, 4, ROWS))
              if drafter == "right_half_the_time" else np.full(ROWS, 4))
    plan = dataclasses.replace(
        padding_plan("prefill", 2, ROWS, 1, num_speculative_tokens=1),
        temperature=np.ones(ROWS, np.float32), seeds=np.arange(ROWS, dtype=np.uint32),
        kv_lens=np.full(ROWS, 9, np.int32), draft_token_ids=drafts[:, None].astype(np.int32),
        num_draft_tokens=np.ones(ROWS, np.int32))
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.tile(np.log(p), (ROWS, 1)), jnp.float32)  # [ROWS * 2, 5]
    tokens = np.asarray(sampling_step.sample_fn(0, "raw_logprobs", logits,
                                                sampling_step.sampling_inputs(plan),
                                                sampling_step.no_token_mask(ROWS))[0])
    assert chi_square(tokens[:, 0], p[0]) < CHI2_4DF_999
    accepted = tokens[:, 1] >= 0
    assert (tokens[accepted, 0] == drafts[accepted]).all()
    if drafter == "always_wrong":
        assert not accepted.any()
    else:
        assert accepted.sum() > 2000
        assert chi_square(tokens[accepted, 1], p[1]) < CHI2_4DF_999
