"""The NNX Llama: dense and paged paths on the same weights agree."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax.engine.step_functions import step_fn
from pagedjax.models import LlamaConfig, get_config, init_model, paged_forward
from pagedjax.models.families.llama import rope
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, init_kv_cache
from pagedjax.scheduler.plan import padding_plan

CONFIG = get_config("debug-tiny")


def chunk_metadata(n, start, table, block_size):
    """(positions, metadata) of one chunk [start, start + n) of a single sequence."""
    positions = np.arange(start, start + n, dtype=np.int32)
    slots = table[positions // block_size] * block_size + positions % block_size
    return positions, AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(table[None]),
        kv_lens=jnp.array([start + n], jnp.int32), cu_q_lens=jnp.array([0, n], jnp.int32),
        num_seqs=jnp.int32(1), decode_only=False)


def paged_logits(model, kv_caches, token_ids, start, table, block_size):
    """Runs one chunk [start, start + len) of a single sequence through the paged path."""
    positions, metadata = chunk_metadata(len(token_ids), start, table, block_size)
    hidden, kv_caches = model.forward_paged(kv_caches, jnp.asarray(token_ids, jnp.int32),
                                            jnp.asarray(positions), metadata)
    return model.logits(hidden), kv_caches


@pytest.mark.parametrize("chunks", [[23], pytest.param([10, 13], marks=pytest.mark.slow),  # 5 s
                                    [1, 1, 21]])
@pytest.mark.quick_variant('chunks0')  # the others: make test-slow
def test_paged_forward_matches_dense_forward(chunks):
    model = init_model(CONFIG, seed=1)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, sum(chunks))
    dense = np.asarray(model(jnp.asarray(tokens[None]))[0])
    block_size = 4
    kv_caches = init_kv_cache(CONFIG.num_layers, 16, block_size, CONFIG.num_kv_heads,
                              CONFIG.head_dim, jnp.float32)
    table = np.array([9, 3, 14, 1, 7, 2, 0, 0], np.int32)
    start, pieces = 0, []
    for n in chunks:
        logits, kv_caches = paged_logits(model, kv_caches, tokens[start:start + n], start,
                                         table, block_size)
        pieces.append(np.asarray(logits))
        start += n
    # Same f32 math in a different order (blockwise online softmax vs one softmax).
    np.testing.assert_allclose(np.concatenate(pieces), dense, rtol=1e-4, atol=1e-4)


def test_rope_is_a_rotation_that_preserves_norms_and_relative_positions():
    x = jax.random.normal(jax.random.key(0), (6, 2, 8))
    pos = jnp.arange(6)
    y = rope(x, pos, 10000.0)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    q, k = x[:, 0], x[:, 1]
    def dot(a, b, pa, pb):
        return jnp.sum(rope(a[None, None], jnp.array([pa]), 1e4)
                       * rope(b[None, None], jnp.array([pb]), 1e4))

    np.testing.assert_allclose(dot(q[0], k[0], 3, 1), dot(q[0], k[0], 10, 8), rtol=1e-4)


def test_tied_embeddings_share_the_matrix():
    config = get_config("demo-small")
    model = init_model(config)
    assert model.lm_head is None
    hidden = jnp.ones((2, config.hidden_size))
    expected = model.norm(hidden) @ model.embed_tokens.embedding[...].T
    np.testing.assert_allclose(model.logits(hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_heads=6, num_kv_heads=4), "num_kv_heads"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(eos_token_id=999), "eos_token_id"),
])
def test_bad_model_config_names_the_field(kwargs, field):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                num_kv_heads=2)
    with pytest.raises(ValueError, match=field):
        LlamaConfig(**{**base, **kwargs})


def test_kv_bytes_per_token_formula():
    config = get_config("llama-3-8b")
    # 2 (K and V) * 32 layers * 8 KV heads * 128 head dim * 2 bytes = 128 KiB per token in bf16.
    assert config.kv_bytes_per_token(2) == 131072


@pytest.mark.slow  # bf16 error statistics over many positions: make test-slow
def test_bf16_paged_error_is_the_error_of_bf16_itself():
    """bf16 changes tokens, so compare errors: the paged bf16 path may stray from the f32
    reference no further than the dense bf16 path does (within 2x), i.e. paging adds no error
    beyond the dtype's own rounding."""
    model16 = init_model(CONFIG, seed=1, dtype=jnp.bfloat16)
    model32 = init_model(CONFIG, seed=1)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 30)
    ref = np.asarray(model32(jnp.asarray(tokens[None]))[0])
    dense16 = np.asarray(model16(jnp.asarray(tokens[None]))[0], np.float32)
    kv_caches = init_kv_cache(CONFIG.num_layers, 16, 4, CONFIG.num_kv_heads, CONFIG.head_dim,
                              jnp.bfloat16)
    table = np.array([3, 9, 1, 12, 5, 7, 2, 8, 0, 0], np.int32)
    first, kv_caches = paged_logits(model16, kv_caches, tokens[:17], 0, table, 4)
    second, _ = paged_logits(model16, kv_caches, tokens[17:], 17, table, 4)
    paged16 = np.concatenate([np.asarray(first), np.asarray(second)]).astype(np.float32)
    dense_err = np.abs(dense16 - ref).max()
    paged_err = np.abs(paged16 - ref).max()
    assert 0 < dense_err < 0.1 * np.abs(ref).max()
    assert paged_err <= 2 * dense_err, (paged_err, dense_err)


