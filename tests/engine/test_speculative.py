"""Speculative decoding in the engine (issue 38): with n-gram drafts the engine's tokens equal
plain decoding's token for token, greedy and seeded sampling alike (the drafts are verified by
coupling with plain sampling: pagedjax/engine/spec_decode/rejection_sampler.py), over a batch with chunked
prefill, preemption, prefix hits, stop strings, stop token ids, a grammar, penalties, logprobs and
n > 1; rejected drafts roll back to the block tables and pool counts of plain decoding; the
per-step switch-off, the config's validation and beam search's refusal."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import run_requests as run

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.engine.beam_search import BeamSearchParams, beam_search
from pagedjax.engine.spec_decode.config import SpeculativeConfig
from pagedjax.engine.warmup import warmup_shapes
from pagedjax.models import get_config, init_model
from pagedjax.scheduler import Request, Scheduler, SchedulerConfig
from pagedjax.text.tokenizer import ByteTokenizer

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def byte_model():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return init_model(config, seed=5)


def make_engine(model, spec, draft_model=None, **overrides):
    config = dict(max_model_len=192, max_num_seqs=6, max_num_batched_tokens=32, block_size=4,
                  num_blocks=64, speculative_config=spec)
    return LLMEngine(model, EngineConfig(**{**config, **overrides}), tokenizer=ByteTokenizer(),
                     draft_model=draft_model)



def mixed_batch(tok, stop_text: str, stop_token: int):
    """Prompts sharing a 24-token prefix (prefix hits), one longer than the token budget
    (chunked prefill), repeating text (n-gram drafts), and every way a request may stop."""
    shared = "the paged cache: abc abc abc "
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    return [
        (tok.encode(shared + "xyz xyz xyz xyz"), dataclasses.replace(greedy, stop=[stop_text])),
        (tok.encode(shared + "12 12 12 12 12"), greedy),
        (tok.encode("one long prompt " * 4), dataclasses.replace(
            greedy, stop_token_ids=[stop_token], logprobs=3)),
        # its prompt's n-grams continue with "z", which its grammar refuses
        (tok.encode(shared + "abz abz abz"), dataclasses.replace(
            greedy, structured_outputs=dict(regex="[ab]{4,40}"))),
        (tok.encode(shared + "q r q r"), SamplingParams(
            max_tokens=40, temperature=0.9, top_k=40, presence_penalty=0.4, seed=7, n=2,
            logprobs=2)),
        (tok.encode("short"), dataclasses.replace(greedy, max_tokens=3)),
    ]


def first_new(tokens: list[int], printable: bool = False) -> int:
    """The first token from the 10th on that did not occur before (a printable ASCII one)."""
    for i in range(10, len(tokens)):
        if tokens[i] not in tokens[:i] and (not printable or 33 <= tokens[i] < 127):
            return tokens[i]
    raise AssertionError(f"no new token after the 10th in {tokens}")


# The n-gram proposer over a whole mixed batch (Predicted Outputs' equal-tokens test runs in make
# test; a draft model's, as this one, in make test-slow).
@pytest.mark.slow
def test_tokens_equal_plain_decoding_over_a_mixed_batch(byte_model):
    tok = ByteTokenizer()
    # the stop string and stop token: from the plain engine's own outputs, mid-way
    probe = run(make_engine(byte_model, None), mixed_batch(tok, "\x00never", 263)[:3])
    stop_text = chr(first_new(probe[0].outputs[0].token_ids, printable=True))
    stop_token = first_new(probe[2].outputs[0].token_ids)
    requests = mixed_batch(tok, stop_text, stop_token)
    assert len(requests[2][0]) > 32  # longer than the token budget: chunked
    plain = run(make_engine(byte_model, None, num_blocks=32), requests)
    engine = make_engine(byte_model, NGRAM, num_blocks=32)  # too few: preemption
    spec = run(engine, requests)
    stats = engine.stats
    assert stats.num_spec_accepted_tokens > 0  # drafts were accepted ...
    assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens  # ... and rejected
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    assert plain[0].outputs[0].stop_reason == stop_text  # the stops did cut
    assert plain[2].outputs[0].finish_reason == "stop"
    for a, b in zip(plain, spec):
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids
            assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason,
                                                                x.stop_reason)
            assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-3)
            if x.logprobs:  # f32: the same logits from a ragged step and a decode step
                for lx, ly in zip(x.logprobs, y.logprobs):
                    assert lx.keys() == ly.keys()
                    for t in lx:
                        assert ly[t].logprob == pytest.approx(lx[t].logprob, abs=1e-4)
                        assert (ly[t].rank, ly[t].decoded_token) == (lx[t].rank,
                                                                     lx[t].decoded_token)


@pytest.mark.slow  # 8 s: make test-slow
def test_a_sliding_window_model_frees_nothing_a_rollback_needs(byte_model):
    """Every layer windowed (8 tokens, blocks of 4 freed as they leave it): drafts rolled back
    over freed blocks still give plain decoding's tokens, and the pool ends as full as it
    began."""
    model = init_model(dataclasses.replace(byte_model.config, sliding_window=8), seed=3)
    tok = ByteTokenizer()
    requests = [(tok.encode(f"{i} window window window"), SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(3)]
    plain = run(make_engine(model, None), requests)
    engine = make_engine(model, NGRAM)
    outs = run(engine, requests)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert engine.stats.num_spec_accepted_tokens > 0
    assert engine.scheduler.kv_manager.num_used_blocks == 0


def draft_of(model, **changes):
    """A draft for byte_model: the same vocabulary, its own (random) weights and shape."""
    return init_model(dataclasses.replace(model.config, **changes), seed=11)


@pytest.mark.slow  # a draft model beside its target over the whole mixed batch (23 s)
def test_a_draft_model_gives_plain_decodings_tokens(byte_model):
    """A one-layer random draft with its own paged KV: greedy and seeded tokens equal plain
    decoding's over the mixed batch (chunked prefill, preemption, a grammar, n = 2)."""
    tok = ByteTokenizer()
    requests = mixed_batch(tok, "\x00never", 263)
    plain = run(make_engine(byte_model, None, num_blocks=32), requests)
    spec = dict(method="draft_model", model="draft", num_speculative_tokens=3)
    engine = make_engine(byte_model, spec, num_blocks=32,
                         draft_model=draft_of(byte_model, num_layers=1, hidden_size=32,
                                              head_dim=8))
    outs = run(engine, requests)
    assert engine.stats.num_spec_draft_tokens > 0 and engine.stats.num_preemptions > 0
    for a, b in zip(plain, outs):
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
    assert engine.speculator.drafter.num_steps > 0
    assert not engine.speculator.drafter.kv.block_tables  # every request's blocks given back


