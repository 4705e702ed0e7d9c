"""Pooling requests through the engine (pagedjax.engine.pooling_requests) and LLM's pooling API,
against transformers' own forward and sentence-transformers' Pooling / Normalize modules on
small random checkpoints with their pooling configs: a Qwen3-Embedding-shaped model (last
token, normalized, Matryoshka dimensions), the same pooled by mean, a Llama sequence classifier
as a reward model, and a Qwen3 reranker scored through its yes / no logits. Chunked prefill in
4-token chunks, prefix-cache hits and steps shared with generation give the same vectors.

Tolerance: f32 end to end; the engine's paged attention and transformers' dense one sum in
different orders, so states agree to ~1e-6 relative: cosine >= 0.99999, values to 2e-5."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import until_done

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st_modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

from pooling_checkpoints import (ENGINE, PROMPTS, assert_close, save_random,  # noqa: E402
                                 st_reference, word_tokenizer, write_st_pipeline)

from pagedjax import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedjax.engine.request_checks import check_specs  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model  # noqa: E402
from pagedjax.pooling.params import PoolingParams  # noqa: E402
from pagedjax.scheduler import RequestError  # noqa: E402


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A Qwen3-Embedding-shaped checkpoint: last token, normalized, Matryoshka 16 / 32."""
    directory = tmp_path_factory.mktemp("qwen3-embedding")
    hf = save_random(directory, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32,
                     tie_word_embeddings=True, matryoshka_dimensions=[16, 32])
    write_st_pipeline(directory, "lasttoken", normalize=True)
    return directory, hf


