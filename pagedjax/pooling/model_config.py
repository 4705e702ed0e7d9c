"""Which pooler a model directory says it was trained with, as vLLM and sentence-transformers
read it: modules.json (sentence-transformers' pipeline: the transformer, a Pooling module whose
config.json names its modes, an optional Normalize), otherwise the architecture's default
(vLLM's: the last token, normalized, for a decoder, the first token for a BERT-like
encoder, a sequence classifier included; a ModernBERT classifier's classifier_pooling). Matryoshka
dimensions come from the model's config.json (matryoshka_dimensions, or is_matryoshka).

What the engine would not compute as the checkpoint's pipeline does is refused by name (a
Dense projection after the pooler, a pooler that leaves the prompt's instruction out), never
skipped.
"""

from __future__ import annotations

import dataclasses
import os

from pagedjax.models.families.hf_fields import architecture_of
from pagedjax.models.loading.hf_config import is_sequence_classifier
from pagedjax.models.loading.user_files import read_user_json
from pagedjax.pooling.poolers import POOLING_TYPES, check_modes

# sentence-transformers' legacy pooling config keys (1_Pooling/config.json), in its order
LEGACY_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean",
                    "pooling_mode_lasttoken": "lasttoken"}
ENCODER_TYPES = ("bert", "modernbert", "roberta", "xlm-roberta")  # CLS by default
STEP_POOLED = ("Qwen2ForProcessRewardModel",)  # token tasks pooled by STEP (vLLM's default)


# --pooler-config's fields (vLLM's PoolerConfig): pooling_type names a sequence pooler (LAST,
# MEAN, CLS) or a token one (ALL, STEP), seq_ / tok_pooling_type one of each kind
OVERRIDES = ("pooling_type", "seq_pooling_type", "tok_pooling_type", "normalize",
             "use_activation", "logit_bias", "step_tag_id", "returned_token_ids")
TOKEN_POOLING = ("ALL", "STEP")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    modes: tuple[str, ...] = ("lasttoken",)
    normalize: bool = True
    # the Matryoshka sizes `dimensions` may ask for: a tuple, True (any), False (none)
    matryoshka: tuple[int, ...] | bool = False
    source: str = "default"  # where it was read from (for the log and `inspect`)
    # the token tasks' pooler: ALL (every prompt token) or STEP (vLLM's process reward models:
    # the rows of the prompt's step_tag_id tokens, the returned_token_ids columns; None: all)
    token_pooling: str = "ALL"
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None
    use_activation: bool | None = None  # the head tasks' default (None: on, as vLLM's)
    logit_bias: float | None = None  # subtracted from a head's logits before its activation

    def __post_init__(self):
        check_modes(self.modes)
        if self.token_pooling not in TOKEN_POOLING:
            raise ValueError(f"token pooling must be one of {TOKEN_POOLING}, got "
                             f"{self.token_pooling!r}")
        given = [f for f in ("step_tag_id", "returned_token_ids") if getattr(self, f) is not None]
        if given and self.token_pooling != "STEP":
            raise ValueError(f"pooler config: {given[0]} is the STEP pooler's; this model's "
                             "token tasks pool ALL tokens (pooling_type STEP selects it)")

    def with_overrides(self, overrides: dict) -> "PoolerConfig":
        """vLLM's --pooler-config fields (OVERRIDES); any other key is refused by name."""
        unknown = sorted(set(overrides) - set(OVERRIDES))
        if unknown:
            raise ValueError(f"pooler config fields {unknown} are not served (known: "
                             f"{', '.join(OVERRIDES)})")
        changes = {}
        for key, value in overrides.items():
            changes.update(_override(key, value))
        return dataclasses.replace(self, **changes, source=f"{self.source} + overrides")