def serving_logits(graph, weights, kv_cache, token_ids, start, table, block_size):
    """paged_logits on pagedjax.models.paged_forward's form of the weights, jitted as the engine runs it."""
    positions, metadata = chunk_metadata(len(token_ids), start, table, block_size)

    @jax.jit
    def run(weights, kv_cache, token_ids, positions, metadata):
        hidden, kv_cache = paged_forward.forward_paged(graph, weights, kv_cache, token_ids, positions,
                                                 metadata)
        return paged_forward.logits(graph, weights, hidden), kv_cache

    return run(weights, kv_cache, jnp.asarray(token_ids, jnp.int32), jnp.asarray(positions),
               metadata)


@pytest.mark.slow  # make test-slow
def test_scanned_and_unrolled_layers_give_the_same_logits_and_cache():
    """The engine's form (layers stacked, one lax.scan) against the unrolled form of the same
    weights: the same f32 ops on the same values, so bitwise equal on the CPU, cache included;
    and both equal to the model's own forward_paged (eager, op by op: XLA may fuse the jitted
    forms differently, hence f32 rounding)."""
    model = init_model(CONFIG, seed=2)
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 14)
    table = np.array([5, 2, 7, 0], np.int32)
    results = {}
    for scan_layers in (True, False):
        graph, weights = paged_forward.serving_form(model, scan_layers)
        kv_cache = init_kv_cache(CONFIG.num_layers, 8, 4, CONFIG.num_kv_heads, CONFIG.head_dim,
                                 jnp.float32)
        first, kv_cache = serving_logits(graph, weights, kv_cache, tokens[:13], 0, table, 4)
        second, kv_cache = serving_logits(graph, weights, kv_cache, tokens[13:], 13, table, 4)
        results[scan_layers] = (np.asarray(first), np.asarray(second), np.asarray(kv_cache))
    for got, want in zip(results[True], results[False]):
        np.testing.assert_array_equal(got, want)
    kv_cache = init_kv_cache(CONFIG.num_layers, 8, 4, CONFIG.num_kv_heads, CONFIG.head_dim,
                             jnp.float32)
    eager, kv_cache = paged_logits(model, kv_cache, tokens[:13], 0, table, 4)
    np.testing.assert_allclose(results[True][0], eager, rtol=1e-5, atol=1e-5)
    eager, kv_cache = paged_logits(model, kv_cache, tokens[13:], 13, table, 4)
    np.testing.assert_allclose(results[True][1], eager, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[True][2], kv_cache, rtol=1e-5, atol=1e-5)
    # Each layer wrote its own blocks: layer l's copy of block 5 at 8 * l + 5, all different.
    written = results[True][2][0][:, 8 * np.arange(CONFIG.num_layers) + 5]  # [K, L, S, H]
    assert np.all(np.abs(written).max(axis=(0, 2, 3)) > 0)
    assert len({written[:, i].tobytes() for i in range(CONFIG.num_layers)}) == CONFIG.num_layers


