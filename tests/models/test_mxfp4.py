"""MXFP4 experts (models/quantization/mxfp4.py, models/loading/mxfp4_checkpoint.py): decoding
against an independent NumPy reading of the OCP MX format, bit for bit on every code, and against
transformers' own dequantization of a checkpoint's blocks; a gpt-oss checkpoint written in the
published layout (`_blocks` / `_scales`, quant_method mxfp4) serves the greedy tokens of its
float dequantization in transformers, its experts kept in the stored bytes."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.models.quantization import mxfp4
from pagedjax.models.quantization.schemes import QArray

torch = pytest.importorskip("torch")


def e2m1_np(codes: np.ndarray) -> np.ndarray:
    """The OCP MX v1.0 reading of 4-bit e2m1 codes: sign, 2 exponent bits (bias 1), 1 mantissa
    bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = np.where(codes & 8, -1.0, 1.0)
    exponent = (codes >> 1) & 3
    mantissa = codes & 1
    normal = 2.0 ** (exponent - 1.0) * (1 + mantissa / 2)
    return (sign * np.where(exponent == 0, mantissa / 2, normal)).astype(np.float32)


def decode_np(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """f32 [.., out, in] of a checkpoint's blocks [.., out, G, 16] and scales [.., out, G]."""
    low, high = e2m1_np(blocks & 0xF), e2m1_np(blocks >> 4)
    values = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], 32)
    weight = values * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return weight.reshape(*scales.shape[:-1], -1).astype(np.float32)