def _override(key: str, value) -> dict:
    """The PoolerConfig fields one --pooler-config entry sets; ValueError naming it."""
    if key in ("pooling_type", "seq_pooling_type", "tok_pooling_type"):
        kinds = {"pooling_type": tuple(POOLING_TYPES) + ("STEP",),
                 "seq_pooling_type": tuple(k for k in POOLING_TYPES if k != "ALL"),
                 "tok_pooling_type": TOKEN_POOLING}[key]
        if value not in kinds:
            raise ValueError(f"{key} must be one of {kinds}, got {value!r}")
        if value in TOKEN_POOLING:  # (seq_pooling_type names none)
            return {"token_pooling": value, **({"modes": ("all",)} if value == "ALL" and
                                               key == "pooling_type" else {})}
        return {"modes": (POOLING_TYPES[value],)}
    if key in ("normalize", "use_activation"):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be a boolean, got {value!r}")
        return {key: value}
    if key == "logit_bias":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"logit_bias must be a number, got {value!r}")
        return {key: float(value)}
    if key == "step_tag_id":
        check_step_fields(value, None)
        return {key: value}
    check_step_fields(None, value)
    return {key: tuple(value)}


def check_step_fields(step_tag_id, returned_token_ids) -> None:
    """ValueError naming step_tag_id or returned_token_ids unless they are (None or) a
    non-negative integer and a non-empty list of them."""
    ids = returned_token_ids
    if ids is not None and (not isinstance(ids, (list, tuple)) or not ids):
        raise ValueError(f"returned_token_ids must be a non-empty list of indices, got {ids!r}")
    for field, values in (("step_tag_id", [step_tag_id]), ("returned_token_ids", ids or ())):
        for value in values:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{field} must hold non-negative integers, got {value!r}")


def matryoshka_of(hf_config: dict) -> tuple[int, ...] | bool:
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return bool(hf_config.get("is_matryoshka", False))


def read_pooler_config(model_dir: str, hf_config: dict) -> PoolerConfig:
    """The pooler of the model in model_dir (module docstring); hf_config its config.json."""
    matryoshka = matryoshka_of(hf_config)
    path = os.path.join(model_dir, "modules.json")
    if os.path.lexists(path):
        modules = read_user_json(path, "modules.json", root=model_dir, kind=list)
        return _sentence_transformers_pooler(model_dir, modules, matryoshka)
    if hf_config.get("model_type") == "modernbert" and is_sequence_classifier(hf_config):
        mode = hf_config.get("classifier_pooling", "cls")
        if mode not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {mode!r} is not served (cls, mean)")
        return PoolerConfig((mode,), True, matryoshka, "config.json classifier_pooling")
    if hf_config.get("model_type") in ENCODER_TYPES:
        return PoolerConfig(("cls",), True, matryoshka, "default (encoder)")
    if architecture_of(hf_config) in STEP_POOLED:
        return PoolerConfig(("lasttoken",), True, matryoshka, "default (process reward model)",
                            token_pooling="STEP")
    return PoolerConfig(("lasttoken",), True, matryoshka, "default (decoder)")


def _sentence_transformers_pooler(model_dir: str, modules: list, matryoshka) -> PoolerConfig:
    modes, normalize = None, False
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            modes = _pooling_modes(read_user_json(
                os.path.join(model_dir, module.get("path", ""), "config.json"), root=model_dir))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"modules.json: the sentence-transformers module {kind!r} "
                             f"({module.get('path')}) is not served (Transformer, Pooling and "
                             "Normalize are)")
    if modes is None:
        raise ValueError("modules.json names no Pooling module")
    return PoolerConfig(modes, normalize, matryoshka, "modules.json")


def _pooling_modes(config: dict) -> tuple[str, ...]:
    """A Pooling module's config.json: sentence-transformers' pooling_mode (a mode or a list)
    or its legacy pooling_mode_* booleans (mean when none is set, as it reads them)."""
    if config.get("include_prompt", True) is False:
        raise ValueError("1_Pooling/config.json: include_prompt false (the pooler leaves an "
                         "instruction prompt out) is not served")
    mode = config.get("pooling_mode")
    if mode is not None:
        return (mode,) if isinstance(mode, str) else tuple(mode)
    legacy = tuple(m for key, m in LEGACY_MODE_KEYS.items() if config.get(key))
    return legacy or ("mean",)
