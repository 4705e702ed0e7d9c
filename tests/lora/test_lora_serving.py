"""Multi-LoRA serving (issue 53): adapters over one base model in one batch, held to transformers +
PEFT. Each family's small random checkpoint gets random PEFT adapters (init_lora_weights=False:
non-zero B); the engine serving them by LoRARequest answers as peft's merged model does (greedy
tokens equal; the prompt's logprobs within f32 tolerance), base-model requests beside them as the
base does. f32 on both sides, different operation order: errors ~1e-6 on logprobs of size ~5;
1e-4 is two orders of margin and far below an adapter's effect (asserted: each adapter changes
the answers)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import until_done

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_models_gemma import build_gemma  # noqa: E402
from test_models_hf import build_hf, hf_greedy  # noqa: E402
from test_models_moe import build_moe  # noqa: E402

from pagedjax import EngineConfig, LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
BUILDERS = {"llama3.1": build_hf, "qwen3": build_hf, "gemma3": build_gemma,
            "qwen3_moe": build_moe}
F32_TOL = dict(atol=1e-4, rtol=1e-4)


def make_adapter(arch: str, directory, seed: int, **lora):
    """A random PEFT adapter over arch's seed-0 checkpoint, saved; returns peft's merged
    model (the reference)."""
    base = BUILDERS[arch](arch, directory / f"base{seed}", seed=0)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora))
    wrapped.save_pretrained(directory / f"adapter{seed}")
    return wrapped.merge_and_unload()


def hf_prompt_logprobs(model, ids) -> np.ndarray:
    """log p(ids[t + 1] | ids[:t + 1]) for each t, from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def run(engine, requests) -> dict:
    """{request id: RequestOutput} of (prompt, params, lora) requests run together."""
    ids = [engine.add_request(p, params, lora_request=lora) for p, params, lora in requests]
    done = {}
    for _ in until_done(engine):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def engine_for(directory, **config) -> LLMEngine:
    base = dict(block_size=16, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                min_seq_bucket=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    return LLMEngine(load_hf_model(str(directory)), EngineConfig(**{**base, **config}))


FAMILIES = {  # arch -> the two adapters' LoraConfigs
    "llama3.1": (dict(r=4, lora_alpha=8, target_modules=ALL),
                 dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj",
                                                                           "down_proj"])),
    "qwen3": (dict(r=8, lora_alpha=16, target_modules="all-linear"),
              dict(r=2, lora_alpha=2, target_modules=["o_proj", "up_proj"])),
    "gemma3": (dict(r=4, lora_alpha=8, target_modules=ALL),
               dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "gate_proj"])),
    "qwen3_moe": (dict(r=4, lora_alpha=8, target_modules=ATTENTION),
                  dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"])),
}


@pytest.mark.parametrize("arch", [
    "llama3.1", *(pytest.param(arch, marks=pytest.mark.slow)  # 6-10 s each
                  for arch in ("gemma3", "qwen3", "qwen3_moe"))])
def test_adapters_equal_peft_merged_models(arch, tmp_path):
    """Base and two adapters mixed in one batch (chunked prefill: 32 tokens a step): each
    request's greedy tokens are its model's (transformers: the base, or peft's merge), and
    the prompt logprobs agree within f32 tolerance."""
    merged = [make_adapter(arch, tmp_path, seed, **lora)
              for seed, lora in enumerate(FAMILIES[arch], start=1)]
    base = BUILDERS[arch](arch, tmp_path / "base", seed=0)
    loras = [None] + [LoRARequest(f"adapter{i}", i, str(tmp_path / f"adapter{i}"))
                      for i in (1, 2)]
    references = [base, *merged]
    rng = np.random.default_rng(2)
    token_prompts = [rng.integers(3, 128, n).tolist() for n in (5, 40, 3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0)
    engine = engine_for(tmp_path / "base")
    requests = [(p, params, lora) for lora in loras for p in token_prompts]
    outputs = run(engine, requests)
    expected = [hf_greedy(ref, token_prompts, 6) for ref in references]
    assert expected[1] != expected[0] and expected[2] != expected[0]  # adapters matter
    for k, out in enumerate(outputs):
        which, p = divmod(k, len(token_prompts))
        assert out.outputs[0].token_ids == expected[which][p], (which, p)
        ours = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:],
                                                     token_prompts[p][1:])]
        np.testing.assert_allclose(ours, hf_prompt_logprobs(references[which],
                                                            token_prompts[p]), **F32_TOL)


