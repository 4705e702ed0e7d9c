"""Hugging Face model directories: config.json -> LlamaConfig, safetensors -> an NNX model.

Supported (models.registry): Llama (2, 3, 3.1 with llama3 RoPE scaling), Mistral (sliding
window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Gemma 2 and Gemma 3 text (models/gemma.py),
the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (models/moe.py; each expert's
tensors stacked on load);
config.json in the transformers 4 format (`rope_theta`, `rope_scaling`, `torch_dtype`) or 5
(`rope_parameters`, `dtype`, explicit `head_dim`), read by models.hf_config. Anything the family
implementation would get wrong is refused at load with UnsupportedModelError.

Weights are read with the `safetensors` library (no torch), one tensor at a time: each is cast,
transposed where HF stores [out, in], and put on the device before the next is read, so the host
never holds a second copy of the model. Every file's header is checked (names, shapes) before the
first tensor is read; any error raises and no model is returned.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.hf_config import (UnsupportedModelError, architecture_of,  # noqa: F401
                              config_from_hf, supported_summary)
from pagedjax.models.llama import LlamaForCausalLM
from pagedjax.models.registry import hf_renames, model_class

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_hf_config(model_dir: str) -> LlamaConfig:
    raw = read_json(os.path.join(model_dir, "config.json"))
    generation_path = os.path.join(model_dir, "generation_config.json")
    generation = read_json(generation_path) if os.path.isfile(generation_path) else None
    return config_from_hf(raw, generation)


def checkpoint_dtype(raw: dict[str, Any]) -> str:
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float32")


# ---- weights ---------------------------------------------------------------------------------

EXPERT = "{expert}"  # in a stacked experts' HF name: the expert index (models/moe.py)


def _hf_name(path: tuple, renames: tuple[tuple[str, str], ...] = ()) -> tuple[str, bool]:
    """HF tensor name for a path in the NNX parameter dict, and whether HF stores it
    transposed ([out, in] for a Linear kernel [in, out]). A stacked experts' weight [E, in,
    out] names its experts' tensors with EXPERT for the index (experts.{expert}.gate_proj...).
    renames: the family's (models.registry.Family.hf_renames) substitutions of the generic name."""
    parts = [str(getattr(k, "key", k)) for k in path]
    leaf = parts[-1]
    prefix = "" if parts[0] == "lm_head" else "model."
    if len(parts) > 1 and parts[-2] == "experts":
        name, transpose = prefix + ".".join(parts[:-1] + [EXPERT, leaf, "weight"]), True
    else:
        transpose = leaf == "kernel"
        parts[-1] = "weight" if leaf in ("kernel", "embedding", "weight") else leaf
        name = prefix + ".".join(parts)
    for old, new in renames:
        name = name.replace(old, new)
    return name, transpose


def expert_names(name: str, num_experts: int) -> list[str]:
    """The HF tensors a weight reads: one, or one an expert for a stacked experts' name."""
    if EXPERT not in name:
        return [name]
    return [name.replace(EXPERT, str(e)) for e in range(num_experts)]


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
        return files
    single = os.path.join(model_dir, SAFETENSORS_FILE)
    if not os.path.isfile(single):
        raise ValueError(f"{model_dir} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}")
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
        from pagedjax.models.compressed_tensors import quantized_abstract
        abstract = quantized_abstract(abstract, compressed)
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    renames = hf_renames(config)
    wanted = [(_hf_name(path, renames), leaf.shape) for path, leaf in leaves
              if str(getattr(path[-1], "key", path[-1])) != "scale"]  # read with its weight

    files = weight_files(model_dir)
    headers = {path: _header(path) for path in sorted(set(files.values()))}
    present = {name for header in headers.values() for name in header}
    stored_as = {}  # each tensor read -> the shape HF stores it in
    for (name, transpose), shape in wanted:
        per_tensor = shape[1:] if EXPERT in name else shape
        for each in expert_names(name, config.num_experts):
            stored_as[each] = tuple(per_tensor[::-1] if transpose else per_tensor)
    missing = sorted(set(stored_as) - present)
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {config.model_type}: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
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


def compressed_scheme(model_dir: str):
    """The checkpoint's models.compressed_tensors.CompressedScheme, or None."""
    from pagedjax.models import compressed_tensors
    return compressed_tensors.read(read_json(os.path.join(model_dir, "config.json")))


def _check_compressed(model_dir, abstract, scheme, headers, files) -> None:
    """Each quantized module's weight is stored in the scheme's type, with its weight_scale
    ([out, 1] per channel, one value per tensor)."""
    from pagedjax.models.quantized_loading import quantized_modules

    stored_type = {"fp8": "F8_E4M3", "int8": "I8"}[scheme.scheme]
    renames = hf_renames(abstract.config)
    for key, module in quantized_modules(abstract).items():
        layers = range(abstract.config.num_layers) if key[0] == "layers" else [None]
        for layer in layers:
            path = tuple(layer if part == "{layer}" else part for part in key) + ("kernel",)
            name = _hf_name(path, renames)[0]
            _, dtype = headers[files[name]][name]
            scale = name[:-len("weight")] + "weight_scale"
            if dtype != stored_type or scale not in files:
                raise ValueError(f"{model_dir}: {name} is {dtype}"
                                 f"{'' if scale in files else ' without weight_scale'}; "
                                 f"compressed-tensors {scheme.scheme} stores {stored_type} "
                                 f"with a weight_scale")
            shape, _ = headers[files[scale]][scale]
            expected = [(module.out_features, 1)] if scheme.strategy == "channel" else [
                (), (1,), (1, 1)]
            if tuple(shape) not in expected:
                raise ValueError(f"{model_dir}: {scale} has shape {tuple(shape)}; strategy "
                                 f"{scheme.strategy} stores {expected[0]}")


