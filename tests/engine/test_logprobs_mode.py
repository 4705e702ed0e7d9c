"""What logprobs report (issue 52: EngineConfig.logprobs_mode, vLLM's four values), against the
model's own dense forward over the whole sequence (what an RL trainer computes), processed in
NumPy: raw_logprobs (the default) are its log-softmax; raw_logits its logits; processed_logprobs
the log of what the sampler draws from (logit_bias, then temperature, min-p, top-k, top-p;
filtered tokens at -inf) and processed_logits those logits. Every token's sampled logprob, and
the top ones with their ranks, by the same values."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_requests

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models import get_config, init_model

CONFIG = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
              num_blocks=32)
PROMPT = list(range(40, 52))
BIAS = {40: 2.0, 41: -3.0}


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return init_model(config, seed=3)


def params(**changes) -> SamplingParams:
    base = dict(max_tokens=6, temperature=0.8, top_k=12, top_p=0.9, min_p=0.02, seed=11,
                logit_bias=BIAS, logprobs=5, ignore_eos=True)
    return SamplingParams(**{**base, **changes})


def dense_logits(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """f32[len(tokens), V]: the logits each generated token was drawn from, by a dense forward
    of the whole sequence."""
    ids = jnp.asarray([prompt + tokens], jnp.int32)
    logits = np.asarray(model(ids)[0], np.float64)
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    finite = np.where(np.isfinite(x), x, -np.inf)
    top = finite.max(axis=-1, keepdims=True)
    return finite - top - np.log(np.exp(finite - top).sum(axis=-1, keepdims=True))


def processed(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """vLLM's order: logit_bias, temperature, min-p, top-k, top-p (filtered: -inf)."""
    x = logits.copy()
    for token, bias in BIAS.items():
        x[:, int(token)] += bias
    x = x / p.temperature
    probs = np.exp(log_softmax(x))
    x = np.where(probs < p.min_p * probs.max(axis=-1, keepdims=True), -np.inf, x)
    kth = -np.sort(-x, axis=-1)[:, p.top_k - 1:p.top_k]
    x = np.where(x < kth, -np.inf, x)
    out = np.full_like(x, -np.inf)
    for row in range(x.shape[0]):  # the smallest prefix whose mass reaches top_p
        order = np.argsort(-x[row])
        probs = np.exp(log_softmax(x[row][None])[0])[order]
        keep = max(1, int(np.sum(np.cumsum(probs) - probs < p.top_p)))
        out[row, order[:keep]] = x[row, order[:keep]]
    return out


REFERENCE = {
    "raw_logprobs": lambda logits, p: log_softmax(logits),
    "raw_logits": lambda logits, p: logits,
    "processed_logits": processed,
    "processed_logprobs": lambda logits, p: log_softmax(processed(logits, p)),
}


# the logits modes (the logprobs modes' inputs) in make test-slow
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m.endswith("logits")
                                  else m for m in sorted(REFERENCE)])
def test_logprobs_are_what_the_mode_names(model, mode):
    p = params()
    engine = LLMEngine(model, EngineConfig(**CONFIG, logprobs_mode=mode))
    out = run_requests(engine, [(PROMPT, p)])[0].outputs[0]
    tokens = out.token_ids
    expected = REFERENCE[mode](dense_logits(model, PROMPT, tokens), p)
    for i, (token, step) in enumerate(zip(tokens, out.logprobs)):
        want = expected[i]
        # f32 engine vs f64 reference over a dense forward: ~1e-5 of logits of size ~5
        np.testing.assert_allclose(step[token].logprob, want[token], rtol=1e-4, atol=1e-4)
        top = sorted((v.rank, t, v.logprob) for t, v in step.items() if v.rank <= 5)
        order = np.argsort(-want, kind="stable")[:5]
        finite = np.isfinite(want[order])
        assert [t for _, t, _ in top][:int(finite.sum())] == order[finite].tolist()
        np.testing.assert_allclose([lp for *_, lp in top], want[order], rtol=1e-4, atol=1e-4)
        assert step[token].rank == int(np.sum(want >= want[token] - 1e-6))  # vLLM's count


def test_the_sampled_tokens_do_not_depend_on_the_mode(model):
    """The mode changes what is reported, never what is sampled."""
    runs = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        engine = LLMEngine(model, EngineConfig(**CONFIG, logprobs_mode=mode))
        runs[mode] = [o.outputs[0].token_ids for o in run_requests(
            engine, [(PROMPT, params()), (PROMPT, params(temperature=0.0, logprobs=0))])]
    assert runs["raw_logprobs"] == runs["processed_logprobs"]


def test_a_bad_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineConfig(logprobs_mode="logits")


def test_the_server_sends_a_filtered_token_as_vllm_does(model):
    """A processed mode's filtered tokens (-inf) go on the wire as -9999.0 (JSON has no
    infinity): top_k 2 leaves the other three of five top logprobs filtered."""
    from fastapi.testclient import TestClient

    from pagedjax.serving.app import OpenAIServer
    from pagedjax.text.tokenizer import ByteTokenizer

    engine = LLMEngine(model, EngineConfig(**CONFIG, logprobs_mode="processed_logprobs"),
                       tokenizer=ByteTokenizer())
    server = OpenAIServer(engine, "tiny")
    with TestClient(server.build_app()) as client:
        response = client.post("/v1/completions", json={
            "prompt": "abc", "max_tokens": 3, "top_k": 2, "logprobs": 5, "seed": 1})
    assert response.status_code == 200, response.text
    for top in response.json()["choices"][0]["logprobs"]["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        assert values[2:] == [-9999.0] * 3 and all(v > -9999.0 for v in values[:2])


def test_a_tied_token_ranks_as_vllm_ranks_it():
    """vLLM's rank counts the values at or above the token's, itself included
    (vllm/v1/sample/ops/logprobs.py batched_count_greater_than): a tie ranks after the other."""
    from pagedjax.engine.sampler import token_ranks

    values = jnp.array([[1.0, 2.0, 2.0, 3.0], [0.5, -1.0, 0.5, 0.5]])
    assert token_ranks(values, jnp.array([2.0, -1.0])).tolist() == [3, 4]
    assert token_ranks(values, jnp.array([3.0, 0.5])).tolist() == [1, 3]