@pytest.mark.slow  # a draft model as large as its target: make test-slow
def test_the_target_as_its_own_draft_is_accepted_every_time(byte_model):
    """Drafting with the target's own weights: its greedy drafts are the target's greedy tokens,
    so all are accepted: the draft's KV holds exactly what the target's does."""
    tok = ByteTokenizer()
    requests = [(tok.encode(f"draft {i}: " * (i + 1)), SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True)) for i in range(3)]
    spec = dict(method="draft_model", model="itself", num_speculative_tokens=4)
    engine = make_engine(byte_model, spec, draft_model=byte_model, max_num_batched_tokens=16,
                         max_num_seqs=4)
    drafter = engine.speculator.drafter
    assert engine.warmup() == len(warmup_shapes(engine.buckets, variants=True)) + len(
        warmup_shapes(drafter.buckets)) + len(drafter.buckets.seq_buckets)  # the fused loop's
    outs = run(engine, requests)
    plain = run(make_engine(byte_model, None), requests)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = engine.stats
    assert stats.num_spec_draft_tokens >= 40
    assert stats.spec_acceptance_rate >= 0.97, stats  # f32 near-ties aside: all


def test_a_draft_model_with_another_vocabulary_is_refused(byte_model):
    with pytest.raises(ValueError, match="the draft's vocab_size .300. is not the target's"):
        make_engine(byte_model, dict(model="d", num_speculative_tokens=2),
                    draft_model=draft_of(byte_model, vocab_size=300))
    with pytest.raises(ValueError, match="the draft's max_position_embeddings .64. is below"):
        make_engine(byte_model, dict(model="d", num_speculative_tokens=2),
                    draft_model=draft_of(byte_model, max_position_embeddings=64))
    with pytest.raises(ValueError, match="pass the loaded draft as draft_model"):
        make_engine(byte_model, dict(model="d", num_speculative_tokens=2))


