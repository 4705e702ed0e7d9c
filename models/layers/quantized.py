"""Quantized modules (pagedjax.models.quantization.schemes's stored form) and `quantize_model`, which swaps a
model's linear layers for them.

QuantizedLinear replaces nnx.Linear: parameters `kernel` (the stored values, [in, out] or
packed [in / 2, out]), `scale` [G, out], `zero` [G, out] (asymmetric formats only) and `bias`;
its output is the Linear's, from the dequantized weight. QuantizedEmbed replaces a tied
embedding (the LM head of a model without lm_head): its `kernel` is the table transposed,
[D, V] (D the contraction axis of the head's product), so one stored form serves both the
lookup (the columns of the ids, dequantized) and the head. The mixture-of-experts router and
Qwen2-MoE's shared-expert gate stay in full precision (a few columns; routing decisions are
discrete), as vLLM and llm-compressor leave them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.layers.moe import Experts, InterleavedExperts
from pagedjax.models.quantization.schemes import (QArray, check_scheme, matmul, num_groups,
                                                  quantize, scale_dtype, storage_dtype, stored_rows)

# The linear layers quantize_model swaps (by attribute name); the LM head is an option.
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj",
                     # multi-head latent attention (models/layers/mla.py): the query's and the
                     # latent's down- and up-projections; kv_b_proj is read as a weight too
                     # (the absorbed form), dequantized then
                     "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


class QuantizedWeight(nnx.Module):
    """A quantized weight [..., in, out] in the stored form: parameters `kernel`, `scale` and
    (with offsets) `zero`; alone, one projection of a mixture's stacked experts."""

    def __init__(self, shape: tuple[int, ...], scheme: str, *, groups: int | None = None,
                 has_zero: bool = False):
        check_scheme(scheme, stored=True)
        *lead, rows, out = shape
        groups = num_groups(scheme, rows) if groups is None else groups
        self.kernel = nnx.Param(jnp.zeros((*lead, stored_rows(scheme, rows), out),
                                          storage_dtype(scheme)))
        self.scale = nnx.Param(jnp.ones((*lead, groups, out), scale_dtype(scheme)))
        self.zero = nnx.Param(jnp.zeros((*lead, groups, out), jnp.float32)) if has_zero \
            else None
        self.scheme = scheme

    def weight(self) -> QArray:
        zero = None if self.zero is None else self.zero[...]
        return QArray(self.kernel[...], self.scale[...], zero, self.scheme)