def encode_np(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float [.., out, in] weight in MXFP4 (blocks, scales): per block of 32 the shared
    exponent floor(log2(amax)) - 2 (e2m1's largest exponent), each value to its nearest code."""
    *lead, rows = weight.shape
    grouped = weight.reshape(*lead, rows // 32, 32).astype(np.float64)
    amax = np.abs(grouped).max(-1)
    exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127)
    scaled = grouped / np.ldexp(1.0, exponent.astype(np.int32))[..., None]
    table = e2m1_np(np.arange(16))
    codes = np.abs(scaled[..., None] - table).argmin(-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return (np.ascontiguousarray(blocks),  # (safetensors writes an array's buffer as it lies)
            np.ascontiguousarray((exponent + 127).astype(np.uint8)))


def test_every_code_and_scale_decodes_as_the_format_says():
    """All 256 bytes (every low/high code pair, in each byte position of a block) under scales
    from 2^-100 to 2^100: bit-identical f32 values. (A scale whose products are subnormal in f32,
    below 2^-124, flushes to zero in XLA as on every accelerator; no checkpoint's is.)"""
    rng = np.random.default_rng(0)
    codes = np.arange(256, dtype=np.uint8)
    blocks = np.stack([rng.permutation(codes).reshape(16, 16) for _ in range(6)])  # [out, G, 16]
    scales = np.stack([rng.permutation([107, 127, 147, 27, 200, 60, 227, 130, 90, 126, 128,
                                        40, 150, 3 + 124, 100, 110]) for _ in range(6)])
    scales = scales.astype(np.uint8)  # [out=6, G=16]
    want = decode_np(blocks, scales)
    data, scale = mxfp4.from_checkpoint(blocks, scales)
    got = np.asarray(QArray(jnp.asarray(data), jnp.asarray(scale), None, "mxfp4")
                     .astype(jnp.float32))
    np.testing.assert_array_equal(got.T.view(np.uint32), want.view(np.uint32))
    from transformers.integrations.mxfp4 import FP4_VALUES
    np.testing.assert_array_equal(e2m1_np(np.arange(16)), np.asarray(FP4_VALUES, np.float32))


def test_blocks_read_as_transformers_dequantizes_them():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 48, 4, 16), dtype=np.uint8)  # 3 experts, out 48, in 128
    scales = rng.integers(118, 134, (3, 48, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                      dtype=torch.float32).numpy()  # [E, in, out]
    data, scale = mxfp4.from_checkpoint(blocks, scales)
    weight = QArray(jnp.asarray(data), jnp.asarray(scale), None, "mxfp4")
    assert weight.shape == (3, 128, 48) and weight[1].shape == (128, 48)
    np.testing.assert_array_equal(np.asarray(weight.astype(jnp.float32)), want)
    np.testing.assert_array_equal(np.asarray(weight[2].astype(jnp.float32)), want[2])


def write_mxfp4(hf, directory) -> None:
    """hf (a float gpt-oss) saved in the published layout: every layer's experts' gate_up_proj
    and down_proj as `_blocks` / `_scales`, its weights replaced by their dequantization (what
    the checkpoint means, for transformers to run)."""
    from safetensors.numpy import save_file
    state = {name: value.detach().numpy().copy() for name, value in hf.state_dict().items()}
    for name in list(state):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        blocks, scales = encode_np(np.swapaxes(state.pop(name), 1, 2))  # [E, out, in]
        state[name + "_blocks"] = blocks.reshape(*scales.shape, 16)
        state[name + "_scales"] = scales
        with torch.no_grad():  # the float model: the checkpoint's values
            hf.get_parameter(name).copy_(torch.tensor(np.swapaxes(decode_np(
                state[name + "_blocks"], scales), 1, 2)))
    hf.config.save_pretrained(directory)
    save_file(state, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw, f)


@pytest.mark.slow  # make test-slow
def test_a_published_layout_checkpoint_serves_its_dequantized_tokens(tmp_path):
    from test_models_gpt_oss import build_gpt_oss
    from test_models_hf import hf_greedy, prompts

    from pagedjax import LLM, SamplingParams

    hf = build_gpt_oss(tmp_path / "float")
    write_mxfp4(hf, str(tmp_path / "mxfp4"))
    token_prompts = prompts()
    expected = hf_greedy(hf, token_prompts, 8)
    llm = LLM(str(tmp_path / "mxfp4"), dtype="float32", block_size=4, max_model_len=96,
              max_num_seqs=4, max_num_batched_tokens=16, num_blocks=96)
    outputs = llm.generate(token_prompts, SamplingParams(max_tokens=8, temperature=0),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    import jax
    served = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if "experts" in names:
            served[".".join(n for n in names[names.index("experts") + 1:] if n != "value")] = (
                leaf.dtype, leaf.shape[-3:])
    # a layer's: the stored bytes and e8m0 scales of its 4 experts; the biases floats
    assert served["gate_up_proj.kernel"] == (jnp.uint8, (4, 32, 64))
    assert served["gate_up_proj.scale"] == (jnp.uint8, (4, 2, 64))
    assert served["down_proj.kernel"] == (jnp.uint8, (4, 16, 64))
    assert served["gate_up_proj_bias"][0] == jnp.float32
    from pagedjax.models.loading.inspect import inspect_model_dir
    report = inspect_model_dir(str(tmp_path / "mxfp4"))
    assert set(report["quantized_weights"].values()) == {"mxfp4, 32 rows a group"}
    assert report["attention"].endswith("attention sinks")
    float_bytes = inspect_model_dir(str(tmp_path / "float"))["served_weight_bytes"]
    assert report["served_weight_bytes"] < 0.6 * float_bytes
    from pagedjax.models.loading.hf import load_hf_model
    with pytest.raises(ValueError, match="read into place by an engine"):
        load_hf_model(str(tmp_path / "mxfp4"))  # never a whole float copy


def test_mxfp4_experts_decode_one_expert_at_a_time_on_every_platform(monkeypatch):
    """On a TPU the grouped matmul is ragged_dot, which takes every expert's weights at once:
    MXFP4 experts take the segments loop there too (an expert's decoded per tile), never a
    float copy of all of them."""
    import jax

    from pagedjax.models.layers import moe_experts
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    packed = QArray(jnp.zeros((2, 16, 8), jnp.uint8), jnp.zeros((2, 1, 8), jnp.uint8), None,
                    "mxfp4")
    int8 = QArray(jnp.zeros((2, 32, 8), jnp.int8), jnp.ones((2, 1, 8)), None, "int8")
    assert moe_experts.default_implementation((packed, packed)) == "segments"
    assert moe_experts.default_implementation((int8, int8, int8)) == "ragged_dot"


def child() -> None:
    """The MXFP4 checkpoint at TP 1, TP 2 (each expert's columns and down rows split: 16 of
    the 32 rows, one whole block group a device) and EP 2 (whole experts a device)."""
    import tempfile

    from test_models_gpt_oss import build_gpt_oss
    from test_models_hf import prompts

    from pagedjax import LLM, SamplingParams
    root = tempfile.mkdtemp()
    write_mxfp4(build_gpt_oss(os.path.join(root, "float"), intermediate_size=64),
                os.path.join(root, "mxfp4"))
    report = {}
    for name, fields in {"tp1": {}, "tp2": dict(tensor_parallel_size=2),
                         "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}.items():
        llm = LLM(os.path.join(root, "mxfp4"), dtype="float32", block_size=4, max_model_len=96,
                  max_num_seqs=4, max_num_batched_tokens=16, num_blocks=96,
                  quantization="mxfp4", **fields)
        outputs = llm.generate(prompts(), SamplingParams(max_tokens=8, temperature=0),
                               use_tqdm=False)
        report[name] = [o.outputs[0].token_ids for o in outputs]
    print(json.dumps(report))


@pytest.mark.slow  # three engines in a child process of 8 host devices
def test_mxfp4_experts_split_over_tensor_and_expert_parallel_devices():
    from helpers import child_report
    report = child_report("test_mxfp4", 8)
    assert report["tp2"] == report["tp1"] and report["ep2"] == report["tp1"]


def test_mxfp4_is_refused_for_a_float_checkpoint(tmp_path):
    from test_models_gpt_oss import build_gpt_oss

    from pagedjax import LLM
    build_gpt_oss(tmp_path)
    with pytest.raises(ValueError, match="quantization 'mxfp4'.*not one"):
        LLM(str(tmp_path), quantization="mxfp4", max_model_len=64, num_blocks=32)
