"""Hugging Face checkpoints: each family member against transformers on random weights.

Every checkpoint is built in the test (a small randomly initialised transformers model saved with
save_pretrained): no download. Norm weights and biases are randomised too, so a swapped or
dropped tensor cannot hide behind an all-ones or all-zeros initialisation.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import until_done

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedjax.models.loading.hf import (UnsupportedModelError, load_hf_model,  # noqa: E402
                                        read_hf_config)
from pagedjax.models.loading.inspect import inspect_model_dir  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
              max_position_embeddings=256)
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
ARCHS = {
    # Llama 3.1: RoPE scaling whose bands fall inside the test's context (original length 16).
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA31_ROPE)),
    # Llama with every bias and tied embeddings.
    "llama-bias-tied": ("LlamaConfig", "LlamaForCausalLM",
                        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),  # window < prompt
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # head_dim * N != hidden
    # Qwen2's max_window_layers: layer 0 global, layer 1 sliding (window 8 < the prompts): a
    # two-group hybrid KV cache.
    "qwen2-max-window-layers": ("Qwen2Config", "Qwen2ForCausalLM",
                                dict(use_sliding_window=True, sliding_window=8,
                                     max_window_layers=1)),
}


def build_hf(arch: str, directory, seed: int = 0, **overrides):
    """A random transformers model of arch saved under directory; returns the torch model."""
    config_cls, model_cls, kwargs = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    randomize_vectors(model)
    model.save_pretrained(directory)
    return model


def randomize_vectors(model) -> None:
    """A random model's 1-D weights drawn wide: norms around 1, biases around 0 (their
    initial 1s and 0s would hide a norm or bias left out)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                base = 1.0 if name.lower().endswith("norm.weight") else 0.0  # BERT's LayerNorm
                param.copy_(base + 0.3 * torch.randn_like(param))


