"""New weights in place (issue 52: LLMEngine.update_weights, pause_generation, weight versions,
reset_prefix_cache): after an update every output equals a fresh engine's built from the new
weights, the same prompt before and after included (no block computed by the old weights is a
hit: device, host tier, disk tier); requests in flight as `wait`, `abort` and `keep` say, each
output naming the weights it was sampled under; nothing recompiles; bad weights refused by name
before anything changes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import until_done

from pagedjax import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedjax.engine.runner import num_step_compiles
from pagedjax.models import get_config, init_model
from pagedjax.text.tokenizer import ByteTokenizer

CONFIG = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
              num_blocks=48, min_seq_bucket=4)
BLOCK_BYTES = 2048  # debug-tiny: 2 * 2 layers * 4 tokens * 2 KV heads * 16 dims * 4 bytes


@pytest.fixture(scope="module")
def models():
    """The weights served first and the trainer's next ones (another seed: other tokens)."""
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return init_model(config, seed=1), init_model(config, seed=2)


def engine_for(model, **overrides) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{**CONFIG, **overrides}), tokenizer=ByteTokenizer())


def requests():
    """Greedy with logprobs, seeded sampling, n = 2, and a prompt sharing a 24-token prefix (a
    prefix hit the second time round)."""
    tok = ByteTokenizer()
    shared = "a shared prefix, 24 tok "
    return [
        (tok.encode(shared + "one"), SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)),
        (tok.encode(shared + "two"), SamplingParams(max_tokens=8, temperature=0.8, seed=3)),
        (tok.encode("samples "), SamplingParams(max_tokens=6, temperature=0.9, seed=4, n=2)),
    ]


def run(engine, batch) -> list:
    ids = [engine.add_request(p, sp) for p, sp in batch]
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def summary(outputs) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def assert_same(got, expected) -> None:
    assert summary(got) == summary(expected)
    for a, b in zip(got, expected):  # f32: the same batch, the same programs
        for x, y in zip(a.outputs[0].logprobs or (), b.outputs[0].logprobs or ()):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([v.logprob for v in x.values()],
                                       [v.logprob for v in y.values()], atol=1e-5)


@pytest.mark.parametrize("tiers", ["device", pytest.param("host_and_disk",
                                                         marks=pytest.mark.slow)])
def test_after_an_update_every_output_is_a_fresh_engines(models, tmp_path, tiers):
    old, new = models
    extra = {} if tiers == "device" else dict(
        kv_offload_bytes=8 * BLOCK_BYTES, kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 22)
    engine = engine_for(old, **extra)
    before = run(engine, requests())
    assert_same(before, run(engine_for(old), requests()))
    assert {o.weight_version for o in before} == {"0"}
    compiles = num_step_compiles()
    engine.update_weights(new, version="step-1")
    after = run(engine, requests())  # the same prompts: their blocks are the old weights'
    assert num_step_compiles() == compiles  # the same shapes, the same programs
    assert_same(after, run(engine_for(new), requests()))
    assert summary(after) != summary(before)
    assert {o.weight_version for o in after} == {"step-1"} and engine.weight_version == "step-1"
    engine.update_weights(nnx.state(old))  # back, from an nnx.State: version 2 by default
    assert_same(run(engine, requests()), before)
    assert engine.weight_version == "2"
    engine.close()


def test_wait_finishes_what_is_in_flight_on_the_old_weights(models):
    old, new = models
    tok = ByteTokenizer()
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = [(tok.encode(f"in flight {i}"), greedy) for i in range(2)]
    later = [(tok.encode("queued before the update"), greedy)]
    expected_old, expected_new = run(engine_for(old), first), run(engine_for(new), later)
    engine = engine_for(old)
    ids = [engine.add_request(p, sp) for p, sp in first]
    outputs = engine.step() + engine.step()  # both running, a few tokens in
    late = engine.add_request(*later[0])  # never ran
    engine.update_weights(new, mode="wait")
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs and summary([done[i] for i in ids]) == summary(expected_old)
    assert summary([done[late]]) == summary(expected_new)
    assert [done[i].weight_version for i in (*ids, late)] == ["0", "0", "1"]