@pytest.fixture(scope="module")
def four_adapters(tmp_path_factory):
    """A Llama checkpoint and four adapters of different ranks, targets and scalings."""
    directory = tmp_path_factory.mktemp("lora")
    configs = [dict(r=8, lora_alpha=16, target_modules=ALL),
               dict(r=4, lora_alpha=4, use_rslora=True, target_modules=ATTENTION),
               dict(r=1, lora_alpha=2, target_modules=["down_proj", "k_proj"]),
               dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj", "q_proj"])]
    for seed, lora in enumerate(configs, start=1):
        make_adapter("llama3.1", directory, seed, **lora)
    build_hf("llama3.1", directory / "base", seed=0)
    return directory, [None] + [LoRARequest(f"adapter{i}", i, str(directory / f"adapter{i}"))
                                for i in range(1, 5)]


def mixed_requests(loras):
    """Two prompts under each model: greedy, and n = 2 seeded samples."""
    rng = np.random.default_rng(3)
    token_prompts = [rng.integers(3, 128, n).tolist() for n in (37, 6)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, n=2, seed=4)
    return [(p, params, lora) for lora in loras
            for p, params in zip(token_prompts, (greedy, sampled))]


def answers(outputs) -> list:
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("speculative", [
    False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "ngram"])  # 6 s
@pytest.mark.slow  # make test-slow
def test_mixed_batch_gives_each_request_what_it_gets_alone(four_adapters, speculative):
    """Base + four adapters through two slots (LRU, the host cache holding three: one is read
    from disk again), chunked prefill, preemption (a small pool), n > 1, speculative decoding:
    each request's tokens are those it gets run alone on an engine with room for it."""
    directory, loras = four_adapters
    spec = dict(speculative_config=dict(
        method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
        prompt_lookup_max=2)) if speculative else {}
    requests = mixed_requests(loras)
    busy = engine_for(directory / "base", max_loras=2, max_cpu_loras=3, num_blocks=12,
                      block_size=8, max_num_batched_tokens=16, **spec)
    together = run(busy, requests)
    alone_engine = engine_for(directory / "base", max_loras=1, **spec)
    alone = [run(alone_engine, [request])[0] for request in requests]
    assert answers(together) == answers(alone)
    assert busy.scheduler.state.num_preemptions > 0
    slots = busy.scheduler.state.lora_slots
    assert slots.num_evictions > 0 and busy.lora_manager.num_slot_loads == slots.num_loads
    assert busy.lora_manager.num_reads > 4  # one adapter was read again
    assert len(set(map(str, answers(alone)[::2]))) == len(loras)  # the five models differ


def test_prefix_cache_never_serves_one_adapters_kv_to_another(four_adapters):
    """The same prompt under adapter 1, adapter 2 and the base model shares no block (the
    adapter is in the block hashes' root), and each is answered right; under adapter 1 again
    it hits its own blocks."""
    directory, loras = four_adapters
    engine = engine_for(directory / "base")
    fresh = engine_for(directory / "base", enable_prefix_caching=False)
    prompt = np.random.default_rng(5).integers(3, 128, 40).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for lora, cached in ((loras[1], 0), (loras[2], 0), (None, 0), (loras[1], 32)):
        out = run(engine, [(prompt, params, lora)])[0]
        assert out.num_cached_tokens == cached and out.lora_request == lora
        assert out.outputs[0].token_ids == run(fresh, [(prompt, params, lora)])[0].outputs[
            0].token_ids


def test_bad_adapters_are_refused_by_name_and_change_nothing(four_adapters, tmp_path):
    directory, loras = four_adapters
    engine = engine_for(directory / "base", max_lora_rank=1)
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=2)
    for lora, refusal in [
            (loras[1], "rank 8 is over max_lora_rank \\(1\\)"),
            (LoRARequest("missing", 9, str(tmp_path / "nowhere")),
             "adapter_config.json could not be read"),
            ("adapter1", "lora_request must be a pagedjax.LoRARequest")]:
        with pytest.raises(ValueError, match=refusal):
            engine.add_request(prompt, params, lora_request=lora)
    assert not engine.has_unfinished() and not engine.lora_manager.adapters
    engine.add_request(prompt, params, lora_request=loras[3])  # rank 1 fits
    for lora, refusal in [(LoRARequest("other-name", 3, loras[3].lora_path),
                           "lora_int_id 3 is adapter 'adapter3'"),
                          (LoRARequest("adapter3", 7, loras[3].lora_path),
                           "'adapter3' has lora_int_id 3, not 7")]:
        with pytest.raises(ValueError, match=refusal):
            engine.add_request(prompt, params, lora_request=lora)
    with pytest.raises(ValueError, match="serves no LoRA adapters; build it with enable_lora"):
        engine_for(directory / "base", enable_lora=False).add_request(
            prompt, params, lora_request=loras[3])
    for field, value, refusal in [("max_lora_rank", 12, "max_lora_rank must be one of"),
                                  ("max_loras", 0, "max_loras must be an integer >= 1"),
                                  ("max_cpu_loras", 1, "max_cpu_loras \\(1\\) must be >= "
                                                       "max_loras \\(2\\)")]:
        with pytest.raises(ValueError, match=refusal):
            EngineConfig(enable_lora=True, **{"max_loras": 2, field: value})
    config = EngineConfig()  # vLLM's defaults
    assert (config.enable_lora, config.max_loras, config.max_lora_rank,
            config.max_cpu_loras, config.num_cpu_loras) == (False, 1, 16, None, 1)
    from pagedjax.frontend.llm import per_prompt_loras
    assert per_prompt_loras(loras[1], 2) == [loras[1]] * 2
    for value, refusal in [("adapter1", "lora_request must be a LoRARequest or a list"),
                           ([loras[1]], "lora_request has 1 entries for 2 prompts")]:
        with pytest.raises(ValueError, match=refusal):
            per_prompt_loras(value, 2)
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "x")
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "x")


