"""LoRA adapters from a hostile client (issue 71): every malformed adapter a load can name is a 400
within about a second that names what is wrong (a FIFO, a link out of the adapter, a sparse
1 GiB file, a header claiming 900 MB, a config nested 100k deep or not an object, an invalid
regular expression, a non-finite or absurd lora_alpha, NaN / inf / int8 / float64 tensors), the
server keeps serving, and no adapter's values reach another tenant's tokens; concurrent loads get
their own ids, and an unload while the adapter's requests are in flight leaves the server's and
the engine's tables in step (the name reloads at once)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import time

import httpx
import numpy as np
import pytest

from pagedjax import LLM, LoRARequest, SamplingParams
from pagedjax.lora.peft_adapter import TARGETS, random_adapter, save_peft_adapter
from pagedjax.models import get_config, init_model
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 9, 33, 70, 12, 8]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(an LLM with LoRA on over a byte-level debug-tiny, its config, a folder of adapters)."""
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    llm = LLM(init_model(config, seed=3), tokenizer="byte", max_model_len=96, max_num_seqs=8,
              max_num_batched_tokens=64, block_size=4, enable_lora=True, max_lora_rank=8,
              max_loras=2, max_cpu_loras=3)
    return llm, config, tmp_path_factory.mktemp("adapters")


def adapter(config, folder, name: str, seed: int = 4, scaling: float = 2.0) -> str:
    return save_peft_adapter(random_adapter(config, 8, sorted(TARGETS), seed=seed, std=0.3,
                                            scaling=scaling), str(folder / name))


def edit_config(path: str, **fields) -> None:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(fields)
    with open(file, "w") as f:
        json.dump(config, f)  # NaN / Infinity as Python's json writes them


def edit_tensors(path: str, change) -> None:
    from safetensors.numpy import load_file, save_file
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    save_file({name: change(name, t) for name, t in tensors.items()}, file)


def fifo(path: str, name: str) -> None:
    os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))


def sparse(path: str, size: int) -> None:
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.truncate(size)


def big_header(path: str) -> None:
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write((900 * 10**6).to_bytes(8, "little") + b'{"a": ')


def raw_config(text: str):
    def write(path: str) -> None:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write(text)
    return write


def link_out(path: str) -> None:
    outside = os.path.join(os.path.dirname(path), "outside.safetensors")
    os.replace(os.path.join(path, "adapter_model.safetensors"), outside)
    os.symlink(outside, os.path.join(path, "adapter_model.safetensors"))


def poisoned(value):
    return lambda name, t: (np.full_like(t, value) if "lora_B" in name else t)


MALFORMED = {  # case -> (how the adapter is broken, what the 400 says)
    "fifo-tensors": (lambda p: fifo(p, "adapter_model.safetensors"), "is a FIFO"),
    "fifo-config": (lambda p: fifo(p, "adapter_config.json"), "is a FIFO"),
    "link-out": (link_out, "a link out of"),
    "sparse-1GiB": (lambda p: sparse(p, 1 << 30), "over the"),
    "header-900MB": (big_header, "could not be read"),
    "config-nested": (raw_config("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    "config-array": (raw_config("[1, 2]"), "must hold a JSON object"),
    "config-bad-regex": (lambda p: edit_config(p, target_modules="(["),
                         "is not a regular expression"),
    "alpha-nan": (lambda p: edit_config(p, lora_alpha=float("nan")), "finite number"),
    "alpha-inf": (lambda p: edit_config(p, lora_alpha=float("inf")), "finite number"),
    "alpha-1e30": (lambda p: edit_config(p, lora_alpha=1e30), "at most 10000 in size"),
    "tensor-nan": (lambda p: edit_tensors(p, poisoned(np.nan)), "non-finite"),
    "tensor-inf": (lambda p: edit_tensors(p, poisoned(np.inf)), "non-finite"),
    "tensor-int8": (lambda p: edit_tensors(p, lambda n, t: t.astype(np.int8)), "is I8"),
    "tensor-float64": (lambda p: edit_tensors(p, lambda n, t: t.astype(np.float64)),
                       "is F64"),
}


def base_tokens(llm, prompts=(PROMPT,)) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]


def test_malformed_adapters_are_400s_and_the_server_keeps_serving(tiny):
    llm, config, folder = tiny
    want = base_tokens(llm)[0]
    server = OpenAIServer(llm.engine, "tiny", allow_runtime_lora_updating=True)
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=30) as client:
        for case, (breaks, says) in MALFORMED.items():
            path = adapter(config, folder, f"bad-{case}")
            breaks(path)
            start = time.monotonic()
            answer = client.post("/v1/load_lora_adapter",
                                 json={"lora_name": case, "lora_path": path})
            assert answer.status_code == 400, (case, answer.text)
            assert says in answer.json()["error"]["message"], (case, answer.text)
            assert time.monotonic() - start < 5, case
            assert client.post("/v1/completions", json={"model": case, "prompt": "x"}
                               ).status_code == 404
        completion = client.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert completion.json()["choices"][0]["token_ids"] == want
        assert client.get("/health").status_code == 200


