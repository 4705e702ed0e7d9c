"""Tensor and data parallelism on 8 CPU devices: the same tokens as one device, the tensors
really split, each replica on its own devices with its own pool (in the stats and /metrics).

The devices exist only if XLA_FLAGS says so before JAX starts, so the engines run in one child
process (this module's `child`), which reports what the tests check as JSON.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import child_report

# The slow suite (make test-slow, run by .ci/run beside make test): eight host devices in
# child processes.
pytestmark = pytest.mark.slow

DEVICES = 8
# (name, EngineConfig fields): chunked prefill (32-token steps), preemption (a 26-block pool)
# and prefix hits (prompts sharing a 16-token head) in every run.
# min_token_bucket, min_seq_bucket: one shape of each step kind (each compiles for seconds over
# the devices)
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
            num_blocks=26,
            min_token_bucket=32, min_seq_bucket=4)
RUNS = {
    "tp1": dict(tensor_parallel_size=1),
    "tp2": dict(tensor_parallel_size=2),
    "tp4": dict(tensor_parallel_size=4),  # more devices than debug-tiny's 2 KV heads
    "tp2-gpu-kernels": dict(tensor_parallel_size=2, attention_backend="gpu",
                            attention_interpret=True),
    # speculative decoding over the mesh: one draft-verifying plan drives every shard
    "tp2-ngram": dict(tensor_parallel_size=2, speculative_config=dict(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)),
    # async scheduling over the mesh: the sampled ids filled into the next step's tokens there
    "tp2-async": dict(tensor_parallel_size=2, async_scheduling=True),
}
DP_RUNS = {
    "dp2": dict(data_parallel_size=2),
    "tp2-dp2": dict(tensor_parallel_size=2, data_parallel_size=2),
    # each replica's next step dispatched before its results: both replicas' devices busy
    "dp2-async": dict(data_parallel_size=2, async_scheduling=True),
}


def child() -> None:
    import jax
    import numpy as np

    from pagedjax import LLM, SamplingParams
    from pagedjax.models import get_config, init_model
    from pagedjax.parallel.sharding import kv_bytes_per_block_per_device, weight_bytes_per_device

    model = init_model(get_config("debug-tiny"), seed=0)
    rng = np.random.default_rng(0)
    head = rng.integers(0, 256, 16).tolist()
    prompts = [head + rng.integers(0, 256, n).tolist() for n in (5, 23, 40, 60, 9, 30)]
    params = SamplingParams(max_tokens=10, temperature=0)
    report = {"devices": len(jax.devices())}
    from pagedjax.models import paged_forward

    asked, scan_by_default = [], paged_forward.scan_by_default  # the shards a runner counts
    paged_forward.scan_by_default = lambda m, platform, shards=1: (
        asked.append(shards) or scan_by_default(m, platform, shards))
    for name, fields in RUNS.items():
        llm = LLM(model, **BASE, **fields)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runner, stats = llm.engine.runner, llm.engine.stats
        layers = runner.params.layers

        def shard_shapes(variable):
            array = variable.get_value() if hasattr(variable, "get_value") else variable
            return [list(s.data.shape) for s in array.addressable_shards]

        def device0_bytes(tree):
            return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
                       for s in leaf.addressable_shards if s.device == jax.devices()[0])

        tp = fields["tensor_parallel_size"]

        report[name] = {
            "tokens": [o.output_token_ids for o in outputs],
            "preemptions": stats.num_preemptions, "prefix_hits": stats.num_prefix_hit_tokens,
            "prefill_steps": stats.num_prefill_steps, "spec_drafts": stats.num_spec_drafts,
            "q_proj": shard_shapes(layers["self_attn"]["q_proj"]["kernel"]),
            "k_proj": shard_shapes(layers["self_attn"]["k_proj"]["kernel"]),
            "o_proj": shard_shapes(layers["self_attn"]["o_proj"]["kernel"]),
            "down_proj": shard_shapes(layers["mlp"]["down_proj"]["kernel"]),
            "lm_head": shard_shapes(runner.params.lm_head["kernel"]),
            "kv_cache": shard_shapes(runner.kv_cache),
            "scan_shards": asked[-1],  # scan_layers' default asked of a device's share
            # what one device holds, against `pagedjax capacity`'s formulas
            "weights_bytes": device0_bytes(runner.params),
            "capacity_weights_bytes": weight_bytes_per_device(model.config, tp, 4),
            "kv_bytes": device0_bytes(runner.kv_cache),
            "capacity_kv_bytes": BASE["num_blocks"] * kv_bytes_per_block_per_device(
                model.config, BASE["block_size"], tp, np.float32),
        }
    for name, fields in DP_RUNS.items():
        llm = LLM(model, **BASE, **fields)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        replicas = llm.engine.replicas
        report[name] = {
            "tokens": [o.output_token_ids for o in outputs],
            "replica_stats": [dataclasses.asdict(s) for s in llm.engine.replica_stats],
            "stats": dataclasses.asdict(llm.engine.stats),
            "devices": [sorted(d.id for leaf in jax.tree.leaves((r.runner.params,
                                                                   r.runner.kv_cache))
                               for d in leaf.devices()) for r in replicas],
            "kv_cache": [[list(s.data.shape) for s in r.runner.kv_cache.addressable_shards]
                         for r in replicas],
        }
    report["quantized"] = quantized_runs(prompts, params)
    report["tiers"] = tiered_runs(model, params)
    report["metrics"] = served_metrics(model, prompts)
    report["placed"] = placed_loading(model)
    report["kernels"] = kernels_under_shard_map()
    errors = {}
    for tp in (3, 16):
        try:
            LLM(model, **BASE, tensor_parallel_size=tp)
        except ValueError as e:
            errors[tp] = str(e)
    try:
        LLM(model, **BASE, tensor_parallel_size=4, data_parallel_size=4)
    except ValueError as e:
        errors["4x4"] = str(e)
    report["errors"] = errors
    print(json.dumps(report))


def tiered_runs(model, params) -> dict:
    """The tiered prefix cache over the mesh: documents asked again after a pool too small for
    them evicted their prefixes, which come back from the host tier and the disk tier (a
    block's every shard moved with it); tensor parallel 2 over a fresh directory and over the
    directory one device wrote (the same blocks, laid out whole on the host)."""
    import tempfile

    import numpy as np

    from pagedjax import LLM

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 256, 38).tolist() for _ in range(4)]
    prompts = [doc + [r, 7] for r in range(2) for doc in docs]
    runs = {}
    one_dir = tempfile.mkdtemp()
    for name, tp, directory in (("off-tp1", 1, None), ("tp1", 1, one_dir),
                                ("tp2", 2, tempfile.mkdtemp()), ("tp2-reads-tp1", 2, one_dir)):
        tiers = {} if directory is None else dict(
            kv_offload_bytes=6 * 2048, kv_disk_dir=directory, kv_disk_bytes=1 << 22)
        llm = LLM(model, **{**BASE, "num_blocks": 24}, **tiers, tensor_parallel_size=tp)
        outputs = [o for half in (prompts[:4], prompts[4:])  # a round, then the next
                   for o in llm.generate(half, params, use_tqdm=False)]
        llm.engine.close()
        runs[name] = {"tokens": [o.output_token_ids for o in outputs],
                      "tiers": llm.engine.stats.kv_tiers,
                      "host_hit_tokens": llm.engine.stats.num_prefix_host_hit_tokens}
    return runs


QUANT_RUNS = {"int8-tp1": ("int8", 1), "int8-tp2": ("int8", 2), "int8-tp4": ("int8", 4),
              "int4-tp1": ("int4", 1), "int4-tp2": ("int4", 2)}


def quantized_runs(prompts, params) -> dict:
    """Quantized weights (LM head too) over the mesh: tokens, the shards device 0 holds, its
    bytes against `pagedjax capacity`'s formula. debug-tiny with a 256-wide MLP: int4's down
    projection has 2 groups of 128 rows (split with the rows under TP 2; TP 4 refused)."""
    import jax

    from pagedjax import LLM
    from pagedjax.models import get_config, init_model
    from pagedjax.parallel.sharding import weight_bytes_per_device

    config = dataclasses.replace(get_config("debug-tiny"), intermediate_size=256)
    model = init_model(config, seed=0)
    out = {}
    for name, (scheme, tp) in QUANT_RUNS.items():
        llm = LLM(model, **BASE, tensor_parallel_size=tp, quantization=scheme,
                  quantize_lm_head=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        params_ = llm.engine.runner.params
        down = params_.layers["mlp"]["down_proj"]
        out[name] = {
            "tokens": [o.output_token_ids for o in outputs],
            "down_kernel": [list(s.data.shape) for s in down["kernel"].get_value()
                            .addressable_shards],
            "down_scale": [list(s.data.shape) for s in down["scale"].get_value()
                           .addressable_shards],
            "weights_bytes": sum(s.data.nbytes for leaf in jax.tree.leaves(params_)
                                 for s in leaf.addressable_shards
                                 if s.device == jax.devices()[0]),
            "capacity_weights_bytes": weight_bytes_per_device(config, tp, 4, scheme, True)}
    llm = LLM(model, **BASE, tensor_parallel_size=2, data_parallel_size=2,
              quantization="int8", quantize_lm_head=True)  # each replica its own copy
    out["int8-tp2-dp2"] = [o.output_token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
    try:
        LLM(model, **BASE, tensor_parallel_size=4, quantization="int4")
    except ValueError as e:
        out["int4-tp4-error"] = str(e)
    return out


PLACED_RUNS = {"tp1": {}, "tp2": dict(tensor_parallel_size=2),
               "tp4": dict(tensor_parallel_size=4),  # k/v (and their biases) repeated
               "tp2-dp2": dict(tensor_parallel_size=2, data_parallel_size=2),
               "tp2-unrolled": dict(tensor_parallel_size=2, scan_layers=False)}


def placed_loading(model) -> dict:
    """Checkpoints read straight into the engine's shardings (pagedjax.models.loading.placed_weights): an HF
    directory (biases, tied embeddings) and an orbax one, at each parallelism; the tokens the
    model loaded whole gives, and what device 0 holds once loaded (every live array's shard)."""
    import tempfile

    import jax
    import numpy as np
    from test_models_hf import build_hf

    import pagedjax.models.loading.placed_weights as placed
    from pagedjax import LLM, SamplingParams
    from pagedjax.models.loading.checkpoint import load_checkpoint, save_checkpoint
    from pagedjax.models.loading.hf import load_hf_model
    from pagedjax.parallel.sharding import kv_bytes_per_block_per_device, weight_bytes_per_device

    read = placed.file_slice
    elements_read = [0]

    def counting_read(*args):  # what the HF reader takes from the files
        part = read(*args)
        elements_read[0] += part.size
        return part

    placed.file_slice = counting_read

    directory = tempfile.mkdtemp()
    build_hf("llama-bias-tied", f"{directory}/hf")
    save_checkpoint(model, f"{directory}/orbax")
    sources = {"hf": (f"{directory}/hf", load_hf_model),
               "orbax": (f"{directory}/orbax", load_checkpoint)}
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n).tolist() for n in (7, 30, 12)]
    params = SamplingParams(max_tokens=6, temperature=0)
    report = {}
    for source, (path, load_whole) in sources.items():
        whole = LLM(load_whole(path), **BASE).generate(prompts, params, use_tqdm=False)
        report[source] = {"whole": [o.output_token_ids for o in whole]}
        del whole
        for name, fields in PLACED_RUNS.items():
            elements_read[0] = 0
            llm = LLM(path, **BASE, **fields)
            engine = llm.engine
            runners = [r.runner for r in getattr(engine, "replicas", [engine])]
            config = engine.model_config
            tp = fields.get("tensor_parallel_size", 1)
            report[source][name] = {
                "tokens": [o.output_token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)],
                "device0_bytes": sum(s.data.nbytes for leaf in jax.tree.leaves(
                    (runners[0].params, runners[0].kv_cache)) for s in leaf.addressable_shards
                    if s.device == jax.devices()[0]),
                "expected_bytes": weight_bytes_per_device(config, tp, 4) + BASE["num_blocks"]
                * kv_bytes_per_block_per_device(config, BASE["block_size"], tp, np.float32),
                "elements_read": elements_read[0],
                "elements_placed": sum(  # a replicated part counts once (read once)
                    sum({str(s.index): s.data.size for s in leaf.addressable_shards}.values())
                    for r in runners for leaf in jax.tree.leaves(r.params))}
            del llm
    return report


