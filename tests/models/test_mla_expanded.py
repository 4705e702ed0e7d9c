"""Multi-head latent attention's expanded prefill (models/layers/mla_expanded.py) against the
absorbed form on the same layer and cache: a fresh step of three sequences (lengths that cut
blocks, padding rows and tokens) through the jnp reference and the Triton kernels (interpreted):
the same outputs within f32 rounding and the same latent written; a step with cached context
falls back to the absorbed form; "auto" picks by the step's shape and backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers")

from test_models_deepseek import _config_only  # noqa: E402

from pagedjax.models.layers import mla_expanded  # noqa: E402
from pagedjax.models.layers.mla import LatentAttention  # noqa: E402
from pagedjax.models.loading.hf import read_hf_config  # noqa: E402
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, init_kv_cache  # noqa: E402

BLOCK = 8


def step(q_lens, kv_lens, padded_seqs=4, padded_tokens=40, width=6):
    """A ragged step's metadata: sequence b in blocks 1 + 6b.., its chunk the last q_len of its
    kv_len positions."""
    num = len(q_lens)
    tables = np.zeros((padded_seqs, width), np.int32)
    slots, positions = [], []
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        tables[b] = 1 + width * b + np.arange(width)
        for pos in range(kv - q, kv):
            slots.append(tables[b, pos // BLOCK] * BLOCK + pos % BLOCK)
            positions.append(pos)
    pad = padded_tokens - len(slots)
    cu = np.zeros(padded_seqs + 1, np.int32)
    cu[1:num + 1] = np.cumsum(q_lens)
    cu[num + 1:] = cu[num]
    lens = np.zeros(padded_seqs, np.int32)
    lens[:num] = kv_lens
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots + [0] * pad, jnp.int32), block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(lens), cu_q_lens=jnp.asarray(cu), num_seqs=jnp.int32(num),
        decode_only=False)
    return metadata, jnp.asarray(positions + [0] * pad, jnp.int32)


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    config = read_hf_config(_config_only(tmp_path_factory.mktemp("v3"), qk_rope_head_dim=16))
    return config, LatentAttention(config, 1, rngs=nnx.Rngs(0), dtype=jnp.float32,
                                   param_dtype=jnp.float32)


def run(layer, form, metadata, positions, backend="reference", cache=None):
    config, attn = layer
    backend = AttentionBackend(backend, interpret=backend != "reference", latent_prefill=form)
    if cache is None:
        cache = init_kv_cache(1, 32, BLOCK, 1, config.kv_head_dim, jnp.float32, backend.name,
                              planes=1)
    x = jax.random.normal(jax.random.key(1), (positions.shape[0], config.hidden_size))
    return jax.jit(lambda *args: attn.forward_paged(*args, backend))(x, positions, cache,
                                                                      metadata)


@pytest.mark.parametrize("backend, rows", [("reference", 4), ("gpu", 4), ("reference", 3)],
                         ids=["reference", "gpu", "every-row-live"])
@pytest.mark.quick_variant('every-row-live')  # the others: make test-slow
def test_expanded_equals_absorbed_on_a_fresh_step(layer, backend, rows):
    metadata, positions = step([5, 17, 9], [5, 17, 9], padded_seqs=rows)
    assert bool(mla_expanded.fresh(metadata))
    want, want_cache = run(layer, "absorbed", metadata, positions, backend)
    got, got_cache = run(layer, "expanded", metadata, positions, backend)
    np.testing.assert_allclose(np.asarray(got[:31]), np.asarray(want[:31]), rtol=2e-5,
                               atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got_cache)[:, :, 1:],
                                  np.asarray(want_cache)[:, :, 1:])


def test_a_step_with_context_falls_back_to_the_absorbed_form(layer):
    """The second chunk of a sequence (context written by the first) under "expanded": the
    absorbed form's output, not attention over the chunk alone."""
    first, positions = step([5, 8], [5, 8])
    _, cache = run(layer, "absorbed", first, positions)
    second, positions = step([5, 4], [10, 8 + 4])
    assert not bool(mla_expanded.fresh(second))
    want, _ = run(layer, "absorbed", second, positions, cache=cache)
    got, _ = run(layer, "expanded", second, positions, cache=cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_auto_picks_by_the_steps_shape(layer):
    """At DeepSeek's dims (512 latent, 128 + 64 query/key, 128 values) the crossover is 341
    tokens a sequence; decode steps and oversized scratch caches stay absorbed."""
    assert mla_expanded.crossover_tokens(512, 128, 64, 128) == pytest.approx(341.3, abs=0.1)
    _, attn = layer
    deepseek = AttentionBackend("tpu", latent_prefill="auto")
    cross = mla_expanded.MEASURED_CROSSOVER * mla_expanded.crossover_tokens(
        attn.latent, attn.nope, attn.rope_dim, attn.v_dim)
    few, _ = step([1], [1], padded_seqs=4)
    many = int(4 * cross) + 8
    assert mla_expanded.chosen(attn, deepseek, few, many, BLOCK, 4)
    assert not mla_expanded.chosen(attn, deepseek, few, int(4 * cross) - 8, BLOCK, 4)
    assert not mla_expanded.chosen(attn, deepseek, dataclasses.replace(few, decode_only=True),
                                   many, BLOCK, 4)
    absorbed = dataclasses.replace(deepseek, latent_prefill="absorbed")
    assert not mla_expanded.chosen(attn, absorbed, few, many, BLOCK, 4)
    # the jnp reference: absorbed at every length (measured: benchmarks/results/mla_prefill.md)
    assert not mla_expanded.chosen(attn, AttentionBackend(), few, 100 * many, BLOCK, 4)
    forced = dataclasses.replace(deepseek, latent_prefill="expanded")
    assert not mla_expanded.chosen(attn, forced, few, 1 << 30, BLOCK, 4)  # past SCRATCH_BYTES
    head_dim = max(attn.nope + attn.rope_dim, attn.v_dim)
    block = (mla_expanded.scratch_bytes(BLOCK, 0, BLOCK, attn.num_heads, head_dim, 4, "tpu")
             - mla_expanded.scratch_bytes(0, 0, BLOCK, attn.num_heads, head_dim, 4, "tpu"))
    at_limit = (mla_expanded.SCRATCH_BYTES // block - 4 - 1) * BLOCK  # 4 rows, the null block
    assert mla_expanded.chosen(attn, forced, few, at_limit - 8 * BLOCK, BLOCK, 4)
    assert not mla_expanded.chosen(attn, forced, few, at_limit + 8 * BLOCK, BLOCK, 4)


def test_the_engine_field_and_flag():
    """EngineConfig.mla_prefill refuses a form it does not know by name; --mla-prefill sets it."""
    import argparse

    from pagedjax import EngineConfig
    from pagedjax.tools.engine_args import add_engine_args, engine_kwargs
    with pytest.raises(ValueError, match="mla_prefill must be one of"):
        EngineConfig(mla_prefill="dense")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--mla-prefill", "expanded"]))["mla_prefill"] == \
        "expanded"
