"""Which runner an engine serves (vLLM's --runner: generate or pooling) and, for pooling, the
model's pooler and head (pagedjax.pooling.pooling_model.PoolingModel): read from the model
directory as vLLM and sentence-transformers read it, overridable by --pooler-config, and
vLLM's hf_overrides for rerankers served through their language-model head
(classifier_from_token; is_original_qwen3_reranker: ["no", "yes"])."""

from __future__ import annotations

import os

from pagedjax.engine.config import RUNNERS
from pagedjax.models.families.hf_fields import architecture_of
from pagedjax.models.loading.encoder import is_encoder_dir
from pagedjax.models.loading.hf_config import REWARD_MODELS, is_sequence_classifier
from pagedjax.models.loading.user_files import read_user_json
from pagedjax.pooling.checkpoint_heads import read_head
from pagedjax.pooling.heads import head_from_tokens, token_rows
from pagedjax.pooling.model_config import PoolerConfig, read_pooler_config
from pagedjax.pooling.pooling_model import PoolingModel

CONVERTED = ("embed", "classify", "reward")  # vLLM's --convert values that imply pooling
HF_OVERRIDES = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")


def model_directory(model) -> tuple[str | None, dict]:
    """(the Hugging Face directory model names, its config.json), or (None, {})."""
    if not isinstance(model, (str, os.PathLike)):
        return None, {}
    path = os.path.join(os.fspath(model), "config.json")
    if not os.path.isfile(path):
        return None, {}
    return os.fspath(model), read_user_json(path)


def _token_ids(tokenizer, tokens) -> list[int]:
    if (not isinstance(tokens, (list, tuple)) or not tokens
            or not all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"hf_overrides: classifier_from_token must be a list of token "
                         f"strings, got {tokens!r}")
    if tokenizer is None:
        raise ValueError("hf_overrides: classifier_from_token needs the model's tokenizer")
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"hf_overrides: classifier_from_token {token!r} is not one token "
                             f"(it encodes to {encoded})")
        ids.extend(encoded)
    return ids


def _check_overrides(hf_overrides: dict) -> list[str] | None:
    """The classifier tokens hf_overrides asks for (None: none); unknown keys refused."""
    unknown = sorted(set(hf_overrides) - set(HF_OVERRIDES))
    if unknown:
        raise ValueError(f"hf_overrides fields {unknown} are not served (known: "
                         f"{list(HF_OVERRIDES)})")
    tokens = hf_overrides.get("classifier_from_token")
    if hf_overrides.get("is_original_qwen3_reranker") and tokens is None:
        tokens = ["no", "yes"]
    archs = hf_overrides.get("architectures")
    if archs is not None and (tokens is None or not isinstance(archs, list) or not all(
            isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs)):
        raise ValueError("hf_overrides: architectures may only declare a "
                         "*ForSequenceClassification served through classifier_from_token, "
                         f"got {archs!r}")
    return tokens


def resolve_runner(model, runner: str, hf_overrides: dict | None, convert: str = "auto") -> str:
    """The runner "auto" means for model: pooling for a sequence classifier, a reranker
    served through classifier_from_token or a model converted (vLLM's --convert embed,
    classify, reward), else generate; the others as given."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if convert in CONVERTED:
        if runner == "generate":
            raise ValueError(f"convert={convert!r} serves a pooling model: runner must be "
                             "'pooling' or 'auto', got 'generate'")
        return "pooling"
    if is_encoder_dir(model):
        if runner == "generate":
            raise ValueError("a BERT-like encoder generates nothing: serve it with "
                             "runner='pooling'")
        return "pooling"
    if runner != "auto":
        return runner
    classifier = is_sequence_classifier(model_directory(model)[1])
    return "pooling" if classifier or _check_overrides(hf_overrides or {}) else "generate"


def pooling_setup(model, loaded, tokenizer, runner: str, pooler_config: dict | None = None,
                  hf_overrides: dict | None = None, convert: str = "auto"
                  ) -> PoolingModel | None:
    """The PoolingModel of runner "pooling" (resolve_runner's), else None (a classifier or
    pooler_config given to a generating runner refused). model: what LLM was given (a
    directory is read for its pooler and head); loaded: the model built; convert: vLLM's
    (_converted)."""
    tokens = _check_overrides(hf_overrides or {})
    model_dir, hf_config = model_directory(model)
    if runner != "pooling":
        if tokens is not None or pooler_config or is_sequence_classifier(hf_config):
            raise ValueError("this model is a classifier (or pooler_config was given): serve "
                             "it with runner='pooling'")
        return None
    if is_encoder_dir(model) and tokens is not None:
        raise ValueError("hf_overrides: classifier_from_token reads a language-model head's "
                         "rows; a BERT-like encoder has none")
    hidden_size = loaded.config.hidden_size
    head = read_head(model_dir, hf_config, hidden_size) if model_dir is not None else None
    if tokens is not None:
        if model_dir is None and not hasattr(loaded, "lm_head"):
            raise ValueError("hf_overrides: classifier_from_token reads the LM head's rows "
                             "from a Hugging Face directory (or a model object)")
        ids = _token_ids(tokenizer, tokens)
        head = head_from_tokens(token_rows(loaded, model_dir, ids), list(tokens))
    pooler = (read_pooler_config(model_dir, hf_config) if model_dir is not None
              else PoolerConfig(source="default (decoder)"))
    if pooler_config:
        pooler = pooler.with_overrides(pooler_config)
    reward = convert == "reward" or architecture_of(hf_config) in REWARD_MODELS
    return PoolingModel(pooler, _converted(convert, head, is_encoder_dir(model)),
                        getattr(loaded.config, "reads_token_types", False), reward)


def _converted(convert: str, head, encoder: bool):
    """The head a pooling model serves under vLLM's --convert: embed serves embeddings only
    (no head); classify and reward need one (a checkpoint's, or classifier_from_token's);
    none converts nothing (a decoder without a head is a generative model, not a pooling
    one); auto serves what the model has."""
    if convert in ("classify", "reward") and head is None:
        raise ValueError(f"convert={convert!r} needs a classification head: a "
                         "*ForSequenceClassification (or reward model) checkpoint's weights, "
                         "or hf_overrides classifier_from_token")
    if convert == "none" and head is None and not encoder:
        raise ValueError("convert='none': this model is a generative one without a pooling "
                         "head; convert='embed' (or 'auto') serves it as an embedding model")
    return None if convert == "embed" else head
