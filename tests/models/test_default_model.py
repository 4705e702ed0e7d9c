"""The embedded trained model as a semantic end-to-end test of the KV cache.

Every task answer depends on the whole prompt (a value stated 200 bytes earlier, a string to
reverse, two numbers to add), so a KV-cache bug that loses, misplaces or mixes up tokens shows as
wrong answers. The paged engine, with preemption, chunked prefill and prefix caching all forced,
must answer exactly as dense full-recompute decoding of the same weights does, prompt by prompt.
"""

import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.models import DEFAULT_CHECKPOINT
from pagedjax.models.loading.checkpoint import load_checkpoint
from pagedjax.models.training.generate import dense_greedy_generate
from pagedjax.models.training.tasks import (Example, decode_answer, encode_example, make_examples,
                                            recall_queries, score)

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model():
    return load_checkpoint(DEFAULT_CHECKPOINT)


def examples() -> list[Example]:
    recall = make_examples("recall", 40, seed=321)
    longest = max(recall, key=lambda e: len(e.prompt))
    shared = recall_queries(longest, 6)  # six questions about one context
    return (shared + sorted(recall, key=lambda e: -len(e.prompt))[1:11]
            + make_examples("copy", 12, seed=321))


@pytest.mark.slow  # make test-slow
def test_paged_engine_accuracy_equals_dense_accuracy(model):
    tasks = examples()
    prompts = [encode_example(e)[0] for e in tasks]
    dense = [decode_answer(ids) for ids in dense_greedy_generate(model, prompts, MAX_TOKENS)]

    # 12 blocks of 16 tokens cannot hold 8 running sequences of 30..100 tokens: preemption is
    # certain; a 16-token budget chunks every longer prompt; six prompts share one context.
    llm = LLM(model, tokenizer="byte", block_size=16, num_blocks=12, max_model_len=128,
              max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=True,
              min_seq_bucket=4)
    outputs = llm.generate([e.prompt for e in tasks],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           use_tqdm=False)
    paged = [decode_answer(o.output_token_ids) for o in outputs]
    stats = llm.engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_prefix_hit_tokens >= 48  # a shared context block was reused
    assert max(len(p) for p in prompts) > 16
    assert [o.prompt_token_ids for o in outputs] == prompts  # the byte tokenizer's encoding
    assert paged == dense
    accuracy = score(tasks, paged)
    assert accuracy == score(tasks, dense)
    assert accuracy["copy"] >= 0.8, accuracy  # the model is the trained one, not noise
