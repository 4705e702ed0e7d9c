"""Gemma 2 and Gemma 3 (text) against transformers, on small random configs with every switch
on: soft-capping (attention and final, Gemma 2) at caps the random logits reach, an attention
scale from query_pre_attn_scalar unlike head_dim's, windows shorter than the prompts, Gemma 3's
q/k norms, local RoPE base and scaled global RoPE, a layer pattern with sliding and global
layers. Norm weights are randomised around 0 (Gemma applies 1 + weight), so a norm applied as
plain weight, or left out, shows."""

from __future__ import annotations

import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import until_done  # noqa: E402
from test_models_hf import F32_TOL, engine_greedy, hf_greedy, hf_logits, prompts  # noqa: E402

from pagedjax import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model, read_hf_config  # noqa: E402
from pagedjax.models.loading.inspect import inspect_model_dir  # noqa: E402
from pagedjax.models.registry import ARCHITECTURES  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, initializer_range=0.1,
              max_position_embeddings=256, query_pre_attn_scalar=24, sliding_window=6)
ARCHS = {
    # Gemma 2: alternating sliding / global layers, both soft caps low enough to bite.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=4, attn_logit_softcapping=3.0,
                    final_logit_softcapping=2.0)),
    # Gemma 3: two sliding layers per global one (and a trailing sliding one), local RoPE base
    # 10,000 and a linearly scaled global base.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention",
                                                      "full_attention", "sliding_attention"],
                    rope_parameters={
                        "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                           "factor": 4.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def build_gemma(arch: str, directory, seed: int = 0):
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gemma_config_is_read_whole(arch, tmp_path):
    hf = build_gemma(arch, tmp_path)
    config = read_hf_config(str(tmp_path))
    assert config.num_params == sum(p.numel() for p in hf.parameters())
    report = inspect_model_dir(str(tmp_path), block_size=16)
    groups = report["kv_cache_groups"]  # gemma2: 2 + 2 layers; gemma3: 1 full + 3 sliding
    assert [g["window"] for g in groups] == ([None, 6] if arch == "gemma2" else [None, 6, 6, 6])
    assert groups[0]["blocks"] * len(groups) == report["kv_bytes_per_block"]
    assert config.model_type == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[arch]
    assert (config.norm_unit_offset, config.scale_embeddings, config.sandwich_norms) == (
        True, True, True)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.attention_scale == 24 ** -0.5
    if arch == "gemma2":
        assert config.layer_types == ("sliding_attention", "full_attention") * 2
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (3.0, 2.0)
        assert not config.qk_norm and config.layer_rope(0) == config.layer_rope(1)
    else:
        assert config.qk_norm and config.layer_window(2) is None and config.layer_window(3) == 6
        assert config.layer_rope(0) == (1e4, None) and config.layer_rope(2)[0] == 1e6
        assert config.layer_rope(2)[1].factor == 4.0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gemma_dense_logits_match_transformers(arch, tmp_path):
    hf = build_gemma(arch, tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, (2, 40))  # 40 tokens, window 6
    ours = np.asarray(load_hf_model(str(tmp_path))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def gemma(request, tmp_path_factory):
    """(arch, model directory, prompts, transformers' greedy continuations)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_gemma(request.param, directory)
    token_prompts = prompts()
    return request.param, str(directory), token_prompts, hf_greedy(hf, token_prompts, MAX_TOKENS)


MAX_TOKENS = 12
ENGINES = {
    # A 16-token budget chunks the 40-token prompts; two prompts share a 20-token prefix.
    "groups": dict(block_size=4),
    "every_layer_full": dict(block_size=4, disable_hybrid_kv_cache_manager=True),
    "small_chunks": dict(block_size=4, max_num_batched_tokens=4),  # chunks under the window
    "preemption": dict(block_size=4, num_blocks=40),
    "swap": dict(block_size=4, num_blocks=40, preemption_mode="swap", swap_space_bytes=1 << 22),
    "unscanned_llama_form": dict(block_size=16, scan_layers=False),
    # each step dispatched ahead of the previous one's results, the groups' tables included
    "async_scheduling": dict(block_size=4, num_blocks=40, async_scheduling=True),
    # the tiered prefix cache: evicted blocks of every group to a small host tier and on to
    # disk, preempted requests' prefixes loaded back from both
    "tiers": dict(block_size=4, num_blocks=40, kv_offload_bytes=1 << 12,
                  kv_disk_dir=tempfile.mkdtemp(prefix="gemma-tiers-"), kv_disk_bytes=1 << 22),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.quick_variant('gemma3-groups')  # the others: make test-slow
def test_gemma_paged_engine_greedy_equals_transformers_generate(gemma, engine):
    """Prompts of 1 to 40 tokens against a 6-token window, through the serving form, with KV
    cache groups (a full group and sliding groups) unless disabled: chunked prefill, a
    prefix-cache hit across groups, preemption by recompute and by swap."""
    arch, directory, token_prompts, expected = gemma
    got, engine_ = engine_greedy(load_hf_model(directory), token_prompts, MAX_TOKENS,
                                 **ENGINES[engine])
    assert got == expected
    groups = engine_.kv_groups
    assert groups.hybrid == (engine != "every_layer_full")
    if engine == "groups":  # the shared prefix's blocks, as every group can serve them
        assert engine_.stats.num_prefix_hit_tokens >= 16
        # The sliding groups' tables are rings of their bound, ceil((6 - 1 + 16) / 4) + 1
        # blocks, narrower than the 52-token requests' 13 (and max_model_len's 32).
        assert engine_.buckets.table_widths == (32, 7)
    if engine in ("preemption", "swap", "async_scheduling", "tiers"):
        assert engine_.scheduler.state.num_preemptions > 0
    if engine == "tiers":
        tiers = engine_.stats.kv_tiers
        assert tiers["host"]["hits"] > 0 and tiers["disk"]["hits"] > 0
    assert engine_.scheduler.kv_manager.num_used_blocks == 0


@pytest.mark.quick_variant('gemma2')  # the others: make test-slow
def test_gemma_read_straight_into_the_scanned_form(gemma):
    """LLM(directory): the checkpoint read lazily into the serving form, whose layers that
    differ are scanned by their period (Gemma 2's: sliding, global) when it repeats, with each
    layer's KV cache group and slot traced; the tokens are transformers'."""
    from pagedjax import LLM
    arch, directory, token_prompts, expected = gemma
    llm = LLM(directory, block_size=4, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16)
    graph = llm.engine.runner.graph
    if arch == "gemma2":  # 4 layers, period 2: one scan over two periods
        assert graph.scan_layers and graph.period == 2
        assert sorted(llm.engine.runner.params.layers) == ["every2_from0", "every2_from1"]
    else:  # s, s, f, s: nothing repeats within 4 layers, so they run unrolled
        assert not graph.scan_layers and graph.period is None
    outputs = llm.generate([{"prompt_token_ids": p} for p in token_prompts],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_long_gemma_generation_keeps_its_sliding_groups_within_the_window(tmp_path):
    """Gemma 2 (a full and a sliding group, window 6, block 4): over a 100-token generation the
    sliding group never holds more than ceil((6 - 1 + 1) / 4) + 1 blocks once decoding, so the
    request holds about half the blocks every layer's full context would."""
    build_gemma("gemma2", tmp_path)
    engine = LLMEngine(load_hf_model(str(tmp_path)), EngineConfig(
        block_size=4, max_model_len=160, max_num_seqs=1, max_num_batched_tokens=16,
        enable_prefix_caching=False))
    engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=100, temperature=0.0,
                                                          ignore_eos=True))
    kv = engine.scheduler.kv_manager
    assert len(kv.groups) == 2 and kv.windows == (None, 6)
    for _ in until_done(engine):
        engine.step()
        for request_id in list(kv.groups[0].block_tables):
            request = engine.scheduler.state.requests[request_id]
            full, sliding = kv.get_block_tables(request_id)
            assert len(full) == -(-request.num_computed_tokens // 4)
            if request.num_computed_tokens > 40:  # decoding
                assert sum(b != 0 for b in sliding) <= 3
                assert kv.num_used_blocks <= len(full) + 3
    assert kv.num_used_blocks == 0


def test_registry_lists_the_gemma_architectures():
    assert ARCHITECTURES["Gemma2ForCausalLM"].name == "gemma"
    assert ARCHITECTURES["Gemma3ForCausalLM"].name == "gemma"
    assert ARCHITECTURES["LlamaForCausalLM"].name == "llama"


@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gemma3",  # 4 s
                                                          marks=pytest.mark.slow)])
