"""SamplingParams.output_kind (vLLM's RequestOutputKind): DELTA outputs hold exactly what is new
since a request's last output (its tokens, logprobs, text, prompt logprobs), so that summed they
are the CUMULATIVE outputs step for step; FINAL_ONLY is one output, the cumulative final one;
CumulativeOutput merges DELTA outputs back into it. The reference is the same seeded requests run
with CUMULATIVE outputs on the same engine."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import until_done

from pagedjax import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from pagedjax.engine.delta_outputs import CumulativeOutput
from pagedjax.models import get_config, init_model
from pagedjax.scheduler import RequestError
from pagedjax.text.tokenizer import ByteTokenizer

CONFIG = EngineConfig(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                      block_size=4, num_blocks=96, min_seq_bucket=2, max_logprobs=4,
                      enable_prefix_caching=False)  # each run steps as the first did


@pytest.fixture(scope="module")
def engine():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return LLMEngine(init_model(config, seed=5), CONFIG, tokenizer=ByteTokenizer())


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Stop strings whose first character is held back, n = 2, logprobs, prompt logprobs over a
    chunked prompt, and best_of > n."""
    tok = ByteTokenizer()
    sampled = SamplingParams(max_tokens=20, temperature=1.0, seed=3)
    return [
        (tok.encode("stops: "), dataclasses.replace(
            sampled, allowed_token_ids=tuple(b"ab "), stop=("a a", "aa "), logprobs=2)),
        (tok.encode("two samples "), dataclasses.replace(sampled, n=2, seed=7, logprobs=1)),
        (tok.encode("x" * 40), dataclasses.replace(sampled, temperature=0.0, max_tokens=8,
                                                   ignore_eos=True, prompt_logprobs=1)),
        (tok.encode("best of three "), dataclasses.replace(sampled, n=2, best_of=3, seed=9)),
    ]


def run(engine, kind: RequestOutputKind) -> list[list]:
    ids = [engine.add_request(prompt, dataclasses.replace(params, output_kind=kind))
           for prompt, params in requests()]
    outputs: dict[str, list] = {request_id: [] for request_id in ids}
    for _ in until_done(engine, 500):
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[request_id] for request_id in ids]


def content(out) -> list[tuple]:
    return [(c.index, c.token_ids, c.logprobs, c.text, c.finish_reason, c.stop_reason,
             c.cumulative_logprob, c.num_tokens) for c in out.outputs]


def test_delta_outputs_are_the_cumulative_ones_differences(engine):
    cumulative = run(engine, RequestOutputKind.CUMULATIVE)
    delta = run(engine, RequestOutputKind.DELTA)
    assert cumulative[0][-1].outputs[0].stop_reason in ("a a", "aa ")  # a stop string ended it
    for whole, parts, (_, params) in zip(cumulative, delta, requests(), strict=True):
        if params.best_of is not None and params.best_of > params.n:
            assert len(parts) == 1 and content(parts[0]) == content(whole[-1])
            continue
        assert len(parts) == len(whole)
        before = None
        for now, part in zip(whole, parts, strict=True):
            for c in now.outputs:
                got = part.outputs[c.index]
                tokens = 0 if before is None else len(before.outputs[c.index].token_ids)
                chars = 0 if before is None else len(before.outputs[c.index].text)
                assert c.text.startswith("" if before is None else before.outputs[c.index].text)
                assert got.token_ids == c.token_ids[tokens:]
                assert got.text == c.text[chars:]
                assert got.num_tokens == len(c.token_ids)
                assert got.logprobs == (None if c.logprobs is None else c.logprobs[tokens:])
                assert (got.finish_reason, got.stop_reason) == (c.finish_reason, c.stop_reason)
            assert part.finished == now.finished
            before = now
        if params.prompt_logprobs is not None:
            assert parts[0].prompt_logprobs == whole[0].prompt_logprobs
            assert all(p.prompt_logprobs == [] for p in parts[1:])
        merged = CumulativeOutput()
        for part in parts:
            merged.add(part)
        final = merged.output()
        assert content(final) == content(whole[-1])
        assert final.prompt_logprobs == whole[-1].prompt_logprobs
        assert final.prompt_token_ids == whole[-1].prompt_token_ids


def test_final_only_is_one_output_the_cumulative_final(engine):
    cumulative = run(engine, RequestOutputKind.CUMULATIVE)
    final = run(engine, RequestOutputKind.FINAL_ONLY)
    for whole, once in zip(cumulative, final, strict=True):
        assert len(once) == 1 and once[0].finished
        assert content(once[0]) == content(whole[-1])
        assert once[0].prompt_logprobs == whole[-1].prompt_logprobs
        m = once[0].metrics  # the samples' first token and last finish
        assert m.arrival_time <= m.first_token_time <= m.finish_time


@pytest.mark.parametrize("value", [3, -1, "partial", 1.0, True, None])
def test_output_kind_is_checked(value):
    with pytest.raises(RequestError, match="output_kind"):
        SamplingParams(output_kind=value)


def test_output_kind_by_name_or_value():
    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