@pytest.mark.slow  # make test-slow
def test_k_bounds_the_drafts_and_the_switch_off_turns_speculation_off(byte_model):
    tok = ByteTokenizer()
    requests = [(tok.encode("ab ab ab ab ab"), SamplingParams(max_tokens=24, temperature=0.0))
                for _ in range(2)]
    engine = make_engine(byte_model, dict(NGRAM, disable_by_batch_size=1))
    run(engine, requests)  # both run side by side to the end: more than 1 sequence
    assert engine.stats.num_spec_drafts == 0
    engine = make_engine(byte_model, dict(NGRAM, disable_by_batch_size=2))
    run(engine, requests)
    stats = engine.stats
    assert stats.num_spec_drafts > 0
    assert stats.num_spec_draft_tokens <= 3 * stats.num_spec_drafts
    assert len(stats.spec_accepted_per_position) == 3
    assert 1.0 <= stats.spec_mean_acceptance_length <= 4.0


@pytest.mark.slow  # make test-slow
def test_drafts_leave_the_last_token_to_plain_sampling(byte_model):
    """Near max_tokens a request drafts fewer tokens than K: its step's tokens after the drafts
    are the target's own, so no step computes the position of the request's last token (prompt +
    max_tokens - 1), which nothing would ever read; and the tokens are plain decoding's."""
    tok = ByteTokenizer()
    prompt = tok.encode("ab ab ab ab ab")
    requests = [(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    engine = make_engine(byte_model, NGRAM)
    schedule, ends = engine.scheduler.schedule, []

    def recording(*args, **kwargs):
        output = schedule(*args, **kwargs)
        ends.extend(s.start + s.num_new_tokens for s in output.scheduled)
        return output

    engine.scheduler.schedule = recording
    outs = run(engine, requests)
    assert engine.stats.num_spec_draft_tokens > 0
    assert max(ends) == len(prompt) + 8 - 1
    plain = run(make_engine(byte_model, None), requests)
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def _scheduler():
    return Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                     max_model_len=64), num_blocks=16, block_size=4)


def _request(max_tokens: int = 30):
    return Request("r", list(range(10, 20)), SamplingParams(max_tokens=max_tokens,
                                                             temperature=0.0),
                   seed=0, arrival_time=0.0)