class QuantizedLinear(QuantizedWeight):
    """y = x @ dequantize(kernel, scale, zero) + bias, in dtype (f32 accumulation)."""

    def __init__(self, in_features: int, out_features: int, scheme: str, *, dtype,
                 groups: int | None = None, has_zero: bool = False, use_bias: bool = False,
                 bias_dtype=jnp.float32):
        super().__init__((in_features, out_features), scheme, groups=groups,
                         has_zero=has_zero)
        self.bias = nnx.Param(jnp.zeros((out_features,), bias_dtype)) if use_bias else None
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul(x, self.weight(), self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class QuantizedEmbed(QuantizedWeight):
    """nnx.Embed's interface (call: lookup, attend: the tied LM head) over a quantized table
    stored as kernel [D, V] (module docstring)."""

    def __init__(self, num_embeddings: int, features: int, scheme: str, *, dtype,
                 groups: int | None = None, has_zero: bool = False):
        super().__init__((features, num_embeddings), scheme, groups=groups, has_zero=has_zero)
        self.num_embeddings, self.features = num_embeddings, features
        self.dtype = dtype

    def __call__(self, token_ids: jax.Array) -> jax.Array:  # i32[...] -> [..., D]
        flat = token_ids.reshape(-1)
        weight = self.weight()
        zero = None if weight.zero is None else jnp.take(weight.zero, flat, axis=-1)
        columns = QArray(jnp.take(weight.data, flat, axis=-1),
                         jnp.take(weight.scale, flat, axis=-1), zero, self.scheme)
        return columns.astype(self.dtype).T.reshape(*token_ids.shape, self.features)

    def attend(self, query: jax.Array) -> jax.Array:  # [..., D] -> [..., V]
        return matmul(query, self.weight(), self.dtype)


class QuantizedProjections:
    """The stacked projections of experts (their class's PROJECTIONS) quantized, each expert its
    own scales: the grouped matmuls dequantize an expert's weights as they take them. Every
    other attribute (activation, gpt-oss's biases and clamp) is the float module's."""

    PROJECTIONS: tuple[str, ...]  # the experts class's (the other base of each subclass)

    def __init__(self, experts: Experts, spec: "Spec"):  # super().__init__ not called:
        for key, value in vars(experts).items():  # the parameters differ, the rest is theirs
            if key not in self.PROJECTIONS and not key.startswith("_"):
                setattr(self, key, value)
        for name in self.PROJECTIONS:
            shape = getattr(experts, name).get_value().shape
            setattr(self, name, QuantizedWeight(shape, spec.scheme,
                                                groups=_groups(spec, shape[-2]),
                                                has_zero=spec.zero))

    def kernels(self) -> tuple:
        return tuple(getattr(self, name).weight() for name in self.PROJECTIONS)


class QuantizedExperts(QuantizedProjections, Experts):
    """pagedjax.models.layers.moe.Experts with gate, up and down quantized."""


class QuantizedInterleavedExperts(QuantizedProjections, InterleavedExperts):
    """gpt-oss's experts (moe.InterleavedExperts) with gate_up and down quantized, their biases
    kept."""


QUANTIZED_EXPERTS: dict[type, type[QuantizedProjections]] = {
    Experts: QuantizedExperts, InterleavedExperts: QuantizedInterleavedExperts}


def quantize_model(model, scheme: str, lm_head: bool = False):
    """A copy of model (arrays shared, the original unchanged) with every linear layer of
    QUANTIZED_LINEARS, and the LM head when lm_head (the embedding, when tied), quantized by
    scheme. An abstract model (nnx.eval_shape) gives the abstract quantized one (nothing
    computed: the loaders quantize as they read, pagedjax.models.loading.quantized_loading)."""
    check_scheme(scheme)
    tied = model.lm_head is None

    def spec(key: tuple):
        if key[-1] in (*QUANTIZED_LINEARS, "experts") or (lm_head and key == ("lm_head",)) or (
                lm_head and tied and key == ("embed_tokens",)):
            return Spec(scheme)
        return None

    return with_quantized_modules(model, spec)


@dataclasses.dataclass(frozen=True)
class Spec:
    """How one module is quantized: scheme, rows a group (None: the scheme's choice,
    pagedjax.models.quantization.schemes.num_groups) and whether groups have an offset."""

    scheme: str
    group: int | None = None
    zero: bool = False


def module_key(path: tuple) -> tuple:
    """A module's model path with its layer index as "{layer}"."""
    return tuple("{layer}" if i == 1 and path[0] == "layers" else part
                 for i, part in enumerate(path))


def with_quantized_modules(model, spec):
    """A copy of model (arrays shared) with each linear layer (the MoE router and shared-
    expert gate aside: module docstring) and the embedding quantized by spec(module_key) (a
    Spec, or None to keep it)."""
    model = nnx.clone(model)
    targets = [(path, node) for path, node in nnx.graph.iter_graph(model)
               if (isinstance(node, nnx.Linear) and path
                   and (path[-1] in QUANTIZED_LINEARS or path == ("lm_head",)))
               or (isinstance(node, nnx.Embed) and path == ("embed_tokens",))
               or (type(node) in QUANTIZED_EXPERTS)]
    for path, module in targets:
        chosen = spec(module_key(path))
        if chosen is None:
            continue
        swap = (_quantized_linear if isinstance(module, nnx.Linear) else
                _quantized_embed if isinstance(module, nnx.Embed) else _quantized_experts)
        _set(model, path, swap(module, chosen))
    return model


def _quantized_experts(experts: Experts, spec: Spec) -> QuantizedProjections:
    cls = QUANTIZED_EXPERTS[type(experts)]
    if _is_abstract(getattr(experts, experts.PROJECTIONS[0])):
        return nnx.eval_shape(lambda: cls(experts, spec))
    _check_computable(spec)
    module = cls(experts, spec)
    for name in experts.PROJECTIONS:
        data, scale = quantize(np.asarray(getattr(experts, name).get_value(), np.float32),
                               spec.scheme)
        getattr(module, name).kernel.set_value(jnp.asarray(data))
        getattr(module, name).scale.set_value(jnp.asarray(scale))
    return module


def _set(model, path: tuple, module) -> None:
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    setattr(parent, path[-1], module)


def _is_abstract(variable) -> bool:
    return isinstance(variable.get_value(), jax.ShapeDtypeStruct)


def _groups(spec: Spec, rows: int) -> int | None:
    return None if spec.group is None else rows // spec.group


def _quantized_linear(linear: nnx.Linear, spec: Spec) -> QuantizedLinear:
    bias = linear.bias
    make = lambda: QuantizedLinear(  # noqa: E731
        linear.in_features, linear.out_features, spec.scheme,
        dtype=linear.dtype or jnp.float32, groups=_groups(spec, linear.in_features),
        has_zero=spec.zero, use_bias=bias is not None,
        bias_dtype=jnp.float32 if bias is None else bias.get_value().dtype)
    if _is_abstract(linear.kernel):
        return nnx.eval_shape(make)
    _check_computable(spec)
    module = make()
    data, scale = quantize(np.asarray(linear.kernel.get_value(), np.float32), spec.scheme)
    module.kernel.set_value(jnp.asarray(data))
    module.scale.set_value(jnp.asarray(scale))
    if bias is not None and module.bias is not None:
        module.bias.set_value(bias.get_value())
    return module


def _check_computable(spec: Spec) -> None:
    if spec.group is not None or spec.zero:
        raise ValueError(f"{spec}: a stored format (a GGUF file's) is read, not computed")


def _quantized_embed(embed: nnx.Embed, spec: Spec) -> QuantizedEmbed:
    make = lambda: QuantizedEmbed(  # noqa: E731
        embed.num_embeddings, embed.features, spec.scheme, dtype=embed.dtype or jnp.float32,
        groups=_groups(spec, embed.features), has_zero=spec.zero)
    if _is_abstract(embed.embedding):
        return nnx.eval_shape(make)
    _check_computable(spec)
    module = make()
    table = np.asarray(embed.embedding.get_value(), np.float32)  # [V, D]
    data, scale = quantize(table.T, spec.scheme)
    module.kernel.set_value(jnp.asarray(data))
    module.scale.set_value(jnp.asarray(scale))
    return module


def quantize_like(template, module):
    """module (a fresh float one of template's structure, other widths allowed: the layers
    pagedjax.models.paged_forward widens for repeated KV heads) with the linear layers quantized that are in
    template, by the same scheme and groups: zeros, for shapes (call under nnx.eval_shape)."""
    for path, node in nnx.graph.iter_graph(template):
        if isinstance(node, QuantizedProjections):
            experts = module
            for key in path:
                experts = experts[key] if isinstance(key, int) else getattr(experts, key)
            weight = getattr(node, node.PROJECTIONS[0])
            _set(module, path, QUANTIZED_EXPERTS[type(experts)](experts, Spec(
                weight.scheme, None, weight.zero is not None)))
            continue
        if not isinstance(node, QuantizedLinear):
            continue
        linear = module
        for key in path:
            linear = linear[key] if isinstance(key, int) else getattr(linear, key)
        bias = None if linear.bias is None else linear.bias.get_value()
        _set(module, path, QuantizedLinear(
            linear.in_features, linear.out_features, node.scheme, dtype=node.dtype,
            groups=node.scale.get_value().shape[-2], has_zero=node.zero is not None,
            use_bias=bias is not None, bias_dtype=jnp.float32 if bias is None else bias.dtype))
    return module
