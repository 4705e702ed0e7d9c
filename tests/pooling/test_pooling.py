"""Poolers and pooling configs (pagedjax/pooling) against sentence-transformers: each of its
pooling modes (and a concatenation) over random token states, ours fed in chunks of 4 tokens
as chunked prefill computes them; its Normalize; its own reading of 1_Pooling/config.json in
the new and the legacy format; Matryoshka truncation then normalization as vLLM serves
`dimensions`; and what is refused by name."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st_modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

from pagedjax.pooling.model_config import PoolerConfig, read_pooler_config  # noqa: E402
from pagedjax.pooling.poolers import PooledSequence, finish_embedding  # noqa: E402

MODES = ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken",
         ("mean", "lasttoken", "cls")]


def pooled(states: np.ndarray, modes, chunk: int) -> np.ndarray:
    pool = PooledSequence(modes)
    for start in range(0, states.shape[0], chunk):
        pool.add(states[start:start + chunk], start)
    return pool.result()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m if isinstance(m, str) else "+".join(m))
@pytest.mark.parametrize("length", [1, 13])
def test_each_mode_equals_sentence_transformers(mode, length):
    rng = np.random.default_rng(length)
    states = rng.standard_normal((length, 24)).astype(np.float32)
    reference = st_modules.Pooling(24, mode)
    features = {"token_embeddings": torch.from_numpy(states)[None],
                "attention_mask": torch.ones(1, length, dtype=torch.int64)}
    want = reference(features)["sentence_embedding"][0].numpy()
    modes = (mode,) if isinstance(mode, str) else mode
    for chunk in (4, length):
        np.testing.assert_allclose(pooled(states, modes, chunk), want, rtol=1e-5, atol=1e-6)


def test_all_keeps_every_tokens_state_and_chunks_must_come_in_order():
    states = np.arange(30, dtype=np.float32).reshape(10, 3)
    np.testing.assert_array_equal(pooled(states, ("all",), 4), states)
    pool = PooledSequence(("mean",))
    pool.add(states[:4], 0)
    with pytest.raises(ValueError, match="in order: position 5 after 4 tokens"):
        pool.add(states[5:], 5)
    with pytest.raises(ValueError, match="combines with no other mode"):
        PooledSequence(("all", "mean"))


def test_normalize_equals_sentence_transformers_and_dimensions_truncate_first():
    rng = np.random.default_rng(0)
    vector = rng.standard_normal((1, 32)).astype(np.float32)
    want = st_modules.Normalize()({"sentence_embedding": torch.from_numpy(vector)})
    np.testing.assert_allclose(finish_embedding(vector, normalize=True),
                               want["sentence_embedding"].numpy(), rtol=1e-6)
    # vLLM's dimensions: the first 8 values, then normalized (Matryoshka)
    got = finish_embedding(vector, normalize=True, dimensions=8, matryoshka=(8, 16, 32))
    np.testing.assert_allclose(got, vector[:, :8] / np.linalg.norm(vector[:, :8]), rtol=1e-6)
    assert finish_embedding(vector, normalize=False, dimensions=16, matryoshka=True).shape == \
        (1, 16)
    assert finish_embedding(vector, normalize=False, dimensions=1, matryoshka=True).shape == \
        (1, 1)  # the least size a model may declare
    for dims, matryoshka, match in ((8, False, "does not support Matryoshka"),
                                    (12, (8, 16), r"one of the model's Matryoshka dimensions"),
                                    (64, True, "exceeds the embedding's 32"),
                                    (0, True, "positive integer")):
        with pytest.raises(ValueError, match=f"dimensions.*{match}|{match}"):
            finish_embedding(vector, normalize=True, dimensions=dims, matryoshka=matryoshka)


def write_st_dir(directory, pooling: dict, extra_modules=(), normalize=True) -> str:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    modules += list(extra_modules)
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    return str(directory)


@pytest.mark.parametrize("pooling", [
    {"word_embedding_dimension": 8, "pooling_mode_lasttoken": True,
     "pooling_mode_mean_tokens": False, "include_prompt": True},  # Qwen3-Embedding's
    {"word_embedding_dimension": 8, "pooling_mode_mean_tokens": True},  # all-MiniLM's
    {"word_embedding_dimension": 8, "pooling_mode_cls_token": True,
     "pooling_mode_max_tokens": True},
    {"word_embedding_dimension": 8},  # no mode: sentence-transformers takes mean
    {"embedding_dimension": 8, "pooling_mode": ["weightedmean", "lasttoken"]},
], ids=["legacy-last", "legacy-mean", "legacy-cls-max", "legacy-none", "new-list"])
def test_modules_json_is_read_as_sentence_transformers_reads_it(tmp_path, pooling):
    directory = write_st_dir(tmp_path, pooling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = st_modules.Pooling.load(os.path.join(directory, "1_Pooling"))
    want = reference.pooling_mode
    config = read_pooler_config(directory, {"matryoshka_dimensions": [4, 8]})
    assert config.modes == ((want,) if isinstance(want, str) else tuple(want))
    assert config.normalize and config.matryoshka == (4, 8) and config.source == "modules.json"
    assert not read_pooler_config(write_st_dir(tmp_path / "raw", pooling, normalize=False),
                                  {}).normalize


def test_defaults_and_overrides():
    assert read_pooler_config("/nonexistent", {"model_type": "qwen3"}) == PoolerConfig(
        ("lasttoken",), True, False, "default (decoder)")
    bert = read_pooler_config("/nonexistent", {"model_type": "bert", "is_matryoshka": True})
    assert bert.modes == ("cls",) and bert.matryoshka is True
    over = bert.with_overrides({"pooling_type": "MEAN", "normalize": False})
    assert over.modes == ("mean",) and not over.normalize
    # vLLM's kinds: pooling_type names either, seq_ / tok_pooling_type one of each kind
    every = bert.with_overrides({"pooling_type": "ALL"})
    assert every.modes == ("all",) and every.token_pooling == "ALL"
    for overrides in ({"pooling_type": "STEP"}, {"tok_pooling_type": "STEP"}):
        stepped = bert.with_overrides(overrides)
        assert stepped.modes == ("cls",) and stepped.token_pooling == "STEP"
    seq = bert.with_overrides({"seq_pooling_type": "MEAN", "tok_pooling_type": "ALL",
                               "use_activation": False, "logit_bias": 2})
    assert seq.modes == ("mean",) and seq.token_pooling == "ALL"
    assert seq.use_activation is False and seq.logit_bias == 2.0
    for overrides, match in (({"seq_pooling_type": "ALL"}, "seq_pooling_type must be one of"),
                             ({"tok_pooling_type": "MEAN"}, "tok_pooling_type must be one of"),
                             ({"use_activation": 1}, "use_activation must be a boolean")):
        with pytest.raises(ValueError, match=match):
            bert.with_overrides(overrides)
    for overrides, match in (({"pooling_type": "MAX"}, "pooling_type must be one of"),
                             ({"normalize": "yes"}, "normalize must be a boolean"),
                             ({"softmax": True}, r"\['softmax'\] are not served")):
        with pytest.raises(ValueError, match=match):
            bert.with_overrides(overrides)


def test_pipelines_not_served_are_refused_by_name(tmp_path):
    dense = {"idx": 3, "name": "3", "path": "3_Dense",
             "type": "sentence_transformers.models.Dense"}
    with pytest.raises(ValueError, match="'Dense' .*3_Dense.* is not served"):
        read_pooler_config(write_st_dir(tmp_path / "a", {"pooling_mode": "mean"}, [dense]), {})
    with pytest.raises(ValueError, match="include_prompt false"):
        read_pooler_config(write_st_dir(tmp_path / "b", {"pooling_mode": "mean",
                                                         "include_prompt": False}), {})