@pytest.mark.parametrize("accepted", range(8))
def test_rejected_drafts_roll_back_to_plain_decodings_tables_and_counts(accepted):
    """A request that verified 7 drafts (a fifth block for them) and kept `accepted` of them
    holds what one decoded plainly to the same tokens holds: its computed tokens, its block
    table (accepted = 1 ends the computed tokens on a block boundary: one rejected draft kept
    would hold a block too many), the pool's free count, and nothing unverified published to
    the prefix cache."""
    spec, plain = _scheduler(), _scheduler()
    a, b = _request(), _request()
    for scheduler, request in ((spec, a), (plain, b)):
        scheduler.add_request(request)
        scheduler.update(scheduler.schedule(0.0), np.array([7]), 0.0)  # the prompt
    drafts = [8, 9, 5, 5, 5, 5, 5]
    a.spec_token_ids = list(drafts)
    output = spec.schedule(0.0)
    assert output.num_scheduled_tokens == 8  # the last token and 7 drafts
    assert len(spec.kv_manager.get_block_table("r")) == 5  # slots for all 18 tokens
    # the target agrees with the first `accepted` drafts, then says 4 (no draft is 4)
    tokens = drafts[:accepted] + [4]
    spec.update(output, np.array([tokens + [-1] * (8 - len(tokens))]), 0.0)
    for token in tokens:
        plain.update(plain.schedule(0.0), np.array([token]), 0.0)
    assert a.output_token_ids == b.output_token_ids == [7, *tokens]
    assert a.num_computed_tokens == b.num_computed_tokens == 11 + accepted
    assert a.spec_token_ids == []
    table = plain.kv_manager.get_block_table("r")
    assert len(table) == -(-(11 + accepted) // 4)  # the blocks of its computed tokens
    assert spec.kv_manager.get_block_table("r") == table
    assert spec.kv_manager.num_free_blocks == plain.kv_manager.num_free_blocks
    assert spec.kv_manager.pool.cached.keys() == plain.kv_manager.pool.cached.keys()
    state = spec.state
    assert (state.num_spec_drafts, state.num_spec_draft_tokens,
            state.num_spec_accepted_tokens, state.spec_accepted_per_position) == (
        1, 7, accepted, [1] * accepted + [0] * (7 - accepted))


def test_a_stop_inside_the_accepted_drafts_ends_where_plain_decoding_does():
    """All 5 drafts accepted but the first is a stop token: the request ends after it, and the
    prefix cache holds what plain decoding's holds (no block past its tokens is published)."""
    spec, plain = _scheduler(), _scheduler()
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[8])
    a, b = (Request("r", list(range(10, 20)), params, seed=0, arrival_time=0.0)
            for _ in range(2))
    for scheduler, request in ((spec, a), (plain, b)):
        scheduler.add_request(request)
        scheduler.update(scheduler.schedule(0.0), np.array([7]), 0.0)
    a.spec_token_ids = [8, 9, 5, 5, 5]
    spec.update(spec.schedule(0.0), np.array([[8, 9, 5, 5, 5, 6]]), 0.0)
    plain.update(plain.schedule(0.0), np.array([8]), 0.0)
    assert a.output_token_ids == b.output_token_ids == [7, 8]
    assert a.status == b.status and a.status.finished and a.stop_reason == 8
    assert spec.kv_manager.pool.cached.keys() == plain.kv_manager.pool.cached.keys()
    assert spec.kv_manager.num_free_blocks == plain.kv_manager.num_free_blocks


def test_a_block_taken_for_rejected_drafts_is_freed_first_in_line():
    """A fifth block taken for drafts and rolled back returns to the front of the free queue:
    the next allocation takes it rather than evicting a cached block."""
    spec = _scheduler()
    request = _request()
    spec.add_request(request)
    spec.update(spec.schedule(0.0), np.array([7]), 0.0)
    request.spec_token_ids = [1] * 8  # slots through token 19: a fifth block
    output = spec.schedule(0.0)
    taken = spec.kv_manager.get_block_table("r")[4]
    spec.update(output, np.array([[3] + [-1] * 8]), 0.0)  # the first draft is rejected
    assert len(spec.kv_manager.get_block_table("r")) == 3
    assert spec.kv_manager.pool.free_block_ids()[0] == taken


def test_drafts_are_dropped_before_anyone_is_preempted():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                          max_model_len=64), num_blocks=5, block_size=4)
    request = _request(max_tokens=6)  # 16 tokens: the 4 usable blocks
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(0.0), np.array([7]), 0.0)
    request.spec_token_ids = [1] * 8  # would need blocks the pool does not have
    output = scheduler.schedule(0.0)
    assert output.num_scheduled_tokens == 1 and not output.preempted
    assert request.spec_token_ids == []


def test_drafts_ride_only_in_steps_of_decodes_alone():
    """A step that admits a prompt runs its decodes without their drafts (and gives back the
    blocks taken for them): speculative programs are decode shapes only."""
    scheduler = _scheduler()
    request = _request()
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(0.0), np.array([7]), 0.0)
    free = scheduler.kv_manager.num_free_blocks
    request.spec_token_ids = [1] * 8
    newcomer = Request("n", [5] * 6, SamplingParams(max_tokens=4), seed=0, arrival_time=0.0)
    scheduler.add_request(newcomer)
    output = scheduler.schedule(0.0)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("r", 1), ("n", 6)]
    assert output.num_scheduled_tokens == 7 and request.spec_token_ids == []
    assert scheduler.kv_manager.num_free_blocks == free - 2  # n's two; r's third block holds
    assert len(scheduler.kv_manager.get_block_table("r")) == 3  # its 11 tokens


