"""Hugging Face PEFT LoRA adapters (issue 53): an adapter directory (`adapter_config.json` and
`adapter_model.safetensors`, what `PeftModel.save_pretrained` writes) read and checked against the
model it adapts, before anything serves it.

Served: `peft_type` LORA, rank `r`, `lora_alpha`, `use_rslora` (scaling alpha / sqrt(r) instead of
alpha / r), `target_modules` among the attention and MLP projections (q/k/v/o, gate/up/down;
"all-linear": all seven), `bias` "none". Anything else PEFT can write that changes what the adapter
computes is refused by name (DoRA, LoRA biases, modules_to_save, per-module rank or alpha
patterns, layers_to_transform, fan_in_fan_out, trainable tokens, target_parameters, exclude_modules,
other PEFT types): serving an adapter without it would silently compute something else.
Dropout and init options only matter in training.

Values are checked as strictly as names (an adapter is any API-key holder's input, and its
values ride in the same step as every other tenant's tokens): `lora_alpha` and the scaling it
gives must be finite and at most MAX_SCALING in size; tensors must be float16, bfloat16 or
float32 (cast to float32; any other dtype, float64 and the integers included, is refused by
name) and finite. The files are opened through models.loading.user_files (regular files of a
bounded size inside the adapter's directory, never a FIFO or a device), and a malformed file of
any kind is a ValueError naming it, never another exception.

Each targeted module's pair is kept in the engine's layout: `a` [layers, in, r] and `b`
[layers, r, out] (HF stores lora_A [r, in], lora_B [out, r]), so the adapted projection is
x @ W + scaling * (x @ a) @ b; a module an adapter leaves out in some layers holds zeros there.
`merged_weights` gives W + scaling * a @ b for a model's own kernels: the dense reference the
engine's adapted step is held to, and a way to serve one adapter merged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np

from pagedjax.models.loading.user_files import MiB, read_user_bytes, read_user_json

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT options that change what an adapter computes: (field, the value that leaves it alone)
REFUSED: tuple[tuple[str, object], ...] = (
    ("use_dora", False), ("lora_bias", False), ("modules_to_save", None), ("rank_pattern", {}),
    ("alpha_pattern", {}), ("layers_to_transform", None), ("layers_pattern", None),
    ("fan_in_fan_out", False), ("trainable_token_indices", None), ("target_parameters", None),
    ("exclude_modules", None))
MAX_SCALING = 1e4  # |lora_alpha / r| (or / sqrt(r)): PEFT's are ~0.1 to 64
MAX_CONFIG_BYTES = 1 * MiB
SERVED_DTYPES = {"F16": np.float16, "F32": np.float32, "BF16": "bfloat16"}  # safetensors' names
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: its rank, scaling and each targeted module's (a, b) pair."""

    path: str
    rank: int
    scaling: float
    pairs: dict  # module name -> (a f32[L, in, r], b f32[L, r, out])

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted(self.pairs))


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {what}")


def read_config(path: str) -> dict:
    """adapter_config.json, checked field by field (ValueError naming the first refused)."""
    try:
        raw = read_user_json(os.path.join(path, "adapter_config.json"), "adapter_config.json",
                             MAX_CONFIG_BYTES, root=path)
    except ValueError as error:
        raise _refuse(path, f"adapter_config.json could not be read ({error})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {raw['peft_type']!r} is not served (LORA only)")
    if raw.get("bias", "none") != "none":
        raise _refuse(path, f"bias {raw['bias']!r} is not served (\"none\" only)")
    for field, neutral in REFUSED:
        value = raw.get(field, neutral)
        if value not in (neutral, None, {}, [], False):
            raise _refuse(path, f"{field}={value!r} is not served")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(path, f"r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) \
            or not math.isfinite(alpha):
        raise _refuse(path, f"lora_alpha must be a finite number, got {alpha!r}")
    check_scaling(path, alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank))
    targets = raw.get("target_modules")
    targets = list(TARGETS) if targets == "all-linear" else targets
    if not targets or not (isinstance(targets, str) or all(isinstance(t, str)
                                                            for t in targets)):
        raise _refuse(path, f"target_modules must name projections among {sorted(TARGETS)} "
                            f"(a list, a regular expression or \"all-linear\"), got "
                            f"{targets!r}")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except (re.error, RecursionError, OverflowError) as error:
            raise _refuse(path, f"target_modules {targets[:200]!r} is not a regular "
                                f"expression ({error})") from None
    return {**raw, "target_modules": targets}