def load_hf_model(model_dir: str, dtype: str = "float32") -> LlamaForCausalLM:
    """The model in a Hugging Face directory, parameters and activations in dtype (on
    jax.devices()[0]; models.placed_weights reads it straight into an engine's shardings)."""
    from safetensors import SafetensorError, safe_open

    abstract, (wanted, treedef), files = checked_hf_weights(model_dir, dtype)
    if compressed_scheme(model_dir) is not None:
        raise ValueError(f"{model_dir}: a compressed-tensors checkpoint is read into place "
                         f"by an engine (models.placed_weights.lazy_hf_model, LLM), not whole")
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


# ---- inspection ------------------------------------------------------------------------------

def inspect_model_dir(model_dir: str, kv_dtype: str = "bfloat16", block_size: int = 16,
                      attention_backend: str = "reference",
                      quantization: str | None = None) -> dict[str, Any]:
    """What `pagedjax inspect` prints: architecture, attention type, KV bytes (in the cache
    layout of attention_backend: the GPU pads the head dim, the TPU a quantized cache's scale
    rows), the weights' bytes as served (quantized by quantization, a scheme of
    models.quantization), support. A `.gguf` file is inspected from its metadata
    (models.gguf_loader), its weights as its blocks are served."""
    _check_inspect_args(kv_dtype, block_size, attention_backend)
    from pagedjax.models.gguf_loader import inspect_gguf, is_gguf
    if is_gguf(model_dir):
        if quantization is not None:
            raise ValueError(f"{model_dir}: a GGUF file is served as its own blocks; "
                             f"quantization must be unset, got {quantization!r}")
        return inspect_gguf(model_dir, kv_dtype, block_size, attention_backend)
    raw = read_json(os.path.join(model_dir, "config.json"))
    report: dict[str, Any] = {"architecture": architecture_of(raw),
                              "model_type": raw.get("model_type"),
                              "checkpoint_dtype": checkpoint_dtype(raw)}
    try:
        config = read_hf_config(model_dir)
    except UnsupportedModelError as e:
        heads = raw.get("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads and kv_heads:
            report["attention"] = attention_kind(heads, kv_heads)
        report.update(supported=False, reason=str(e))
        return report
    from pagedjax.models.quantized_layers import quantize_model
    from pagedjax.models.quantized_loading import weight_report
    from pagedjax.models.registry import model_class
    dtype = jnp.bfloat16 if report["checkpoint_dtype"] in ("bfloat16", "float16") \
        else jnp.float32
    abstract = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0),
                                                          dtype=dtype, param_dtype=dtype))
    compressed = compressed_scheme(model_dir)
    if compressed is not None:
        from pagedjax.models.compressed_tensors import quantized_abstract
        abstract = quantized_abstract(abstract, compressed)
    elif quantization is not None:
        abstract = quantize_model(abstract, quantization)
    return {**report, **config_report(config, kv_dtype, block_size, attention_backend),
            **weight_report(abstract)}


KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")


def _check_inspect_args(kv_dtype, block_size, attention_backend) -> None:
    from pagedjax.pallas_kernels import IMPLEMENTATIONS
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if attention_backend not in IMPLEMENTATIONS:
        raise ValueError(f"attention_backend must be one of {sorted(IMPLEMENTATIONS)}, "
                         f"got {attention_backend!r}")


def attention_kind(heads: int, kv_heads: int) -> str:
    return ("MHA" if kv_heads == heads else "MQA" if kv_heads == 1
            else f"GQA ({heads // kv_heads} query heads per KV head)")


def config_report(config: LlamaConfig, kv_dtype: str, block_size: int,
                  attention_backend: str) -> dict[str, Any]:
    """The served shape of a supported config: heads, RoPE, parameters, KV bytes."""
    import ml_dtypes

    from pagedjax.pallas_kernels import kv_cache_bytes_per_block
    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8,
              "fp8": ml_dtypes.float8_e4m3fn}
    # int8 / fp8 add an f32 scale per token and KV head (on the TPU, per 128-lane row slot)
    per_block = kv_cache_bytes_per_block(config.num_layers, block_size, config.num_kv_heads,
                                         config.head_dim, dtypes[kv_dtype], attention_backend)
    from pagedjax.models.kv_groups import kv_cache_groups
    groups = kv_cache_groups(config)
    group_block = kv_cache_bytes_per_block(groups.num_slots, block_size, config.num_kv_heads,
                                           config.head_dim, dtypes[kv_dtype], attention_backend)
    return dict(
        kv_cache_groups=[{"window": w, "blocks": group_block} for w in groups.windows]
        if groups.hybrid else None, layers_a_group=groups.num_slots,
        supported=True, attention=attention_kind(config.num_heads, config.num_kv_heads),
        num_layers=config.num_layers, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        sliding_window=config.sliding_window,
        sliding_layers=sum(config.layer_window(i) is not None for i in range(config.num_layers))
        if config.sliding_window else None,
        rope=(config.rope_scaling.rope_type if config.rope_scaling else "default"),
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        num_params=config.num_params, kv_dtype=kv_dtype, attention_backend=attention_backend,
        kv_bytes_per_token=per_block // block_size, block_size=block_size,
        kv_bytes_per_block=per_block, eos_token_ids=list(config.eos_token_ids),
        **moe_report(config))


def moe_report(config: LlamaConfig) -> dict[str, Any]:
    """A mixture of experts' shape (empty for a dense model): experts, k, the sparse layers,
    and the parameters a token's forward reads."""
    if not config.num_experts:
        return {}
    return dict(num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                sparse_layers=config.num_sparse_layers,
                shared_expert=config.shared_expert_intermediate_size or None,
                num_active_params=config.num_active_params)
