"""Classification heads beyond a linear `score` (pagedjax.pooling.checkpoint_heads): BERT,
XLM-RoBERTa and ModernBERT cross-encoders (transformers' *ForSequenceClassification: BERT's
pooler, RoBERTa's classifier MLP, ModernBERT's head with mean pooling) against
sentence-transformers' CrossEncoder reading the same directory, pairs built by the tokenizer's
pair template with BERT's token types; a Qwen2ForRewardModel's two-layer score against
transformers' Qwen2Model under the same torch head.

Tolerance: f32 on both sides, the same dense attention: scores to 2e-5."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
cross_encoder = pytest.importorskip("sentence_transformers.cross_encoder")

from pooling_checkpoints import COMMON, save_random  # noqa: E402
from test_models_hf import randomize_vectors  # noqa: E402

from pagedjax import LLM  # noqa: E402
from pagedjax.pooling.params import PoolingParams  # noqa: E402
from pagedjax.scheduler import RequestError  # noqa: E402

ENCODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=80, initializer_range=0.2)
KINDS = {  # config, model, its config's extra fields, (cls, id), (sep, id), pad id
    "bert": ("BertConfig", "BertForSequenceClassification", {}, ("[CLS]", 2), ("[SEP]", 3), 0),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification",
                    dict(pad_token_id=1, type_vocab_size=1), ("<s>", 0), ("</s>", 2), 1),
    "modernbert": ("ModernBertConfig", "ModernBertForSequenceClassification",
                   dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                        sep_token_id=2, local_attention=8, global_attn_every_n_layers=3,
                        num_hidden_layers=4, intermediate_size=96, classifier_pooling="mean"),
                   ("[CLS]", 1), ("[SEP]", 2), 0)}
QUERY, DOCS = "w10 w11 w12", ["w20 w21", "w30 w31 w32 w33 w34 w35 w36", "w40"]


def save_tokenizer(directory, kind: str) -> None:
    """A word-level tokenizer ("w12" is id 12) with the kind's pair template (BERT's
    [CLS] a [SEP] b [SEP] with segments 0 / 1, XLM-R's <s> a </s></s> b </s>), as
    transformers' fast tokenizer saves it (CrossEncoder loads it through AutoTokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    (cls, cls_id), (sep, sep_id), pad = KINDS[kind][3:]
    vocab = {f"w{i}": i for i in range(128)}
    for token, i in ((cls, cls_id), (sep, sep_id), ("<pad>", pad), ("<unk>", 5)):
        del vocab[f"w{i}"]
        vocab[token] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    between = f"{sep} {sep}" if kind == "xlm-roberta" else sep
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {between} $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)])
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if kind == "bert" else [])
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, cls_token=cls, sep_token=sep, unk_token="<unk>",
        pad_token="<pad>", model_input_names=inputs).save_pretrained(directory)


