"""Mixture-of-experts families (models/layers/moe.py, models/{mixtral,qwen_moe,olmoe}.py) against
transformers, on small random configs with every switch on: 4-8 experts, top-2 (OLMoE top-3),
norm_topk_prob on and off, Qwen2-MoE's gated shared expert and its dense layers
(decoder_sparse_step, mlp_only_layers), Qwen3-MoE's q/k norm, OLMoE's whole-projection q/k norm
and clip_qkv (low enough to bite), Mixtral's sliding window. Router weights are drawn wide
enough that tokens spread over the experts and the top-k choices are not near ties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import until_done  # noqa: E402,F401
from test_models_hf import (F32_TOL, engine_greedy, hf_greedy, hf_logits, prompts,  # noqa: E402
                            randomize_vectors)

from pagedjax.models.layers.moe import Experts, route  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model, read_hf_config  # noqa: E402
from pagedjax.models.loading.inspect import inspect_model_dir  # noqa: E402
from pagedjax.models.registry import ARCHITECTURES  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256,
              tie_word_embeddings=False)
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=24)),
    # Four layers: 0 dense (mlp_only_layers), 1 sparse, 2 dense (off the sparse step), 3 sparse.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=3,
                   norm_topk_prob=False, clip_qkv=0.5, pad_token_id=0, eos_token_id=1,
                   bos_token_id=2)),
}


def build_moe(arch: str, directory, seed: int = 0):
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs})
    model = getattr(transformers, model_cls)(config).eval()
    randomize_vectors(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and param.shape[0] > 1:
                param.copy_(torch.randn_like(param))  # routers: spread, not near ties
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_moe_config_is_read_whole(arch, tmp_path):
    hf = build_moe(arch, tmp_path)
    config = read_hf_config(str(tmp_path))
    assert ARCHITECTURES[ARCHS[arch][1]].name in ("mixtral", "qwen_moe", "olmoe")
    assert config.num_params == sum(p.numel() for p in hf.parameters())
    assert config.num_experts == {"mixtral": 4, "qwen2_moe": 8, "qwen3_moe": 6, "olmoe": 8}[arch]
    if arch == "qwen2_moe":
        assert config.mlp_types == ("dense", "sparse", "dense", "sparse")
        assert config.shared_expert_intermediate_size == 48 and not config.norm_topk_prob
    if arch == "olmoe":
        assert config.qk_norm_whole and config.clip_qkv == 0.5 and config.num_experts_per_tok == 3
    active = config.num_active_params
    assert active < config.num_params  # k of the experts a token
    report = inspect_model_dir(str(tmp_path))
    assert (report["num_experts"], report["num_active_params"]) == (config.num_experts, active)
    assert report["sparse_layers"] == (2 if arch == "qwen2_moe" else config.num_layers)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.quick_variant('qwen2_moe')  # the others: make test-slow
def test_moe_dense_logits_match_transformers(arch, tmp_path):
    hf = build_moe(arch, tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, (2, 40))
    ours = np.asarray(load_hf_model(str(tmp_path))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_router_picks_transformers_experts(arch, tmp_path):
    """On the same hidden states, each sparse layer's router picks transformers' experts with
    its weights (the k chosen in order, and their weights to f32 rounding)."""
    hf = build_moe(arch, tmp_path)
    model = load_hf_model(str(tmp_path))
    hidden = np.random.default_rng(3).normal(size=(50, 64)).astype(np.float32)
    checked = 0
    for index, layer in enumerate(model.layers):
        if not model.config.layer_is_moe(index):
            continue
        hf_block = hf.model.layers[index].mlp
        with torch.no_grad():
            _, hf_weights, hf_experts = hf_block.gate(torch.tensor(hidden))
        weights, experts = route(layer.mlp.router_logits(jnp.asarray(hidden)),
                                 layer.mlp.top_k, layer.mlp.norm_topk_prob)
        np.testing.assert_array_equal(np.asarray(experts), hf_experts.numpy())
        # f32 logits of ~64 products of size ~1 differ by summation order, ~64 x 6e-8 each;
        # a weight moves by at most a quarter of that: 1e-5 is an order above, and far below
        # a wrong router's effect (another expert, or weights not renormalised).
        np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), atol=1e-5)
        checked += 1
    assert checked == (2 if arch == "qwen2_moe" else model.config.num_layers)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def moe(request, tmp_path_factory):
    """(arch, model directory, prompts, transformers' greedy continuations)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_moe(request.param, directory)
    token_prompts = prompts()
    return request.param, str(directory), token_prompts, hf_greedy(hf, token_prompts, MAX_TOKENS)


MAX_TOKENS = 10
ENGINES = {
    # A 16-token budget chunks the 40-token prompts in a mixed batch; two share a prefix.
    "chunked": dict(),
    "preemption": dict(block_size=4, num_blocks=16),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.quick_variant('qwen3_moe-chunked')  # the others: make test-slow
def test_moe_paged_engine_greedy_equals_transformers_generate(moe, engine):
    """Five prompts of 1 to 43 tokens at once through the scanned serving form: the padding
    tokens of each step's plan route to no expert, chunked prefill, preemption."""
    arch, directory, token_prompts, expected = moe
    got, engine_ = engine_greedy(load_hf_model(directory), token_prompts, MAX_TOKENS,
                                 **ENGINES[engine])
    assert got == expected
    if engine == "preemption":
        assert engine_.scheduler.state.num_preemptions > 0
    graph = engine_.runner.graph
    assert graph.scan_layers  # qwen2_moe: dense and sparse layers scanned by their period 2
    assert graph.period == (2 if arch == "qwen2_moe" else None)


def _experts(num_experts=8, seed=0):
    from flax import nnx

    from pagedjax.models.config import LlamaConfig
    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=24, num_layers=1,
                         num_heads=2, num_kv_heads=1, num_experts=num_experts,
                         num_experts_per_tok=2, initializer_range=0.3)
    return Experts(config, rngs=nnx.Rngs(seed), dtype=jnp.float32, param_dtype=jnp.float32)


@pytest.mark.parametrize("implementation", ["segments", "ragged_dot"])
@pytest.mark.parametrize("case", ["one_expert_for_all", "an_idle_expert", "padding"])
def test_grouped_experts_equal_every_expert_on_every_token(case, implementation,
                                                            monkeypatch):
    """The sorted grouped matmuls (segments' tiles; ragged_dot in chunks of 16 rows, a group
    spanning chunks) against every expert on every token mixed by the routing weights: every token on the same two experts (two groups hold everything), an
    expert no token picks (an empty group), and padding tokens past num_valid (routed nowhere:
    zero output, whatever their router said)."""
    from pagedjax.models.layers import moe_experts
    monkeypatch.setattr(moe_experts, "ragged_chunk", lambda width: 16)  # ragged_dot: 5 chunks
    experts = _experts()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(40, 16)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(40, 2)), jnp.float32)
    # 80 rows over 8 experts: tiles of 32 rows (pagedjax.models.layers.moe.tile_rows); all on experts 2 and 0:
    # two groups of 40 rows, two tiles each, the second one part full
    ids = {"one_expert_for_all": np.tile([2, 0], (40, 1)),
           "an_idle_expert": rng.permuted(np.tile([0, 1, 3, 4, 5, 6, 7], (40, 1)),
                                          axis=1)[:, :2],
           "padding": rng.permuted(np.tile(np.arange(8), (40, 1)), axis=1)[:, :2]}[case]
    ids = jnp.asarray(ids, jnp.int32)
    num_valid = jnp.asarray(27 if case == "padding" else 40)
    got = experts(x, weights, ids, num_valid, implementation=implementation)
    want = experts(x, weights, ids, num_valid, implementation="dense")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    if case == "padding":
        assert not np.asarray(got)[27:].any()
    assert np.abs(np.asarray(want)[:27]).min(axis=1).max() > 0.01


def test_route_renormalises_only_when_asked():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    weights, experts = route(logits, 2, False)
    probs = jax.nn.softmax(logits)
    np.testing.assert_allclose(np.asarray(weights), np.asarray(probs[:, :2]), rtol=1e-6)
    assert np.asarray(experts).tolist() == [[0, 1]]
    weights, _ = route(logits, 2, True)
    np.testing.assert_allclose(np.asarray(weights).sum(), 1.0, rtol=1e-6)


def test_expert_parallel_is_refused_where_it_cannot_apply():
    """--enable-expert-parallel on a dense model, or with experts that do not split over the
    devices, is refused by name before anything is built."""
    from pagedjax import EngineConfig, LLMEngine
    from pagedjax.models import LlamaConfig, get_config, init_model
    from pagedjax.parallel.placement import check_expert_parallel

    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
        LLMEngine(init_model(get_config("debug-tiny")),
                  EngineConfig(enable_expert_parallel=True, max_model_len=64))
    with pytest.raises(ValueError, match="6 experts do not split over tensor_parallel_size 4"):
        check_expert_parallel(
            LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=1, num_kv_heads=1, num_experts=6),
            EngineConfig(enable_expert_parallel=True, tensor_parallel_size=4))
