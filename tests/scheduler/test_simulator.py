"""The scheduler simulator: traces, the step-time model, and the simulated schedule against the
real engine's (same steps, prefill steps, preemptions and prefix hits when requests arrive at
once)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedjax import LLM
from pagedjax.scheduler import DECODE, PREFILL, SchedulerConfig, ShapeBuckets
from pagedjax.scheduler.cost_model import StepCostModel
from pagedjax.scheduler.simulator import simulate
from pagedjax.scheduler.trace import TraceRequest, load_trace, save_trace
from pagedjax.tools.profiling import run_trace


def test_trace_requests_validate_and_round_trip(tmp_path):
    for bad, field in [(dict(arrival_s=-1, prompt_len=4, output_len=2), "arrival_s"),
                       (dict(arrival_s=0, prompt_len=0, output_len=2), "prompt_len"),
                       (dict(arrival_s=0, prompt_len=4, output_len=2.5), "output_len"),
                       (dict(arrival_s=0, prompt_len=4, output_len=2, n=0), "n"),
                       (dict(arrival_s=0, prompt_len=4, output_len=2, prefix_len=5,
                             prefix_group=1), "prefix_len"),
                       (dict(arrival_s=0, prompt_len=4, output_len=2, prefix_len=2),
                        "prefix_group")]:
        with pytest.raises(ValueError, match=field):
            TraceRequest(**bad)
    trace = [TraceRequest(0.0, 10, 3), TraceRequest(1.5, 40, 8, n=2, prefix_group=3,
                                                    prefix_len=32)]
    path = tmp_path / "trace.jsonl"
    save_trace(path, trace)
    assert load_trace(path) == trace
    path.write_text(json.dumps({"arrival_s": 0, "prompt_len": 3, "output_len": 1}) + "\n"
                    + json.dumps({"arrival_s": 0, "prompt_len": 3}) + "\n")
    with pytest.raises(ValueError, match=r"trace.jsonl:2: .*output_len"):
        load_trace(path)
    a, b = trace[1].prompt_token_ids(1, 100), TraceRequest(
        0, 50, 1, prefix_group=3, prefix_len=32).prompt_token_ids(7, 100)
    assert a[:32] == b[:32] and a[32:] != b[32:40] and len(a) == 40


def test_cost_model_fit_recovers_a_linear_model():
    rng = np.random.default_rng(0)
    true = {PREFILL: (2e-3, 1e-5, 0.0, 2e-7, 0.0), DECODE: (1e-3, 0.0, 3e-5, 1e-7, 0.0)}
    samples = []
    for _ in range(60):
        kind = PREFILL if rng.random() < 0.5 else DECODE
        t = float(2 ** rng.integers(4, 9))  # 16 .. 256
        b = float(2 ** rng.integers(0, 2))  # 1, 2
        kv = float(rng.integers(10, 5000))
        pairs = float(rng.integers(10, 200_000)) if kind == PREFILL else kv
        features = np.array([1.0, t if kind == PREFILL else b, b, kv, pairs])
        samples.append((kind, features, float(np.dot(true[kind], features))))
    model = StepCostModel.fit(samples)
    for kind in true:
        np.testing.assert_allclose(model.coef[kind], true[kind], rtol=1e-6, atol=1e-12)
        assert min(model.coef[kind]) >= 0
    assert max(abs(v) for v in model.shape.values()) < 1e-9  # exactly linear: no residuals
    assert StepCostModel.from_json(model.to_json()) == model
    # A shape that costs more than the line: its residual is learned, other shapes keep the line.
    slow = [np.array([1.0, 64, 4, kv, 30 * kv]) for kv in (100, 900, 2500)]  # a shape not drawn
    bumped = samples + [(PREFILL, f, float(np.dot(true[PREFILL], f)) + 0.05) for f in slow]
    fitted = StepCostModel.fit(bumped)
    assert set(fitted.shape) == {(PREFILL, 64, 4)} or \
        max(abs(v) for k, v in fitted.shape.items() if k != (PREFILL, 64, 4)) < 0.01
    for f in slow:
        assert fitted.predict(PREFILL, f) == pytest.approx(np.dot(true[PREFILL], f) + 0.05,
                                                           abs=0.01)
    with pytest.raises(ValueError, match="coef"):
        StepCostModel({PREFILL: (1, 2)})
    with pytest.raises(ValueError, match="at least 2 decode"):
        StepCostModel.fit([s for s in samples if s[0] == PREFILL])


def _setup(num_blocks=200, **config):
    config = SchedulerConfig(**{**dict(max_num_seqs=8, max_num_batched_tokens=64,
                                       max_model_len=256), **config})
    buckets = ShapeBuckets.create(max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs,
                                  max_model_len=config.max_model_len, block_size=16)
    cost = StepCostModel({PREFILL: (0.01, 1e-4, 0, 0, 0), DECODE: (0.005, 0, 1e-4, 0, 0)})
    return dict(config=config, num_blocks=num_blocks, block_size=16, buckets=buckets,
                cost=cost)


def test_simulation_waits_for_arrivals_and_runs_parallel_samples():
    trace = [TraceRequest(0.0, 20, 5), TraceRequest(100.0, 20, 5, n=3)]
    result = simulate(trace, **_setup())
    assert result.makespan_s > 100 and result.ttft_s[1] < 1.0
    assert result.output_tokens == 5 + 3 * 5
    with pytest.raises(ValueError, match="trace request 0: .*max_model_len"):
        simulate([TraceRequest(0.0, 250, 10)], **_setup())


@pytest.mark.parametrize("num_blocks", [pytest.param(200, marks=pytest.mark.slow),  # 8 s
                                        24], ids=["roomy", "preempting"])
@pytest.mark.slow  # make test-slow
def test_simulated_schedule_is_the_engines(num_blocks):
    llm = LLM(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              num_blocks=num_blocks)
    engine = llm.engine
    rng = np.random.default_rng(1)
    trace = [TraceRequest(0.0, int(rng.integers(5, 90)), int(rng.integers(2, 30)))
             for _ in range(10)]
    trace += [TraceRequest(0.0, 70, 6, prefix_group=0, prefix_len=48) for _ in range(3)]
    real, samples = run_trace(engine, trace)
    assert len(samples) == real.num_steps and not engine.has_unfinished()
    sim = simulate(trace, engine.config.scheduler_config(), num_blocks=num_blocks,
                   block_size=16, buckets=engine.buckets, cost=StepCostModel.fit(samples),
                   vocab_size=engine.model_config.vocab_size)
    assert (sim.num_steps, sim.num_prefill_steps, sim.num_preemptions) == \
        (real.num_steps, real.num_prefill_steps, real.num_preemptions)
    assert sim.output_tokens == real.output_tokens == sum(r.output_len for r in trace)
    assert sim.prefix_hit_rate == real.prefix_hit_rate > 0
    assert sim.peak_used_blocks == real.peak_used_blocks
    if num_blocks == 24:
        assert real.num_preemptions > 0


def test_simulate_cli_sweeps_configs(tmp_path, capsys):
    from pagedjax.tools.cli import main

    trace = tmp_path / "trace.jsonl"
    save_trace(trace, [TraceRequest(0.0, 30 + i, 40) for i in range(12)])
    cost = tmp_path / "cost.json"
    cost.write_text(_setup()["cost"].to_json())
    main(["simulate", "--trace", str(trace), "--cost", str(cost), "--num-blocks", "10,60",
          "--max-num-seqs", "2,8", "--max-model-len", "128", "--max-num-batched-tokens", "64"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:4] == ["num_blocks", "max_num_seqs", "max_num_batched_tokens",
                                    "steps"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [("10", "2"), ("10", "8"), ("60", "2"), ("60", "8")]
    preemptions = {(r[0], r[1]): int(r[5]) for r in rows}
    assert preemptions["10", "8"] > 0 and preemptions["60", "8"] == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--trace", str(trace), "--cost", str(cost), "--num-blocks", "1"])
    assert exit_info.value.code == 1 and "num_blocks" in capsys.readouterr().err


def test_roofline_estimate_matches_the_formula():
    from pagedjax.models import get_config
    from pagedjax.scheduler.chips import CHIPS
    from pagedjax.scheduler.cost_model import RooflineCost

    config = get_config("llama-3-8b")
    kv_per_token = config.kv_bytes_per_token(2)
    assert kv_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB: 2 L K H itemsize
    cost = RooflineCost(CHIPS["h200"], config.num_params, 2 * config.num_params, kv_per_token,
                        4 * config.num_layers * config.num_heads * config.head_dim)
    # Decode, 64 sequences of 2k tokens: memory-bound (weights + 128k tokens of KV).
    features = np.array([1.0, 64, 64, 64 * 2048, 64 * 2048])
    moved = 2 * config.num_params + (64 * 2048 + 64) * kv_per_token
    assert cost.predict(DECODE, features) == pytest.approx(0.002 + moved / (4.8e12 * 0.7))
    # An 8k-token prefill chunk: compute-bound.
    features = np.array([1.0, 8192, 1, 8192, 8192 * 8193 / 2])
    flops = 2 * config.num_params * 8192 + 4 * 32 * 32 * 128 * 8192 * 8193 / 2
    assert cost.predict(PREFILL, features) == pytest.approx(0.002 + flops / (989e12 * 0.5))
    with pytest.raises(ValueError, match="bw_util"):
        RooflineCost(CHIPS["h200"], 1, 1, 1, 1, bw_util=0)


def test_simulate_cli_plans_with_the_roofline(tmp_path, capsys):
    from pagedjax.tools.cli import main

    trace = tmp_path / "trace.jsonl"
    save_trace(trace, [TraceRequest(0.05 * i, 300 + 10 * i, 50) for i in range(20)])
    main(["simulate", "--trace", str(trace), "--roofline", "h200", "--model", "llama-3-8b",
          "--kv-memory-gib", "0.25,1", "--max-model-len", "1024"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("roofline estimate: llama-3-8b on h200")
    # 1 GiB / (128 KiB a token x 16) = 512 blocks, plus the null block.
    assert [line.split()[0] for line in out[2:]] == ["129", "513"]
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--trace", str(trace), "--roofline", "h200", "--num-blocks", "64"])
    assert exit_info.value.code == 2 and "--model" in capsys.readouterr().err


@pytest.mark.slow  # make test-slow
def test_tensor_parallel_roofline_splits_the_work_and_adds_the_collectives():
    from pagedjax.models import get_config
    from pagedjax.parallel.plan import roofline_cost
    from pagedjax.parallel.sharding import kv_bytes_per_block_per_device, weight_bytes_per_device
    from pagedjax.scheduler.chips import CHIPS

    config = get_config("llama-3-8b")
    chip = CHIPS["tpu-v5e"]
    one, four = roofline_cost(config, chip, 1), roofline_cost(config, chip, 4)
    assert four.weight_bytes == weight_bytes_per_device(config, 4, 2) < one.weight_bytes / 3
    assert four.kv_bytes_per_token == kv_bytes_per_block_per_device(config, 1, 4,
                                                                    "bfloat16")
    assert four.kv_bytes_per_token * 4 == one.kv_bytes_per_token == config.kv_bytes_per_token(2)
    # Decode, 64 sequences of 2k tokens: a device's bytes, plus two ring all-reduces a layer of
    # 64 bf16 hidden states and the logits' all-gather.
    features = np.array([1.0, 64, 64, 64 * 2048, 64 * 2048])
    moved = four.weight_bytes + (64 * 2048 + 64) * four.kv_bytes_per_token
    sent = 2 * (2 * 32 * 4096 * 2) * 64 + config.vocab_size * 4 * 64
    assert four.predict(DECODE, features) == pytest.approx(
        0.002 + moved / (chip.hbm_bytes_per_s * 0.7) + 3 / 4 * sent / chip.link_bytes_per_s)
    assert four.predict(DECODE, features) < one.predict(DECODE, features) / 2
    with pytest.raises(ValueError, match="num_heads"):
        roofline_cost(config, chip, 3)


def test_data_parallel_simulation_places_by_prefix_affinity():
    """Two replicas in lockstep with the engine's placement rule: every request served once,
    the shared prefix's requests kept together (the hit rate of one replica), the load spread
    (a shorter makespan than one replica with the same pool)."""
    from pagedjax.parallel.plan import prefix_affinity_placer

    trace = [TraceRequest(0.0, 70, 20, prefix_group=g % 2, prefix_len=64) for g in range(16)]
    setup = _setup(num_blocks=60)
    one = simulate(trace, **setup)
    two = simulate(trace, **setup, replicas=2, place=prefix_affinity_placer(2, 16))
    assert two.output_tokens == one.output_tokens == 16 * 20
    assert two.prefix_hit_rate >= one.prefix_hit_rate > 0.5
    assert two.makespan_s < 0.75 * one.makespan_s
    with pytest.raises(ValueError, match="place"):
        simulate(trace, **setup, replicas=2)


def test_simulate_cli_with_parallelism(tmp_path, capsys):
    from pagedjax.tools.cli import main

    trace = tmp_path / "trace.jsonl"
    save_trace(trace, [TraceRequest(0.05 * i, 300 + 10 * i, 50) for i in range(20)])
    main(["simulate", "--trace", str(trace), "--roofline", "tpu-v5e", "--model", "llama-3-8b",
          "--kv-memory-gib", "1", "--max-model-len", "1024", "--tensor-parallel-size", "4",
          "--data-parallel-size", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("roofline estimate: llama-3-8b on tpu-v5e x TP 4 x DP 2")
    # 1 GiB a device / (32 KiB a token a device x 16) = 2048 blocks, plus the null block.
    assert out[2].split()[0] == "2049"
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(trace), "--cost", "x.json", "--num-blocks", "64",
              "--tensor-parallel-size", "2"])
    assert "--tensor-parallel-size needs --roofline" in capsys.readouterr().err


def test_step_features_count_what_a_sliding_layer_attends():
    """A 100-token chunk from position 1,000 on a model of one full and three 64-window layers:
    the full layer reads 1,100 keys, each sliding one 163 (the window before the chunk's first
    token and the chunk), and their (query, key) pairs are 64 a query."""
    from pagedjax.scheduler import Request, SamplingParams
    from pagedjax.scheduler.cost_model import attended, step_features
    from pagedjax.scheduler.state import ScheduledSeq, SchedulerOutput

    assert attended(1000, 100, None) == (1100, 100 * 1000 + 100 * 101 / 2)
    assert attended(1000, 100, 64) == (163, 100 * 64)
    assert attended(10, 4, 64) == attended(10, 4, None)  # inside the window: the whole context
    buckets = ShapeBuckets.create(max_num_batched_tokens=128, max_num_seqs=4, max_model_len=2048,
                                  block_size=16)
    request = Request("r", list(range(1200)), SamplingParams(max_tokens=1), seed=0,
                      arrival_time=0.0)
    output = SchedulerOutput(scheduled=[ScheduledSeq(request, 1000, 100)], preempted=[],
                             kind=PREFILL, num_scheduled_tokens=100, now=0.0)
    _, features = step_features(output, buckets, (None, 64, 64, 64))
    assert features[3] == pytest.approx((1100 + 3 * 163) / 4)
    assert features[4] == pytest.approx((100 * 1000 + 5050 + 3 * 6400) / 4)


@pytest.mark.slow  # make test-slow
def test_simulate_counts_a_hybrid_models_kv_cache_groups(tmp_path, capsys):
    """Gemma-3-4B on a v5e's 4 GiB of KV, 16k-token prompts: with KV cache groups (a sliding
    group holds its 1,024-token window) the pool holds several times the requests it holds when
    every layer keeps the whole context, and the run preempts less and ends sooner."""
    from pagedjax.models import get_config
    from pagedjax.models.layers.kv_groups import kv_cache_groups
    from pagedjax.scheduler.kv_cache_groups import blocks_for
    from pagedjax.tools.cli import main

    trace = tmp_path / "trace.jsonl"
    save_trace(trace, [TraceRequest(0.05 * i, 16000, 32) for i in range(16)])
    rows = {}
    for flag in ([], ["--disable-hybrid-kv-cache-manager"]):
        main(["simulate", "--trace", str(trace), "--roofline", "tpu-v5e", "--model",
              "gemma-3-4b", "--kv-memory-gib", "4", "--max-model-len", "16384",
              "--max-num-seqs", "16", "--max-num-batched-tokens", "2048", *flag])
        lines = capsys.readouterr().out.splitlines()
        rows[bool(flag)] = dict(zip(lines[1].split(), lines[2].split()))
    groups, full = rows[False], rows[True]
    assert int(groups["num_blocks"]) > 5 * int(full["num_blocks"])  # a block: 1/6 the layers
    assert int(groups["preemptions"]) < int(full["preemptions"])
    assert float(groups["makespan_s"]) < float(full["makespan_s"])
    # One request alone: its peak is what its groups hold, the full group's 1,002 blocks and
    # each of the 6 sliding groups' window (64 blocks at least, at most its bound).
    save_trace(trace, [TraceRequest(0.0, 16000, 32)])
    main(["simulate", "--trace", str(trace), "--roofline", "tpu-v5e", "--model", "gemma-3-4b",
          "--kv-memory-gib", "4", "--max-model-len", "16384", "--max-num-batched-tokens", "2048"])
    lines = capsys.readouterr().out.splitlines()
    peak = int(dict(zip(lines[1].split(), lines[2].split()))["peak_used_blocks"])
    windows = kv_cache_groups(get_config("gemma-3-4b")).windows
    assert windows == (None,) + (1024,) * 6
    assert 1002 + 6 * 64 <= peak <= blocks_for(windows, 16, 16032, 2048)


@pytest.mark.slow  # make test-slow
def test_roofline_of_a_mixture_counts_active_parameters_and_picked_experts():
    """Qwen3-30B-A3B: FLOPs from the 3.35B parameters a token reads, not the 30.5B; a decode
    step reads the experts its tokens pick (8 of 128 for one token, nearly all for 256) on top
    of the rest of the weights."""
    from pagedjax.models import get_config
    from pagedjax.parallel.plan import roofline_cost
    from pagedjax.scheduler.chips import CHIPS

    config = get_config("qwen3-30b-a3b")
    cost = roofline_cost(config, CHIPS["h200"])
    assert cost.num_params == config.num_active_params < config.num_params / 9
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    assert cost.expert_bytes == experts and cost.expert_share == 8 / 128
    rest = cost.weight_bytes - experts
    assert cost.weights_read(1) == pytest.approx(rest + experts * 8 / 128)
    assert cost.weights_read(256) == pytest.approx(rest + experts, rel=1e-6)
    dense = roofline_cost(get_config("llama-3-8b"), CHIPS["h200"])
    assert dense.weights_read(1) == dense.weights_read(256) == dense.weight_bytes
