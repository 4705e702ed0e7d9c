"""The user-facing surface: LLM.generate, bf16 serving, the CLI."""

import jax
import jax.numpy as jnp
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.tools.cli import main as cli_main

SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, min_seq_bucket=4,
             block_size=8)


def test_generate_returns_outputs_in_prompt_order_with_timings():
    llm = LLM("debug-tiny", **SMALL)
    prompts = [[5] * 30, [1, 2], [7] * 12]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (3, 9, 5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.output_token_ids) for o in outputs] == [3, 9, 5]
    for out in outputs:
        assert out.finished and out.finish_reason == "length"
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_stop_tokens_finish_with_stop():
    llm = LLM("debug-tiny", **SMALL)
    first = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False)[0]
    stop_id = first.output_token_ids[1]
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0,
                                                   stop_token_ids=(stop_id,)), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.output_token_ids == first.output_token_ids[:first.output_token_ids.index(stop_id) + 1]


def test_bf16_engine_serves_with_a_bf16_cache():
    llm = LLM("debug-tiny", dtype="bfloat16", **SMALL)
    assert all(c.dtype == jnp.bfloat16 for c in jax.tree.leaves(llm.engine.runner.kv_cache))
    outputs = llm.generate([[1, 2, 3], [4] * 40], SamplingParams(max_tokens=6, temperature=0),
                           use_tqdm=False)
    assert [len(o.output_token_ids) for o in outputs] == [6, 6]
    assert llm.engine.scheduler.kv_manager.num_used_blocks == 0


def test_memory_budget_sets_the_pool():
    llm = LLM("debug-tiny", **{**SMALL, "kv_cache_memory_bytes": 100_000})
    engine = llm.engine
    # debug-tiny: 2 layers, 2 KV heads, head dim 16, f32, block 8 -> 2*2*8*2*16*4 = 4096 B/block
    assert engine.bytes_per_block == 4096
    assert engine.num_blocks == 100_000 // 4096


def test_cli_capacity_uses_the_kv_formula(capsys):
    cli_main(["capacity", "--model", "llama-3-8b", "--kv-memory-gib", "1", "--context", "1024"])
    out = capsys.readouterr().out
    assert "131,072" in out  # bytes per token, bf16
    assert "2,097,152" in out  # bytes per 16-token block
    with pytest.raises(SystemExit):
        cli_main(["capacity", "--kv-memory-gib", "-1"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve-everything"])
    assert exit_info.value.code == 2
    assert "unknown command 'serve-everything'" in capsys.readouterr().err


def test_final_only_steps_return_each_request_once_when_it_finishes(tiny_model):
    """LLM.generate's output kind: no per-step copies of unfinished requests, and the finished
    outputs are those every-step outputs end with."""
    from helpers import until_done

    from pagedjax import EngineConfig, LLMEngine

    results = {}
    for final_only in (False, True):
        engine = LLMEngine(tiny_model, EngineConfig(max_model_len=64, max_num_seqs=4))
        ids = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0)),
               engine.add_request([4, 5], SamplingParams(max_tokens=7, temperature=0))]
        outputs = []
        for _ in until_done(engine):
            outputs += engine.step(final_only=final_only)
        assert not final_only or all(o.finished for o in outputs)
        results[final_only] = {o.request_id: o.output_token_ids for o in outputs if o.finished}
        assert sorted(results[final_only]) == sorted(ids)
        assert len(outputs) == (2 if final_only else 3 + 7)
    assert results[True] == results[False]
