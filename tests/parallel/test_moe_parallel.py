"""Mixture-of-experts configs split over 2 and 4 host devices give the greedy tokens of the
dense model: a Qwen2-MoE-shaped one (dense and sparse layers scanned by their period, a gated
shared expert, routing weights not renormalised) and an OLMoE-shaped one (whole-projection q/k
norm, repeated with the KV heads at TP 4, clip_qkv). Without expert parallelism the experts are
tensor parallel: each device holds 1/TP of every expert's MLP columns; with
--enable-expert-parallel (EP 2, 4, and EP 2 x DP 2) each device holds E / EP whole experts and
the tokens are the same; a gpt-oss-shaped one too (sinks, fused biased experts), and a
DeepSeek-V3-shaped one (latent attention: its one-plane cache a copy a device). The devices exist only if XLA_FLAGS says so before JAX starts, so the
engines run in a child process."""

from __future__ import annotations

import json

import pytest
from helpers import child_report

pytestmark = pytest.mark.slow

# min_token_bucket, min_seq_bucket: one shape of each step kind (each compiles for seconds over
# the devices)
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
            num_blocks=64,
            min_token_bucket=16, min_seq_bucket=4)
RUNS = {"tp1": {}, "tp2": dict(tensor_parallel_size=2), "tp4": dict(tensor_parallel_size=4),
        "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
        "ep4": dict(tensor_parallel_size=4, enable_expert_parallel=True),
        # two replicas of EP 2: the 8 host devices' first 4
        "ep2xdp2": dict(tensor_parallel_size=2, enable_expert_parallel=True,
                        data_parallel_size=2)}


def moe_configs():
    from pagedjax.models.config import LlamaConfig
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_heads=4,
                  num_kv_heads=2, head_dim=16, initializer_range=0.3,
                  max_position_embeddings=256, num_experts=8)
    return {
        "qwen2_moe": LlamaConfig(**common, num_layers=4, attention_bias=True,
                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, norm_topk_prob=False,
                                 mlp_types=("dense", "sparse") * 2, model_type="qwen2_moe"),
        "olmoe": LlamaConfig(**common, num_layers=2, num_experts_per_tok=3, qk_norm=True,
                             qk_norm_whole=True, clip_qkv=0.8, norm_topk_prob=False,
                             model_type="olmoe"),
        # sinks split with the query heads, the fused gate_up and its bias split by columns
        # (pairs of gate and up stay together) or experts, the down bias added once
        "gpt_oss": LlamaConfig(**common, num_layers=2, num_experts_per_tok=2,
                               moe_intermediate_size=32, attention_bias=True, o_proj_bias=True,
                               attention_sinks=True, router_bias=True,
                               expert_layout="interleaved", swiglu_limit=0.5,
                               layer_types=("sliding_attention", "full_attention"),
                               sliding_window=8, model_type="gpt_oss"),
        # latent attention: the heads split, the one-plane latent cache repeated (a copy a
        # device); V3's grouped sigmoid routing, an ungated shared expert, a dense first layer
        "deepseek": LlamaConfig(**{**common, "num_kv_heads": 1}, num_layers=2,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32, shared_expert_gate=False,
                                mlp_types=("dense", "sparse"), kv_lora_rank=32, q_lora_rank=24,
                                qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8,
                                rope_interleave=True, topk_method="noaux_tc", n_group=4,
                                topk_group=2, routed_scaling_factor=2.5,
                                model_type="deepseek_v3")}


def _expert_shards(params) -> list[list[int]]:
    import jax
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if "experts" in names and "down_proj" in names:
            return [list(s.data.shape) for s in leaf.addressable_shards]
    raise AssertionError("no experts in the serving weights")


