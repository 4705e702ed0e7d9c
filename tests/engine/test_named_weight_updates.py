"""New weights by Hugging Face tensor name (issue 52: update_weights with a mapping, whole or
partial; pagedjax.engine.named_weights and pagedjax.engine.weight_writer): checkpoints written by transformers (random weights, save_pretrained), their tensors
as the safetensors file holds them. After an update every served leaf equals, bit for bit, the
leaf of an engine built from a checkpoint with those tensors (float32: a transpose and a copy
are exact), and what no name touched stays as it was; bad names, shapes and dtypes are refused
by name before anything changes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import until_done

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402
from test_models_hf import build_hf  # noqa: E402
from test_models_moe import build_moe  # noqa: E402

from pagedjax import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model  # noqa: E402
from pagedjax.models.loading.names import hf_state_dict  # noqa: E402
from pagedjax.models.registry import hf_renames  # noqa: E402

CONFIG = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
              num_blocks=32, min_seq_bucket=4)


def checkpoint(arch: str, directory, seed: int) -> dict:
    """A random transformers checkpoint of arch under directory: its tensors, by name."""
    (build_moe if arch == "qwen2_moe" else build_hf)(arch, directory, seed=seed)
    return load_file(str(directory / "model.safetensors"))


def engine_of(directory, **overrides) -> LLMEngine:
    return LLMEngine(load_hf_model(str(directory)), EngineConfig(**{**CONFIG, **overrides}))


def leaves(engine) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(engine.runner.params)]


def greedy(engine) -> list[int]:
    request_id = engine.add_request([5, 9, 2, 7, 11, 3], SamplingParams(max_tokens=6,
                                                                          temperature=0.0))
    for _ in until_done(engine):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.outputs[0].token_ids
    raise AssertionError("unfinished")


def assert_leaves_equal(got, expected) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


# a tied head with every bias (lm_head.weight stands for the embedding); experts on every other
# layer (stacked by period) with shared experts; a hybrid KV cache (a global and a sliding layer)
@pytest.mark.parametrize("arch", ["llama-bias-tied", "qwen2_moe", pytest.param(
    "qwen2-max-window-layers", marks=pytest.mark.slow)])  # make test-slow: a third family
@pytest.mark.quick_variant('llama-bias-tied')  # the others: make test-slow
def test_a_checkpoints_tensors_by_name_update_every_leaf(arch, tmp_path):
    checkpoint(arch, tmp_path / "old", seed=0)
    new = checkpoint(arch, tmp_path / "new", seed=1)
    if arch == "llama-bias-tied":  # as a torch state dict has them (older ones: inv_freq)
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
        new["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    engine = engine_of(tmp_path / "old")
    greedy(engine)
    engine.update_weights(new, version="by-name")
    fresh = engine_of(tmp_path / "new")
    assert_leaves_equal(leaves(engine), leaves(fresh))
    assert greedy(engine) == greedy(fresh) and engine.weight_version == "by-name"


def test_a_partial_update_changes_only_what_it_names(tmp_path):
    """Two layers' down projections (of one stack of four) and another's k projection: the
    engine equals one built from the checkpoint with those tensors replaced; every leaf no name
    touches is the array it was (not rewritten)."""
    build_hf("llama3.1", tmp_path / "old", seed=0, num_hidden_layers=4)
    old = load_file(str(tmp_path / "old" / "model.safetensors"))
    rng = np.random.default_rng(0)
    names = ["model.layers.2.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.1.self_attn.k_proj.weight"]
    update = {n: rng.normal(size=old[n].shape).astype(np.float32) for n in names}
    save_file({**old, **update}, str(tmp_path / "old" / "model.safetensors"))
    expected = leaves(engine_of(tmp_path / "old"))
    save_file(old, str(tmp_path / "old" / "model.safetensors"))
    engine = engine_of(tmp_path / "old")
    before = jax.tree.leaves(engine.runner.params)
    engine.update_weights(update)
    after = jax.tree.leaves(engine.runner.params)
    assert_leaves_equal(leaves(engine), expected)
    untouched = [i for i, (a, b) in enumerate(zip(before, after)) if a is b]
    assert len(untouched) == len(after) - 2  # the two leaves named, rewritten in place


def test_names_from_a_jax_model_equal_the_model(tmp_path):
    """hf_state_dict (a pagedjax model's tensors by HF name, on its devices) taken by name
    equals the model taken whole."""
    checkpoint("qwen2_moe", tmp_path / "old", seed=0)
    checkpoint("qwen2_moe", tmp_path / "new", seed=1)
    model = load_hf_model(str(tmp_path / "new"))
    engine = engine_of(tmp_path / "old")
    engine.update_weights(hf_state_dict(model, hf_renames(model.config)))
    whole = engine_of(tmp_path / "old")
    whole.update_weights(model)
    assert_leaves_equal(leaves(engine), leaves(whole))


@pytest.mark.parametrize("scheme", ["int8", "int4"])  # int4: two rows a byte, in groups
def test_a_quantized_engine_quantizes_named_tensors(tmp_path, scheme):
    checkpoint("llama3.1", tmp_path / "old", seed=0)
    new = checkpoint("llama3.1", tmp_path / "new", seed=1)
    engine = engine_of(tmp_path / "old", quantization=scheme)
    part = {"model.layers.0.mlp.up_proj.weight": new["model.layers.0.mlp.up_proj.weight"]}
    engine.update_weights(part)  # partial: data and scales of one layer's weight
    engine.update_weights(new)
    assert_leaves_equal(leaves(engine), leaves(engine_of(tmp_path / "new", quantization=scheme)))


def test_bad_names_shapes_and_dtypes_are_refused_and_change_nothing(tmp_path):
    old = checkpoint("llama-bias-tied", tmp_path / "old", seed=0)
    engine = engine_of(tmp_path / "old")
    before = leaves(engine)
    name = "model.layers.1.self_attn.v_proj.weight"
    for bad, refusal in [
        ({"model.layers.9.mlp.up_proj.weight": old[name]},
         r"unknown tensor names \['model.layers.9.mlp.up_proj.weight'\]"),
        ({name: old[name][:, :-1]}, name + r" is float32\[32, 63\], the engine takes a float "
                                           r"dtype \[32, 64\]"),
        ({name: old[name].astype(np.int32)}, name + r" is int32"),
        ({name: "weights"}, name + " must be an array"),
        ({"lm_head.weight": old[name]}, r"lm_head.weight is float32\[32, 64\]"),
    ]:
        with pytest.raises(ValueError, match=refusal):  # with a good name: nothing changes
            engine.update_weights({**bad, "model.norm.weight": old["model.norm.weight"] * 2})
    with pytest.raises(ValueError, match="mapping of Hugging Face names to arrays is empty"):
        engine.update_weights({})
    assert engine.num_weight_updates == 0
    assert_leaves_equal(leaves(engine), before)
    engine.sleep(level=2)
    with pytest.raises(ValueError, match="a partial update .* needs the weights awake"):
        engine.update_weights({name: old[name]})
    engine.update_weights(old)  # every name: wakes the weights
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping
    assert_leaves_equal(leaves(engine), before)