def test_embed_equals_sentence_transformers_in_chunks_with_matryoshka(embedder):
    directory, hf = embedder
    llm = LLM(str(directory), runner="pooling", **ENGINE)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, ids in zip(outs, PROMPTS):
        assert out.outputs.hidden_size == 64
        assert_close(out.outputs.embedding, st_reference(hf, ids, "lasttoken", True))
    short = llm.embed(PROMPTS[:1], PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert_close(short.outputs.embedding, st_reference(hf, PROMPTS[0], "lasttoken", True, 16))
    raw = llm.embed(PROMPTS[:1], PoolingParams(normalize=False), use_tqdm=False)[0]
    assert_close(raw.outputs.embedding, st_reference(hf, PROMPTS[0], "lasttoken", False))
    # a shared prefix is computed once: the repeat hits the cache, same vector
    again = llm.encode([PROMPTS[0]], use_tqdm=False)[0]
    assert again.num_cached_tokens == 12
    assert_close(again.outputs.data, outs[0].outputs.embedding)
    with pytest.raises(RequestError, match="Matryoshka dimensions"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=20), use_tqdm=False)
    with pytest.raises(RequestError, match="supports only"):
        llm.embed(PROMPTS[:1], PoolingParams(use_activation=True), use_tqdm=False)
    with pytest.raises(RequestError, match="needs a classification head"):
        llm.classify(PROMPTS[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="needs runner='generate'"):
        llm.generate([PROMPTS[0]])
    with pytest.raises(RequestError, match="runner='pooling'"):  # no logits to sample from
        llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
    # admission control counts a pooling request's prompt tokens only
    admission, = check_specs(llm.engine, [llm.engine.pooling_spec(PROMPTS[0], None, "embed")])
    assert admission.num_tokens == len(PROMPTS[0])
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("fields", [{}, dict(async_scheduling=True)], ids=["sync", "async"])
def test_a_pooling_runner_builds_and_runs_no_sampler(embedder, monkeypatch, fields):
    """A pooling runner's sampled tokens are nobody's: no sampler program is compiled or run
    (its rows get token 0, what sampling its one zero logit column picked), the vectors are
    the same, async scheduling included (its placeholders filled from those host tokens)."""
    from pagedjax.engine import sampling_step

    def refuse(*args, **kwargs):
        raise AssertionError("a pooling runner built a sampler program")

    monkeypatch.setattr(sampling_step, "program", refuse)
    directory, hf = embedder
    llm = LLM(str(directory), runner="pooling", **ENGINE, **fields)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, ids in zip(outs, PROMPTS):
        assert_close(out.outputs.embedding, st_reference(hf, ids, "lasttoken", True))


def test_a_warmed_pooling_runner_compiles_nothing_more(embedder):
    """warmup() of a pooling runner compiles its step shapes with and without pooled rows
    (pooling_shapes; no sampler); embedding in chunks (a one-token chunk runs as a decode
    step) then compiles nothing."""
    from pagedjax.engine.warmup import pooling_shapes

    directory, hf = embedder
    llm = LLM(str(directory), runner="pooling", **{**ENGINE, "max_num_seqs": 2})
    assert llm.engine.warmup() == len(pooling_shapes(llm.engine.buckets))
    compiled = llm.engine.num_compiled_programs
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    stats = llm.engine.stats
    assert stats.num_steps > len(PROMPTS) and stats.num_decode_steps  # chunks, decode-kind too
    assert llm.engine.num_compiled_programs == compiled
    assert_close(outs[0].outputs.embedding, st_reference(hf, PROMPTS[0], "lasttoken", True))


def test_mean_pooling_mixed_with_generation_equals_alone(embedder):
    """MEAN needs every token's state: no prefix hits; pooled beside decoding requests in the
    same steps, vectors and generated tokens are those of each run alone."""
    directory, hf = embedder
    model = load_hf_model(str(directory))
    engine = LLMEngine(model, EngineConfig(**ENGINE))
    engine.pooling_model = type(engine.pooling_model)(
        engine.pooling_model.pooler.with_overrides({"pooling_type": "MEAN"}))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    gen_ids = [engine.add_request(p, greedy) for p in PROMPTS[1:]]
    for _ in range(2):
        engine.step()  # generation under way before the pooling requests come
    pool_ids = [engine.add_pooling_request(p, None, "embed") for p in PROMPTS + PROMPTS[:1]]
    done, mixed_steps = {}, 0
    for _ in until_done(engine, 200):
        plan_kinds = set()
        for out in engine.step():
            plan_kinds.add(type(out).__name__)
            if out.finished:
                done[out.request_id] = out
        mixed_steps += plan_kinds == {"RequestOutput", "PoolingRequestOutput"}
    assert mixed_steps >= 1
    for request_id, ids in zip(pool_ids, PROMPTS + PROMPTS[:1]):
        assert done[request_id].num_cached_tokens == 0
        assert_close(done[request_id].outputs.data, st_reference(hf, ids, "mean", True))
    alone = LLMEngine(model, EngineConfig(**ENGINE))
    alone_ids = [alone.add_request(p, greedy) for p in PROMPTS[1:]]
    finished = {}
    for _ in until_done(alone, 200):
        finished.update({o.request_id: o for o in alone.step() if o.finished})
    for a, b in zip(gen_ids, alone_ids):
        assert done[a].outputs[0].token_ids == finished[b].outputs[0].token_ids


def test_reward_model_and_classifier_equal_transformers(tmp_path):
    """LlamaForSequenceClassification (num_labels 1): runner auto is pooling; classify is the
    sigmoid of transformers' logit, reward the per-token scores (raw with use_activation
    false: the last = its logit; by default their sigmoid, as vLLM's)."""
    hf = save_random(tmp_path, "LlamaConfig", "LlamaForSequenceClassification", num_labels=1)
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.runner == "pooling"
    prompts = [p for p in PROMPTS]
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]
    probs = llm.classify(prompts, use_tqdm=False)
    rewards = llm.reward(prompts, PoolingParams(use_activation=False), use_tqdm=False)
    activated = llm.reward(prompts, use_tqdm=False)
    for p, w, c, r, a in zip(prompts, want, probs, rewards, activated):
        np.testing.assert_allclose(c.outputs.probs, 1 / (1 + np.exp(-w)), rtol=2e-5, atol=2e-6)
        assert r.outputs.data.shape == (len(p), 1)
        np.testing.assert_allclose(r.outputs.data[-1], w, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(a.outputs.data, 1 / (1 + np.exp(-r.outputs.data)),
                                   rtol=2e-5, atol=1e-6)
    with torch.no_grad():  # every token's reward: the head over each position's state
        states = hf.model(torch.tensor([prompts[0]])).last_hidden_state[0]
        per_token = hf.score(states).numpy()
    np.testing.assert_allclose(rewards[0].outputs.data, per_token, rtol=2e-5, atol=2e-5)


def test_qwen3_reranker_scores_through_yes_no_logits(tmp_path):
    """classifier_from_token ["no", "yes"]: score = softmax over (no, yes) of the causal LM's
    last-token logits, transformers' computation of Qwen3-Reranker's score."""
    hf = save_random(tmp_path, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32)
    word_tokenizer(tmp_path, {"no": 5, "yes": 7})
    llm = LLM(str(tmp_path), runner="pooling", **ENGINE,
              hf_overrides={"classifier_from_token": ["no", "yes"]})
    query, docs = "w10 w11 w12", ["w20 w21", "w30 w31 w32 w33 w34", "w40"]
    scores = llm.score(query, docs, use_tqdm=False)
    for doc, got in zip(docs, scores):
        ids = [int(w[1:]) for w in (query + " " + doc).split()]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        want = torch.softmax(logits[[5, 7]], dim=0)[1].item()
        assert got.outputs.score == pytest.approx(want, rel=2e-5, abs=2e-6)
    with pytest.raises(ValueError, match="not served"):
        LLM(str(tmp_path), runner="pooling", **ENGINE, hf_overrides={"rope_theta": 1.0})


def test_pooling_rows_mark_the_states_each_request_reads():
    """A step's pooling_rows: every prompt token of an "all" request, the last prompt token
    of a "last" request only in the chunk that holds it, nothing for generation rows."""
    from pagedjax.scheduler import Request
    from pagedjax.scheduler.plan_rows import pooling_rows

    def request(pooling, length):
        r = Request(pooling or "gen", list(range(1, length + 1)), SamplingParams(max_tokens=1),
                    seed=0, arrival_time=0.0)
        r.pooling = pooling
        return r

    last, every, gen = request("last", 10), request("all", 6), request(None, 5)
    rows = pooling_rows([(last, 4, 4), (every, 2, 4), (gen, 0, 5)], 16)
    np.testing.assert_array_equal(rows, [0] * 4 + [1] * 4 + [0] * 8)
    rows = pooling_rows([(last, 8, 2), (gen, 5, 1)], 4)
    np.testing.assert_array_equal(rows, [0, 1, 0, 0])
    assert pooling_rows([(gen, 0, 5)], 8).shape == (0,)


@pytest.mark.parametrize("fields", [dict(async_scheduling=True),
                                    dict(num_blocks=12, max_num_seqs=3)],
                         ids=["async-scheduling", "preempted"])
def test_pooling_survives_async_scheduling_and_preemption(embedder, fields):
    """Async scheduling (a step scheduled before the last one's results are in) and a pool so
    small that requests are preempted and recomputed: the same vectors, every pool fed each
    position once (MEAN: a doubled row would show)."""
    directory, hf = embedder
    engine = LLMEngine(load_hf_model(str(directory)), EngineConfig(**{**ENGINE, **fields}))
    engine.pooling_model = type(engine.pooling_model)(
        engine.pooling_model.pooler.with_overrides({"pooling_type": "MEAN"}))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS + [[40 + i for i in range(20)]]
    gen_ids = [engine.add_request(p, greedy) for p in prompts[:2]]
    pool_ids = [engine.add_pooling_request(p, None, "embed") for p in prompts]
    done = {}
    for _ in until_done(engine, 400):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    if "num_blocks" in fields:
        assert engine.stats.num_preemptions > 0
    for request_id, ids in zip(pool_ids, prompts):
        assert done[request_id].error is None
        assert_close(done[request_id].outputs.data, st_reference(hf, ids, "mean", True))
    assert all(len(done[i].outputs[0].token_ids) == 12 for i in gen_ids)


def test_truncate_prompt_tokens_keeps_the_last_tokens(embedder):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as max_model_len
    allows); 0, a non-integer and more than max_model_len refused by name."""
    directory, hf = embedder
    llm = LLM(str(directory), runner="pooling", **ENGINE)
    cut = llm.embed(PROMPTS[:1], use_tqdm=False, truncate_prompt_tokens=5)[0]
    assert cut.prompt_token_ids == PROMPTS[0][-5:]
    assert_close(cut.outputs.embedding, st_reference(hf, PROMPTS[0][-5:], "lasttoken", True))
    whole = llm.embed(PROMPTS[:1], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == PROMPTS[0]
    for bad in (0, -2, 1.5, True, ENGINE["max_model_len"] + 1):
        with pytest.raises(RequestError, match="truncate_prompt_tokens"):
            llm.embed(PROMPTS[:1], PoolingParams(truncate_prompt_tokens=bad), use_tqdm=False)


def test_pooling_over_data_parallel_replicas(embedder):
    """Two replicas (over one CPU device, as the placement tests run them) share the
    PoolingModel set on the engine; requests sharing a prompt head land on one replica (its
    prefix cache), a new head on the other, and every vector is sentence-transformers'."""
    import jax

    from pagedjax.frontend.data_parallel import DataParallelEngine

    directory, hf = embedder
    device = jax.devices()[0]
    engine = DataParallelEngine(load_hf_model(str(directory)), EngineConfig(
        **{**ENGINE, "data_parallel_size": 2, "runner": "pooling"}), devices=[device, device])
    assert engine.runner_type == "pooling"
    engine.pooling_model = type(engine.pooling_model)(
        engine.pooling_model.pooler.with_overrides({"pooling_type": "LAST"}))
    assert all(r.pooling_model is engine.pooling_model for r in engine.replicas)
    head = PROMPTS[0][:8]
    prompts = [head + [90 + i, 91] for i in range(3)] + [[100 + i for i in range(10)]]
    first = engine.add_pooling_request(prompts[0], None, "embed")
    for _ in until_done(engine, 100):
        engine.step()
    ids = [engine.add_pooling_request(p, PoolingParams(normalize=False), "embed")
           for p in prompts[1:]]
    on = [{r for r, rep in enumerate(engine.replicas) if i in rep.request_groups} for i in ids]
    assert on[0] == on[1] != on[2]  # the shared head where its blocks are, a new one aside
    done = {}
    for _ in until_done(engine, 100):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for request_id, ids_ in zip(ids, prompts[1:]):
        assert_close(done[request_id].outputs.data,
                     st_reference(hf, ids_, "lasttoken", False))
    assert sum(done[i].num_cached_tokens for i in ids[:2]) == 16  # the head's two blocks each
    assert first not in done
    with pytest.raises(RequestError, match="runner='pooling'"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
