"""GGUF weights served from their blocks (models/quantization/gguf_blocks.py): each block type's decoding
against llama.cpp's own `gguf` dequantization of the same bytes, and a Q8_0 / Q4_0 / Q4_1 file
written here loading with no float copy of its weights (peak host memory, and gguf's
dequantizer never called for a block tensor), serving what its dequantized weights serve."""

from __future__ import annotations

import tracemalloc

import jax
import numpy as np
import pytest
from helpers import assert_same_outputs, run_requests

gguf = pytest.importorskip("gguf")

from pagedjax.engine.config import EngineConfig  # noqa: E402
from pagedjax.engine.llm_engine import LLMEngine  # noqa: E402
from pagedjax.models.loading.gguf import lazy_gguf_model, load_gguf_model  # noqa: E402
from pagedjax.models.quantization.gguf_blocks import (FORMATS, common_format, decode,  # noqa: E402
                                                      stored_parts)
from pagedjax.models.quantization.schemes import dequantize_np  # noqa: E402
from pagedjax.scheduler import SamplingParams  # noqa: E402

# each type's f16 fields (byte offsets in a block): set to sane values in random blocks
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        values = rng.uniform(0.001, 0.05, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])
        raw[:, offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
@pytest.mark.parametrize("promoted", [False, True], ids=["own", "promoted"])
def test_blocks_equal_gguf_dequantization(type_name, promoted):
    """Random blocks of each type (every bit pattern of values, scales and mins), decoded into
    the stored form and read back by NumPy, against gguf.quants.dequantize: equal up to f32
    rounding (Q4_1 and Q4_K fold their min into an offset: m + 8 d, one rounding). promoted:
    in the format a weight takes when its layers mix types (Q4_K with Q6_K: int8, 16-row
    groups, offsets)."""
    rows, cols = 48, 512
    raw = random_blocks(type_name, rows, cols)
    qtype = gguf.GGMLQuantizationType[type_name]
    expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    target = common_format({type_name, "Q6_K", "Q4_K"}) if promoted else FORMATS[type_name]
    q, scale, zero = decode(raw, type_name, (rows, cols))
    parts = stored_parts(q, scale, zero, target, FORMATS[type_name].group)
    assert parts["kernel"].dtype == (np.int8 if target.scheme == "int8" else np.uint8)
    got = dequantize_np(parts["kernel"], parts["scale"], parts["zero"], target.scheme).T
    scale_bound = np.repeat(np.abs(scale), FORMATS[type_name].group, axis=-1)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)  if zero is None else \
        np.testing.assert_allclose(got, expected, rtol=0, atol=float(scale_bound.max()) * 2e-6)


LAYERS, HIDDEN, FFN, VOCAB = 4, 128, 384, 512


