"""vLLM's sampling controls on device: presence / frequency / repetition penalties against
NumPy references of their definitions, the token bitmask, and end to end through the engine:
greedy with repetition_penalty equals transformers' generate, min_tokens holds EOS back exactly
that long, allowed_token_ids bound every sample, bad_words never appear."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_requests as run

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.engine.sampler import apply_penalties, apply_token_mask
from pagedjax.models import get_config, init_model
from pagedjax.text.tokenizer import ByteTokenizer

CONFIG = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, min_seq_bucket=4,
              block_size=4)



def numpy_penalties(logits, tokens, prompt_len, presence, frequency, repetition):
    """vLLM's definitions, one row at a time."""
    out = logits.astype(np.float64).copy()
    seen = set(tokens)
    counts = np.bincount(tokens[prompt_len:], minlength=len(out))
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    return out - frequency * counts - presence * (counts > 0)


def test_penalties_match_the_numpy_definition():
    rng = np.random.default_rng(0)
    vocab, width = 40, 24
    logits = rng.normal(0, 3, (3, vocab)).astype(np.float32)
    rows = [(rng.integers(0, 10, 15), 6), (rng.integers(0, vocab, 9), 9), (np.array([], int), 0)]
    settings = [(0.5, 0.3, 1.7), (-0.4, 1.2, 0.6), (2.0, 2.0, 3.0)]
    tokens = np.full((3, width), -1, np.int32)
    for i, (row, _) in enumerate(rows):
        tokens[i, :len(row)] = row
    got = np.asarray(apply_penalties(
        jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray([p for _, p in rows], jnp.int32),
        *(jnp.asarray(col, jnp.float32) for col in zip(*settings))))
    for i, ((row, prompt_len), (presence, frequency, repetition)) in enumerate(zip(rows,
                                                                                   settings)):
        want = numpy_penalties(logits[i], row, prompt_len, presence, frequency, repetition)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)  # f32 of an f64 formula
    np.testing.assert_array_equal(got[2], logits[2])  # no tokens: untouched


def test_token_mask_keeps_exactly_the_set_bits():
    rng = np.random.default_rng(1)
    vocab = 70  # not a multiple of 32: the last word's high bits lie past the vocabulary
    allowed = rng.random((4, vocab)) < 0.3
    words = np.packbits(np.pad(allowed, ((0, 0), (0, 96 - vocab))), axis=1,
                        bitorder="little").view(np.int32)
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(words)))
    np.testing.assert_array_equal(np.isfinite(got), allowed)
    np.testing.assert_array_equal(got[allowed], logits[allowed])


def test_frequency_and_presence_penalties_equal_a_dense_greedy_reference(tiny_model):
    """The engine's penalized greedy decode (chunked prompt, a batch of two) equals a dense
    recompute that applies the NumPy definition to the full logits each step."""
    prompt = [5, 9, 5, 17, 9, 5, 30, 31, 32, 5, 9, 40, 41, 42, 43, 44, 45, 46]  # chunked: 16
    params = SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=1.5,
                            frequency_penalty=0.8, repetition_penalty=1.3)
    engine = LLMEngine(tiny_model, EngineConfig(**CONFIG))
    penalized, plain = run(engine, [(prompt, params),
                                    (prompt, SamplingParams(max_tokens=10, temperature=0.0))])
    tokens = list(prompt)
    for _ in range(10):  # one shape: causal, so the zeros after the tokens change nothing
        padded = np.zeros((1, 32), np.int32)
        padded[0, :len(tokens)] = tokens
        logits = np.asarray(tiny_model(jnp.asarray(padded)))[0, len(tokens) - 1]
        logits = numpy_penalties(logits, np.asarray(tokens), len(prompt), 1.5, 0.8, 1.3)
        tokens.append(int(np.argmax(logits)))
    assert penalized.output_token_ids == tokens[len(prompt):]
    assert penalized.output_token_ids != plain.output_token_ids  # the penalties did something


