"""Small random checkpoints for the pooling tests (saved by transformers, nothing downloaded),
their sentence-transformers pipeline files, a word-level tokenizer, and the reference
embedding: transformers' last_hidden_state through sentence-transformers' own modules."""

from __future__ import annotations

import json

import numpy as np
import torch
import transformers
from sentence_transformers.sentence_transformer import modules as st_modules

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
              max_position_embeddings=256, pad_token_id=0)
ENGINE = dict(block_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8,
              enable_chunked_prefill=True, enable_prefix_caching=True, min_seq_bucket=4)
PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 61, 7, 30, 11, 12, 13], [70, 71, 3], [9] * 9]


def save_random(directory, config_cls: str, model_cls: str, **extra):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms around 1, not all ones
                param.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


def write_st_pipeline(directory, mode: str, normalize: bool) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json (and 2_Normalize)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type":
                "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode": mode}))


def st_reference(hf, ids, mode: str, normalize: bool, dimensions=None) -> np.ndarray:
    """transformers' last_hidden_state through sentence-transformers' Pooling (and
    Normalize, after truncation to dimensions as its truncate_dim does)."""
    with torch.no_grad():
        states = hf.model(torch.tensor([ids])).last_hidden_state
    features = {"token_embeddings": states, "attention_mask": torch.ones(1, len(ids),
                                                                         dtype=torch.int64)}
    vector = st_modules.Pooling(64, mode)(features)["sentence_embedding"]
    if dimensions is not None:
        vector = vector[:, :dimensions]
    if normalize:
        vector = st_modules.Normalize()({"sentence_embedding": vector})["sentence_embedding"]
    return vector[0].numpy()


def assert_close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    cosine = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cosine >= 0.99999
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)




def word_tokenizer(directory, words: dict[str, int] | None = None) -> None:
    """tokenizer.json of a word-level vocabulary "w0" .. "w127" (words: names replacing some
    ids), split on whitespace: "w12 w7" encodes to [12, 7]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(128)}
    for word, token_id in (words or {}).items():
        del vocab[f"w{token_id}"]
        vocab[word] = token_id
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
