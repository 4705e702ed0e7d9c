"""Checkpoints whose experts are stored in MXFP4 (`quantization_config.quant_method` "mxfp4":
gpt-oss as OpenAI publishes it), served in that form with no float copy
(pagedjax.models.quantization.mxfp4): each layer's `mlp.experts.gate_up_proj` and `down_proj`
are read from their `_blocks` and `_scales` tensors into a QuantizedInterleavedExperts' kernels
(an expert's weights are decoded only inside the grouped matmul that takes them); attention,
the router, the embeddings, the LM head and the experts' biases are the checkpoint's floats.

The quantization_config must say so: `modules_to_not_convert` may name only those float
modules; any other layout is refused by name.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import numpy as np

from pagedjax.models.quantization import mxfp4

# the modules gpt-oss keeps in floats (the published config's modules_to_not_convert)
FLOAT_MODULES = ("model.layers.0.self_attn", "model.layers.0.mlp.router", "model.embed_tokens",
                 "lm_head")
PROJECTIONS = ("gate_up_proj", "down_proj")


def read(raw: dict[str, Any]) -> bool:
    """Whether config.json declares MXFP4 experts (ValueError naming what is not served)."""
    config = raw.get("quantization_config") or {}
    if config.get("quant_method") != "mxfp4":
        return False
    if raw.get("model_type") != "gpt_oss":
        raise ValueError(f"quantization_config: MXFP4 is served for gpt-oss's experts, not a "
                         f"{raw.get('model_type')!r} model")
    for entry in config.get("modules_to_not_convert") or ():
        pattern = re.sub(r"\.\d+\.", ".*.", str(entry))
        if not any(fnmatch.fnmatch(re.sub(r"\.\d+\.", ".0.", name), pattern)
                   or name.startswith(str(entry)) for name in FLOAT_MODULES):
            raise ValueError(f"quantization_config.modules_to_not_convert: {entry!r} would keep "
                             f"a module MXFP4 does not cover in floats; served: experts only")
    return True


def quantized_abstract(abstract):
    """The abstract model with every layer's experts in the MXFP4 stored form."""
    from pagedjax.models.layers.quantized import Spec, with_quantized_modules

    def spec(key: tuple):
        return Spec("mxfp4") if key[-1] == "experts" else None

    return with_quantized_modules(abstract, spec)


def stored_names(name: str) -> tuple[str, str]:
    """The `_blocks` and `_scales` tensors of an experts' projection's name."""
    return name + "_blocks", name + "_scales"


def stored_shapes(shape: tuple) -> tuple[tuple, tuple]:
    """The checkpoint shapes of the `_blocks` and `_scales` of an [E, in, out] weight."""
    experts, rows, out = shape
    return (experts, out, rows // mxfp4.BLOCK, mxfp4.BLOCK // 2), (experts, out,
                                                                   rows // mxfp4.BLOCK)


def parts(files: dict[str, str], name: str) -> dict:
    """The served form (kernel [E, in / 2, out], scale [E, in / 32, out]) of the experts'
    projection `name` (...mlp.experts.gate_up_proj) from its `_blocks` and `_scales`."""
    from pagedjax.models.loading.compressed_tensors import read_raw

    blocks, scales = (read_raw(files[each], each) for each in stored_names(name))
    kernel, scale = mxfp4.from_checkpoint(np.asarray(blocks, np.uint8),
                                          np.asarray(scales, np.uint8))
    return {"kernel": kernel, "scale": scale, "zero": None}