def test_a_request_that_waited_for_room_keeps_no_hash_of_the_old_weights(models):
    """B shares A's 24-token prompt but finds no room while A runs (its blocks' hashes computed,
    under the old weights' key); the update waits for A, whose blocks stay cached: B, admitted
    on the new weights, must not hit them (its tokens are a fresh engine's on the new weights)."""
    old, new = models
    tok = ByteTokenizer()
    shared = tok.encode("a shared prefix, 24 tok ")
    greedy = SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True)  # 44 tokens
    small = dict(num_blocks=12, max_num_seqs=2)  # 11 blocks: A's 11 at the end
    b = (shared + tok.encode("and seventeen mor")[1:], SamplingParams(  # 42 + 2 tokens
        max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=1))
    expected = run(engine_for(new, **small), [b])
    engine = engine_for(old, **small)
    a_id = engine.add_request(shared, greedy)
    engine.step(), engine.step()
    b_id = engine.add_request(*b)
    engine.step()
    assert engine.scheduler.state.waiting and engine.scheduler.state.waiting[0].block_hashes
    engine.update_weights(new)
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[a_id].weight_version == "0" and done[b_id].weight_version == "1"
    assert summary([done[b_id]]) == summary(expected)
    np.testing.assert_allclose(  # f32: B's prompt computed in other chunks than there
        [next(iter(s.values())).logprob for s in done[b_id].outputs[0].logprobs],
        [next(iter(s.values())).logprob for s in expected[0].outputs[0].logprobs], atol=1e-4)


def test_abort_ends_what_is_in_flight_and_keep_carries_it_over(models):
    old, new = models
    tok = ByteTokenizer()
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = tok.encode("in flight")
    full_old = run(engine_for(old), [(prompt, greedy)])[0].outputs[0].token_ids
    for mode in ("abort", "keep"):
        engine = engine_for(old)
        request_id = engine.add_request(prompt, greedy)
        for _ in range(3):
            engine.step()  # the prompt, then two tokens
        engine.update_weights(new, mode=mode)
        done = {}
        for _ in until_done(engine):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        out = done[request_id]
        tokens = out.outputs[0].token_ids
        assert tokens[:3] == full_old[:3]
        if mode == "abort":
            assert out.finish_reason == "abort" and len(tokens) == 3
            assert out.weight_version == "0"
        else:  # on the new weights from the fourth token, over the old weights' KV
            assert out.finish_reason == "length" and len(tokens) == 10
            assert out.weight_version == ["0", "1"]
        assert engine.scheduler.kv_manager.num_used_blocks == 0


def test_pause_and_resume(models):
    old, _ = models
    tok = ByteTokenizer()
    engine = engine_for(old)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = run(engine_for(old), [(tok.encode("pause me"), greedy)])
    request_id = engine.add_request(tok.encode("pause me"), greedy)
    engine.step()
    engine.pause_generation("keep")
    assert engine.is_paused and engine.step() == [] and engine.step() == []
    engine.resume_generation()
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert summary([done[request_id]]) == summary(expected)
    with pytest.raises(ValueError, match=r"mode must be one of \['abort', 'wait', 'keep'\]"):
        engine.pause_generation("drop")


def test_drafted_structured_and_beam_outputs_after_an_update_are_a_fresh_engines(models):
    """Prompt-lookup drafts (verified by the new weights), a choice constrained by a grammar
    (seeded sampling) and beam search: after update_weights each equals what an engine built
    from the new weights gives."""
    from pagedjax.engine.beam_search import BeamSearchParams, beam_search

    old, new = models
    tok = ByteTokenizer()
    drafting = dict(speculative_config=dict(method="ngram", num_speculative_tokens=2,
                                            prompt_lookup_min=1, prompt_lookup_max=2))
    batch = [(tok.encode("ab ab ab ab ab "), SamplingParams(max_tokens=8, temperature=0.0)),
             (tok.encode("pick one: "), SamplingParams(
                 max_tokens=8, temperature=0.9, seed=5,
                 structured_outputs=dict(choice=["red", "green", "blue"])))]
    engine = engine_for(old, **drafting)
    run(engine, batch)
    engine.update_weights(new)
    fresh = engine_for(new, **drafting)
    assert_same(run(engine, batch), run(fresh, batch))
    assert engine.stats.num_spec_draft_tokens > 0
    beams = BeamSearchParams(beam_width=2, max_tokens=4)  # (an engine without drafts)
    searching = engine_for(old)
    beam_search(searching, [tok.encode("beams ")], beams)
    searching.update_weights(new)
    got = beam_search(searching, [tok.encode("beams ")], beams)
    expected = beam_search(engine_for(new), [tok.encode("beams ")], beams)
    assert [[b.token_ids for b in r] for r in got] == [[b.token_ids for b in r]
                                                       for r in expected]


