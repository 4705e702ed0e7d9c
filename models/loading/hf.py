"""Hugging Face model directories: config.json -> LlamaConfig, safetensors -> an NNX model.

Supported (models.registry): Llama (2, 3, 3.1 with llama3 RoPE scaling), Mistral (sliding
window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Gemma 2 and Gemma 3 text (models/families/gemma.py),
the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (models/layers/moe.py; each expert's
tensors stacked on load);
config.json in the transformers 4 format (`rope_theta`, `rope_scaling`, `torch_dtype`) or 5
(`rope_parameters`, `dtype`, explicit `head_dim`), read by pagedjax.models.loading.hf_config. Anything the family
implementation would get wrong is refused at load with UnsupportedModelError.

Weights are read with the `safetensors` library (no torch), one tensor at a time: each is cast,
transposed where HF stores [out, in], and put on the device before the next is read, so the host
never holds a second copy of the model. Every file's header is checked (names, shapes) before the
first tensor is read; any error raises and no model is returned.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import LlamaForCausalLM
from pagedjax.models.loading import mxfp4_checkpoint
from pagedjax.models.loading.hf_config import (UnsupportedModelError, architecture_of,  # noqa: F401
                                               config_from_hf, is_sequence_classifier,
                                               supported_summary)
from pagedjax.models.loading.names import EXPERT, expert_names, hf_weight_name
from pagedjax.models.loading.user_files import checked_path, read_user_json
from pagedjax.models.registry import hf_renames, model_class

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: str) -> dict[str, Any]:
    """A checkpoint's JSON object (through user_files: a regular file of bounded size)."""
    if not os.path.lexists(path):
        raise ValueError(f"{path} is missing")
    return read_user_json(path, os.path.basename(path))


def read_hf_config(model_dir: str) -> LlamaConfig:
    raw = read_json(os.path.join(model_dir, "config.json"))
    generation_path = os.path.join(model_dir, "generation_config.json")
    generation = read_json(generation_path) if os.path.isfile(generation_path) else None
    return config_from_hf(raw, generation)


def checkpoint_dtype(raw: dict[str, Any]) -> str:
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float32")


# ---- weights ---------------------------------------------------------------------------------