def save_classifier(directory, kind: str, num_labels: int = 1):
    torch.manual_seed(0)
    config_cls, model_cls, extra = KINDS[kind][:3]
    config = getattr(transformers, config_cls)(**{**ENCODER, **extra}, num_labels=num_labels)
    if num_labels > 1:
        config.id2label = {i: f"class_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    hf = getattr(transformers, model_cls)(config).eval()
    randomize_vectors(hf)
    hf.save_pretrained(directory)
    save_tokenizer(directory, kind)
    return hf


@pytest.mark.parametrize("kind", list(KINDS))
def test_cross_encoder_scores_equal_sentence_transformers(kind, tmp_path):
    save_classifier(tmp_path, kind)
    want = cross_encoder.CrossEncoder(str(tmp_path), device="cpu").predict(
        [(QUERY, d) for d in DOCS])
    llm = LLM(str(tmp_path), max_num_seqs=2)  # a classifier: runner pooling
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    ranked = llm.score([QUERY] * 3, DOCS, use_tqdm=False)  # pairwise: the same scores
    np.testing.assert_allclose([o.outputs.score for o in ranked], want, rtol=2e-5, atol=2e-5)


def test_bert_reads_each_pairs_segments(tmp_path):
    """The same tokens scored as one text (segment 0 throughout) and as a pair (the second
    text's tokens segment 1) differ, each as transformers computes it."""
    hf = save_classifier(tmp_path, "bert")
    llm = LLM(str(tmp_path))
    ids, types = [2, 10, 11, 3, 20, 21, 3], [0, 0, 0, 0, 1, 1, 1]
    pair = llm.score("w10 w11", "w20 w21", use_tqdm=False)[0]
    assert pair.prompt_token_ids == ids
    alone = llm.classify([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.probs
    with torch.no_grad():
        logits = [hf(torch.tensor([ids]), token_type_ids=torch.tensor([t])).logits[0, 0]
                  for t in ([0] * 7, types)]
    want_alone, want_pair = (float(torch.sigmoid(x)) for x in logits)
    assert abs(want_alone - want_pair) > 1e-3  # the segments matter to this model
    np.testing.assert_allclose(alone, [want_alone], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(pair.outputs.score, want_pair, rtol=2e-5, atol=2e-5)
    # token ids on both sides: the first as given (its specials), the second after it
    by_ids = llm.score([{"prompt_token_ids": ids[:4]}], [{"prompt_token_ids": ids[4:]}],
                       use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == ids
    np.testing.assert_allclose(by_ids.outputs.score, want_pair, rtol=2e-5, atol=2e-5)
    mixed = llm.score("w10 w11", [{"prompt_token_ids": ids[4:]}], use_tqdm=False)[0]
    assert mixed.prompt_token_ids == ids  # the text with its specials, the ids after it
    np.testing.assert_allclose(mixed.outputs.score, want_pair, rtol=2e-5, atol=2e-5)
    with pytest.raises(RequestError, match="text_2 is not valid Unicode"):  # checked first
        llm.score(QUERY, ["w20", "\ud800"], use_tqdm=False)
    with pytest.raises(RequestError, match="token_type_ids"):  # one for each token
        llm.engine.pooling_spec(ids, None, "score", token_type_ids=types[:-1])
    with pytest.raises(RequestError, match="token_type_ids"):  # BERT's two segments
        llm.engine.pooling_spec(ids, None, "score", token_type_ids=[2] * 7)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_encoder_classifier_probs_and_labels_equal_transformers(kind, tmp_path):
    hf = save_classifier(tmp_path, kind, num_labels=3)
    llm = LLM(str(tmp_path))
    prompts = [[KINDS[kind][3][1], 10, 11, 12, KINDS[kind][4][1]], [KINDS[kind][3][1], 40]]
    got = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    raw = llm.classify([{"prompt_token_ids": prompts[0]}], PoolingParams(use_activation=False),
                       use_tqdm=False)[0].outputs.probs
    with torch.no_grad():
        logits = [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]
    for out, want in zip(got, logits):
        np.testing.assert_allclose(out.outputs.probs, np.exp(want) / np.exp(want).sum(),
                                   rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(raw, logits[0], rtol=2e-5, atol=2e-5)
    assert llm.engine.pooling_model.head.labels == ("class_0", "class_1", "class_2")
    with pytest.raises(RequestError, match="one label"):  # a 3-way classifier scores nothing
        llm.score(QUERY, DOCS, use_tqdm=False)


def save_qwen2_reward_model(directory, with_lm_head: bool = True,
                            architecture: str = "Qwen2ForRewardModel"):
    """Qwen2.5-Math-RM's layout (its remote code's Qwen2ForRewardModel): model.* and a score
    MLP of hidden -> hidden, ReLU, hidden -> 1, both with biases (Qwen2.5-Math-PRM's
    Qwen2ForProcessRewardModel: -> 2); the head as torch runs it."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**COMMON)
    base = transformers.Qwen2Model(config).eval()
    labels = 2 if architecture == "Qwen2ForProcessRewardModel" else 1
    head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, labels))
    tensors = {f"model.{k}": v for k, v in base.state_dict().items()}
    tensors.update({f"score.{k}": v for k, v in head.state_dict().items()})
    if with_lm_head:  # the checkpoint's unused language-model head
        tensors["lm_head.weight"] = torch.randn(128, 64)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(directory / "model.safetensors"))
    raw = {**config.to_dict(), "architectures": [architecture],
           "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(raw))
    return base, head


def test_qwen2_reward_model_rewards_every_token(tmp_path):
    base, head = save_qwen2_reward_model(tmp_path)
    llm = LLM(str(tmp_path), block_size=4, max_model_len=64, max_num_batched_tokens=8,
              max_num_seqs=4,
              enable_chunked_prefill=True)
    assert llm.runner == "pooling"
    prompts = [[5, 9, 17, 3, 44, 2, 8, 61, 7, 30, 11], [70, 71, 3]]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    got = llm.reward(inputs, use_tqdm=False)  # vLLM's default: the head's activation
    raw = llm.reward(inputs, PoolingParams(use_activation=False), use_tqdm=False)
    for out, out_raw, ids in zip(got, raw, prompts):
        with torch.no_grad():
            want = head(base(torch.tensor([ids])).last_hidden_state)[0].numpy()
        assert out.outputs.data.shape == (len(ids), 1)
        np.testing.assert_allclose(out_raw.outputs.data, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(out.outputs.data, 1 / (1 + np.exp(-want)), rtol=2e-5,
                                   atol=1e-6)
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(tmp_path), runner="generate")
    with pytest.raises(RequestError, match="reads no token type ids"):
        llm.engine.pooling_spec(prompts[1], None, "embed", token_type_ids=[0, 0, 1])
    spec = llm.engine.pooling_spec(prompts[1], None, "embed")
    with pytest.raises(RequestError, match="token_type_ids"):  # the paged engine's own check
        llm.engine.add_requests([dataclasses.replace(spec, token_type_ids=[0, 0, 1])])


def test_a_head_that_does_not_fit_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    save_classifier(tmp_path / "modernbert", "modernbert")
    path = str(tmp_path / "modernbert" / "model.safetensors")
    tensors = load_file(path)
    tensors["head.norm.weight"] = torch.ones(32)  # the head's norm, of the wrong width
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"head\.norm\.weight has shape \(32,\)"):
        LLM(str(tmp_path / "modernbert"))
    save_qwen2_reward_model(tmp_path, with_lm_head=False)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    tensors["score.2.weight"] = torch.zeros(1, 32)  # a projection from 32, after 64
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"score\.2\.weight has shape \(1, 32\)"):
        LLM(str(tmp_path))
    del tensors["score.2.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"no score\.2\.weight"):
        LLM(str(tmp_path))


def test_bert_reranker_over_http_equals_sentence_transformers(tmp_path):
    """/rerank and /score of a BERT cross-encoder: its pairs through the tokenizer's template
    with their segments, as CrossEncoder.rank orders and scores them."""
    from fastapi.testclient import TestClient

    from pagedjax.serving.app import OpenAIServer

    save_classifier(tmp_path, "bert")
    want = cross_encoder.CrossEncoder(str(tmp_path), device="cpu").rank(
        QUERY, DOCS, return_documents=True)
    llm = LLM(str(tmp_path), max_num_seqs=2, max_model_len=32)
    with TestClient(OpenAIServer(llm.engine, "bge").build_app()) as client:
        got = client.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                           "return_documents": True}).json()
        scored = client.post("/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [r["index"] for r in got["results"]] == [w["corpus_id"] for w in want[:2]]
    assert [r["document"]["text"] for r in got["results"]] == [w["text"] for w in want[:2]]
    np.testing.assert_allclose([r["relevance_score"] for r in got["results"]],
                               [w["score"] for w in want[:2]], rtol=2e-5, atol=2e-5)
    by_index = {w["corpus_id"]: w["score"] for w in want}
    np.testing.assert_allclose([d["score"] for d in scored["data"]],
                               [by_index[i] for i in range(3)], rtol=2e-5, atol=2e-5)
    assert scored["usage"]["prompt_tokens"] == sum(
        len(llm.tokenizer.encode_pair(QUERY, d)[0]) for d in DOCS)


def test_convert_as_vllm_reads_it(tmp_path):
    """vLLM's --convert: embed serves a reward model's states without its head, classify and
    reward need a head, none refuses a generative model as a pooling one; each implies the
    pooling runner and is refused beside runner='generate'."""
    save_qwen2_reward_model(tmp_path)
    llm = LLM(str(tmp_path), convert="embed", max_model_len=32)
    assert llm.runner == "pooling" and llm.engine.pooling_model.head is None
    with pytest.raises(RequestError, match="needs a classification head"):
        llm.classify([[5, 9, 17]], use_tqdm=False)
    assert len(llm.embed([[5, 9, 17]], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="runner must be 'pooling' or 'auto'"):
        LLM(str(tmp_path), convert="reward", runner="generate")
    with pytest.raises(ValueError, match="convert must be one of"):
        LLM(str(tmp_path), convert="sort")
    generative = tmp_path / "generative"
    save_random(generative, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32)
    for convert, why in (("classify", "needs a classification head"),
                         ("reward", "needs a classification head"),
                         ("none", "generative one without a pooling head")):
        with pytest.raises(ValueError, match=why):
            LLM(str(generative), runner="pooling", convert=convert)


def test_a_transformers_tokenizer_builds_the_pair(tmp_path):
    """LLM(tokenizer=<a transformers tokenizer>) scores a pair through that tokenizer's own
    pair template and segments, as the directory's tokenizer does (BERT: [CLS] a [SEP] b
    [SEP], the second text segment 1)."""
    save_classifier(tmp_path, "bert")
    own = LLM(str(tmp_path)).score(QUERY, DOCS, use_tqdm=False)
    given = LLM(str(tmp_path), tokenizer=transformers.AutoTokenizer.from_pretrained(
        str(tmp_path))).score(QUERY, DOCS, use_tqdm=False)
    assert [o.prompt_token_ids for o in given] == [o.prompt_token_ids for o in own]
    assert given[0].prompt_token_ids[0] == 2  # [CLS] once, not a second text's
    np.testing.assert_allclose([o.outputs.score for o in given],
                               [o.outputs.score for o in own], rtol=1e-6)


def test_the_classify_activation_is_vllms_pooler_classify():
    """One label: its sigmoid; two or more: their softmax (a two-label classifier's second
    probability is sigmoid(l1 - l0), not sigmoid(l1)); multi-label: each label's sigmoid."""
    from pagedjax.pooling.heads import activated
    logits = np.asarray([[1.0, 3.0], [-2.0, 0.5]], np.float32)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(activated(logits), e / e.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(activated(logits[:, :1]), 1 / (1 + np.exp(-logits[:, :1])),
                               rtol=1e-6)
    np.testing.assert_allclose(activated(logits, "multi_label"), 1 / (1 + np.exp(-logits)),
                               rtol=1e-6)
    np.testing.assert_array_equal(activated(logits, "identity"), logits)