def test_bad_weights_are_refused_by_name_and_change_nothing(models):
    old, new = models
    engine = engine_for(old)
    before = run(engine, requests())
    other = init_model(dataclasses.replace(old.config, intermediate_size=96), seed=0)
    with pytest.raises(ValueError, match="another config than the engine's .differs in "
                                         "intermediate_size"):
        engine.update_weights(other)
    state = nnx.state(new)
    leaf_path, _ = jax.tree_util.tree_flatten_with_path(state)[0][0]
    for change, refusal in [(lambda x: x.astype(np.int32), r"is int32\[.*a float dtype"),
                            (lambda x: x[..., :-1], r"is float32\[.*takes a float dtype")]:
        bad = jax.tree_util.tree_map_with_path(
            lambda path, x: change(x) if path == leaf_path else x, state)  # noqa: B023
        with pytest.raises(ValueError, match=r"weights: embed_tokens/embedding " + refusal):
            engine.update_weights(bad)
    for bad_version in ("", 7, "v" * 300):
        with pytest.raises(ValueError, match="version must be a non-empty string"):
            engine.update_weights(new, version=bad_version)
    with pytest.raises(ValueError, match="weights must be a model of the engine's family"):
        engine.update_weights(object())
    flat = list(nnx.to_flat_state(state))
    partial = nnx.from_flat_state(flat[:3] + flat[4:])  # one parameter left out
    with pytest.raises(ValueError, match="the nnx.State misses some of the model's parameters"):
        engine.update_weights(partial)
    assert not engine.is_sleeping and not engine.is_paused  # a refusal changes nothing
    assert engine.weight_version == "0" and engine.num_weight_updates == 0
    assert_same(run(engine, requests()), before)


def test_reset_prefix_cache(models):
    old, _ = models
    # a small pool: what the device evicts goes to the host tier
    engine = engine_for(old, kv_offload_bytes=8 * BLOCK_BYTES, num_blocks=16)
    run(engine, requests())
    hits = engine.stats.num_prefix_hit_tokens
    run(engine, requests()[:1])
    assert engine.stats.num_prefix_hit_tokens > hits  # the first prompt's blocks: hits
    engine.add_request(*requests()[0])
    engine.step()
    assert engine.reset_prefix_cache() is False  # a request holds blocks
    for _ in until_done(engine):
        engine.step()
    assert engine.scheduler.kv_manager.host_tier.num_used_blocks > 0
    assert engine.reset_prefix_cache() is True
    assert engine.scheduler.kv_manager.host_tier.num_used_blocks == 0
    hits = engine.stats.num_prefix_hit_tokens
    run(engine, requests()[:1])
    assert engine.stats.num_prefix_hit_tokens == hits  # nothing cached any more


def test_llm_takes_a_checkpoint_path(models, tmp_path):
    from pagedjax.models.loading.checkpoint import save_checkpoint

    old, new = models
    save_checkpoint(new, str(tmp_path / "next"))
    llm = LLM(old, tokenizer="byte", **CONFIG)
    prompts = [ByteTokenizer().encode("checkpoint")]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.update_weights(str(tmp_path / "next"), version="ckpt")
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    fresh = LLM(new, tokenizer="byte", **CONFIG).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert summary(got) == summary(fresh) and got[0].weight_version == "ckpt"
    assert llm.weight_version == "ckpt"


@pytest.mark.slow  # two replicas; test_weight_updates_parallel runs them on their own devices
def test_every_data_parallel_replica_takes_the_update(models):
    """Two replicas (over one CPU device, as tests/parallel/test_data_parallel_placement.py runs them):
    both serve the new weights, and requests in flight on each finish as `abort` says."""
    from pagedjax.frontend.data_parallel import DataParallelEngine

    old, new = models
    device = jax.devices()[0]
    engine = DataParallelEngine(old, EngineConfig(**CONFIG, data_parallel_size=2),
                                tokenizer=ByteTokenizer(), devices=[device, device])
    tok = ByteTokenizer()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = [(tok.encode(f"replica {i} " * (i + 1)), greedy) for i in range(4)]
    ids = [engine.add_request(p, sp) for p, sp in batch]
    engine.step()
    assert all(r.has_unfinished() for r in engine.replicas)  # work on both
    engine.update_weights(new, version="dp", mode="abort")
    aborted = {o.request_id: o for o in engine.step(final_only=True)}
    assert sorted(aborted) == sorted(ids) and {o.finish_reason for o in aborted.values()} == {
        "abort"}
    assert engine.weight_version == "dp" and not engine.has_unfinished()
    after = run(engine, batch)
    assert summary(after) == summary(run(engine_for(new), batch))
    assert {o.weight_version for o in after} == {"dp"}
    assert engine.reset_prefix_cache() is True


