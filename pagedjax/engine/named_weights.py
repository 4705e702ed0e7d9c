"""New weights by Hugging Face tensor name (update_weights with a mapping, issue 52; vLLM's
`load_weights(weights: Iterable[tuple[name, tensor]])`, SGLang's update_weights_from_tensor):
any subset of the names a checkpoint of the engine's model has, each an array in HF's layout
([out, in] for a Linear's weight; one tensor an expert), on any devices or in host memory.

Each name is the part of one served leaf it lands in (a layer of a stack, an expert of a
layer; pagedjax.engine.weight_writer): the leaves no name touches stay as they are, and a named
tensor is transposed, cast and its KV heads repeated on the devices it lands on. An engine
quantized by a scheme (int8, fp8, int4) quantizes each named weight as a checkpoint's are
quantized when read (on the host, as the loaders do), then writes its data and scales.

Unknown names, wrong shapes and other dtype families are refused by name before anything
changes. Two names every tied or older HF state dict carries are taken as what they stand for:
`lm_head.weight` of a model whose head is its embedding (the same tensor as
`model.embed_tokens.weight`: checked equal in shape, written once through the embedding) and
`*.rotary_emb.inv_freq` (computed from the config, not a weight), as vLLM's loaders take them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pagedjax.engine.new_weights import sources_of
from pagedjax.engine.weight_writer import Part, check_part
from pagedjax.models.loading.names import EXPERT, hf_weight_name
from pagedjax.models.registry import hf_renames

QUANTIZED_PARTS = ("kernel", "scale", "zero")


def _quantized_modules(sources) -> set[tuple]:
    """The model-level module paths ({layer} form) whose served leaves are quantized."""
    return {model_path[:-1] for model_path, _, _ in sources if model_path[-1] == "scale"}


def name_index(runner, config) -> dict[str, list[tuple[int, tuple, str | None, bool]]]:
    """HF name -> where it lands: (served leaf position, index into the leaf, the quantized
    part the leaf holds or None, whether HF stores it transposed); kept on the runner."""
    return runner.cached_layout("hf_names", lambda: _name_index(runner, config))


def _name_index(runner, config) -> dict[str, list[tuple[int, tuple, str | None, bool]]]:
    renames, sources = hf_renames(config), sources_of(runner, config)
    quantized = _quantized_modules(sources)
    index: dict[str, list] = {}
    for position, (model_path, places, _) in enumerate(sources):
        part = model_path[-1] if model_path[:-1] in quantized else None
        if part is not None and part not in QUANTIZED_PARTS:
            part = None  # a quantized module's bias: a float leaf of its own
        for leaf_index, path in places:
            stored = path[:-1] + ("kernel",) if part is not None else path
            name, transpose = hf_weight_name(stored, renames)
            if EXPERT in name:
                experts = range(config.num_experts)
                targets = [(name.replace(EXPERT, str(e)), leaf_index + (e,)) for e in experts]
            else:
                targets = [(name, leaf_index)]
            for hf_name, at in targets:
                index.setdefault(hf_name, []).append((position, at, part, transpose))
    return index


def _taken_as_other(name: str, config, index: dict) -> bool:
    """Whether a name not in the index stands for one that is (the module docstring)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def named_parts(tensors: Mapping, runner, config, scheme: str | None
                ) -> tuple[dict[int, list[Part]], dict[int, int], bool]:
    """(the served leaves' parts, their KV repeats, whether the parts cover every leaf whole)
    for HF-named tensors; ValueError naming unknown names, wrong shapes or dtypes first."""
    index, sources = name_index(runner, config), sources_of(runner, config)
    if not tensors:
        raise ValueError("weights: the mapping of Hugging Face names to arrays is empty")
    unknown = sorted(n for n in tensors if n not in index and not _taken_as_other(n, config, index))
    if unknown:
        example = next(iter(index))
        raise ValueError(f"weights: unknown tensor names {unknown[:4]} (the engine's model "
                         f"names its weights as Hugging Face does, e.g. {example!r})")
    import jax

    specs = jax.tree.leaves(runner.weight_specs)
    parts: dict[int, list[Part]] = {}
    quantized: dict[str, dict] = {}  # name -> its quantized parts
    for name, value in tensors.items():
        if name not in index:
            _check_alias(name, value, tensors, index, specs)
            continue
        for position, at, part, transpose in index[name]:
            repeats = sources[position][2]
            new: Part | None
            if part is None:
                new = Part(at, value, transpose)
                check_part(name, specs[position], new, repeats)
            else:
                new = _quantized_part(name, value, at, part, specs[position], repeats, scheme,
                                      quantized)
            if new is not None:
                parts.setdefault(position, []).append(new)
    complete = all(len(parts.get(p, ())) == _num_places(index, p) for p in range(len(specs)))
    return parts, {p: sources[p][2] for p in parts}, complete


def _num_places(index: dict, position: int) -> int:
    return sum(1 for places in index.values() for p, *_ in places if p == position)


def _check_alias(name, value, tensors, index, specs) -> None:
    """A tied head's lm_head.weight must have the embedding's shape (inv_freq: anything)."""
    if name != "lm_head.weight":
        return
    position, at, _, transpose = index["model.embed_tokens.weight"][0]
    check_part(name, specs[position], Part(at, value, transpose), 1)


def _quantized_part(name, value, at, part, spec, repeats, scheme, done: dict) -> Part | None:
    """One quantized leaf's part of a named float weight: quantized by scheme (on the host,
    [in, out], once a name: done keeps it), its KV columns the model's (repeated when written)."""
    from pagedjax.models.quantization.schemes import SCHEMES, quantize

    if scheme not in SCHEMES:
        raise ValueError(f"weights: {name}: an engine serving {scheme or 'its own'} quantized "
                         f"weights takes new ones as a checkpoint path or a model, not by name")
    if name not in done:
        if not hasattr(value, "shape") or not np.issubdtype(np.dtype(value.dtype), np.floating):
            raise ValueError(f"weights: {name} must be a float array (the engine quantizes it "
                             f"by {scheme}), got {getattr(value, 'dtype', type(value).__name__)}")
        if part == "kernel":
            rows, columns = spec.shape[len(at):][-2:]
            expected = (columns // repeats, rows * (2 if scheme == "int4" else 1))
            if tuple(value.shape) != expected:
                raise ValueError(f"weights: {name} is {value.dtype}{list(value.shape)}, the "
                                 f"engine takes a float dtype {list(expected)} there")
        data, scale = quantize(np.asarray(value, dtype=np.float32).T, scheme)
        done[name] = {"kernel": data, "scale": scale}
    if part not in done[name]:
        return None
    new = Part(at, done[name][part])
    check_part(name, spec, new, repeats)
    return new