def kernels_under_shard_map() -> dict:
    """The Pallas GPU kernels (interpreted) per device under shard_map, 2 and 4 ways over the
    heads (4 query / 2 KV heads: KV heads repeated past 2), against the reference on one device:
    a ragged prefill and a decode over shuffled, NaN-padded pages; max abs error of each."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from test_kernels_reference import build_case

    from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, paged_attention
    from pagedjax.parallel.sharding import make_mesh

    errors = {}
    for name, seqs, decode in (("ragged", [(9, 3), (37, 37), (17, 16), (50, 1)], False),
                               ("decode", [(1, 1), (37, 1), (50, 1), (9, 1)], True)):
        rng = np.random.default_rng(3)
        case = build_case(rng, seqs, block_size=8, num_heads=4, num_kv_heads=2, head_dim=32,
                          backend="gpu")
        tokens = case["q"].shape[0]
        zeros = jnp.zeros((tokens, 2, 32), jnp.float32)  # this step's K/V: to the null block
        metadata = AttentionMetadata(jnp.zeros(tokens, jnp.int32), jnp.asarray(case["tables"]),
                                     jnp.asarray(case["kv_lens"]),
                                     jnp.asarray(case["cu_q_lens"]),
                                     jnp.asarray(case["num_seqs"]), decode)
        want, _ = paged_attention(jnp.asarray(case["q"]), zeros, zeros,
                                  jnp.asarray(case["cache"]), metadata, scale=32 ** -0.5)
        for tp in (2, 4):
            repeats = max(1, tp // 2)
            k = jnp.repeat(zeros, repeats, axis=1)
            cache = jnp.repeat(jnp.asarray(case["cache"]), repeats, axis=1)
            backend = dataclasses.replace(AttentionBackend("gpu", interpret=True),
                                          mesh=make_mesh(tp))
            got, _ = paged_attention(jnp.asarray(case["q"]), k, k, cache, metadata,
                                     scale=32 ** -0.5, backend=backend)
            errors[f"{name}-tp{tp}"] = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    return errors


def served_metrics(model, prompts) -> dict:
    """A DP 2 server's /metrics after the prompts, as {series: value} for the replica series."""
    import httpx

    from pagedjax.engine.config import EngineConfig
    from pagedjax.frontend.data_parallel import make_engine
    from pagedjax.serving.app import build_app
    from pagedjax.serving.background import BackgroundServer

    engine = make_engine(model, EngineConfig(**BASE, data_parallel_size=2))
    with BackgroundServer(build_app(engine, "tiny")) as url, \
            httpx.Client(base_url=url, timeout=300) as client:
        for prompt in prompts:
            response = client.post("/v1/completions", json=dict(
                model="tiny", prompt=prompt, max_tokens=4, temperature=0))
            assert response.status_code == 200, response.text
        text = client.get("/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("pagedjax:replica_")}


@pytest.fixture(scope="module")
def report():
    return child_report("test_tensor_parallel", DEVICES)


@pytest.mark.parametrize("name", [n for n in RUNS if n != "tp1"])
def test_tensor_parallel_greedy_tokens_equal_one_device(report, name):
    """f32 everywhere; the row-parallel matmuls sum their partial products in another order
    than one device does (an all-reduce), so logits may differ in the last bits, yet the seeded
    model's peaked logits leave no greedy tie for that to flip: the tokens must be equal."""
    assert report["devices"] == DEVICES
    one = report["tp1"]
    assert one["preemptions"] > 0 and one["prefix_hits"] > 0 and one["prefill_steps"] > 6
    assert report[name]["tokens"] == one["tokens"]
    assert (report[name]["spec_drafts"] > 0) == ("ngram" in name)


def test_weights_and_cache_are_split_not_replicated(report):
    one = report["tp1"]
    for name, tp in (("tp2", 2), ("tp4", 4)):
        run = report[name]
        assert len(run["q_proj"]) == tp  # one shard a device, each 1/tp of the columns
        assert all(s[-1] * tp == one["q_proj"][0][-1] for s in run["q_proj"])
        assert all(s[-2] * tp == one["o_proj"][0][-2] for s in run["o_proj"])  # rows
        assert all(s[-2] * tp == one["down_proj"][0][-2] for s in run["down_proj"])
        assert all(s[-1] * tp == one["lm_head"][0][-1] for s in run["lm_head"])  # vocab
        # The cache over KV heads: debug-tiny has 2, so each of 2 devices holds 1; with 4
        # devices each head is repeated twice and each device still holds 1 (vLLM's rule).
        assert all(s[1] == 1 for s in run["kv_cache"]) and len(run["kv_cache"]) == tp
        assert all(s[-1] * tp == max(2, tp) // 2 * one["k_proj"][0][-1] for s in run["k_proj"])
        assert run["scan_shards"] == tp


def test_capacity_formulas_match_what_each_device_holds(report):
    for name in ("tp1", "tp2", "tp4"):
        run = report[name]
        assert run["weights_bytes"] == run["capacity_weights_bytes"], name
        assert run["kv_bytes"] == run["capacity_kv_bytes"], name
    assert report["tp2"]["kv_bytes"] * 2 == report["tp1"]["kv_bytes"]
    assert report["tp4"]["kv_bytes"] == report["tp2"]["kv_bytes"]  # heads repeated past K


@pytest.mark.parametrize("name", [n for n in QUANT_RUNS if not n.endswith("tp1")])
def test_quantized_weights_over_the_mesh_equal_one_device(report, name):
    """int8 (per channel: a row-parallel kernel's scales replicated) and int4 (per group: the
    down projection's two groups split with its rows) give one device's tokens; each device
    holds 1/TP of the quantized kernels, what the capacity formula counts."""
    runs = report["quantized"]
    scheme, tp = QUANT_RUNS[name]
    one, run = runs[f"{scheme}-tp1"], runs[name]
    assert run["tokens"] == one["tokens"]
    assert all(s[-2] * tp == one["down_kernel"][0][-2] for s in run["down_kernel"])
    groups = one["down_scale"][0][-2]
    assert groups == (2 if scheme == "int4" else 1)
    assert all(s[-2] == (groups // tp if groups > 1 else 1) for s in run["down_scale"])
    for each in (one, run):
        assert each["weights_bytes"] == each["capacity_weights_bytes"]
    assert "must divide the 2 quantization groups of mlp/down_proj" in runs["int4-tp4-error"]
    assert runs["int8-tp2-dp2"] == runs["int8-tp1"]["tokens"]


def test_bad_tensor_parallel_sizes_name_the_limit(report):
    assert "num_heads" in report["errors"]["3"]
    assert "exceeds the 8 devices" in report["errors"]["16"]
    assert "data_parallel_size (4) = 16 exceeds the 8 devices" in report["errors"]["4x4"]


def test_tiered_prefix_cache_over_the_mesh_equals_one_device(report):
    runs = report["tiers"]
    for name in ("tp1", "tp2", "tp2-reads-tp1"):
        assert runs[name]["tokens"] == runs["off-tp1"]["tokens"], name
        assert runs[name]["host_hit_tokens"] > 0, name
        assert runs[name]["tiers"]["host"]["hits"] > 0, name
        assert runs[name]["tiers"]["disk"]["hits"] > 0 and runs[name]["tiers"]["disk"][
            "corrupt"] == 0, name
    # over the directory tensor parallel 1 wrote, the first round's prefixes are disk hits
    assert runs["tp2-reads-tp1"]["tiers"]["disk"]["hits"] > runs["tp2"]["tiers"]["disk"]["hits"]


@pytest.mark.parametrize("name", list(DP_RUNS))
def test_data_parallel_greedy_tokens_equal_one_device(report, name):
    """Each request runs whole on one replica, so its tokens are the single device's (as TP's,
    bit for bit); both replicas took requests, each preempted and hit its prefix cache."""
    run = report[name]
    assert run["tokens"] == report["tp1"]["tokens"]
    replicas = run["replica_stats"]
    assert len(replicas) == 2
    for stats in replicas:
        assert stats["num_finished"] > 0 and stats["num_prefix_hit_tokens"] > 0
        assert stats["num_preemptions"] > 0
        assert stats["num_blocks"] == BASE["num_blocks"] - 1  # a whole pool each
        assert (stats["num_ahead_steps"] > 0) == ("async" in name)
    assert run["stats"]["num_finished"] == len(run["tokens"])
    assert run["stats"]["num_blocks"] == 2 * (BASE["num_blocks"] - 1)


def test_data_parallel_replicas_on_disjoint_devices(report):
    assert [sorted(set(d)) for d in report["dp2"]["devices"]] == [[0], [1]]
    assert [sorted(set(d)) for d in report["tp2-dp2"]["devices"]] == [[0, 1], [2, 3]]
    for shards in report["tp2-dp2"]["kv_cache"]:  # each replica's pool over its 2 devices
        assert len(shards) == 2 and all(s[1] == 1 for s in shards)


def test_data_parallel_pools_show_per_replica_in_metrics(report):
    metrics = report["metrics"]
    for replica in ("0", "1"):
        key = (f'pagedjax:replica_kv_cache_usable_blocks{{model_name="tiny",'
               f'replica="{replica}"}}')
        assert metrics[key] == BASE["num_blocks"] - 1, metrics


@pytest.mark.parametrize("source", ["hf", "orbax"])
@pytest.mark.parametrize("name", list(PLACED_RUNS))
def test_checkpoints_load_straight_into_their_shardings(report, source, name):
    """The tokens of the model loaded whole (f32: the same arithmetic, as TP's); device 0 holds
    its share (`pagedjax capacity`'s formula); and the HF reader took from the files exactly
    the elements of the distinct shards the devices hold (a replicated one is read once): no
    tensor read whole and then split (orbax reads its shards itself)."""
    run = report["placed"][source][name]
    assert run["tokens"] == report["placed"][source]["whole"]
    assert run["device0_bytes"] == run["expected_bytes"]
    if source == "hf":
        assert run["elements_read"] == run["elements_placed"]


def test_pallas_kernels_under_shard_map_equal_the_reference(report):
    """f32 (tests/kernels/test_kernels_gpu.py's tolerance: accumulation order only); a NaN page that
    leaked into any device's heads would show as NaN."""
    assert set(report["kernels"]) == {"ragged-tp2", "ragged-tp4", "decode-tp2", "decode-tp4"}
    for name, error in report["kernels"].items():
        assert error < 2e-5, (name, error)