@pytest.mark.slow  # an int8 engine twice: make test-slow
def test_a_quantized_engine_quantizes_what_it_receives(models):
    """An int8 engine's update equals an int8 engine built from the new weights."""
    old, new = models
    engine = engine_for(old, quantization="int8")
    run(engine, requests())
    engine.update_weights(new)
    assert_same(run(engine, requests()), run(engine_for(new, quantization="int8"), requests()))


def test_an_update_that_fails_part_way_leaves_the_weights_asleep(models, monkeypatch):
    """Checked, then written leaf by leaf into the old leaves' buffers (never two copies); a
    write that fails part way (device memory) leaves mixed weights: the engine refuses requests
    by name until an update succeeds."""
    from pagedjax.engine import weight_writer
    from pagedjax.engine.sleep_mode import EngineAsleepError

    old, new = models
    engine = engine_for(old)
    run(engine, requests())
    real, written = weight_writer.write_leaf, []

    def out_of_memory(*args):
        if len(written) == 3:
            raise MemoryError("RESOURCE_EXHAUSTED: writing a leaf")
        written.append(real(*args))
        return written[-1]

    monkeypatch.setattr(weight_writer, "write_leaf", out_of_memory)
    with pytest.raises(RuntimeError, match=r"failed after 3 of \d+ leaves .*RESOURCE_EXHAUSTED"):
        engine.update_weights(new)
    assert engine.is_sleeping and engine.runner.params is None
    with pytest.raises(EngineAsleepError, match="weights off the device"):
        engine.add_request([1, 2, 3])
    monkeypatch.setattr(weight_writer, "write_leaf", real)
    engine.update_weights(new)
    assert not engine.is_sleeping
    assert_same(run(engine, requests()), run(engine_for(new), requests()))


def test_the_callers_arrays_stay_theirs(models):
    """The engine copies the caller's arrays (a trainer may donate or delete them next): once
    the update is done, deleting every array of the model it came from changes nothing; the
    model the engine was built from keeps its arrays (the leaves the engine shares with it are
    written anew, not donated)."""
    old, _ = models
    engine = engine_for(old)
    assert engine.runner.borrowed  # the embedding, norm, head: old's buffers, not copied
    trainer = init_model(old.config, seed=2)  # the same weights as `new`
    engine.update_weights(trainer)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(nnx.state(old)))
    assert not engine.runner.borrowed
    expected = run(engine_for(models[1]), requests())
    for leaf in jax.tree.leaves(nnx.state(trainer)):
        leaf.delete()
    assert_same(run(engine, requests()), expected)


def test_held_new_requests_wait_and_a_stuck_scheduler_is_named(models, monkeypatch):
    """hold_new_requests (a server's drain): the request in flight runs to its end, the new one
    waits without the engine calling that a stall, and runs once released. Without a hold, a
    step in which the scheduler moves nothing while requests wait is a RuntimeError naming it,
    not a silent empty step."""
    engine = engine_for(models[0])
    running = engine.add_request([3, 4, 5, 6], SamplingParams(max_tokens=6, temperature=0.0))
    engine.step()  # its prompt: in flight now
    engine.hold_new_requests()
    held = engine.add_request([7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0))
    done = {}
    for _ in range(50):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if running in done:
            break
    assert running in done and held not in done
    assert engine.step() == [] and not engine.has_work  # held: nothing to do, nothing raised
    engine.release_new_requests()
    for _ in until_done(engine, 50):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done[held].outputs[0].token_ids) == 3
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0))
    empty = dataclasses.replace(engine.scheduler.schedule(engine.clock()), scheduled=[])
    monkeypatch.setattr(engine, "_schedule", lambda: empty)
    with pytest.raises(RuntimeError, match="no progress"):
        engine.step()
