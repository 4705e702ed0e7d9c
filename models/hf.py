"""Hugging Face model directories: config.json -> LlamaConfig, safetensors -> an NNX model.

Supported: Llama (2, 3, 3.1 with llama3 RoPE scaling), Mistral (sliding window), Qwen2 (q/k/v
bias), Qwen3 (q/k RMSNorm); config.json in the transformers 4 format (`rope_theta`,
`rope_scaling`, `torch_dtype`) or 5 (`rope_parameters`, `dtype`, explicit `head_dim`). Anything
the family implementation would get wrong is refused at load with UnsupportedModelError.

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

from models.config import ROPE_TYPES, LlamaConfig, RopeScaling
from models.llama import LlamaForCausalLM

ARCHITECTURES = {  # HF class -> model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Why some well-known architectures are refused (others get the generic reason).
KNOWN_UNSUPPORTED = {
    "mamba": "state-space (Mamba) layers keep a recurrent state, not a paged KV cache",
    "mamba2": "state-space (Mamba) layers keep a recurrent state, not a paged KV cache",
    "jamba": "hybrid attention + Mamba layers",
    "zamba2": "hybrid attention + Mamba layers",
    "falcon_h1": "hybrid attention + Mamba layers",
    "qwen3_next": "hybrid gated linear attention (Gated DeltaNet) layers",
    "rwkv": "RWKV linear-attention recurrence",
    "bloom": "ALiBi position bias instead of RoPE",
    "mpt": "ALiBi position bias instead of RoPE",
    "falcon": "ALiBi or parallel attention blocks",
    "mixtral": "mixture-of-experts MLP layers",
    "qwen2_moe": "mixture-of-experts MLP layers",
    "qwen3_moe": "mixture-of-experts MLP layers",
    "gemma": "GeGLU MLP and (1 + weight) RMSNorm",
    "gemma2": "logit soft-capping and alternating local/global layers",
    "gemma3": "alternating local/global layers with per-type RoPE",
    "phi3": "fused qkv/gate_up projections",
}
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class UnsupportedModelError(ValueError):
    """The directory holds a model this engine cannot serve correctly."""


def supported_summary() -> str:
    return ", ".join(ARCHITECTURES)


def _refuse(architecture: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"architecture {architecture}: {what} is not supported; "
                                 f"supported architectures: {supported_summary()} (RoPE types "
                                 f"{', '.join(ROPE_TYPES)}, SiLU MLP, full or sliding-window "
                                 f"attention)")


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


def architecture_of(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if archs:
        return str(archs[0])
    return str(raw.get("model_type", "unknown"))


def _rope(raw: dict[str, Any], architecture: str) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either config format."""
    params = raw.get("rope_parameters")  # transformers 5
    if params is None:
        params = dict(raw.get("rope_scaling") or {})  # transformers 4
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise _refuse(architecture, f"rope_parameters {params!r} (per-layer-type RoPE)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _refuse(architecture, f"RoPE type {rope_type!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(architecture, f"partial_rotary_factor {params['partial_rotary_factor']}")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    fields = {"factor": params.get("factor")}
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if name not in params:
                raise ValueError(f"llama3 RoPE scaling needs {name} in the config")
            fields[name] = params[name]
    if fields["factor"] is None:
        raise ValueError(f"{rope_type} RoPE scaling needs a factor in the config")
    return theta, RopeScaling(rope_type=rope_type, **fields)


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def _check_supported(raw: dict[str, Any], architecture: str) -> str:
    """The Llama-family model_type of a config.json, or UnsupportedModelError naming why not."""
    model_type = ARCHITECTURES.get(architecture)
    if model_type is None:
        reason = KNOWN_UNSUPPORTED.get(str(raw.get("model_type")),
                                       "not a member of the Llama family implemented in models/")
        raise UnsupportedModelError(f"architecture {architecture} is not supported ({reason}); "
                                    f"supported architectures: {supported_summary()}")
    if raw.get("model_type", model_type) != model_type:
        raise _refuse(architecture, f"model_type {raw.get('model_type')!r}")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise _refuse(architecture, f"a quantized checkpoint ({method})")
    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse(architecture, f"hidden_act {raw['hidden_act']!r}")
    if raw.get("alibi") or raw.get("position_embedding_type", "rope") != "rope":
        raise _refuse(architecture, "a non-RoPE position encoding")
    return model_type


def _attention_window(raw: dict[str, Any], architecture: str, model_type: str,
                      num_layers: int) -> int | None:
    """The attention window: one per model. Qwen2/3 give layer_types (or use_sliding_window
    with max_window_layers in the transformers 4 format); Mistral gives sliding_window alone."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        layer_types = raw.get("layer_types")
        if layer_types is None:
            sliding = raw.get("use_sliding_window", False)
            first = raw.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if sliding and i >= first else "full_attention"
                           for i in range(num_layers)]
        kinds = set(layer_types)
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise _refuse(architecture, f"layer types {sorted(kinds)}")
        if len(kinds) > 1:
            raise _refuse(architecture, "a mix of sliding-window and full-attention layers")
        if kinds != {"sliding_attention"}:
            window = None
    elif model_type == "llama":
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be an integer >= 1, got {window!r}")
    return window


def config_from_hf(raw: dict[str, Any],
                   generation_config: dict[str, Any] | None = None) -> LlamaConfig:
    """The LlamaConfig for a parsed config.json, or UnsupportedModelError naming what is not."""
    architecture = architecture_of(raw)
    model_type = _check_supported(raw, architecture)
    num_layers = raw["num_hidden_layers"]
    theta, scaling = _rope(raw, architecture)
    window = _attention_window(raw, architecture, model_type, num_layers)
    bias = bool(raw.get("attention_bias", False))
    eos = _eos_ids(raw.get("eos_token_id"))
    for token_id in _eos_ids((generation_config or {}).get("eos_token_id")):
        if token_id not in eos:
            eos += (token_id,)
    heads = raw["num_attention_heads"]
    try:
        return LlamaConfig(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_layers=num_layers,
            num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=theta, rope_scaling=scaling, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            initializer_range=raw.get("initializer_range", 0.02),
            bos_token_id=raw.get("bos_token_id"), eos_token_id=eos or None,
            sliding_window=window,
            attention_bias=bias or model_type == "qwen2",
            o_proj_bias=bias and model_type == "llama",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3", model_type=model_type)
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None


def read_hf_config(model_dir: str) -> LlamaConfig:
    raw = read_json(os.path.join(model_dir, "config.json"))
    generation_path = os.path.join(model_dir, "generation_config.json")
    generation = read_json(generation_path) if os.path.isfile(generation_path) else None
    return config_from_hf(raw, generation)


def checkpoint_dtype(raw: dict[str, Any]) -> str:
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float32")


# ---- weights ---------------------------------------------------------------------------------

def _hf_name(path: tuple) -> tuple[str, bool]:
    """HF tensor name for a path in the NNX parameter dict, and whether HF stores it
    transposed ([out, in] for a Linear kernel [in, out])."""
    parts = [str(getattr(k, "key", k)) for k in path]
    leaf = parts[-1]
    transpose = leaf == "kernel"
    parts[-1] = "weight" if leaf in ("kernel", "embedding", "weight") else leaf
    prefix = "" if parts[0] == "lm_head" else "model."
    return prefix + ".".join(parts), transpose


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
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jdtype,
                                                       param_dtype=jdtype))
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    wanted = [(_hf_name(path), leaf.shape) for path, leaf in leaves]

    files = weight_files(model_dir)
    headers = {path: _header(path) for path in sorted(set(files.values()))}
    present = {name for header in headers.values() for name in header}
    names = {name for (name, _), _ in wanted}
    missing = sorted(names - present)
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {config.model_type}: "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in present - names - ignorable
                        if not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected weights (not part of {config.model_type}): "
                         f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for (name, transpose), shape in wanted:
        stored, _ = headers[files[name]][name]
        expected = shape[::-1] if transpose else shape
        if stored != tuple(expected):
            raise ValueError(f"{model_dir}: weight {name} has shape {stored}, the config "
                             f"implies {tuple(expected)}")
    return abstract, (wanted, treedef), files


def load_hf_model(model_dir: str, dtype: str = "float32") -> LlamaForCausalLM:
    """The model in a Hugging Face directory, parameters and activations in dtype (on
    jax.devices()[0]; models.placed_weights reads it straight into an engine's shardings)."""
    from safetensors import SafetensorError, safe_open

    abstract, (wanted, treedef), files = checked_hf_weights(model_dir, dtype)
    jdtype = jnp.dtype(dtype)
    np_dtype = np.dtype(jdtype)
    device = jax.devices()[0]
    arrays: list[Any] = [None] * len(wanted)
    by_file: dict[str, list[int]] = {}
    for index, ((name, _), _) in enumerate(wanted):
        by_file.setdefault(files[name], []).append(index)
    try:
        for path, indices in by_file.items():  # one file open at a time: its mapped pages are
            with safe_open(path, framework="numpy") as f:  # released before the next one
                for index in indices:
                    (name, transpose), _ = wanted[index]
                    host = f.get_tensor(name)
                    # one host copy at most (cast and/or transpose), none when neither is needed
                    host = np.ascontiguousarray(host.T if transpose else host, dtype=np_dtype)
                    arrays[index] = jax.device_put(host, device)
                    del host
    except SafetensorError as e:
        raise ValueError(f"{model_dir}: cannot read weights: {e}") from None
    loaded = jax.tree_util.tree_unflatten(treedef, arrays)
    state = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(state, loaded)
    nnx.update(abstract, state)
    return abstract


# ---- inspection ------------------------------------------------------------------------------

def inspect_model_dir(model_dir: str, kv_dtype: str = "bfloat16", block_size: int = 16,
                      attention_backend: str = "reference") -> dict[str, Any]:
    """What `pagedjax inspect` prints: architecture, attention type, KV bytes (in the cache
    layout of attention_backend: the GPU pads the head dim, the TPU a quantized cache's scale
    rows), support. A `.gguf` file is inspected from its metadata (models.gguf_loader)."""
    _check_inspect_args(kv_dtype, block_size, attention_backend)
    from models.gguf_loader import inspect_gguf, is_gguf
    if is_gguf(model_dir):
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
    return {**report, **config_report(config, kv_dtype, block_size, attention_backend)}


KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")


def _check_inspect_args(kv_dtype, block_size, attention_backend) -> None:
    from pallas_kernels import IMPLEMENTATIONS
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

    from pallas_kernels import kv_cache_bytes_per_block
    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8,
              "fp8": ml_dtypes.float8_e4m3fn}
    # int8 / fp8 add an f32 scale per token and KV head (on the TPU, per 128-lane row slot)
    per_block = kv_cache_bytes_per_block(config.num_layers, block_size, config.num_kv_heads,
                                         config.head_dim, dtypes[kv_dtype], attention_backend)
    return dict(
        supported=True, attention=attention_kind(config.num_heads, config.num_kv_heads),
        num_layers=config.num_layers, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        sliding_window=config.sliding_window,
        rope=(config.rope_scaling.rope_type if config.rope_scaling else "default"),
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        num_params=config.num_params, kv_dtype=kv_dtype, attention_backend=attention_backend,
        kv_bytes_per_token=per_block // block_size, block_size=block_size,
        kv_bytes_per_block=per_block, eos_token_ids=list(config.eos_token_ids))