def test_a_grammar_cuts_the_drafts_it_refuses(byte_model):
    engine = make_engine(byte_model, NGRAM)
    tok = ByteTokenizer()
    engine.add_request(tok.encode("abcabc"), SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=dict(regex="ab[c]{0,3}")),
        request_id="g")
    request = engine.request_groups["g"][0]
    drafts = tok.encode("abccz", add_special_tokens=False)
    assert engine.token_masks.num_valid(request, drafts) == 4
    assert engine.token_masks.num_valid(request, drafts[1:]) == 0


def test_the_mask_at_each_draft_position_is_plain_decodings_there(byte_model):
    """Row j of a speculative step's mask (bad words, min_tokens, a grammar) is the mask plain
    decoding builds once the first j drafts are the request's tokens."""
    engine = make_engine(byte_model, NGRAM)
    tok = ByteTokenizer()
    engine.add_request(tok.encode("abc"), SamplingParams(
        max_tokens=8, min_tokens=3, bad_words=["ca"], structured_outputs=dict(
            regex="[abc]{1,6}")), request_id="m")
    request = engine.request_groups["m"][0]
    drafts = tok.encode("bca", add_special_tokens=False)
    spec = engine.token_masks.build([(request, True, drafts)], 1, 3)
    for j in range(4):
        plain = engine.token_masks.build([(request, True, [])], 1)
        np.testing.assert_array_equal(spec[j], plain[0], err_msg=f"position {j}")
        if j < 3:
            request.output_token_ids.append(drafts[j])
            engine.token_masks.advance(request)
    ids = lambda row: {t for t in range(264) if row[t >> 5] >> (t & 31) & 1}  # noqa: E731
    assert 257 not in ids(spec[0]) and 257 in ids(spec[3])  # min_tokens, then EOS
    assert ord("a") in ids(spec[1]) and ord("a") not in ids(spec[2])  # "ca" after the "c"


def test_penalties_count_the_drafts_before_each_position():
    """expand_rows: the row verifying draft j sees the request's tokens and its first j drafts
    (what plain decoding's penalties count there), at the position of the token it samples."""
    from pagedjax.engine.spec_decode import rejection_sampler
    from pagedjax.scheduler import SAMPLING_FIELDS
    from pagedjax.scheduler.plan import penalty_tokens
    tokens, prompt_lens = penalty_tokens(
        [Request("p", [3, 4], SamplingParams(presence_penalty=1.0), seed=0, arrival_time=0),
         None], 2, 8)
    inputs = {name: np.zeros(2, np.float32) for name in SAMPLING_FIELDS}
    inputs.update(penalty_tokens=tokens, penalty_prompt_lens=prompt_lens,
                  kv_lens=np.array([5, 0], np.int32),
                  draft_token_ids=np.array([[7, 8], [0, 0]], np.int32),
                  num_draft_tokens=np.array([2, 0], np.int32))
    flat = rejection_sampler.expand_rows(inputs, 2)
    np.testing.assert_array_equal(np.asarray(flat["penalty_tokens"])[:3], [
        [3, 4, -1, -1, -1, -1, -1, -1], [3, 4, 7, -1, -1, -1, -1, -1],
        [3, 4, 7, 8, -1, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(flat["kv_lens"]), [3, 4, 5, 0, 1, 2])


@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "some/draft"},
     "model names the draft model of method draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model names the draft model"),
    ({"num_speculative_tokens": 2, "quantization": "fp8"}, r"\['quantization'\] are not served"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, r"unknown speculative_config field\(s\) "
                                                    r"\['lookahead'\]"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min .4. must not exceed"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ("{not json", "not JSON"),
])
def test_bad_speculative_configs_are_refused_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=value)


def test_speculative_config_takes_vllms_json_and_defaults():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert config.speculative_config == SpeculativeConfig(  # vLLM's 5 and 5
        "ngram", 4, prompt_lookup_min=5, prompt_lookup_max=5)
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(num_speculative_tokens=2, model="d").method == "draft_model"
    assert config.buckets().num_speculative_tokens == 4


def test_beam_search_refuses_speculation_by_name(byte_model):
    engine = make_engine(byte_model, NGRAM)
    with pytest.raises(ValueError, match="beam search does not run with speculative_config"):
        beam_search(engine, [[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=4))