def weight_files(model_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the index (sharded) or the single file."""
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        files = {name: os.path.join(model_dir, f) for name, f in weight_map.items()}
        for path in sorted(set(files.values())):
            if not os.path.isfile(path):
                raise ValueError(f"weight file {path} (named in {SAFETENSORS_INDEX}) is missing")
            checked_path(path, "weight file", root=model_dir)
        return files
    single = os.path.join(model_dir, SAFETENSORS_FILE)
    if not os.path.isfile(single):
        raise ValueError(f"{model_dir} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}")
    checked_path(single, "weight file", root=model_dir)
    return {name: single for name in _header(single)}


def _header(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) from a safetensors header, without reading tensors."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, framework="numpy") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                    for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read weight file {path}: {e}") from None


def checked_hf_weights(model_dir: str, dtype: str = "float32"):
    """(abstract model in dtype, [((HF name, transposed), shape) for each of its parameters in
    tree order, with the tree's treedef], name -> safetensors file), once every file's header
    was checked against the config (names, shapes): nothing read yet."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    config = read_hf_config(model_dir)
    jdtype = jnp.dtype(dtype)
    cls = model_class(config)
    abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=jdtype,
                                          param_dtype=jdtype))
    compressed = compressed_scheme(model_dir)
    if compressed is not None:
        from pagedjax.models.loading.compressed_tensors import quantized_abstract
        abstract = quantized_abstract(abstract, compressed)
    mxfp4 = mxfp4_experts(model_dir)
    if mxfp4:
        abstract = mxfp4_checkpoint.quantized_abstract(abstract)
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    renames = hf_renames(config)
    wanted = [(_stored_name(path, renames), leaf.shape) for path, leaf in leaves
              if str(getattr(path[-1], "key", path[-1])) != "scale"]  # read with its weight

    files = weight_files(model_dir)
    headers = {path: _header(path) for path in sorted(set(files.values()))}
    present = {name for header in headers.values() for name in header}
    stored_as: dict = {}  # each tensor read -> the shape HF stores it in
    for (name, transpose), shape in wanted:
        if transpose is None:  # MXFP4 experts: their _blocks and _scales
            weight = (shape[0], 2 * shape[1], shape[2])
            stored_as.update(zip(mxfp4_checkpoint.stored_names(name),
                                 mxfp4_checkpoint.stored_shapes(weight)))
            continue
        per_tensor = shape[1:] if EXPERT in name else shape
        for each in expert_names(name, config.num_experts):
            stored_as[each] = tuple(per_tensor[::-1] if transpose else per_tensor)
    missing = sorted(set(stored_as) - present)
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {config.model_type}: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if is_sequence_classifier(read_json(os.path.join(model_dir, "config.json"))):
        ignorable |= {n for n in present if n.startswith("score.")}  # its head (pooling's)
    if compressed is not None:  # read with their weights (_check_compressed checks them)
        ignorable |= {n for n in present if n.endswith(".weight_scale")}
    unexpected = sorted(n for n in present - set(stored_as) - ignorable
                        if not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected weights (not part of {config.model_type}): "
                         f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for name, expected in stored_as.items():
        stored, _ = headers[files[name]][name]
        if stored != expected:
            raise ValueError(f"{model_dir}: weight {name} has shape {stored}, the config "
                             f"implies {expected}")
    if compressed is not None:
        _check_compressed(model_dir, abstract, compressed, headers, files)
    return abstract, (wanted, treedef), files


def _stored_name(path: tuple, renames) -> tuple[str, bool | None]:
    """hf_weight_name of a parameter; an MXFP4 experts' kernel: its projection's name (the
    checkpoint's `<name>_blocks` and `_scales` hold it) and None."""
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-1] == "kernel" and len(keys) > 2 and keys[-3] == "experts":
        return hf_weight_name(path[:-1], renames)[0], None
    return hf_weight_name(path, renames)


def mxfp4_experts(model_dir: str) -> bool:
    """Whether the checkpoint stores its experts in MXFP4 (models/loading/mxfp4_checkpoint.py)."""
    return mxfp4_checkpoint.read(read_json(os.path.join(model_dir, "config.json")))


def compressed_scheme(model_dir: str):
    """The checkpoint's pagedjax.models.loading.compressed_tensors.CompressedScheme, or None."""
    from pagedjax.models.loading import compressed_tensors
    raw = read_json(os.path.join(model_dir, "config.json"))
    if mxfp4_checkpoint.read(raw):  # another stored form
        return None
    return compressed_tensors.read(raw)


def _check_compressed(model_dir, abstract, scheme, headers, files) -> None:
    """Each quantized module's weight is stored in the scheme's type, with its weight_scale
    ([out, 1] per channel, one value per tensor)."""
    from pagedjax.models.loading.quantized_loading import quantized_modules

    stored_type = {"fp8": "F8_E4M3", "int8": "I8"}[scheme.scheme]
    renames = hf_renames(abstract.config)
    for key, module in quantized_modules(abstract).items():
        layers = range(abstract.config.num_layers) if key[0] == "layers" else [None]
        for layer in layers:
            path = tuple(layer if part == "{layer}" else part for part in key) + ("kernel",)
            name = hf_weight_name(path, renames)[0]
            _, dtype = headers[files[name]][name]
            scale = name[:-len("weight")] + "weight_scale"
            if dtype != stored_type or scale not in files:
                raise ValueError(f"{model_dir}: {name} is {dtype}"
                                 f"{'' if scale in files else ' without weight_scale'}; "
                                 f"compressed-tensors {scheme.scheme} stores {stored_type} "
                                 f"with a weight_scale")
            shape, _ = headers[files[scale]][scale]
            out_features = module.kernel.get_value().shape[-1]
            expected = [(out_features, 1)] if scheme.strategy == "channel" else [(), (1,), (1, 1)]
            if tuple(shape) not in expected:
                raise ValueError(f"{model_dir}: {scale} has shape {tuple(shape)}; strategy "
                                 f"{scheme.strategy} stores {expected[0]}")


def load_hf_model(model_dir: str, dtype: str = "float32") -> LlamaForCausalLM:
    """The model in a Hugging Face directory, parameters and activations in dtype (on
    jax.devices()[0]; pagedjax.models.loading.placed_weights reads it straight into an engine's shardings)."""
    from safetensors import SafetensorError, safe_open

    abstract, (wanted, treedef), files = checked_hf_weights(model_dir, dtype)
    if compressed_scheme(model_dir) is not None or mxfp4_experts(model_dir):
        raise ValueError(f"{model_dir}: a quantized (compressed-tensors, MXFP4) checkpoint is "
                         f"read into place by an engine (pagedjax.models.loading.placed_weights."
                         f"lazy_hf_model, LLM), not whole")
    num_experts = abstract.config.num_experts
    jdtype = jnp.dtype(dtype)
    np_dtype = np.dtype(jdtype)
    device = jax.devices()[0]
    arrays: list[Any] = [None] * len(wanted)
    by_file: dict[str, list[int]] = {}
    for index, ((name, _), _) in enumerate(wanted):
        by_file.setdefault(files[expert_names(name, 1)[0]], []).append(index)
    try:
        for path, indices in by_file.items():  # one file open at a time: its mapped pages are
            with safe_open(path, framework="numpy") as f:  # released before the next one
                for index in indices:
                    (name, transpose), _ = wanted[index]
                    # one host copy at most of a tensor (cast and/or transpose), none when
                    # neither is needed; a stacked experts' weight, their stack too
                    parts = [np.ascontiguousarray(t.T if transpose else t, dtype=np_dtype)
                             for t in (_get_tensor(f, path, files, each)
                                       for each in expert_names(name, num_experts))]
                    host = parts[0] if EXPERT not in name else np.stack(parts)
                    arrays[index] = jax.device_put(host, device)
                    del host, parts
    except SafetensorError as e:
        raise ValueError(f"{model_dir}: cannot read weights: {e}") from None
    loaded = jax.tree_util.tree_unflatten(treedef, arrays)
    state = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(state, loaded)
    nnx.update(abstract, state)
    return abstract


def _get_tensor(opened, opened_path: str, files: dict[str, str], name: str) -> np.ndarray:
    """A tensor from the open file, or from its own (an expert a sharded checkpoint stored in
    another file than its stack's first)."""
    from safetensors import safe_open

    if files[name] == opened_path:
        return opened.get_tensor(name)
    with safe_open(files[name], framework="numpy") as other:
        return other.get_tensor(name)
