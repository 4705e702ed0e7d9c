"""Hugging Face checkpoints quantized by llm-compressor in the `compressed-tensors` format
(`quantization_config.quant_method`), as RedHatAI's `*-FP8-dynamic` and `*-quantized.w8a8`
ship them, served as pagedjax.models.quantization.schemes's stored form with no float copy:

- weights: 8 bits, `type` float (e4m3: scheme fp8) or int (scheme int8), symmetric, strategy
  `channel` (`weight_scale` [out, 1]) or `tensor` (one scale, broadcast to every channel);
  stored `weight` [out, in] as F8_E4M3 or I8 (`format` float-quantized, int-quantized or
  naive-quantized);
- input activations: none, or dynamic (W8A8, computed per token at run time by vLLM): served
  weight-only here, activations in the engine's dtype (dynamic activation scales are computed,
  not stored, so nothing of the checkpoint is left unread; the arithmetic is at least as
  exact);
- `ignore`: modules kept in full precision (names, or `re:` patterns: the LM head, MoE routers).

Anything else (4-bit pack-quantized, groups, static activation scales, a quantized KV cache,
other quant_methods: awq, gptq, bitsandbytes...) is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np

FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


@dataclasses.dataclass(frozen=True)
class CompressedScheme:
    scheme: str  # fp8 | int8
    strategy: str  # channel | tensor
    ignore: tuple[str, ...]
    activations: str  # "none" | "dynamic"

    def ignored(self, module: str) -> bool:
        """Whether the HF module name (model.layers.0.mlp.gate) stays in full precision."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


def refuse(detail: str) -> ValueError:
    return ValueError(f"quantization_config: {detail} is not served (served: compressed-tensors "
                      f"8-bit fp8 or int8 weights, per channel or per tensor, symmetric, with "
                      f"no or dynamic input activations)")


def read(raw: dict[str, Any]) -> CompressedScheme | None:
    """The config.json's quantization_config as a CompressedScheme (None: not quantized);
    ValueError naming the field of one not served."""
    config = raw.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r}")
    if config.get("format") not in FORMATS:
        raise refuse(f"format {config.get('format')!r}")
    if config.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme (a quantized KV cache: use kv_cache_dtype)")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config_groups")
    group = groups[0]
    if group.get("targets") != ["Linear"]:
        raise refuse(f"targets {group.get('targets')!r}")
    weights = group.get("weights") or {}
    kind, bits = weights.get("type"), weights.get("num_bits")
    if bits != 8 or kind not in ("float", "int"):
        raise refuse(f"weights of {bits} bits, type {kind!r}")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor") or weights.get("group_size"):
        raise refuse(f"weights strategy {strategy!r} (group_size {weights.get('group_size')})")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise refuse("asymmetric or dynamic weights")
    if group.get("output_activations"):
        raise refuse("output_activations")
    inputs = group.get("input_activations")
    if inputs and not inputs.get("dynamic"):
        raise refuse("static input_activations (stored input_scale)")
    return CompressedScheme("fp8" if kind == "float" else "int8", strategy,
                            tuple(config.get("ignore") or ()),
                            "dynamic" if inputs else "none")


def read_raw(path: str, name: str) -> np.ndarray:
    """A tensor's bytes from a safetensors file, as stored (F8_E4M3 as uint8 bit patterns:
    NumPy has no such type; I8 as int8; float types as themselves)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    entry = header[name]
    start, end = entry["data_offsets"]
    dtype = {"F8_E4M3": np.uint8, "U8": np.uint8, "I8": np.int8, "F32": np.float32, "F16": np.float16,
             "BF16": np.uint16}[entry["dtype"]]
    data = np.memmap(path, np.uint8, "r", offset=8 + length + start, shape=(end - start,))
    values = np.asarray(data).view(dtype).reshape(entry["shape"])
    if entry["dtype"] == "BF16":  # bf16 bits -> f32
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values


def parts(files: dict[str, str], name: str) -> dict:
    """The stored form ([in, out] values, [1, out] scales) of the module weight `name`
    (module.weight) of a compressed checkpoint."""
    weight = read_raw(files[name], name)  # [out, in]
    scale_name = name[:-len("weight")] + "weight_scale"
    per_row = np.asarray(read_raw(files[scale_name], scale_name), np.float32).reshape(-1)
    scale = np.broadcast_to(per_row, (weight.shape[0],)).reshape(1, -1)
    return {"kernel": np.ascontiguousarray(weight.T), "scale": np.ascontiguousarray(scale),
            "zero": None}


def quantized_abstract(abstract, scheme: CompressedScheme):
    """The abstract model with the modules the checkpoint quantized (every linear layer the
    engine quantizes, and the LM head, unless ignored) as QuantizedLinear; ValueError when an
    ignore entry splits a weight's layers (stacked layers share one form) or the model has
    experts (their stored form is not read)."""
    from pagedjax.models.layers.quantized import QUANTIZED_LINEARS, Spec, with_quantized_modules

    config = abstract.config
    if config.num_experts:
        raise refuse("a mixture of experts' quantized experts")

    def spec(key: tuple):
        if key == ("embed_tokens",) or (key[-1] not in QUANTIZED_LINEARS
                                        and key != ("lm_head",)):
            return None
        if key == ("lm_head",):
            return None if scheme.ignored("lm_head") else Spec(scheme.scheme)
        names = [".".join(("model", "layers", str(i), *key[2:]))
                 for i in range(config.num_layers)]
        ignored = {scheme.ignored(name) for name in names}
        if len(ignored) > 1:
            raise refuse(f"ignore entries covering some layers' {'.'.join(key[2:])} only")
        return None if ignored.pop() else Spec(scheme.scheme)

    return with_quantized_modules(abstract, spec)