def check_scaling(path: str, scaling) -> float:
    """scaling as a float, once finite and at most MAX_SCALING in size (ValueError)."""
    number: int | float | np.floating | None = None
    if isinstance(scaling, (int, float, np.floating)) and not isinstance(scaling, bool):
        number = scaling
    if number is None or not math.isfinite(number) or abs(float(number)) > MAX_SCALING:
        raise _refuse(path, f"the scaling (lora_alpha / r) must be finite and at most "
                            f"{MAX_SCALING:g} in size, got {scaling!r}")
    return float(number)


def read_tensors(path: str, max_bytes: int) -> dict:
    """adapter_model.safetensors' tensors (float32 numpy arrays; float16 and bfloat16 cast,
    other dtypes refused by name), the file at most max_bytes (ValueError naming what is
    wrong: the file, its header, a tensor)."""
    from safetensors import SafetensorError, deserialize

    file = os.path.join(path, "adapter_model.safetensors")
    try:
        data = read_user_bytes(file, "adapter_model.safetensors", max_bytes, root=path)
        stored = deserialize(data)
    except (ValueError, SafetensorError) as error:
        raise _refuse(path, f"adapter_model.safetensors could not be read "
                            f"({str(error)[:300]})") from None
    tensors = {}
    for name, view in sorted(stored, key=lambda item: item[0]):
        dtype: Any = SERVED_DTYPES.get(view["dtype"])
        if dtype is None:
            raise _refuse(path, f"tensor {name!r} is {view['dtype']}; served: float16, "
                                f"bfloat16, float32")
        if dtype == "bfloat16":
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        array = np.frombuffer(bytes(view["data"]), dtype).reshape(view["shape"])
        tensors[name] = array.astype(np.float32)
    return tensors


def max_adapter_bytes(config, rank: int) -> int:
    """The largest adapter_model.safetensors a rank-r adapter of config can be (every
    projection adapted in every layer, in float32, and a MiB for the header)."""
    pairs = sum(i + o for i, o in module_dims(config).values())
    return config.num_layers * pairs * rank * 4 + MiB


def targeted_projections(path: str, targets, num_layers: int) -> list[str]:
    """The projections (q_proj, ..., down_proj) target_modules adapts in some layer, matched
    as PEFT matches them against a decoder's module names: a list entry is a name or a
    dotted suffix of one, a string a regular expression of the whole name (ValueError for a
    list entry that names no projection served)."""
    names = {f"model.layers.{layer}.{group}.{name}": name
             for layer in range(num_layers) for name, group in TARGETS.items()}
    if isinstance(targets, str):
        return sorted({name for full, name in names.items() if re.fullmatch(targets, full)})
    found = set()
    for entry in targets:
        hits = {name for full, name in names.items()
                if full == entry or full.endswith("." + entry)}
        if not hits:
            raise _refuse(path, f"target_modules entry {entry!r} is not served (the "
                                f"projections among {sorted(TARGETS)})")
        found |= hits
    return sorted(found)


def read_peft_adapter(path: str, config, max_rank: int | None = None) -> LoRAAdapter:
    """The adapter at path for a model of config (a LlamaConfig), checked: its config, every
    tensor's name, layer and shape (ValueError naming the first that does not fit)."""
    raw = read_config(path)
    rank = raw["r"]
    if max_rank is not None and rank > max_rank:
        raise _refuse(path, f"rank {rank} is over max_lora_rank ({max_rank})")
    tensors = read_tensors(path, max_adapter_bytes(config, rank))
    targets = targeted_projections(path, raw["target_modules"], config.num_layers)
    mlp = sorted(name for name in targets if TARGETS[name] == "mlp")
    moe = [i for i in range(config.num_layers) if config.layer_is_moe(i)]
    if mlp and moe:
        raise _refuse(path, f"target_modules {mlp} adapt a mixture-of-experts MLP (layer "
                            f"{moe[0]}'s experts): LoRA on experts is not served, on "
                            f"attention (q/k/v/o_proj) it is")
    scaling = raw["lora_alpha"] / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return adapter_from_tensors(path, tensors, config, rank, float(scaling), targets)


