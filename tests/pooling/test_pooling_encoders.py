"""BERT-like encoders (models.families.bert and .modernbert, pagedjax.engine.encoder_engine)
as embedding models against transformers' BertModel / RobertaModel / ModernBertModel (rotary,
GeGLU, local and global layers) and sentence-transformers' mean Pooling and Normalize: every
sequence of a padded batch equals the model run on it alone.

Tolerance: f32; two implementations of the same dense attention: values to 2e-5, cosine
>= 0.99999."""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st_modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

from pooling_checkpoints import assert_close, write_st_pipeline  # noqa: E402
from test_models_hf import randomize_vectors  # noqa: E402

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
    randomize_vectors(hf)
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
    for control in (lambda: llm.sleep(), lambda: llm.update_weights(hf), lambda: llm.is_paused):
        with pytest.raises(ValueError, match="BERT-like encoder, which serves pooling only"):
            control()  # the generating engine's controls, refused by name
    with pytest.raises(ValueError, match="generates nothing"):
        LLM(str(tmp_path), runner="generate")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tmp_path), tensor_parallel_size=2)


def test_encoder_served_over_http_with_its_programs_warmed(tmp_path):
    """`pagedjax serve` of an encoder: /v1/embeddings through the server's front-end
    (admission, metrics) equals sentence-transformers' vectors; the generation routes answer
    400; after warmup() no request compiles."""
    from fastapi.testclient import TestClient

    from pagedjax.serving.app import OpenAIServer

    hf = save_encoder(tmp_path, "bert")
    write_st_pipeline(tmp_path, "mean", normalize=True)
    llm = LLM(str(tmp_path), max_num_seqs=2, max_model_len=32)
    assert llm.engine.warmup() == len(llm.engine.shapes()) == 2 * 2  # B 1, 2 x L 16, 32
    from pagedjax.engine.engine_protocol import Engine
    assert isinstance(llm.engine, Engine) and llm.engine.replicas == [llm.engine]
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name)
        if name == "/jax/core/compile/jaxpr_trace_duration" else None)
    server = OpenAIServer(llm.engine, "bert", max_outstanding_tokens=64)
    with TestClient(server.build_app()) as client:
        got = client.post("/v1/embeddings", json={"input": PROMPTS}).json()
        for item, ids in zip(got["data"], PROMPTS):
            assert_close(item["embedding"], reference(hf, ids))
        assert got["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
        assert client.post("/v1/completions", json={"prompt": [5]}).status_code == 400
        busy = client.post("/v1/embeddings", json={"input": [[5] * 30] * 3})
        assert busy.status_code == 200  # admitted whole when idle, whatever the budget
        metrics = client.get("/metrics").text
    assert llm.engine.num_compiled_programs == 4
    served = len(compiles)
    llm.engine.add_requests([llm.engine.pooling_spec(PROMPTS[0], None, "embed")])
    llm.engine.step()  # an encoder step of a warmed shape traces (compiles) nothing
    assert len(compiles) == served
    line = next(m for m in metrics.splitlines()
                if m.startswith("pagedjax:request_success_total") and 'reason="stop"' in m)
    assert float(line.split()[-1]) == len(PROMPTS) + 3


@pytest.mark.slow
def test_pagedjax_serve_embeds_through_its_engine_core(tmp_path):
    """`pagedjax serve DIR` (the engine in a process of its own, --warmup): the core's
    description of an encoder, pooling outputs over its channel, /v1/embeddings equal to the
    reference."""
    import json
    import signal
    import urllib.request

    from helpers import start_serve, wait_healthy

    hf = save_encoder(tmp_path, "bert")
    write_st_pipeline(tmp_path, "mean", normalize=True)
    proc, url = start_serve(str(tmp_path), "--max-model-len", "64", "--max-num-seqs", "2",
                            "--warmup")
    try:
        wait_healthy(url, [proc])
        request = urllib.request.Request(
            f"{url}/v1/embeddings", json.dumps({"input": PROMPTS}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            got = json.load(response)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    for item, ids in zip(got["data"], PROMPTS):
        assert_close(item["embedding"], reference(hf, ids))
    # its programs: B 1, 2 x L 16, 32, 64
    assert "no KV cache (a dense encoder)" in out and "warmup: 6 step programs" in out, out
