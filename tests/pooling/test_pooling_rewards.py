"""Reward models and head activations as vLLM serves them, against torch references:
Qwen2.5-Math-PRM's Qwen2ForProcessRewardModel through the STEP pooler (the rows of the
prompt's step tags, the returned columns), vLLM's --pooler-config step / activation fields,
and the activation config.json asks for (problem_type for classify, a cross-encoder's
sentence-transformers activation_fn for score)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
cross_encoder = pytest.importorskip("sentence_transformers.cross_encoder")

from pooling_checkpoints import ENGINE, PROMPTS, save_random  # noqa: E402
from test_pooling_heads import DOCS, QUERY, save_classifier, save_qwen2_reward_model  # noqa: E402

from pagedjax import LLM  # noqa: E402
from pagedjax.pooling.params import PoolingParams  # noqa: E402
from pagedjax.scheduler import RequestError  # noqa: E402

TAG = 44  # the step tag (Qwen2.5-Math-PRM's <extra_0>)
STEPPED = [[5, 9, 44, 3, 8, 44, 2, 8, 61, 7, 44], [70, 71, 3, 44], [12, 13, 14]]


def prm_reference(base, head, ids) -> np.ndarray:
    """f32[tokens, 2]: the PRM's logits at every prompt token (transformers + its head)."""
    with torch.no_grad():
        return head(base(torch.tensor([ids])).last_hidden_state)[0].numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_process_reward_model_scores_its_step_tags(tmp_path):
    """LLM.reward of a Qwen2ForProcessRewardModel: the softmax over its two labels at the
    prompt's step_tag_id tokens (the model card's computation), in 4-token prefill chunks;
    returned_token_ids keeps columns before the activation (one column: its sigmoid); no tag:
    every token; a prompt without the tag: no rows."""
    base, head = save_qwen2_reward_model(tmp_path, architecture="Qwen2ForProcessRewardModel")
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.runner == "pooling" and llm.engine.pooling_model.default_task == "token_classify"
    inputs = [{"prompt_token_ids": p} for p in STEPPED]
    tagged = llm.reward(inputs, PoolingParams(step_tag_id=TAG), use_tqdm=False)
    good = llm.reward(inputs, PoolingParams(step_tag_id=TAG, returned_token_ids=[1]),
                      use_tqdm=False)
    every = llm.reward(inputs, use_tqdm=False)
    for ids, a, b, c in zip(STEPPED, tagged, good, every):
        logits = prm_reference(base, head, ids)
        at_tags = logits[np.asarray(ids) == TAG]
        assert a.outputs.data.shape == (len(at_tags), 2)
        np.testing.assert_allclose(a.outputs.data, softmax(at_tags), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(b.outputs.data, 1 / (1 + np.exp(-at_tags[:, 1:])),
                                   rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(c.outputs.data, softmax(logits), rtol=2e-5, atol=1e-6)
    assert tagged[2].outputs.data.shape == (0, 2)


def test_pooler_config_sets_the_step_defaults_and_activation(tmp_path):
    """--pooler-config's step_tag_id / returned_token_ids are a request's defaults (its own
    win), use_activation false makes raw scores the default, logit_bias is subtracted before
    the activation."""
    base, head = save_qwen2_reward_model(tmp_path, architecture="Qwen2ForProcessRewardModel")
    ids = STEPPED[0]
    logits = prm_reference(base, head, ids)
    llm = LLM(str(tmp_path), **ENGINE, pooler_config={
        "step_tag_id": TAG, "returned_token_ids": [0, 1], "use_activation": False,
        "logit_bias": 0.5})
    raw = llm.reward([ids], use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(raw, logits[np.asarray(ids) == TAG] - 0.5, rtol=2e-5, atol=2e-5)
    own = llm.reward([ids], PoolingParams(step_tag_id=8, use_activation=True),
                     use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(own, softmax(logits[np.asarray(ids) == 8] - 0.5), rtol=2e-5,
                               atol=1e-6)


def test_step_fields_are_refused_where_nothing_reads_them(tmp_path):
    prm = tmp_path / "prm"
    prm.mkdir()
    save_qwen2_reward_model(prm, architecture="Qwen2ForProcessRewardModel")
    llm = LLM(str(prm), max_model_len=32)
    for params, field in ((PoolingParams(returned_token_ids=[2]), "returned_token_ids"),
                          (PoolingParams(returned_token_ids=[]), "returned_token_ids"),
                          (PoolingParams(step_tag_id=-1), "step_tag_id"),
                          (PoolingParams(step_tag_id=True), "step_tag_id")):
        with pytest.raises(RequestError) as error:
            llm.reward([[5, 44]], params, use_tqdm=False)
        assert error.value.field == field
    with pytest.raises(RequestError, match="supports only"):  # a sequence task reads neither
        llm.classify([[5, 44]], PoolingParams(step_tag_id=TAG), use_tqdm=False)
    save_qwen2_reward_model(tmp_path)  # Qwen2ForRewardModel: every token, not STEP
    rm = LLM(str(tmp_path), max_model_len=32)
    with pytest.raises(RequestError, match="pool by STEP") as error:
        rm.reward([[5, 44]], PoolingParams(step_tag_id=TAG), use_tqdm=False)
    assert error.value.field == "step_tag_id"
    with pytest.raises(ValueError, match="step_tag_id is the STEP pooler's"):
        LLM(str(tmp_path), max_model_len=32, pooler_config={"step_tag_id": TAG})
    stepped = LLM(str(tmp_path), max_model_len=32, pooler_config={"tok_pooling_type": "STEP"})
    assert stepped.reward([[5, 44, 9]], PoolingParams(step_tag_id=TAG),
                          use_tqdm=False)[0].outputs.data.shape == (1, 1)
    for bad, why in (({"pooling_type": "STEPS"}, "pooling_type must be one of"),
                     ({"logit_bias": "1"}, "logit_bias must be a number"),
                     ({"returned_token_ids": 1}, "returned_token_ids must be a non-empty")):
        with pytest.raises(ValueError, match=why):
            LLM(str(prm), max_model_len=32, pooler_config=bad)


@pytest.mark.parametrize("problem_type", ["multi_label_classification", "regression"])
def test_classify_applies_the_problem_types_activation(problem_type, tmp_path):
    """config.json's problem_type picks classify's activation as vLLM reads it: each label's
    sigmoid for a multi-label classifier, the raw value for a regression."""
    labels = 3 if problem_type == "multi_label_classification" else 1
    hf = save_random(tmp_path, "LlamaConfig", "LlamaForSequenceClassification",
                     num_labels=labels, problem_type=problem_type)
    llm = LLM(str(tmp_path), **ENGINE)
    got = llm.classify(PROMPTS, use_tqdm=False)
    for ids, out in zip(PROMPTS, got):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].numpy()
        want = torch.sigmoid(torch.tensor(logits)).numpy() if labels == 3 else logits
        np.testing.assert_allclose(out.outputs.probs, want, rtol=2e-5, atol=2e-5)


def test_score_applies_the_cross_encoders_activation_fn(tmp_path):
    """A cross-encoder whose sentence-transformers config names Identity scores raw logits,
    as CrossEncoder.predict does; an activation neither serves is refused by name."""
    save_classifier(tmp_path, "bert")
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    path.write_text(json.dumps(config))
    want = cross_encoder.CrossEncoder(str(tmp_path), device="cpu").predict(
        [(QUERY, d) for d in DOCS])
    got = LLM(str(tmp_path), max_model_len=32).score(QUERY, DOCS, use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in got], want, rtol=2e-5, atol=2e-5)
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.GELU"}
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation_fn 'torch.nn.modules.activation.GELU'"):
        LLM(str(tmp_path), max_model_len=32)
