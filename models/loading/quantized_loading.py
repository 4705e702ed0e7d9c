"""Quantized weights read straight into place (pagedjax.models.loading.placed_weights' lazy loaders).

A LazyModel whose abstract model has quantized modules (pagedjax.models.layers.quantized: swapped by
`quantize_lazy`, or a GGUF file's own blocks) builds each of their leaves (`kernel`, `scale`,
`zero`) from a per-layer reading of the whole weight in the serving layout: `parts(name)` ->
{"kernel", "scale", "zero"}, one layer's tensor at a time on the host. For a float checkpoint
it reads the tensor and quantizes it (pagedjax.models.quantization.schemes.quantize); a GGUF file's reader
converts its blocks (pagedjax.models.quantization.gguf_blocks), with no float copy. The small `scale` / `zero` parts
are kept for the leaves that follow their kernel's (one read of a tensor, not three).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from flax import nnx

from pagedjax.models.layers.quantized import (QuantizedEmbed, QuantizedLinear, QuantizedWeight,
                                              module_key, quantize_model)
from pagedjax.models.loading.lazy_model import LazyModel

QUANTIZED_PARTS = ("kernel", "scale", "zero")


def quantized_modules(abstract) -> dict[tuple, QuantizedWeight]:
    """module_key of each quantized module -> one such module (every layer's is alike:
    quantize_model and the GGUF reader quantize a weight the same way in every layer)."""
    found: dict[tuple, QuantizedWeight] = {}
    for path, node in nnx.graph.iter_graph(abstract):
        if isinstance(node, QuantizedWeight):  # Linear, Embed, or an experts' projection
            found.setdefault(module_key(path), node)
    return found


def quantize_lazy(lazy, scheme: str, lm_head: bool = False):
    """The LazyModel of the same checkpoint with its linear layers quantized by scheme as they
    are read (quantize_model's choice of layers). A loader that cannot quantize as it reads
    (orbax) is read whole, then quantized (ValueError from there is not raised here)."""
    abstract = quantize_model(lazy.abstract, scheme, lm_head)
    modules = quantized_modules(abstract)
    if not getattr(lazy.place, "reads_quantized", False):
        raise ValueError(f"{lazy.source}: this checkpoint format is read whole; "
                         f"load it eagerly to quantize it")
    place = functools.partial(lazy.place, modules=modules, scheme=scheme)
    return dataclasses.replace(lazy, abstract=abstract, place=place)


class QuantizedReader:
    """parts(name_and_transpose) for one place() call: the whole tensor's quantized parts in
    the serving layout. read_parts(name_and_transpose) computes them (quantizing a float read,
    or converting a GGUF tensor's blocks); the last tensor's are kept whole, every tensor's
    scale and zero until the call ends."""

    def __init__(self, read_parts):
        self.read_parts = read_parts
        self.small: dict[str, dict] = {}
        self.last: tuple[str, dict] | None = None

    def __call__(self, name_and_transpose: tuple[str, bool], part: str) -> np.ndarray | None:
        name = name_and_transpose[0]
        if part != "kernel" and name in self.small:
            return self.small[name][part]
        if self.last is None or self.last[0] != name:
            parts = self.read_parts(name_and_transpose)
            self.last = (name, parts)
            self.small[name] = {key: parts[key] for key in ("scale", "zero")}
        return self.last[1][part]


def columns_of(part: np.ndarray | None, columns) -> np.ndarray | None:
    """A part with the repeated KV heads' columns (pagedjax.models.loading.placed_weights.kv_columns)."""
    if part is None or columns is None:
        return part
    return np.ascontiguousarray(part[..., columns])


def for_serving(model, quantization: str | None, lm_head: bool = False):
    """The model an engine serves under EngineConfig.quantization: a float model (in memory or
    a LazyModel) quantized by a scheme; a GGUF file's own blocks ("gguf", or unset). ValueError
    names a mismatch (a scheme on weights already quantized, "gguf" on other weights)."""
    from pagedjax.models.quantization.schemes import SCHEMES

    abstract = model.abstract if isinstance(model, LazyModel) else model
    stored = sorted({module.scheme for module in quantized_modules(abstract).values()})
    source = getattr(model, "source", "the model")
    gguf = str(source).endswith(".gguf")
    if quantization == "gguf" and not gguf:
        raise ValueError(f"quantization 'gguf' serves a GGUF file's blocks; {source} is not a "
                         f"GGUF file")
    if quantization == "mxfp4" and stored != ["mxfp4"]:
        raise ValueError(f"quantization 'mxfp4' serves a checkpoint's MXFP4 experts (gpt-oss); "
                         f"{source} is not one")
    if quantization == "compressed-tensors" and (gguf or not stored):
        raise ValueError(f"quantization 'compressed-tensors' serves an llm-compressor "
                         f"checkpoint's weights; {source} is not one")
    if quantization not in SCHEMES:
        return model
    if stored:
        raise ValueError(f"quantization {quantization!r}: {source} is already quantized "
                         f"({', '.join(stored)}); leave quantization unset to serve its own")
    if isinstance(model, LazyModel):
        return quantize_lazy(model, quantization, lm_head)
    return quantize_model(model, quantization, lm_head)


def weight_report(abstract) -> dict:
    """What a model's weights take as served: bytes (every parameter, at its stored dtype), and
    the quantized modules' formats (module key -> "int4, 32 rows a group, offsets")."""
    import jax

    from pagedjax.models.quantization.schemes import PACKED

    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    formats = {}
    for key, module in quantized_modules(abstract).items():
        rows = (module.in_features if isinstance(module, QuantizedLinear) else
                module.features if isinstance(module, QuantizedEmbed) else
                module.kernel.get_value().shape[-2] * (2 if module.scheme in PACKED else 1))
        groups = module.scale.get_value().shape[-2]
        formats[".".join(map(str, key))] = (
            f"{module.scheme}, " + ("per output channel" if groups == 1 and module.scheme != "mxfp4"
                                    else f"{rows // groups} rows a group")
            + (", offsets" if module.zero is not None else ""))
    return {"served_weight_bytes": int(sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)),
            "quantized_weights": formats}
