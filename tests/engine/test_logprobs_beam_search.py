"""Top logprobs from the device, and beam search over the engine, against dense references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax import LLM, BeamSearchParams, SamplingParams

CONFIG = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, min_seq_bucket=8,
              block_size=4)


DENSE_LEN = 32  # longer than every context here: one compiled dense forward for them all
_dense_forward = nnx.jit(lambda model, token_ids: model(token_ids))


def dense_log_probs(model, tokens):
    """Full recompute of the next token's log-probabilities, the context padded to DENSE_LEN:
    a causal model's logits at the last real position do not see what follows it."""
    ids = np.zeros((1, DENSE_LEN), np.int32)
    ids[0, :len(tokens)] = tokens
    logits = _dense_forward(model, jnp.asarray(ids))[0, len(tokens) - 1]
    return np.asarray(jax.nn.log_softmax(logits))


def test_top_logprobs_match_the_dense_model(tiny_model):
    """vLLM's Logprob objects: each top token's and the sampled one's logprob and rank (1 =
    the most likely) equal the dense model's; sampled hot, so tokens outside the top 2 come
    up and their ranks are the device's count."""
    llm = LLM(tiny_model, **CONFIG)
    prompt = list(range(5, 22))
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=3.0, seed=1,
                                                logprobs=2), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 8
    context, outside = list(prompt), 0
    for token, top in zip(out.token_ids, out.logprobs):
        expected = dense_log_probs(tiny_model, context)
        assert set(top) == set(np.argsort(-expected)[:2].tolist()) | {token}
        for t, lp in top.items():
            assert lp.logprob == pytest.approx(float(expected[t]), abs=1e-4)  # f32, two orders
            assert lp.rank == 1 + int(np.sum(expected > expected[t]))
        outside += top[token].rank > 2
        context.append(token)
    assert outside  # a sampled token outside the top 2 was ranked
    np.testing.assert_allclose(out.cumulative_logprob, sum(t[k].logprob for t, k in
                                                           zip(out.logprobs, out.token_ids)),
                               rtol=1e-5)


def test_logprobs_are_the_models_before_masks_penalties_and_filters(tiny_model):
    """vLLM's raw logprobs: a request whose samples are bounded by allowed_token_ids, penalised
    and filtered by top-k still reports the model's own log-softmax over the whole vocabulary,
    its top tokens included (those outside allowed_token_ids too)."""
    llm = LLM(tiny_model, **CONFIG)
    prompt = list(range(40, 53))
    first = dense_log_probs(tiny_model, prompt)
    allowed = tuple(int(t) for t in np.argsort(-first)[5:25])  # not the model's top tokens
    params = SamplingParams(max_tokens=6, temperature=2.0, top_k=3, seed=2, logprobs=2,
                            allowed_token_ids=allowed, repetition_penalty=1.5,
                            presence_penalty=0.5)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    context = list(prompt)
    for token, top in zip(out.token_ids, out.logprobs):
        assert token in allowed
        expected = dense_log_probs(tiny_model, context)
        assert set(top) == set(np.argsort(-expected)[:2].tolist()) | {token}
        for t, lp in top.items():
            assert lp.logprob == pytest.approx(float(expected[t]), abs=1e-4)  # f32
        context.append(token)


def dense_beam_search(model, prompt, width, steps):
    """Reference: the same beam search on dense full-recompute logprobs."""
    beams = [([], 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, cumulative in beams:
            lp = dense_log_probs(model, prompt + tokens)
            for t in np.argsort(-lp)[:2 * width]:
                candidates.append((tokens + [int(t)], cumulative + float(lp[t])))
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:width]
    return beams


def test_beam_search_equals_dense_reference(tiny_model):
    llm = LLM(tiny_model, tokenizer="byte", **CONFIG)
    prompts = [list(range(30, 43)), [7, 8]]
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5,
                                                        length_penalty=0.0))
    for prompt, beams in zip(prompts, results):
        expected = dense_beam_search(tiny_model, prompt, 3, 5)
        assert [b.token_ids for b in beams] == [tokens for tokens, _ in expected]
        assert [b.text for b in beams] == [llm.tokenizer.decode(t) for t, _ in expected]
        np.testing.assert_allclose([b.cumulative_logprob for b in beams],
                                   [c for _, c in expected], atol=1e-4)
    # Beams share their prompt blocks through the prefix cache.
    assert llm.engine.stats.num_prefix_hit_tokens > 0
    assert llm.engine.scheduler.kv_manager.num_used_blocks == 0


def test_beam_search_validates(tiny_model):
    llm = LLM(tiny_model, **CONFIG)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[1] * 60], BeamSearchParams(beam_width=2, max_tokens=10))
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([[1, 2]], SamplingParams(logprobs=50), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def dense_prompt_log_probs(model, tokens):
    """log-probabilities at every position of one dense forward over tokens."""
    ids = np.zeros((1, DENSE_LEN), np.int32)
    ids[0, :len(tokens)] = tokens
    return np.asarray(jax.nn.log_softmax(_dense_forward(model, jnp.asarray(ids))[0]))


def check_prompt_logprobs(entries, model, prompt, num_top):
    """vLLM's layout: None, then per prompt token {its id and the num_top most likely: Logprob}
    with the dense model's logprobs and ranks (f32 over two orders of magnitude: 1e-4)."""
    expected = dense_prompt_log_probs(model, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row, token = expected[position - 1], prompt[position]
        assert set(entry) == set(np.argsort(-row)[:num_top].tolist()) | {token}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert lp.rank == 1 + int(np.sum(row > row[t]))


@pytest.mark.slow  # make test-slow
def test_prompt_logprobs_match_the_dense_model_through_chunks_and_preemption(tiny_model):
    """prompt_logprobs over a prompt prefilled in chunks of at most 8 tokens (the prefix cache
    holds it already: a request asking for prompt logprobs computes it whole), beside a request
    that does not ask, and again after a preemption recomputed it (no position twice)."""
    config = dict(CONFIG, max_num_batched_tokens=8, max_num_seqs=4, min_seq_bucket=4)
    llm = LLM(tiny_model, tokenizer="byte", **config)
    prompt = list(range(40, 63))  # 23 tokens: three chunks
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    outs = llm.generate([prompt, prompt[:9]], [
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3),
        SamplingParams(max_tokens=3, temperature=0)], use_tqdm=False)
    check_prompt_logprobs(outs[0].prompt_logprobs, tiny_model, prompt, 3)
    assert outs[1].prompt_logprobs is None
    assert outs[0].metrics.num_cached_tokens == 0  # computed whole
    assert outs[1].metrics.num_cached_tokens == 8  # the other read the cache
    entry = outs[0].prompt_logprobs[1]
    assert entry[prompt[1]].decoded_token == llm.tokenizer.decode([prompt[1]])

    # A pool of 12 blocks of 4 tokens: four 23-token prompts preempt each other.
    small = LLM(tiny_model, tokenizer="byte", **dict(config, num_blocks=13))
    prompts = [[p + i for p in prompt] for i in range(4)]
    outs = small.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  prompt_logprobs=1), use_tqdm=False)
    assert small.engine.stats.num_preemptions > 0
    for out, p in zip(outs, prompts):
        check_prompt_logprobs(out.prompt_logprobs, tiny_model, p, 1)


def test_prompt_logprobs_is_refused_past_max_logprobs(tiny_model):
    llm = LLM(tiny_model, **dict(CONFIG, max_logprobs=4))
    with pytest.raises(ValueError, match="prompt_logprobs .5. exceeds max_logprobs .4."):
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=5), use_tqdm=False)
    assert not llm.engine.has_unfinished()
