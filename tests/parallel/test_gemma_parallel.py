"""A Gemma config (every Gemma 2 and 3 switch on, sliding and global layers scanned by their
period, KV cache groups) split over 2 and 4 host devices gives the greedy tokens of one device,
which are the dense model's. The devices exist only if XLA_FLAGS says so before JAX starts, so the engines run in
a child process (as tests/parallel/test_tensor_parallel.py's)."""

from __future__ import annotations

import json

import pytest
from helpers import child_report

pytestmark = pytest.mark.slow

# min_token_bucket, min_seq_bucket: one shape of each step kind (each compiles for seconds over
# the devices)
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
            num_blocks=48,
            min_token_bucket=16, min_seq_bucket=4)
RUNS = {"tp1": {}, "tp2": dict(tensor_parallel_size=2),
        "tp4": dict(tensor_parallel_size=4),  # past the config's 2 KV heads: repeated
        "tp2-gpu-kernels": dict(tensor_parallel_size=2, attention_backend="gpu",
                                attention_interpret=True)}


def gemma_config():
    from pagedjax.models.config import LlamaConfig, RopeScaling
    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=7, num_heads=4,
        num_kv_heads=2, head_dim=16, initializer_range=0.3, max_position_embeddings=256,
        sliding_window=6, layer_types=("sliding_attention", "sliding_attention",
                                       "full_attention") * 2 + ("sliding_attention",),
        rope_theta=1e6, rope_scaling=RopeScaling("linear", 4.0), rope_local_theta=1e4,
        qk_norm=True, hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
        scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0, final_logit_softcapping=2.0, tie_word_embeddings=True,
        model_type="gemma3_text")


def child() -> None:
    import jax
    import numpy as np

    from pagedjax import LLM, SamplingParams
    from pagedjax.models import init_model
    from pagedjax.models.training.generate import dense_greedy_generate

    model = init_model(gemma_config(), seed=0)
    rng = np.random.default_rng(0)
    head = rng.integers(0, 256, 16).tolist()
    prompts = [head + rng.integers(0, 256, n).tolist() for n in (5, 23, 40, 9)]
    report = {"devices": len(jax.devices()),
              "dense": dense_greedy_generate(model, prompts, 10)}
    for name, fields in RUNS.items():
        llm = LLM(model, **BASE, **fields)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0),
                               use_tqdm=False)
        report[name] = {"tokens": [o.output_token_ids for o in outputs],
                        "groups": llm.engine.kv_groups.num_groups,
                        "period": llm.engine.runner.graph.period,
                        "kv_cache": [list(s.data.shape)
                                     for s in llm.engine.runner.kv_cache.addressable_shards]}
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report():
    return child_report("test_gemma_parallel", 8)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_gemma_tensor_parallel_greedy_tokens_equal_the_dense_model(report, name):
    assert report["devices"] == 8
    assert report[name]["groups"] > 1  # a full and sliding groups
    assert report[name]["period"] == 3  # two periods scanned, the last layer unrolled
    assert report[name]["tokens"] == report["dense"]


def test_gemma_cache_is_split_over_kv_heads(report):
    for name, heads in (("tp2", 1), ("tp4", 1)):
        shards = report[name]["kv_cache"]
        assert len(shards) == int(name[2]) and all(s[1] == heads for s in shards)