def test_an_adapter_built_in_memory_is_checked_as_a_read_one(tiny):
    llm, config, folder = tiny
    path = adapter(config, folder, "in-memory", seed=9)
    llm.engine.add_lora(LoRARequest("in-memory", 50, path))
    nan = random_adapter(config, 8, ["q_proj"], seed=1, scaling=float("nan"))
    with pytest.raises(ValueError, match="scaling"):
        llm.engine.update_lora("in-memory", nan)
    inf = random_adapter(config, 8, ["q_proj"], seed=1)
    inf.pairs["q_proj"][1][0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        llm.engine.update_lora("in-memory", inf)
    from safetensors.numpy import load_file
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="int8; LoRA weights are floats"):
        llm.engine.update_lora("in-memory", {n: t.astype(np.int8) for n, t in tensors.items()})
    edge = random_adapter(config, 8, ["q_proj"], seed=2, scaling=1e4)  # at the bound: served
    llm.engine.update_lora("in-memory", edge)
    manager = llm.engine.lora_manager
    assert 50 in manager.pinned  # held only in memory: the host cache never lets it go
    assert manager.shapes[50][1] == 1e4
    assert llm.engine.remove_lora(50)
    assert not llm.engine.remove_lora(50) and not llm.engine.remove_lora(999)
    assert 50 not in llm.engine.list_loras()


def test_no_adapters_values_reach_the_base_models_tokens(tiny):
    """An adapter slot holding NaN and inf (written past the loads' checks) beside base
    requests in the same steps: the base answers are the base model's."""
    llm, config, folder = tiny
    prompts = [PROMPT, [7, 7, 81, 3], [100, 4, 2, 9, 9]]
    want = base_tokens(llm, prompts)
    lora = LoRARequest("poison", 60, adapter(config, folder, "poison", seed=5))
    llm.engine.add_lora(lora)
    manager = llm.engine.lora_manager
    for value in (np.nan, np.inf):
        manager.host[60] = {name: (np.full_like(a, value), np.full_like(b, value))
                            for name, (a, b) in manager.host[60].items()}
        llm.engine.scheduler.state.lora_slots.evict(60)  # the next use writes the slot anew
        outs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, PROMPT]], GREEDY,
                            lora_request=[None, None, None, lora], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:3]] == want, value
    assert llm.engine.remove_lora(60)


def test_the_host_cache_keeps_the_most_recently_used(tiny):
    """max_cpu_loras 3 here; loads 1, 2, 1, 3, 4 keep [1, 3, 4] in use order (a hit refreshes
    its place: 2 goes, not 1)."""
    llm, config, folder = tiny
    manager = llm.engine.lora_manager
    for lora_id in (71, 72, 71, 73, 74):
        manager.check(LoRARequest(f"lru{lora_id}", lora_id,
                                  adapter(config, folder, f"lru{lora_id}", seed=lora_id)))
    assert list(manager.host) == [71, 73, 74]
    reads = manager.num_reads
    manager.arrays(71)
    assert manager.num_reads == reads and list(manager.host) == [73, 74, 71]  # a hit, no read
    manager.arrays(72)
    assert manager.num_reads == reads + 1 and list(manager.host) == [74, 71, 72]
    for lora_id in (71, 72, 73, 74):
        llm.engine.remove_lora(lora_id)


