"""The checkpoint names of a model's weights: the Hugging Face tensor a parameter path reads
(transposed or not), a stacked experts' name with its expert index. What every loader
(safetensors, GGUF, placed weights) shares, below them all."""

from __future__ import annotations

EXPERT = "{expert}"  # in a stacked experts' HF name: the expert index (models/layers/moe.py)


def hf_weight_name(path: tuple, renames: tuple[tuple[str, str], ...] = ()) -> tuple[str, bool]:
    """HF tensor name for a path in the NNX parameter dict, and whether HF stores it
    transposed ([out, in] for a Linear kernel [in, out]). A stacked experts' weight [E, in,
    out] names its experts' tensors with EXPERT for the index (experts.{expert}.gate_proj...).
    renames: the family's (models.registry.Family.hf_renames) substitutions of the generic name;
    one that drops the expert index names a fused tensor of every expert ([E, ...], gpt-oss's),
    stored as the module holds it."""
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
    if len(parts) > 1 and parts[-2] == "experts" and EXPERT not in name:
        transpose = False  # renamed to a fused tensor stored as the module holds it (gpt-oss)
    return name, transpose


def expert_names(name: str, num_experts: int) -> list[str]:
    """The HF tensors a weight reads: one, or one an expert for a stacked experts' name."""
    if EXPERT not in name:
        return [name]
    return [name.replace(EXPERT, str(e)) for e in range(num_experts)]


def hf_state_dict(model, renames: tuple[tuple[str, str], ...] = ()) -> dict:
    """A float model's weights by Hugging Face name, in HF's layout ([out, in] for a Linear's
    weight, one tensor an expert; transposed where they lie, on their devices): what a
    checkpoint of it would hold, and what update_weights takes by name. renames: the family's
    (pagedjax.models.registry.hf_renames)."""
    from flax import nnx

    tensors: dict = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transpose = hf_weight_name(path, renames)
        value = variable.get_value()
        value = value.swapaxes(-1, -2) if transpose else value
        if EXPERT in name:
            tensors.update(zip(expert_names(name, value.shape[0]), value))
        else:
            tensors[name] = value
    return tensors