def child() -> None:
    import jax
    import numpy as np

    from pagedjax import LLM, SamplingParams
    from pagedjax.models import init_model
    from pagedjax.models.layers.quantized import quantize_model
    from pagedjax.models.training.generate import dense_greedy_generate

    rng = np.random.default_rng(0)
    head = rng.integers(0, 256, 16).tolist()
    prompts = [head + rng.integers(0, 256, n).tolist() for n in (5, 23, 40, 9)]
    report = {"devices": len(jax.devices())}
    for arch, config in moe_configs().items():
        model = init_model(config, seed=0)
        report[arch] = {"dense": dense_greedy_generate(model, prompts, 8)}
        for name, fields in RUNS.items():
            llm = LLM(model, **BASE, **fields)
            outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                   use_tqdm=False)
            engine = llm.engine
            runner = engine.runner if hasattr(engine, "runner") else engine.replicas[0].runner
            report[arch][name] = {"tokens": [o.output_token_ids for o in outputs],
                                  "period": runner.graph.period,
                                  "experts": _expert_shards(runner.params),
                                  "cache": [list(s.data.shape)
                                            for s in runner.kv_cache.addressable_shards]}
        quantized = quantize_model(model, "int8")
        report[arch]["int8-dense"] = dense_greedy_generate(quantized, prompts, 8)
        for name in INT8_RUNS:
            llm = LLM(model, **BASE, **RUNS[name], quantization="int8")
            outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                   use_tqdm=False)
            report[arch][f"int8-{name}"] = {
                "tokens": [o.output_token_ids for o in outputs],
                "experts": _expert_shards(llm.engine.runner.params)}
        if arch == "deepseek":  # latent attention's expanded prefill over TP 2
            llm = LLM(model, **BASE, **RUNS["tp2"], mla_prefill="expanded")
            outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                   use_tqdm=False)
            report[arch]["tp2-expanded"] = [o.output_token_ids for o in outputs]
    print(json.dumps(report))


def test_deepseek_expanded_prefill_splits_its_heads(report):
    """--mla-prefill expanded at TP 2: the latent written on each device's copy (write_kv under
    shard_map), the step's expanded keys and values and the scratch cache split by heads with
    the query: the dense model's tokens (first chunks expanded, later ones absorbed)."""
    assert report["deepseek"]["tp2-expanded"] == report["deepseek"]["dense"]


INT8_RUNS = ("tp1", "tp2", "ep2", "ep4")


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "gpt_oss", "deepseek"])
@pytest.mark.parametrize("name", INT8_RUNS)
def test_int8_experts_split_like_the_float_ones(report, arch, name):
    """int8 experts (each expert's own per-channel scales): over TP (each expert's MLP split,
    the down projection's scales replicated) and EP (whole experts a device), the tokens of the
    dense forward of the same quantized model; the experts' int8 values split as the float
    ones do."""
    run = report[arch][f"int8-{name}"]
    assert run["tokens"] == report[arch]["int8-dense"]
    assert run["experts"] == report[arch][name]["experts"]


@pytest.fixture(scope="module")
def report():
    return child_report("test_moe_parallel", 8)


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "gpt_oss", "deepseek"])
@pytest.mark.parametrize("name", sorted(RUNS))
def test_moe_tensor_parallel_greedy_tokens_equal_the_dense_model(report, arch, name):
    assert report["devices"] == 8
    run = report[arch][name]
    assert run["tokens"] == report[arch]["dense"]
    if arch == "qwen2_moe":
        assert run["period"] == 2  # dense, sparse: scanned by their period
    if arch == "deepseek":  # every device the whole latent [1, 1, L * NB, S, Dl + R]
        assert all(s[:2] == [1, 1] and s[-1] == 32 + 4 for s in run["cache"])
    tp = int(name[2])
    width = 96 if arch == "olmoe" else 32  # an expert's MLP
    # down_proj [layers, E, F, D]: tensor parallel, every device all 8 experts and 1/TP of an
    # expert's rows; expert parallel, 8 / EP whole experts
    shape = [8 // tp, width, 64] if name.startswith("ep") else [8, width // tp, 64]
    assert len(run["experts"]) == tp and all(s[-3:] == shape for s in run["experts"])
