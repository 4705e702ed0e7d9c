"""LoRA adapters over HTTP (issue 53: pagedjax/serving/lora_routes.py), a real server on 127.0.0.1:
the `model` field picks an adapter of --lora-modules (answered as the engine answers that adapter
directly), /v1/models lists each with its lineage, adapters load, reload in place and unload at
runtime when allowed, and an unknown adapter is a 404 naming it."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

pytest.importorskip("peft")

from test_lora_serving import engine_for, four_adapters, run  # noqa: E402, F401

from pagedjax import SamplingParams  # noqa: E402
from pagedjax.serving.app import OpenAIServer  # noqa: E402
from pagedjax.serving.background import BackgroundServer  # noqa: E402

PROMPT = np.random.default_rng(7).integers(3, 128, 12).tolist()


def expected(directory, loras) -> list[list[int]]:
    """Each model's greedy 5 tokens of PROMPT, from an engine asked directly."""
    engine = engine_for(directory / "base")
    params = SamplingParams(max_tokens=5, temperature=0.0)
    return [out.outputs[0].token_ids for out in run(engine, [(PROMPT, params, lora)
                                                             for lora in loras])]


def complete(client, model: str) -> httpx.Response:
    return client.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
        "return_token_ids": True})


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_model_field_picks_the_adapter_and_adapters_load_at_runtime(four_adapters):  # noqa: F811
    directory, loras = four_adapters
    want = expected(directory, loras)
    modules = [f"one={loras[1].lora_path}",
               json.dumps({"name": "two", "path": loras[2].lora_path,
                           "base_model_name": "llama-base"})]
    server = OpenAIServer(engine_for(directory / "base"), "base", lora_modules=modules,
                          allow_runtime_lora_updating=True)
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=120) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            ("base", None, "base"), ("one", "base", loras[1].lora_path),
            ("two", "llama-base", loras[2].lora_path)]
        assert client.get("/v1/models/two").json()["parent"] == "llama-base"
        assert tokens(complete(client, "base")) == want[0]
        one = complete(client, "one")
        assert tokens(one) == want[1] and one.json()["model"] == "one"
        assert tokens(complete(client, "two")) == want[2]
        missing = complete(client, "three")
        assert missing.status_code == 404 and "'three' does not exist" in missing.json()[
            "error"]["message"]
        loaded = client.post("/v1/load_lora_adapter", json={
            "lora_name": "three", "lora_path": loras[3].lora_path})
        assert loaded.text == "Success: LoRA adapter 'three' added successfully."
        assert tokens(complete(client, "three")) == want[3]
        again = client.post("/v1/load_lora_adapter", json={
            "lora_name": "three", "lora_path": loras[3].lora_path})
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = client.post("/v1/load_lora_adapter", json={
            "lora_name": "four", "lora_path": str(directory / "nowhere")})
        assert bad.status_code == 400 and "adapter_config.json could not be read" in bad.text
        assert complete(client, "four").status_code == 404
        inplace = client.post("/v1/load_lora_adapter", json={
            "lora_name": "one", "lora_path": loras[4].lora_path, "load_inplace": True})
        assert inplace.status_code == 200
        assert tokens(complete(client, "one")) == want[4]
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "three"})
        assert unloaded.text == "Success: LoRA adapter 'three' removed successfully."
        assert complete(client, "three").status_code == 404
        assert client.post("/v1/unload_lora_adapter",
                           json={"lora_name": "three"}).status_code == 404
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [
            "base", "one", "two"]
        metrics = client.get("/metrics").text
        assert ('pagedjax:lora_requests_info{max_lora="2",model_name="base",'
                'running_lora_adapters="",waiting_lora_adapters=""}') in metrics
        loads = next(line for line in metrics.splitlines()
                     if line.startswith('pagedjax:lora_slot_loads_total{model_name="base"}'))
        assert float(loads.split()[-1]) >= 3  # one, two, three (one again after reloading)