def test_moe_adapter_on_the_experts_is_refused_by_name(tmp_path):
    make_adapter("qwen3_moe", tmp_path, 1, r=2, lora_alpha=2, target_modules=["q_proj"])
    (tmp_path / "adapter1" / "adapter_config.json").write_text(
        (tmp_path / "adapter1" / "adapter_config.json").read_text().replace(
            '"q_proj"', '"q_proj", "down_proj"'))
    engine = engine_for(tmp_path / "base1")
    with pytest.raises(ValueError, match=r"\['down_proj'\] adapt a mixture-of-experts MLP"):
        engine.add_request([1, 2], SamplingParams(max_tokens=1), lora_request=LoRARequest(
            "experts", 1, str(tmp_path / "adapter1")))


def test_loading_and_swapping_adapters_under_load_compiles_nothing(four_adapters):
    """After warmup, requests under four adapters through one slot (each swap a load and an
    eviction) and the base model compile nothing at all (XLA's backend compiles counted)."""
    from test_engine_compilation import BackendCompiles
    directory, loras = four_adapters
    engine = engine_for(directory / "base", max_loras=1, max_cpu_loras=4)
    engine.warmup(variants=False)
    compiles = BackendCompiles()
    compiles.on = True
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0)
        run(engine, [([3 + i, 4, 5, 6], params, loras[i % 5]) for i in range(10)])
    finally:
        compiles.on = False
    assert engine.scheduler.state.lora_slots.num_evictions >= 3
    assert compiles.count == 0


