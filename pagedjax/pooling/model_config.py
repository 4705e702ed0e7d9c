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
import json
import os

from pagedjax.models.loading.hf_config import is_sequence_classifier
from pagedjax.pooling.poolers import POOLING_TYPES, check_modes

# sentence-transformers' legacy pooling config keys (1_Pooling/config.json), in its order
LEGACY_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean",
                    "pooling_mode_lasttoken": "lasttoken"}
ENCODER_TYPES = ("bert", "modernbert", "roberta", "xlm-roberta")  # CLS by default


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    modes: tuple[str, ...] = ("lasttoken",)
    normalize: bool = True
    # the Matryoshka sizes `dimensions` may ask for: a tuple, True (any), False (none)
    matryoshka: tuple[int, ...] | bool = False
    source: str = "default"  # where it was read from (for the log and `inspect`)

    def __post_init__(self):
        check_modes(self.modes)

    def with_overrides(self, overrides: dict) -> "PoolerConfig":
        """vLLM's --pooler-config fields: pooling_type (LAST, MEAN, CLS, ALL) and normalize;
        any other key is refused by name."""
        unknown = set(overrides) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler config fields {sorted(unknown)} are not served (known: "
                             "pooling_type, normalize)")
        changes = {}
        if "pooling_type" in overrides:
            kind = overrides["pooling_type"]
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {tuple(POOLING_TYPES)}, "
                                 f"got {kind!r}")
            changes["modes"] = (POOLING_TYPES[kind],)
        if "normalize" in overrides:
            if not isinstance(overrides["normalize"], bool):
                raise ValueError(f"normalize must be a boolean, got {overrides['normalize']!r}")
            changes["normalize"] = overrides["normalize"]
        return dataclasses.replace(self, **changes, source=f"{self.source} + overrides")


def matryoshka_of(hf_config: dict) -> tuple[int, ...] | bool:
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return bool(hf_config.get("is_matryoshka", False))


def read_pooler_config(model_dir: str, hf_config: dict) -> PoolerConfig:
    """The pooler of the model in model_dir (module docstring); hf_config its config.json."""
    matryoshka = matryoshka_of(hf_config)
    path = os.path.join(model_dir, "modules.json")
    if os.path.exists(path):
        with open(path) as f:
            modules = json.load(f)
        return _sentence_transformers_pooler(model_dir, modules, matryoshka)
    if hf_config.get("model_type") == "modernbert" and is_sequence_classifier(hf_config):
        mode = hf_config.get("classifier_pooling", "cls")
        if mode not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {mode!r} is not served (cls, mean)")
        return PoolerConfig((mode,), True, matryoshka, "config.json classifier_pooling")
    if hf_config.get("model_type") in ENCODER_TYPES:
        return PoolerConfig(("cls",), True, matryoshka, "default (encoder)")
    return PoolerConfig(("lasttoken",), True, matryoshka, "default (decoder)")


def _sentence_transformers_pooler(model_dir: str, modules: list, matryoshka) -> PoolerConfig:
    modes, normalize = None, False
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            with open(os.path.join(model_dir, module.get("path", ""), "config.json")) as f:
                modes = _pooling_modes(json.load(f))
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
