"""What a family's config.json reader shares (models/families/*.py): the refusal of what it
cannot serve, the architecture's name, RoPE in both config formats. The loader
(pagedjax.models.loading.hf_config) names the supported architectures when a refusal reaches it;
the families never import the registry above them."""

from __future__ import annotations

from typing import Any

from pagedjax.models.config import ROPE_TYPES, RopeScaling


class UnsupportedModelError(ValueError):
    """The directory holds a model this engine cannot serve correctly."""


def refuse(architecture: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"architecture {architecture}: {what} is not supported")


def architecture_of(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if archs:
        return str(archs[0])
    return str(raw.get("model_type", "unknown"))


def rope_from_params(params: Any, architecture: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one RoPE parameter dict (`rope_theta`, `rope_type`, `factor`...)."""
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise refuse(architecture, f"rope_parameters {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise refuse(architecture, f"RoPE type {rope_type!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(architecture, f"partial_rotary_factor {params['partial_rotary_factor']}")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    fields: dict[str, Any] = {"factor": params.get("factor")}
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if name not in params:
                raise ValueError(f"llama3 RoPE scaling needs {name} in the config")
            fields[name] = params[name]
    if rope_type == "yarn":
        return theta, yarn_scaling(params)
    if fields["factor"] is None:
        raise ValueError(f"{rope_type} RoPE scaling needs a factor in the config")
    return theta, RopeScaling(rope_type=rope_type, **fields)


def yarn_scaling(params: dict[str, Any], max_position_embeddings: int | None = None):
    """A yarn RopeScaling from its parameters (transformers' names; factor None: the ratio of
    max_position_embeddings to original_max_position_embeddings, as transformers takes it)."""
    if "original_max_position_embeddings" not in params:
        raise ValueError("yarn RoPE scaling needs original_max_position_embeddings in the config")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("yarn RoPE scaling needs a factor in the config")
        factor = max_position_embeddings / original
    fields = {name: params[name]
              for name in ("attention_factor", "mscale", "mscale_all_dim", "truncate")
              if params.get(name) is not None}  # (else RopeScaling's: transformers' defaults)
    return RopeScaling(rope_type="yarn", factor=float(factor),
                       original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1), **fields)


def rope_params(raw: dict[str, Any]) -> Any:
    """The RoPE parameters of either config format: transformers 5's `rope_parameters` (a dict,
    or a dict of dicts by layer type), or transformers 4's `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params