def test_greedy_repetition_penalty_equals_transformers_generate(tmp_path):
    torch = pytest.importorskip("torch")
    from test_models_hf import build_hf

    from pagedjax.models.loading.hf import load_hf_model
    hf = build_hf("llama3.1", tmp_path)
    rng = np.random.default_rng(2)
    token_prompts = [rng.integers(3, 20, n).tolist() for n in (5, 23)]  # repeats to penalize
    engine = LLMEngine(load_hf_model(str(tmp_path)),
                       EngineConfig(**{**CONFIG, "max_model_len": 128}))
    for penalty in (1.3, 0.7):
        params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=penalty)
        got = [o.output_token_ids for o in run(engine, [(p, params) for p in token_prompts])]
        for p, ours in zip(token_prompts, got):
            with torch.no_grad():
                out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                  do_sample=False, max_new_tokens=12, pad_token_id=0,
                                  repetition_penalty=penalty)
            assert ours == out[0, len(p):].tolist(), penalty


def test_min_tokens_holds_the_stop_tokens_back_exactly_that_long(tiny_model):
    """A bias of 100 makes the stop token the argmax at every step: without min_tokens the
    output is that token alone; with min_tokens=5, five other tokens come first."""
    engine = LLMEngine(tiny_model, EngineConfig(**CONFIG))
    base = dict(max_tokens=12, temperature=0.0, stop_token_ids=(7,), logit_bias={7: 100.0})
    at_once, held = run(engine, [([1, 2, 3], SamplingParams(**base)),
                                 ([1, 2, 3], SamplingParams(**base, min_tokens=5))])
    assert at_once.output_token_ids == [7]
    assert len(held.output_token_ids) == 6 and held.output_token_ids[-1] == 7
    assert 7 not in held.output_token_ids[:5]
    assert held.outputs[0].finish_reason == "stop"


def test_allowed_token_ids_bound_every_sample(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(**CONFIG))
    allowed = (3, 50, 77, 200)
    params = SamplingParams(max_tokens=16, temperature=1.5, n=2, seed=4,
                            allowed_token_ids=allowed)
    out, free = run(engine, [([9, 8, 7], params),
                             ([9, 8, 7], dataclasses.replace(params, allowed_token_ids=None))])
    for sample in out.outputs:
        assert set(sample.token_ids) <= set(allowed) and len(sample.token_ids) == 16
    assert not all(set(s.token_ids) <= set(allowed) for s in free.outputs)


@pytest.fixture(scope="module")
def byte_engine():
    """A random model over the byte tokenizer's vocabulary (264 ids, EOS 257)."""
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return LLMEngine(init_model(config, seed=3), EngineConfig(**CONFIG),
                     tokenizer=ByteTokenizer())


def test_bad_words_never_appear(byte_engine):
    """Over letters only (allowed_token_ids: the mask composes), a pair and a single letter the
    unconstrained greedy output holds are banned: neither appears, and the output still runs
    its full length."""
    tok = ByteTokenizer()
    prompt = tok.encode("the cat sat on the mat and the")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            allowed_token_ids=tuple(b"abcdefghijklmnopqrstuvwxyz"))
    free = run(byte_engine, [(prompt, greedy)])[0].outputs[0].text
    pair, single = free[3:5], free[0]  # words the unconstrained output holds
    assert pair in free and single in free
    banned = run(byte_engine, [(prompt, dataclasses.replace(greedy, bad_words=(pair,))),
                               (prompt, dataclasses.replace(greedy, bad_words=(single,)))])
    assert pair not in banned[0].outputs[0].text and len(banned[0].outputs[0].token_ids) == 24
    assert single not in banned[1].outputs[0].text


def test_bad_words_and_grammars_need_a_tokenizer(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(**CONFIG))
    for field, value in (("bad_words", ("x",)), ("structured_outputs", {"regex": "a+"})):
        with pytest.raises(ValueError, match=field) as error:
            engine.add_request([1, 2], SamplingParams(**{field: value}))
        assert error.value.field == field
    assert not engine.has_unfinished()