def write_blocks_gguf(path: str) -> int:
    """A Llama GGUF of random weights: attention in Q8_0, the MLP in Q4_0 (gate, up) and Q4_1
    (down), the tied embedding Q8_0, norms F32; returns the f32 bytes of its weights."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", LAYERS), ("context_length", 256),
                       ("embedding_length", HIDDEN), ("feed_forward_length", FFN),
                       ("head_count", 4), ("head_count_kv", 2)):
        getattr(writer, f"add_{key}")(value)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    f32_bytes = 0

    def add(name, shape, type_name):
        nonlocal f32_bytes
        weight = (0.08 * rng.standard_normal(shape)).astype(np.float32)
        f32_bytes += weight.nbytes
        if type_name == "F32":
            writer.add_tensor(name, weight)
            return
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), "Q8_0")
    add("output_norm.weight", (HIDDEN,), "F32")
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32")
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32")
        for name, rows in (("attn_q", HIDDEN), ("attn_k", 64), ("attn_v", 64),
                           ("attn_output", HIDDEN)):
            add(f"blk.{i}.{name}.weight", (rows, HIDDEN), "Q8_0")
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), "Q4_0")
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), "Q4_0")
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), "Q4_1")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return f32_bytes


def _engine(model):
    return LLMEngine(model, EngineConfig(max_model_len=64, max_num_seqs=2,
                                         max_num_batched_tokens=32, block_size=4,
                                         max_logprobs=3))


def _placed_peak(model) -> tuple[LLMEngine, int]:
    """(an engine, the peak of host memory Python allocated while it read the weights)."""
    tracemalloc.start()
    try:
        engine = _engine(model)
        return engine, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow  # a memory peak over a whole load: make test-slow
def test_gguf_blocks_load_without_a_float_copy(tmp_path, monkeypatch):
    """The blocks load into int8 / packed int4 arrays: the host's peak stays under a fifth of
    the weights' f32 bytes (the f32 path peaks above it: a stacked leaf and its per-layer
    dequantized tensors), and gguf's dequantizer runs for no tensor but the norms (F32). The
    engine then serves what the float model of llama.cpp's dequantization serves."""
    path = str(tmp_path / "blocks.gguf")
    f32_bytes = write_blocks_gguf(path)
    reference = _engine(load_gguf_model(path))  # (and every import an engine makes, done)
    dequantized = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: (
        dequantized.append(qtype.name), real(data, qtype))[1])
    engine, peak = _placed_peak(lazy_gguf_model(path))
    assert set(dequantized) <= {"F32"}, dequantized
    params = engine.runner.params
    assert params.layers["mlp"]["gate_proj"]["kernel"].get_value().shape == (
        LAYERS, HIDDEN // 2, FFN)  # int4, two a byte
    assert params.embed["kernel"].get_value().dtype == np.int8  # the tied table, Q8_0
    print(f"host peak: blocks {peak:,} bytes, f32 weights {f32_bytes:,}")
    # Under the blocks' own bytes plus one stacked MLP weight in f32 (786 KB): a float copy of
    # any MLP leaf would pass it. (The peak also holds the engine's own Python allocations,
    # 150-300 KB depending on what the process compiled before: a fifth of the f32 bytes,
    # the bound before, left a worker of the suite 1 KB over it.)
    blocks_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert peak < blocks_bytes + LAYERS * HIDDEN * FFN * 4 < f32_bytes / 2, (
        peak, blocks_bytes, f32_bytes)
    _, float_peak = _placed_peak(lazy_gguf_model(path, blocks=False))
    print(f"host peak of the f32 path: {float_peak:,}")
    assert float_peak > f32_bytes / 5, (float_peak, f32_bytes)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    prompts = [[3, 99, 250, 7, 41], list(range(60, 90))]
    got = run_requests(engine, [(p, params) for p in prompts])
    expected = run_requests(reference, [(p, params) for p in prompts])
    assert_same_outputs(got, expected)


def test_inspect_reports_the_blocks_as_served(tmp_path):
    from pagedjax.models.loading.inspect import inspect_model_dir

    path = str(tmp_path / "blocks.gguf")
    f32_bytes = write_blocks_gguf(path)
    report = inspect_model_dir(path)
    formats = report["quantized_weights"]
    assert formats["layers.{layer}.mlp.down_proj"] == "int4, 32 rows a group, offsets"  # Q4_1
    assert formats["layers.{layer}.mlp.gate_proj"] == "int4, 32 rows a group"  # Q4_0
    assert formats["layers.{layer}.self_attn.q_proj"] == "int8, 32 rows a group"  # Q8_0
    assert formats["embed_tokens"] == "int8, 32 rows a group"
    assert report["served_weight_bytes"] < f32_bytes / 3
    with pytest.raises(ValueError, match="served as its own blocks"):
        inspect_model_dir(path, quantization="int8")


def test_a_quantized_embedding_with_offsets_looks_up_its_dequantized_rows():
    """A table in an asymmetric format (GGUF's Q4_1, Q5_1, Q4_K: w = q * scale + zero, a zero a
    group) looks up the rows its dequantization holds (issue 57: the lookup dropping the zeros
    passed every test), and its tied LM head attends to the same table."""
    import jax.numpy as jnp

    from pagedjax.models.layers.quantized import QuantizedEmbed

    rng = np.random.default_rng(0)
    vocab, features = 40, 64
    embed = QuantizedEmbed(vocab, features, "int4", dtype=jnp.float32, groups=2, has_zero=True)
    embed.kernel.set_value(jnp.asarray(rng.integers(-128, 128, embed.kernel.shape, np.int8)))
    embed.scale.set_value(jnp.asarray(rng.uniform(0.01, 0.1, embed.scale.shape), jnp.float32))
    embed.zero.set_value(jnp.asarray(rng.uniform(-1, 1, embed.zero.shape), jnp.float32))
    table = embed.weight().astype(jnp.float32).T  # [V, D]
    ids = jnp.asarray([[3, 0, 39], [7, 7, 12]])
    np.testing.assert_allclose(np.asarray(embed(ids)), np.asarray(table[ids]), rtol=1e-6)
    query = jnp.asarray(rng.normal(size=(2, features)), jnp.float32)
    np.testing.assert_allclose(np.asarray(embed.attend(query)), np.asarray(query @ table.T),
                               rtol=1e-4, atol=1e-4)