@pytest.mark.parametrize("scan_layers, grows", [(True, False), (False, True)])
def test_step_program_size_is_independent_of_depth_under_scan(scan_layers, grows):
    """Scanned, a step program holds one layer: 2 and 6 layers lower to the same number of
    matmuls. Unrolled, the count grows with the depth."""
    def matmuls(num_layers):
        config = dataclasses.replace(CONFIG, num_layers=num_layers)
        graph, weights = paged_forward.serving_form(
            nnx.eval_shape(lambda: init_model(config)), scan_layers)
        cache = jax.eval_shape(lambda: init_kv_cache(num_layers, 8, 4, config.num_kv_heads,
                                                     config.head_dim, jnp.float32))
        plan = padding_plan("prefill", 16, 2, max_blocks_per_seq=4)
        text = jax.jit(functools.partial(step_fn, graph, AttentionBackend(), 0)).lower(
            weights, cache, plan).as_text()
        return text.count("stablehlo.dot_general")

    assert (matmuls(6) > matmuls(2)) == grows


def test_scan_by_default_unrolls_large_layers_on_the_cpu_only(monkeypatch):
    """EngineConfig.scan_layers None: scanned, except on the CPU for layers of
    CPU_SCAN_MAX_LAYER_BYTES or more a device (XLA's CPU backend copies a scanned layer's
    weights out of the stack every step); a layer's bytes are its weights', counted on an
    abstract model."""
    tiny = nnx.eval_shape(lambda: init_model(CONFIG))
    d, f, heads, kv_heads, head_dim = 1024, 3072, 16, 8, 128  # Qwen3-0.6B's layer shapes
    large_config = dataclasses.replace(
        CONFIG, vocab_size=512, hidden_size=d, intermediate_size=f, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim)
    large = nnx.eval_shape(lambda: init_model(large_config))
    weights = d * head_dim * (2 * heads + 2 * kv_heads) + 3 * d * f
    assert weights * 4 <= paged_forward.layer_bytes(large.layers[0]) < weights * 4 + 64 * 1024
    assert paged_forward.scan_by_default(tiny, "cpu")
    assert not paged_forward.scan_by_default(large, "cpu")
    # a tensor-parallel device's share: 60 MiB over 16 devices is under the limit, over 4 not
    assert paged_forward.scan_by_default(large, "cpu", shards=16)
    assert not paged_forward.scan_by_default(large, "cpu", shards=4)
    assert paged_forward.scan_by_default(large, "gpu") and paged_forward.scan_by_default(
        large, "tpu")
    limit = paged_forward.layer_bytes(tiny.layers[0])  # a layer of the limit's size: unrolled
    monkeypatch.setattr(paged_forward, "CPU_SCAN_MAX_LAYER_BYTES", limit)
    assert not paged_forward.scan_by_default(tiny, "cpu")
    monkeypatch.setattr(paged_forward, "CPU_SCAN_MAX_LAYER_BYTES", limit + 1)
    assert paged_forward.scan_by_default(tiny, "cpu")


def test_runner_resolves_scan_layers_on_its_devices_platform(monkeypatch):
    """A runner given no scan_layers asks scan_by_default on its device's platform; an
    explicit value stands."""
    from pagedjax.engine.runner import ModelRunner

    model = init_model(CONFIG)
    def runner(**kw):
        return ModelRunner(model, num_blocks=8, block_size=4, dtype=np.float32, **kw)

    assert runner().graph.scan_layers
    monkeypatch.setattr(paged_forward, "CPU_SCAN_MAX_LAYER_BYTES", 1)
    assert not runner().graph.scan_layers
    assert runner(scan_layers=True).graph.scan_layers


def test_scan_layers_flags_and_config():
    """--scan-layers / --no-scan-layers set EngineConfig.scan_layers; neither leaves the
    default (None); a value neither boolean nor None is refused by name."""
    import argparse

    from pagedjax.engine.config import EngineConfig
    from pagedjax.tools.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    def kwargs(*flags):
        return engine_kwargs(parser.parse_args(list(flags)))

    assert kwargs("--scan-layers")["scan_layers"] is True
    assert kwargs("--no-scan-layers")["scan_layers"] is False
    assert "scan_layers" not in kwargs()
    assert EngineConfig().scan_layers is None
    with pytest.raises(ValueError, match="scan_layers must be a boolean or None"):
        EngineConfig(scan_layers="no")
