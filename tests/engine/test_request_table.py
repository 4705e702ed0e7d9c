"""The engine's request table (pagedjax/engine/request_table.py, issue 72): one entry a request,
one way out. Whatever way a request ends (it finishes, it is aborted, it fails alone in a step,
every request fails with the engine's cache), nothing the engine kept for it stays behind: not its
entry, not its samples' token masks."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import until_done

from pagedjax import EngineConfig, LLMEngine, PoolingParams, SamplingParams
from pagedjax.engine.request_table import RequestState, RequestTable
from pagedjax.models import get_config, init_model
from pagedjax.scheduler import make_samples
from pagedjax.text.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def engine():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return LLMEngine(init_model(config, seed=2), EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
        num_blocks=40, min_seq_bucket=2), tokenizer=ByteTokenizer())


def params(**kwargs) -> SamplingParams:
    # min_tokens gives every sample a token-mask state (what the table's finish must drop)
    return SamplingParams(**{"max_tokens": 5, "temperature": 0.0, "ignore_eos": True,
                             "min_tokens": 2, **kwargs})


def assert_nothing_kept(engine) -> None:
    assert len(engine.requests) == 0 and not dict(engine.request_groups)
    assert not engine.token_masks._states


def test_finish_takes_the_entry_out_and_forgets_each_sample():
    forgotten = []
    table = RequestTable(forgotten.append)
    request = make_samples("r", [3, 4, 5], SamplingParams(n=3, max_tokens=2), seed=1,
                           arrival_time=0.0, eos_token_ids=())
    state = RequestState("r", [request, *request.followers], prompt_text="abc")
    table.add(state)
    assert table["r"] is state and dict(table.groups) == {"r": state.samples}
    with pytest.raises(ValueError, match="already"):
        table.add(RequestState("r", []))
    assert table.finish("r") is state and "r" not in table and len(table.groups) == 0
    assert forgotten == [s.request_id for s in state.samples] and len(forgotten) == 3
    assert table.finish("r") is None and len(forgotten) == 3


def test_versions_name_each_weight_a_requests_tokens_came_from():
    state = RequestState("r", [])
    assert state.record_version("0") == "0" and state.record_version("0") == "0"
    assert state.record_version("1") == ["0", "1"]


def test_a_finished_request_leaves_nothing(engine):
    ids = [engine.add_request([3, 4, 5, 6, 7], params(n=2)),
           engine.add_request([8, 9, 10], params())]
    engine.requests[ids[0]].prompt_text = "given"
    done = {}
    for _ in until_done(engine, 200):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == sorted(ids) and len(done[ids[0]].outputs) == 2
    assert done[ids[0]].prompt == "given"
    assert_nothing_kept(engine)


def test_an_aborted_request_leaves_nothing(engine):
    kept = engine.add_request([3, 4, 5, 6], params(max_tokens=20))
    aborted = engine.add_request([3, 4, 5, 6, 7], params(n=2, max_tokens=20))
    engine.step()
    engine.abort(aborted)
    assert list(engine.requests) == [kept] and aborted not in engine.scheduler.state.requests
    assert all(s.request_id in engine.token_masks for s in engine.requests[kept].samples)
    engine.abort(kept)
    assert_nothing_kept(engine)


def test_failed_requests_leave_nothing(engine):
    engine.add_request([3, 4, 5, 6], params(n=2))
    engine.add_request([3, 4, 5, 6, 7, 8], params())
    engine.step()
    outputs = engine.fail_all(RuntimeError("the device went away"))
    assert len(outputs) == 2 and all(o.finished and o.error for o in outputs)
    assert_nothing_kept(engine)


def test_a_pooling_request_finishes_through_the_table(engine):
    request_id = engine.add_pooling_request([3, 4, 5, 6, 7], PoolingParams(), "embed")
    assert engine.requests[request_id].pooling is not None
    done = []
    for _ in until_done(engine, 100):
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [request_id]
    assert done[0].outputs.data.shape == (engine.model_config.hidden_size,)
    assert_nothing_kept(engine)