def test_runtime_loading_is_off_unless_allowed(four_adapters):  # noqa: F811
    directory, loras = four_adapters
    server = OpenAIServer(engine_for(directory / "base"), "base",
                          lora_modules=[f"one={loras[1].lora_path}"])
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=120) as client:
        assert client.post("/v1/load_lora_adapter", json={
            "lora_name": "x", "lora_path": loras[2].lora_path}).status_code == 404
    with pytest.raises(ValueError, match="need an engine with enable_lora"):
        OpenAIServer(engine_for(directory / "base", enable_lora=False), "base",
                     lora_modules=[f"one={loras[1].lora_path}"])
    with pytest.raises(ValueError, match="adapter_config.json could not be read"):
        OpenAIServer(engine_for(directory / "base"), "base",
                     lora_modules=[f"one={directory / 'nowhere'}"])
    with pytest.raises(ValueError, match="takes name=path"):
        OpenAIServer(engine_for(directory / "base"), "base", lora_modules=["one"])


@pytest.mark.slow  # a server process and its engine core process (~30 s)
def test_pagedjax_serve_with_lora_flags_through_the_engine_core(four_adapters):  # noqa: F811
    """`pagedjax serve --enable-lora --lora-modules ...`: the adapters cross to the engine core
    process with their requests; one loaded at runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    answers as the engine answers it directly."""
    from helpers import start_serve, wait_healthy
    directory, loras = four_adapters
    want = expected(directory, loras)
    proc, url = start_serve(
        str(directory / "base"), "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--lora-modules", f"one={loras[1].lora_path}", "--served-model-name", "base",
        "--max-model-len", "128", "--max-num-batched-tokens", "32", "--block-size", "16",
        "--compilation-cache", "off", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        wait_healthy(url, [proc], timeout_s=300)
        with httpx.Client(base_url=url, timeout=120) as client:
            assert tokens(complete(client, "one")) == want[1]
            assert client.post("/v1/load_lora_adapter", json={
                "lora_name": "two", "lora_path": loras[2].lora_path}).status_code == 200
            assert tokens(complete(client, "two")) == want[2]
            assert tokens(complete(client, "base")) == want[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_chat_and_responses_pick_the_adapter_by_model(tmp_path):
    """/v1/chat/completions and /v1/responses with `model` = an adapter answer as LLM.chat
    under that adapter does (byte-level model, a role template), and name it in `model`."""
    import dataclasses

    from helpers import ROLE_TEMPLATE

    from pagedjax import LLM, LoRARequest
    from pagedjax.lora.peft_adapter import TARGETS, random_adapter, save_peft_adapter
    from pagedjax.models import get_config, init_model
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    model = init_model(config, seed=3)
    path = save_peft_adapter(random_adapter(config, 8, sorted(TARGETS), seed=4, std=0.3),
                             str(tmp_path / "tone"))
    llm = LLM(model, tokenizer="byte", max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=64, block_size=4, enable_lora=True, max_lora_rank=8)
    messages = [{"role": "user", "content": "say something"}]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = {lora: llm.chat(messages, greedy, use_tqdm=False, chat_template=ROLE_TEMPLATE,
                           lora_request=lora)[0].outputs[0].text
            for lora in (None, LoRARequest("tone", 1, path))}
    assert len(set(want.values())) == 2
    server = OpenAIServer(llm.engine, "tiny", chat_template=ROLE_TEMPLATE,
                          lora_modules=[f"tone={path}"])
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=120) as client:
        for model_name, lora in (("tiny", None), ("tone", "tone")):
            chat = client.post("/v1/chat/completions", json={
                "model": model_name, "messages": messages, "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}).json()
            key = None if lora is None else LoRARequest("tone", 1, path)
            assert chat["model"] == model_name
            assert chat["choices"][0]["message"]["content"] == want[key]
        response = client.post("/v1/responses", json={
            "model": "tone", "input": messages, "max_output_tokens": 6, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "tone"
