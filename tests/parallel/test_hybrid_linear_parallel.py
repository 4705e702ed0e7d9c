"""Qwen3.5 and Qwen3-Next under tensor parallelism on 8 CPU devices (a child process): each
device runs its linear-attention heads on its share of the state pages (the cache split over KV
heads), the projections split by heads; TP 2 answers with transformers' greedy tokens and TP 1's,
through chunked prefill and preemption by swap, and the shards are what the split says."""

from __future__ import annotations

import pytest
from helpers import child_report

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # eight host devices in a child process

ARCHES = ("qwen3_5", "qwen3_next")
BASE = dict(block_size=4, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=8,
            min_token_bucket=8, min_seq_bucket=4, num_blocks=40, preemption_mode="swap",
            swap_space_bytes=4 << 20)


def child() -> None:
    import json
    import tempfile

    from test_models_hf import hf_greedy, prompts
    from test_models_qwen3_5 import build

    from pagedjax import LLM, SamplingParams
    from pagedjax.models.loading.hf import load_hf_model

    report = {}
    for arch in ARCHES:
        directory = tempfile.mkdtemp()
        hf = build(arch, directory)
        model = load_hf_model(directory)
        runs = {"hf": hf_greedy(hf, prompts(), 8)}
        for tp in (1, 2):
            llm = LLM(model, tensor_parallel_size=tp, **BASE)
            outputs = llm.generate(prompts(), SamplingParams(max_tokens=8, temperature=0),
                                   use_tqdm=False)
            runs[f"tp{tp}"] = [o.outputs[0].token_ids for o in outputs]
            runs[f"tp{tp}_swaps"] = llm.engine.stats.num_swap_outs
            layers = llm.engine.runner.params.layers
            linear = layers[0] if isinstance(layers, tuple) else layers["every4_from0"]
            runs[f"tp{tp}_z"] = [list(s.data.shape) for s in
                                 linear["linear_attn"]["in_proj_z" if arch == "qwen3_5"
                                                       else "in_proj_qkvz"]["kernel"]
                                 .get_value().addressable_shards]
            runs[f"tp{tp}_cache"] = [list(s.data.shape)
                                     for s in llm.engine.runner.kv_cache.addressable_shards]
        try:
            LLM(model, tensor_parallel_size=4, **BASE)
        except ValueError as e:
            runs["tp4"] = str(e)
        report[arch] = runs
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report():
    return child_report("test_hybrid_linear_parallel", timeout=900)


@pytest.mark.parametrize("arch", ARCHES)
def test_tp2_answers_as_one_device_and_as_transformers(report, arch):
    runs = report[arch]
    assert runs["tp2"] == runs["tp1"] == runs["hf"]
    assert runs["tp2_swaps"] > 0, "the pool was meant to force swaps"


@pytest.mark.parametrize("arch", ARCHES)
def test_the_heads_and_the_state_pages_are_split(report, arch):
    runs = report[arch]
    z = runs["tp1_z"][0]
    assert runs["tp2_z"] == [[*z[:-1], z[-1] // 2]] * 2  # out / 2 on each of 2 devices
    cache = runs["tp1_cache"][0]
    assert runs["tp2_cache"] == [[cache[0], cache[1] // 2, *cache[2:]]] * 2
    assert "linear_num_key_heads (2)" in runs["tp4"]
