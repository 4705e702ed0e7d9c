"""BERT-like encoders (models.families.bert and .modernbert, pagedjax.engine.encoder_engine)
as embedding models against transformers' BertModel / RobertaModel / ModernBertModel (rotary,
GeGLU, local and global layers) and sentence-transformers' mean Pooling and Normalize: every
sequence of a padded batch equals the model run on it alone.

Tolerance: f32; two implementations of the same dense attention: values to 2e-5, cosine
>= 0.99999."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st_modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

from pooling_checkpoints import assert_close, write_st_pipeline  # noqa: E402

from pagedjax import LLM  # noqa: E402
from pagedjax.pooling.params import PoolingParams  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=80, initializer_range=0.2)
PROMPTS = [[5, 9, 17, 3, 44, 2, 8, 61, 7, 30, 11, 12, 13], [70, 71, 3], [9] * 20]


# ModernBERT: a local window of 4 tokens either side (< the prompts), layers 0 and 3 global
MODERNBERT = dict(local_attention=8, global_attn_every_n_layers=3, num_hidden_layers=4,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                  sep_token_id=2)


def save_encoder(directory, kind: str):
    torch.manual_seed(0)
    config_cls, model_cls = {"bert": ("BertConfig", "BertModel"),
                             "roberta": ("RobertaConfig", "RobertaModel"),
                             "modernbert": ("ModernBertConfig", "ModernBertModel")}[kind]
    extra = {"roberta": dict(pad_token_id=1), "modernbert": MODERNBERT}.get(kind, {})
    extra = {**COMMON, **extra}
    if kind == "modernbert":
        extra["intermediate_size"] = 96  # its MLP: a GeGLU of 2 x 96
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**extra)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.ndim == 1:  # norms around 1, biases around 0, not their initial values
                base = 1.0 if "norm" in name.lower() and name.endswith("weight") else 0.0
                param.copy_(base + 0.3 * torch.randn_like(param))
    hf.save_pretrained(directory)
    return hf


def reference(hf, ids, mode: str = "mean") -> np.ndarray:
    with torch.no_grad():
        states = hf(torch.tensor([ids])).last_hidden_state
    features = {"token_embeddings": states,
                "attention_mask": torch.ones(1, len(ids), dtype=torch.int64)}
    vector = st_modules.Pooling(64, mode)(features)["sentence_embedding"]
    return st_modules.Normalize()({"sentence_embedding": vector})["sentence_embedding"][0].numpy()


@pytest.mark.parametrize("kind", ["bert", "roberta", "modernbert"])
def test_mean_pooled_encoder_equals_sentence_transformers(kind, tmp_path):
    hf = save_encoder(tmp_path, kind)
    write_st_pipeline(tmp_path, "mean", normalize=True)
    llm = LLM(str(tmp_path), max_num_seqs=4)  # an encoder: runner pooling
    assert llm.runner == "pooling"
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, ids in zip(outs, PROMPTS):
        assert_close(out.outputs.embedding, reference(hf, ids))
    raw = llm.encode([PROMPTS[1]], PoolingParams(normalize=False), use_tqdm=False)[0]
    with torch.no_grad():
        states = hf(torch.tensor([PROMPTS[1]])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(raw.outputs.data, states.mean(0), rtol=2e-5, atol=2e-5)


def test_encoder_defaults_to_cls_and_refuses_what_it_cannot_serve(tmp_path):
    hf = save_encoder(tmp_path, "bert")  # no modules.json: BERT's default, the CLS token
    llm = LLM(str(tmp_path))
    got = llm.embed([PROMPTS[0]], use_tqdm=False)[0].outputs.embedding
    assert_close(got, reference(hf, PROMPTS[0], "cls"))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([list(range(2, 90))], use_tqdm=False)  # 88 > 80 positions
    with pytest.raises(ValueError, match="generates nothing"):
        LLM(str(tmp_path), runner="generate")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tmp_path), tensor_parallel_size=2)
    from pagedjax.serving.app import OpenAIServer
    with pytest.raises(ValueError, match="not served over HTTP"):
        OpenAIServer(llm.engine, "bert")
