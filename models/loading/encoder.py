"""A BERT-like encoder's Hugging Face directory (config.json + safetensors) read into
models.families.bert.BertModel or models.families.modernbert.ModernBertModel: transformers' names (with or without a `bert.` / `roberta.`
prefix, as a task model saves its base), every weight checked for shape, none left over but
the heads (a masked-LM head, and the classification heads pagedjax.pooling.checkpoint_heads
reads: BertModel's pooler, a classifier)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.families.bert import BertModel, read_encoder_config
from pagedjax.models.loading.hf import read_json, weight_files

IGNORED = ("pooler.", "cls.", "lm_head.", "classifier.", "head.",
           "decoder.")  # the heads pooling does not run
LAYER_NAMES = {"query": "attention.self.query", "key": "attention.self.key",
               "value": "attention.self.value", "attention_output": "attention.output.dense",
               "attention_norm": "attention.output.LayerNorm",
               "intermediate": "intermediate.dense", "output": "output.dense",
               "output_norm": "output.LayerNorm"}
EMBEDDING_NAMES = {"word_embeddings": "embeddings.word_embeddings",
                   "position_embeddings": "embeddings.position_embeddings",
                   "token_type_embeddings": "embeddings.token_type_embeddings",
                   "embedding_norm": "embeddings.LayerNorm"}


def is_encoder_dir(model) -> bool:
    """A directory whose config.json is a BERT-like encoder's."""
    from pagedjax.models.families.bert import ENCODER_TYPES

    encoders = ENCODER_TYPES + ("modernbert",)
    if not isinstance(model, (str, os.PathLike)):
        return False
    path = os.path.join(os.fspath(model), "config.json")
    return os.path.isfile(path) and read_json(path).get("model_type") in encoders


MODERNBERT_NAMES = {"tok_embeddings": "embeddings.tok_embeddings",
                    "embedding_norm": "embeddings.norm", "final_norm": "final_norm",
                    "attn_norm": "attn_norm", "wqkv": "attn.Wqkv", "wo": "attn.Wo",
                    "mlp_norm": "mlp_norm", "wi": "mlp.Wi", "mlp_out": "mlp.Wo"}


def _hf_name(path: tuple[str, ...], model_type: str) -> str:
    """An encoder's parameter path -> transformers' tensor name (without a prefix)."""
    *module, leaf = path
    suffix = {"kernel": "weight", "scale": "weight", "bias": "bias", "embedding": "weight"}[leaf]
    if model_type == "modernbert":
        if module[0] == "layers":
            return f"layers.{module[1]}.{MODERNBERT_NAMES[module[2]]}.{suffix}"
        return f"{MODERNBERT_NAMES[module[0]]}.{suffix}"
    if module[0] == "layers":
        return f"encoder.layer.{module[1]}.{LAYER_NAMES[module[2]]}.{suffix}"
    return f"{EMBEDDING_NAMES[module[0]]}.{suffix}"


def build_encoder(raw: dict):
    """(an abstract encoder of config.json raw, its config)."""
    if raw.get("model_type") == "modernbert":
        from pagedjax.models.families.modernbert import ModernBertModel, read_modernbert_config

        modern = read_modernbert_config(raw)
        return nnx.eval_shape(lambda: ModernBertModel(modern, rngs=nnx.Rngs(0))), modern
    config = read_encoder_config(raw)
    return nnx.eval_shape(lambda: BertModel(config, rngs=nnx.Rngs(0))), config


def load_encoder(model_dir: str, dtype: str = "float32"):
    """The encoder in model_dir, f32 (or bfloat16) parameters; ValueError naming a missing,
    misshapen or unexpected tensor."""
    from safetensors import safe_open

    model, config = build_encoder(read_json(os.path.join(model_dir, "config.json")))
    state = nnx.state(model, nnx.Param)
    wanted = dict(nnx.to_flat_state(state))
    files = weight_files(model_dir)
    first = _hf_name(("tok_embeddings" if config.model_type == "modernbert"
                      else "word_embeddings", "embedding"), config.model_type)
    prefix = next((p for p in ("", f"{config.model_type.replace('-', '_')}.", "bert.",
                               "roberta.", "model.") if p + first in files), None)
    if prefix is None:
        raise ValueError(f"{model_dir}: no {first} in its weights")
    loaded, used = {}, set()
    for path, leaf in wanted.items():
        name = prefix + _hf_name(tuple(str(k) for k in path), config.model_type)
        if name not in files:
            raise ValueError(f"{model_dir}: weight {name} is missing")
        with safe_open(files[name], framework="numpy") as f:
            tensor = np.asarray(f.get_tensor(name), np.float32)
        if path[-1] == "kernel":
            tensor = tensor.T  # transformers' [out, in]
        if tensor.shape != leaf.get_value().shape:
            raise ValueError(f"{model_dir}: weight {name} has shape {tensor.shape}, the config "
                             f"implies {leaf.get_value().shape}")
        loaded[path] = jnp.asarray(tensor, jnp.dtype(dtype))
        used.add(name)
    unexpected = sorted(n for n in files if n not in used and not n.removeprefix(
        prefix).startswith(IGNORED) and not n.endswith("position_ids"))
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected weights for {config.model_type}: "
                         f"{unexpected[:5]}")
    pure: dict = nnx.to_pure_dict(state)
    for path, value in loaded.items():
        node = pure
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model