def test_update_lora_serves_new_adapter_weights_in_place(four_adapters):
    """update_lora: adapter 1 given adapter 4's tensors (PEFT names, lora_B halved against
    adapter 1's scaling 2 = adapter 4's 1) answers as adapter 4; given its own directory back,
    as before. Each update bumps its version: the prompt it ran finds no cached block. A bad
    tensor is refused by name and changes nothing."""
    from safetensors.numpy import load_file
    directory, loras = four_adapters
    engine = engine_for(directory / "base")
    prompt = np.random.default_rng(6).integers(3, 128, 40).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def answer(lora):
        out = run(engine, [(prompt, params, lora)])[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    before, _ = answer(loras[1])
    as_four, _ = answer(loras[4])
    assert before != as_four
    tensors = load_file(str(directory / "adapter4" / "adapter_model.safetensors"))
    halved = {name: t * 0.5 if "lora_B" in name else t for name, t in tensors.items()}
    engine.update_lora("adapter1", halved)
    assert answer(loras[1]) == (as_four, 0)
    assert answer(loras[1]) == (as_four, 32)  # cached under the new version
    engine.update_lora("adapter1", str(directory / "adapter1"))
    assert answer(loras[1]) == (before, 0)
    wrong = dict(halved)
    name = next(n for n in wrong if "q_proj.lora_A" in n)
    wrong[name] = wrong[name][:, :5]
    with pytest.raises(ValueError, match="q_proj.lora_A.weight is \\[8, 5\\], the model takes"):
        engine.update_lora("adapter1", wrong)
    with pytest.raises(ValueError, match="no LoRA adapter named 'adapter9'"):
        engine.update_lora("adapter9", halved)
    assert answer(loras[1]) == (before, 32)
    assert engine.list_loras() == {1, 4} and engine.remove_lora(1) and not engine.remove_lora(1)
    assert engine.list_loras() == {4}


@pytest.mark.slow  # three engines, ~15 s
def test_beam_search_under_an_adapter_is_the_merged_models(four_adapters):
    """beam_search(lora_request=...) equals beam search on the model with the adapter merged
    into its kernels (merged_weights): the same beams, cumulative logprobs within f32
    tolerance; other prompts of the call on the base model stay the base's."""
    from pagedjax import LLM
    from pagedjax.engine.beam_search import BeamSearchParams
    from pagedjax.lora.peft_adapter import merged_weights, read_peft_adapter
    directory, loras = four_adapters
    engine_args = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                       block_size=16, max_logprobs=8)
    prompts = [[5, 9, 33, 70, 12], [7, 7, 81]]
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    served = LLM(load_hf_model(str(directory / "base")), enable_lora=True, max_lora_rank=8,
                 **engine_args).beam_search(prompts, params, lora_request=[loras[1], None])
    merged = load_hf_model(str(directory / "base"))
    merged_weights(merged, read_peft_adapter(loras[1].lora_path, merged.config))
    base = LLM(load_hf_model(str(directory / "base")), **engine_args).beam_search(
        prompts[1:], params)
    expected = LLM(merged, **engine_args).beam_search(prompts[:1], params) + base
    for got, want in zip(served, expected):
        assert [b.token_ids for b in got] == [b.token_ids for b in want]
        np.testing.assert_allclose([b.cumulative_logprob for b in got],
                                   [b.cumulative_logprob for b in want], **F32_TOL)


def test_data_parallel_replicas_serve_one_set_of_adapters(four_adapters):
    """Two replicas over one CPU device share the adapters (ids, host cache, versions), each
    with its own slots: a mixed batch answers as one engine does; a prompt's head under one
    adapter draws its requests to one replica (its KV is there), the same head under another
    adapter does not count as cached; update_lora reaches every replica."""
    import jax

    from pagedjax.frontend.data_parallel import DataParallelEngine
    directory, loras = four_adapters
    config = EngineConfig(block_size=16, max_model_len=128, max_num_seqs=8,
                          max_num_batched_tokens=32, min_seq_bucket=4, enable_lora=True,
                          max_loras=2, max_lora_rank=8, data_parallel_size=2)
    device = jax.devices()[0]
    engine = DataParallelEngine(load_hf_model(str(directory / "base")), config,
                                devices=[device, device])
    assert engine.replicas[1].lora_manager is engine.lora_manager
    assert engine.stats.loras == {}  # nothing ran yet
    requests = mixed_requests(loras[:3])
    assert answers(run(engine, requests)) == answers(run(engine_for(directory / "base"),
                                                         requests))
    head = np.random.default_rng(9).integers(3, 128, 32).tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = engine.add_request(head + [5], params, lora_request=loras[1])
    placed = {r for r, rep in enumerate(engine.replicas) if first in rep.request_groups}
    second = engine.add_request(head + [6], params, lora_request=loras[1])
    assert {r for r, rep in enumerate(engine.replicas) if second in rep.request_groups} == placed
    other = engine.add_request(head + [7], params, lora_request=loras[2])  # no affinity:
    assert {r for r, rep in enumerate(engine.replicas) if other in rep.request_groups} \
        != placed  # the less loaded replica
    for _ in until_done(engine):
        engine.step()
    totals = engine.stats.loras  # both replicas' counts summed
    assert totals["max_lora"] == 4 and totals["slot_loads"] == sum(
        r.stats.loras["slot_loads"] for r in engine.replicas) >= 3
    engine.update_lora("adapter1", loras[4].lora_path)
    prompt = [(head, SamplingParams(max_tokens=4, temperature=0.0), loras[1])]
    four = [(head, SamplingParams(max_tokens=4, temperature=0.0), loras[4])]
    assert answers(run(engine, prompt * 2)) == answers(run(engine_for(directory / "base"),
                                                           four * 2))
