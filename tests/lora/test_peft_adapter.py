"""PEFT LoRA adapter directories (issue 53: pagedjax.lora.peft_adapter), against peft itself: a
random transformers Llama wrapped by peft (non-zero B: init_lora_weights=False), saved with
save_pretrained; read back and merged into the pagedjax model of the base checkpoint, every
kernel equals peft's merge_and_unload (f32: one rank-r product and a sum, 1e-5). What PEFT can
write that changes what an adapter computes is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_models_hf import build_hf  # noqa: E402

from pagedjax.lora.peft_adapter import merged_weights, read_peft_adapter  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter(tmp_path, **lora):
    """(the base checkpoint's directory, the adapter's, peft's merged model)."""
    base = build_hf("llama3.1", tmp_path / "base", seed=0)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora))
    wrapped.save_pretrained(tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter", wrapped.merge_and_unload()


@pytest.mark.parametrize("lora", [dict(r=4, lora_alpha=8, target_modules=ALL),
                                  dict(r=8, lora_alpha=4, use_rslora=True,
                                       target_modules=["q_proj", "v_proj", "down_proj"])],
                         ids=["all-seven", "rslora-three"])
def test_merged_adapter_equals_peft_merge_and_unload(tmp_path, lora):
    base_dir, adapter_dir, merged = adapter(tmp_path, **lora)
    model = load_hf_model(str(base_dir))
    read = read_peft_adapter(str(adapter_dir), model.config)
    assert read.rank == lora["r"] and read.target_modules == tuple(sorted(lora["target_modules"]))
    merged_weights(model, read)
    state = merged.state_dict()
    for layer, block in enumerate(model.layers):
        for name in ALL:
            group = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            ours = np.asarray(getattr(getattr(block, group), name).kernel.get_value())
            theirs = state[f"model.layers.{layer}.{group}.{name}.weight"].numpy().T
            np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_what_changes_an_adapter_is_refused_by_name(tmp_path):
    base_dir, adapter_dir, _ = adapter(tmp_path, r=4, lora_alpha=8, target_modules=["q_proj"])
    config = load_hf_model(str(base_dir)).config
    with pytest.raises(ValueError, match="rank 4 is over max_lora_rank \\(2\\)"):
        read_peft_adapter(str(adapter_dir), config, max_rank=2)
    original = json.loads((adapter_dir / "adapter_config.json").read_text())
    for change, refusal in [(dict(use_dora=True), "use_dora=True is not served"),
                            (dict(bias="lora_only"), "bias 'lora_only' is not served"),
                            (dict(modules_to_save=["lm_head"]), "modules_to_save"),
                            (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
                            (dict(target_modules=["embed_tokens"]),
                             r"target_modules entry 'embed_tokens' is not served"),
                            (dict(peft_type="IA3"), "peft_type 'IA3' is not served"),
                            (dict(r=0), "r must be a positive integer")]:
        (adapter_dir / "adapter_config.json").write_text(json.dumps({**original, **change}))
        with pytest.raises(ValueError, match=refusal):
            read_peft_adapter(str(adapter_dir), config)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(
        {**original, "target_modules": ["k_proj"]}))  # its tensors are q_proj's
    with pytest.raises(ValueError, match="is not a LoRA pair of a targeted projection"):
        read_peft_adapter(str(adapter_dir), config)
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**original, "r": 2}))
    with pytest.raises(ValueError, match=r"lora_A.weight is \[4, 64\], the model takes \[2, 64\]"):
        read_peft_adapter(str(adapter_dir), config)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(original))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    save_file({name.replace("layers.1.", "layers.2."): t for name, t in tensors.items()},
              str(adapter_dir / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="layers.2.self_attn.q_proj.* the model has 2 layers"):
        read_peft_adapter(str(adapter_dir), config)


def test_a_saved_adapter_is_what_peft_reads(tmp_path):
    """save_peft_adapter writes what PeftModel.from_pretrained loads: peft's merge of it equals
    ours, and read_peft_adapter reads it back unchanged."""
    from test_models_hf import build_hf

    from pagedjax.lora.peft_adapter import random_adapter, save_peft_adapter
    base = build_hf("llama3.1", tmp_path / "base", seed=0)
    model = load_hf_model(str(tmp_path / "base"))
    ours = random_adapter(model.config, 4, ["q_proj", "v_proj", "up_proj"], seed=3)
    save_peft_adapter(ours, str(tmp_path / "saved"))
    back = read_peft_adapter(str(tmp_path / "saved"), model.config)
    assert back.rank == 4 and back.scaling == ours.scaling
    for name, (a, b) in ours.pairs.items():
        np.testing.assert_array_equal(back.pairs[name][0], a)
        np.testing.assert_array_equal(back.pairs[name][1], b)
    merged = peft.PeftModel.from_pretrained(base, str(tmp_path / "saved")).merge_and_unload()
    merged_weights(model, back)
    state = merged.state_dict()
    for layer, block in enumerate(model.layers):
        for name, group in (("q_proj", "self_attn"), ("v_proj", "self_attn"),
                            ("up_proj", "mlp")):
            kernel = np.asarray(getattr(getattr(block, group), name).kernel.get_value())
            np.testing.assert_allclose(
                kernel, state[f"model.layers.{layer}.{group}.{name}.weight"].numpy().T,
                atol=1e-5)