def adapter_from_tensors(path: str, tensors: dict, config, rank: int, scaling: float,
                         targets) -> LoRAAdapter:
    """An adapter from PEFT-named tensors (adapter_model.safetensors' names: `base_model.model.
    model.layers.{l}.self_attn.q_proj.lora_A.weight` [r, in], `lora_B` [out, r]) of the
    targeted projections, each checked (ValueError naming the first that does not fit); path
    names the adapter in the errors. A projection a tensor leaves out holds zeros there.
    Float tensors of any width are cast to float32; every value must be finite."""
    scaling = check_scaling(path, scaling)
    dims = module_dims(config)
    pairs = {name: (np.zeros((config.num_layers, dims[name][0], rank), np.float32),
                    np.zeros((config.num_layers, rank, dims[name][1]), np.float32))
             for name in targets}
    for name, tensor in tensors.items():
        layer, module, which = _place(path, name, config, pairs)
        inputs, outputs = dims[module]
        expected = (rank, inputs) if which == "A" else (outputs, rank)
        if getattr(tensor, "shape", None) != expected:
            raise _refuse(path, f"{name} is {list(getattr(tensor, 'shape', ()))}, the model "
                                f"takes {list(expected)}")
        pairs[module][0 if which == "A" else 1][layer] = _finite(path, name, tensor).T
    return LoRAAdapter(path, rank, scaling, pairs)


def _finite(path: str, name: str, tensor) -> np.ndarray:
    """tensor as float32, once it is a float array whose every value is finite."""
    array = np.asarray(tensor)
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        raise _refuse(path, f"tensor {name!r} is {array.dtype.name}; LoRA weights are floats")
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise _refuse(path, f"tensor {name!r} holds non-finite values (NaN or inf, or past "
                            f"float32's range)")
    return array


def check_adapter_values(adapter: LoRAAdapter) -> LoRAAdapter:
    """adapter, once its scaling and every pair's values are finite (ValueError naming what is
    not): an adapter built in memory (update_lora) passes the checks a read one does."""
    check_scaling(adapter.path, adapter.scaling)
    for module, (a, b) in adapter.pairs.items():
        _finite(adapter.path, f"{module}.lora_A", a)
        _finite(adapter.path, f"{module}.lora_B", b)
    return adapter


def _place(path: str, name: str, config, pairs: dict) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a tensor name (ValueError naming one that is not a
    targeted module's pair in a layer the model has)."""
    match = _TENSOR.match(name)
    if match is None or match.group(3) not in pairs or TARGETS[match.group(3)] != match.group(2):
        raise _refuse(path, f"tensor {name!r} is not a LoRA pair of a targeted projection "
                            f"({sorted(pairs)})")
    layer = int(match.group(1))
    if layer >= config.num_layers:
        raise _refuse(path, f"tensor {name!r}: the model has {config.num_layers} layers")
    return layer, match.group(3), match.group(4)


def module_dims(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection a LoRA may target."""
    hidden, heads = config.hidden_size, config.num_heads * config.head_dim
    kv, inner = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (hidden, heads), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads, hidden), "gate_proj": (hidden, inner),
            "up_proj": (hidden, inner), "down_proj": (inner, hidden)}


def merged_weights(model, adapter: LoRAAdapter) -> None:
    """Adds each targeted module's scaling * a @ b to the model's kernels, in place (a float
    model of the adapter's config: the dense reference, or one adapter served merged)."""
    for module, (a, b) in adapter.pairs.items():
        for layer, block in enumerate(model.layers):
            kernel = getattr(getattr(block, TARGETS[module]), module).kernel
            delta = adapter.scaling * (a[layer] @ b[layer])
            kernel.set_value(kernel.get_value() + delta.astype(kernel.get_value().dtype))


def save_peft_adapter(adapter: LoRAAdapter, directory: str) -> str:
    """Writes an adapter as a PEFT directory (adapter_config.json and
    adapter_model.safetensors, as PeftModel.save_pretrained does: lora_A [r, in], lora_B
    [out, r]; lora_alpha = scaling * r), which read_peft_adapter, peft and vLLM read back;
    returns the directory."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for name, (a, b) in adapter.pairs.items():
        for layer in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[name]}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(
                np.asarray(a[layer], np.float32).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(
                np.asarray(b[layer], np.float32).T)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.scaling * adapter.rank,
              "target_modules": sorted(adapter.pairs), "bias": "none", "use_rslora": False}
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return directory


def random_adapter(config, rank: int, targets, seed: int = 0, std: float = 0.05,
                   scaling: float = 2.0) -> LoRAAdapter:
    """A random adapter (both A and B non-zero) of config's shapes: tests and benchmarks."""
    rng = np.random.default_rng(seed)
    dims = module_dims(config)
    pairs = {name: (rng.normal(0, std, (config.num_layers, dims[name][0], rank)),
                    rng.normal(0, std, (config.num_layers, rank, dims[name][1])))
             for name in targets}
    return LoRAAdapter(f"random-{seed}", rank, scaling,
                       {k: (a.astype(np.float32), b.astype(np.float32))
                        for k, (a, b) in pairs.items()})