@pytest.mark.slow  # make test-slow
def test_gemma_parallel_samples_share_blocks_across_groups(arch, tmp_path):
    """n = 3 seeded samples of 40-token prompts (windows of 6): the followers fork the leader's
    blocks in every group (a sliding group's null head included) and copy-on-write the shared
    last block; their tokens equal those of the one-group engine (every layer keeping the whole
    context), whose paged attention is checked against transformers above; a second request
    with the same prompt hits the cache in every group and samples the same."""
    build_gemma(arch, tmp_path)
    prompt = list(range(3, 43))
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7)
    runs = {}
    for hybrid in (True, False):
        engine = LLMEngine(load_hf_model(str(tmp_path)), EngineConfig(
            block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16,
            enable_prefix_caching=True, disable_hybrid_kv_cache_manager=not hybrid))
        finished = []
        for request_index in range(2):  # the second after the first: a prefix hit
            engine.add_request(prompt, params, request_id=f"r{request_index}")
            for _ in until_done(engine):
                finished += [o for o in engine.step() if o.finished]
        assert engine.kv_groups.hybrid == hybrid
        assert engine.stats.num_prefix_hit_tokens >= 36
        assert engine.scheduler.kv_manager.num_used_blocks == 0
        runs[hybrid] = {o.request_id: [c.token_ids for c in o.outputs] for o in finished}
    assert runs[True] == runs[False]
    samples = runs[True]["r0"]
    assert len({tuple(s) for s in samples}) > 1 and runs[True]["r1"] == samples