def hf_greedy(model, token_prompts, max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time."""
    expected = []
    for p in token_prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                 do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    return expected


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def prompts(n_tokens=(5, 40, 1, 23, 17), seed=1):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 128, 20).tolist()  # a 20-token prefix two prompts share
    out = [rng.integers(3, 128, n).tolist() for n in n_tokens]
    out[3] = shared + out[3]
    out[4] = shared + out[4]
    return out


# f32 on both sides, different operation order: errors are ~1e-6 on logits of size ~3; 1e-4 is
# two orders of margin and still five orders below a wrong weight's effect.
F32_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_dense_logits_match_transformers(arch, tmp_path):
    hf = build_hf(arch, tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, (2, 48))
    ours = np.asarray(load_hf_model(str(tmp_path))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


def engine_greedy(model, token_prompts, max_tokens, **config):
    base = dict(block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
                enable_chunked_prefill=True, enable_prefix_caching=True, min_seq_bucket=4)
    engine = LLMEngine(model, EngineConfig(**{**base, **config}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p, params) for p in token_prompts]
    done = {}
    for _ in until_done(engine):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i].output_token_ids for i in ids], engine


def test_dtype_auto_takes_the_checkpoint_dtype(tmp_path):
    """vLLM's dtype="auto": a float32 checkpoint runs in float32, a 16-bit one in bfloat16."""
    from pagedjax import LLM
    from pagedjax.frontend.llm import checkpoint_dtype
    build_hf("qwen2", tmp_path)
    assert LLM(str(tmp_path), dtype="auto", max_model_len=64).engine.config.dtype == "float32"
    config_file = tmp_path / "config.json"
    raw = json.loads(config_file.read_text())
    for stored in ("bfloat16", "float16"):
        raw["dtype"] = stored
        config_file.write_text(json.dumps(raw))
        assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    assert checkpoint_dtype("debug-tiny") == "float32"


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.quick_variant('qwen3')  # the others: make test-slow
def test_paged_engine_greedy_equals_transformers_generate(arch, tmp_path):
    """Mixed-length prompts (1 to 40 tokens, two sharing a 20-token prefix), block size 16,
    a 16-token budget so every long prompt is chunked, prefix caching on."""
    hf = build_hf(arch, tmp_path)
    token_prompts = prompts()
    max_tokens = 10
    expected = []
    for p in token_prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                              do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    got, engine = engine_greedy(load_hf_model(str(tmp_path)), token_prompts, max_tokens)
    assert got == expected
    assert engine.stats.num_prefix_hit_tokens >= 16  # the shared prefix's full block was reused
    # a global and a sliding layer: two KV cache groups
    assert engine.kv_groups.num_groups == (2 if arch == "qwen2-max-window-layers" else 1)


def test_sharded_checkpoint(tmp_path):
    hf = build_hf("llama3.1", tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    files = os.listdir(tmp_path / "sharded")
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    ids = np.arange(30)[None] % 128
    ours = np.asarray(load_hf_model(str(tmp_path / "sharded"))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


@pytest.mark.slow  # make test-slow
def test_bfloat16_load_error_is_that_of_bfloat16(tmp_path):
    """Loaded in bf16, our logits are as far from the f32 reference as transformers' own bf16
    run is (bf16 keeps 8 mantissa bits: ~0.4% per rounding), not further."""
    hf = build_hf("qwen3", tmp_path)
    ids = np.random.default_rng(3).integers(0, 128, (2, 32))
    reference = hf_logits(hf, ids)
    model = load_hf_model(str(tmp_path), dtype="bfloat16")
    assert model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    ours = np.asarray(model(jnp.asarray(ids)), np.float32)
    hf_bf16_error = np.abs(hf_logits(hf.to(torch.bfloat16), ids) - reference).max()
    our_error = np.abs(ours - reference).max()
    assert 0 < our_error <= 3 * hf_bf16_error + 1e-3


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 8.0,
             "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
YARN_MSCALE_ROPE = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "mscale": 0.9,
                    "mscale_all_dim": 0.5, "original_max_position_embeddings": 100}


def to_transformers4(directory, rope_scaling):
    """Rewrites a saved config.json in the transformers 4 format: rope_theta + rope_scaling,
    torch_dtype, no head_dim."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        raw = json.load(f)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope_scaling
    raw["torch_dtype"] = raw.pop("dtype")
    raw.pop("head_dim")
    raw["transformers_version"] = "4.46.0"
    with open(path, "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize("rope, rope_scaling", [
    (LLAMA31_ROPE, {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_theta"}),
    ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
     {"type": "linear", "factor": 4.0}),  # the oldest spelling: "type"
    ({"rope_type": "default", "rope_theta": 10000.0}, None),
    # YaRN (gpt-oss's, truncate off; DeepSeek's, with mscale): dims on both sides of the ramp
    (YARN_ROPE, {k: v for k, v in YARN_ROPE.items() if k != "rope_theta"}),
    (YARN_MSCALE_ROPE, {k: v for k, v in YARN_MSCALE_ROPE.items() if k != "rope_theta"}),
])
def test_transformers4_config(rope, rope_scaling, tmp_path):
    hf = build_hf("llama3.1", tmp_path, rope_parameters=rope)
    to_transformers4(tmp_path, rope_scaling)
    ids = np.arange(40)[None] * 3 % 128
    ours = np.asarray(load_hf_model(str(tmp_path))(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), **F32_TOL)


def test_eos_ids_from_config_and_generation_config(tmp_path):
    build_hf("llama3.1", tmp_path, eos_token_id=2)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [2, 7, 9]}, f)
    assert read_hf_config(str(tmp_path)).eos_token_ids == (2, 7, 9)


def write_config(directory, **raw):
    os.makedirs(directory, exist_ok=True)
    base = dict(COMMON, num_hidden_layers=2, hidden_act="silu", rope_theta=10000.0)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**base, **raw}, f)


@pytest.mark.parametrize("raw, words", [
    (dict(architectures=["MambaForCausalLM"], model_type="mamba"),
     ["MambaForCausalLM", "state-space", "LlamaForCausalLM"]),
    (dict(architectures=["Phi3ForCausalLM"], model_type="phi3"),
     ["Phi3ForCausalLM", "fused qkv", "Qwen3ForCausalLM"]),
    (dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
          n_routed_experts=4, topk_method="random"),
     ["DeepseekV2ForCausalLM", "topk_method 'random'", "Qwen3ForCausalLM"]),
    (dict(architectures=["BloomForCausalLM"], model_type="bloom"), ["ALiBi"]),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama",
          rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     ["RoPE type 'longrope'", "llama3"]),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="gelu"),
     ["hidden_act 'gelu'"]),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama",
          quantization_config={"quant_method": "awq"}), ["quantized", "awq"]),
])
def test_unsupported_architecture_is_refused_with_a_reason(raw, words, tmp_path):
    write_config(tmp_path, **raw)
    with pytest.raises(UnsupportedModelError) as info:
        load_hf_model(str(tmp_path))
    for word in words:
        assert word in str(info.value)
    report = inspect_model_dir(str(tmp_path))
    assert report["supported"] is False and words[0] in report["reason"]


def test_corrupt_or_missing_weights_fail_clearly(tmp_path):
    build_hf("qwen2", tmp_path / "m")
    good = tmp_path / "m" / "model.safetensors"
    data = good.read_bytes()

    good.write_bytes(data[: len(data) // 2])  # truncated: header promises more than the file has
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_model(str(tmp_path / "m"))

    good.write_bytes(b"\x00" * 64)  # not a safetensors file at all
    with pytest.raises(ValueError, match="cannot read weight file"):
        load_hf_model(str(tmp_path / "m"))

    good.unlink()
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_hf_model(str(tmp_path / "m"))

    from safetensors.numpy import load_file, save_file
    hf = build_hf("qwen2", tmp_path / "n")
    tensors = load_file(str(tmp_path / "n" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "n" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.self_attn\.k_proj\.bias"):
        load_hf_model(str(tmp_path / "n"))

    hf.save_pretrained(tmp_path / "s", max_shard_size="40KB")
    shard = sorted(f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors"))[1]
    os.remove(tmp_path / "s" / shard)
    with pytest.raises(ValueError, match=f"{shard}.*missing"):
        load_hf_model(str(tmp_path / "s"))


def test_shape_mismatch_names_the_tensor(tmp_path):
    build_hf("llama3.1", tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw["intermediate_size"] = 96
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_hf_model(str(tmp_path))


def test_inspect_reports_attention_and_kv_bytes(tmp_path, capsys):
    build_hf("mistral", tmp_path)
    report = inspect_model_dir(str(tmp_path), kv_dtype="bfloat16", block_size=16)
    assert report["supported"] and report["architecture"] == "MistralForCausalLM"
    assert report["attention"].startswith("GQA") and report["sliding_window"] == 8
    assert report["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # 2 (K,V) * L * K * H * bf16
    assert report["kv_bytes_per_block"] == 16 * report["kv_bytes_per_token"]
    from pagedjax.tools.cli import main
    main(["inspect", str(tmp_path), "--kv-dtype", "int8"])
    printed = capsys.readouterr().out
    assert "MistralForCausalLM" in printed and "supported" in printed
    assert f"{2 * 2 * 2 * (16 + 4):,}" in printed  # int8 bytes per token, with f32 scales
    # The TPU's layout pads each page's scale row to 128 lanes (128 / 16 f32 a token) and the
    # head dim of 16 to a 128-lane tile too (pallas_kernels/layout.py)
    tpu = inspect_model_dir(str(tmp_path), kv_dtype="int8", attention_backend="tpu")
    assert tpu["kv_bytes_per_token"] == 2 * 2 * 2 * (128 + 4 * 128 // 16)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        inspect_model_dir(str(tmp_path), attention_backend="cuda")
    # a block of one token is the smallest there is; none is refused
    one = inspect_model_dir(str(tmp_path), kv_dtype="bfloat16", block_size=1)
    assert one["kv_bytes_per_block"] == report["kv_bytes_per_token"]
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        inspect_model_dir(str(tmp_path), block_size=0)
