"""n > 1 and best_of: one prompt computation, shared blocks, copy-on-write, seeded samples."""

import numpy as np
import pytest
from helpers import until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams

BLOCK = 4
PROMPT = list(range(40, 58))  # 18 tokens: 4 full blocks and a shared, partly filled fifth


def engine(model, **kwargs):
    base = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, min_seq_bucket=8,
                block_size=BLOCK)
    return LLMEngine(model, EngineConfig(**{**base, **kwargs}))


def generate(eng, requests):
    ids = [eng.add_request(p, sp) for p, sp in requests]
    done = {}
    for _ in until_done(eng):
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[i] for i in ids]


def sampled(seed, n=1, best_of=None, max_tokens=10):
    return SamplingParams(max_tokens=max_tokens, temperature=1.5, seed=seed, n=n,
                          best_of=best_of)


@pytest.mark.parametrize("engine_kwargs", [dict(), dict(num_blocks=14, max_num_batched_tokens=8)],
                         ids=["roomy", "preemption"])
def test_each_sample_equals_its_seed_run_alone(tiny_model, engine_kwargs):
    together = generate(engine(tiny_model, **engine_kwargs), [(PROMPT, sampled(7, n=4))])[0]
    alone = [generate(engine(tiny_model), [(PROMPT, sampled(7 + i))])[0].output_token_ids
             for i in range(4)]
    assert [o.token_ids for o in together.outputs] == alone
    assert len({tuple(a) for a in alone}) == 4, "seeds were meant to give different samples"
    assert [o.index for o in together.outputs] == [0, 1, 2, 3]


def test_prompt_blocks_are_stored_once_and_partial_block_copied_on_write(tiny_model):
    eng = engine(tiny_model, max_num_batched_tokens=32)
    eng.add_request(PROMPT, sampled(1, n=4, max_tokens=4))
    kv = eng.scheduler.kv_manager
    eng.step()  # the prompt, computed once; 4 first tokens from its logits; then the fork
    assert kv.num_used_blocks == 5  # vs 4 x 5 = 20 for independent requests
    tables = [kv.get_block_table(f"0#{i}") for i in range(4)]
    assert all(t == tables[0] for t in tables)
    assert all(kv.pool.ref_counts[b] == 4 for b in tables[0])
    eng.step()  # each sample writes position 18, inside the shared block: three copy on write
    tables = [kv.get_block_table(f"0#{i}") for i in range(4)]
    assert kv.num_used_blocks == 5 + 3
    assert len({t[4] for t in tables}) == 4 and all(t[:4] == tables[0][:4] for t in tables)
    for _ in until_done(eng):
        eng.step()
    assert kv.num_used_blocks == 0


def test_greedy_samples_are_identical(tiny_model):
    out = generate(engine(tiny_model), [(PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                                n=3))])[0]
    solo = generate(engine(tiny_model), [(PROMPT, SamplingParams(max_tokens=6,
                                                                 temperature=0.0))])[0]
    assert [o.token_ids for o in out.outputs] == [solo.output_token_ids] * 3


def test_best_of_keeps_the_most_likely(tiny_model):
    out = generate(engine(tiny_model), [(PROMPT, sampled(3, n=2, best_of=5))])[0]
    assert len(out.outputs) == 2
    alone = [generate(engine(tiny_model), [(PROMPT, sampled(3 + i))])[0] for i in range(5)]
    ranked = sorted(alone, key=lambda o: -o.outputs[0].cumulative_logprob)
    assert [o.token_ids for o in out.outputs] == [r.output_token_ids for r in ranked[:2]]
    np.testing.assert_allclose([o.cumulative_logprob for o in out.outputs],
                               [r.outputs[0].cumulative_logprob for r in ranked[:2]], rtol=1e-5)


def test_mixed_batch_with_parallel_and_single_requests(tiny_model):
    requests = [(PROMPT, sampled(5, n=3)), (list(range(3, 30)), sampled(9)),
                (list(range(100, 105)), sampled(11, n=2))]
    together = generate(engine(tiny_model), requests)
    for (prompt, params), out in zip(requests, together):
        for i, sample in enumerate(out.outputs):
            solo = generate(engine(tiny_model), [(prompt, sampled(params.seed + i))])[0]
            assert sample.token_ids == solo.output_token_ids


def test_abort_before_and_after_the_fork(tiny_model):
    eng = engine(tiny_model, max_num_batched_tokens=8)  # the prompt takes 3 steps
    a = eng.add_request(PROMPT, sampled(1, n=3))
    eng.step()
    eng.abort(a)  # leader mid-prefill, followers not forked yet
    assert not eng.has_unfinished() and eng.scheduler.kv_manager.num_used_blocks == 0
    assert eng.scheduler.state.num_followers == 0
    b = eng.add_request(PROMPT, sampled(1, n=3))
    for _ in range(4):
        eng.step()
    eng.abort(b)
    assert not eng.has_unfinished() and eng.scheduler.kv_manager.num_used_blocks == 0


def test_n_is_validated(tiny_model):
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)
    eng = engine(tiny_model)
    with pytest.raises(ValueError, match="max_num_seqs"):
        eng.add_request(PROMPT, SamplingParams(n=9))
    assert not eng.has_unfinished()