def test_concurrent_loads_get_their_own_ids(tiny):
    llm, config, folder = tiny
    paths = [adapter(config, folder, f"c{i}", seed=20 + i) for i in range(4)]
    server = OpenAIServer(llm.engine, "tiny", allow_runtime_lora_updating=True)
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=60) as client:
        def load(name_path):
            return client.post("/v1/load_lora_adapter",
                               json={"lora_name": name_path[0], "lora_path": name_path[1]})

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            different = list(pool.map(load, [(f"c{i}", p) for i, p in enumerate(paths)]))
            same = list(pool.map(load, [("same", paths[0])] * 4))
        assert [r.status_code for r in different] == [200] * 4, [r.text for r in different]
        assert sorted(r.status_code for r in same) == [200, 400, 400, 400]
        assert all("has already been loaded" in r.text for r in same if r.status_code == 400)
        ids = [server.loras.by_name[f"c{i}"].lora_int_id for i in range(4)]
        assert len(set(ids)) == 4 and llm.engine.list_loras() >= set(ids)
        for name in ["same", *(f"c{i}" for i in range(4))]:
            assert client.post("/v1/unload_lora_adapter",
                               json={"lora_name": name}).status_code == 200


def test_unloading_with_requests_in_flight_keeps_the_tables_in_step(tiny):
    """Load X, 12 requests to X, unload X while they run: each request is answered (served, or
    refused by name once X is gone), and then X reloads and unloads cleanly, three times."""
    llm, config, folder = tiny
    path = adapter(config, folder, "x", seed=30)
    server = OpenAIServer(llm.engine, "tiny", allow_runtime_lora_updating=True)
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=60) as client:
        for _ in range(3):
            assert client.post("/v1/load_lora_adapter", json={
                "lora_name": "x", "lora_path": path}).status_code == 200
            with concurrent.futures.ThreadPoolExecutor(13) as pool:
                chats = [pool.submit(client.post, "/v1/completions", json={
                    "model": "x", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
                    for _ in range(12)]
                time.sleep(0.05)
                unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
                codes = [c.result().status_code for c in chats]
            assert unload.status_code == 200
            assert set(codes) <= {200, 400, 404}, codes
            assert "x" not in server.loras.by_name
            assert "x" not in llm.engine.lora_manager.ids
        assert client.post("/v1/load_lora_adapter", json={
            "lora_name": "x", "lora_path": path}).status_code == 200
        answer = client.post("/v1/completions", json={
            "model": "x", "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200


def test_a_request_naming_an_unloaded_id_is_refused_by_name(tiny):
    llm, config, folder = tiny
    lora = LoRARequest("gone", 80, adapter(config, folder, "gone", seed=40))
    llm.engine.add_lora(lora)
    assert llm.engine.remove_lora(80)
    with pytest.raises(ValueError, match="'gone' \\(lora_int_id 80\\) was unloaded"):
        llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, lora_request=lora,
                     use_tqdm=False)
    again = LoRARequest("gone", 81, lora.lora_path)  # the name under a new id: served
    assert llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, lora_request=again,
                        use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.remove_lora(81)
    assert llm.engine.add_lora(lora) and 80 in llm.engine.list_loras()  # brought back
    assert llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, lora_request=lora,
                        use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.remove_lora(80)


def test_the_operators_allowlist_of_adapter_paths(tiny):
    """--allowed-lora-paths: a load from under an allowed directory is served; any other path,
    existing or not (or a link inside that leads out), gets the same 400, saying nothing of the
    path."""
    llm, config, folder = tiny
    allowed = folder / "allowed"
    inside = adapter(config, allowed, "in", seed=50)
    outside = adapter(config, folder, "out", seed=51)
    os.symlink(outside, allowed / "link-out")
    server = OpenAIServer(llm.engine, "tiny", allow_runtime_lora_updating=True,
                          allowed_lora_paths=[str(allowed)])
    with BackgroundServer(server.build_app()) as url, httpx.Client(
            base_url=url, timeout=60) as client:
        refusals = [client.post("/v1/load_lora_adapter", json={"lora_name": f"r{i}",
                                                               "lora_path": path})
                    for i, path in enumerate([outside, str(folder / "nowhere"),
                                              str(allowed / "link-out"), "/etc"])]
        assert {r.status_code for r in refusals} == {400}
        assert len({r.json()["error"]["message"] for r in refusals}) == 1
        assert "--allowed-lora-paths" in refusals[0].json()["error"]["message"]
        assert client.post("/v1/load_lora_adapter", json={
            "lora_name": "in", "lora_path": inside}).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "in"}).status_code == 200
    with pytest.raises(ValueError, match="is not a directory"):
        OpenAIServer(llm.engine, "tiny", allowed_lora_paths=[str(folder / "nowhere")])
