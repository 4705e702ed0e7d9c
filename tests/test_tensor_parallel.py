"""Tensor parallelism on 8 CPU devices: the same tokens as one device, the tensors really split.

The devices exist only if XLA_FLAGS says so before JAX starts, so the engines run in one child
process (this module's `child`), which reports what the tests check as JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICES = 8
# (name, EngineConfig fields): chunked prefill (32-token steps), preemption (a 26-block pool)
# and prefix hits (prompts sharing a 16-token head) in every run.
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
            num_blocks=26)
RUNS = {
    "tp1": dict(tensor_parallel_size=1),
    "tp2": dict(tensor_parallel_size=2),
    "tp4": dict(tensor_parallel_size=4),  # more devices than debug-tiny's 2 KV heads
    "tp2-gpu-kernels": dict(tensor_parallel_size=2, attention_backend="gpu",
                            attention_interpret=True),
}


def child() -> None:
    import jax
    import numpy as np

    from models import get_config, init_model
    from pagedjax import LLM, SamplingParams
    from pagedjax.sharding import kv_bytes_per_block_per_device, weight_bytes_per_device

    model = init_model(get_config("debug-tiny"), seed=0)
    rng = np.random.default_rng(0)
    head = rng.integers(0, 256, 16).tolist()
    prompts = [head + rng.integers(0, 256, n).tolist() for n in (5, 23, 40, 60, 9, 30)]
    params = SamplingParams(max_tokens=10, temperature=0)
    report = {"devices": len(jax.devices())}
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
            "prefill_steps": stats.num_prefill_steps,
            "q_proj": shard_shapes(layers["self_attn"]["q_proj"]["kernel"]),
            "k_proj": shard_shapes(layers["self_attn"]["k_proj"]["kernel"]),
            "o_proj": shard_shapes(layers["self_attn"]["o_proj"]["kernel"]),
            "down_proj": shard_shapes(layers["mlp"]["down_proj"]["kernel"]),
            "lm_head": shard_shapes(runner.params.lm_head["kernel"]),
            "kv_cache": shard_shapes(runner.kv_cache),
            # what one device holds, against `pagedjax capacity`'s formulas
            "weights_bytes": device0_bytes(runner.params),
            "capacity_weights_bytes": weight_bytes_per_device(model.config, tp, 4),
            "kv_bytes": device0_bytes(runner.kv_cache),
            "capacity_kv_bytes": BASE["num_blocks"] * kv_bytes_per_block_per_device(
                model.config, BASE["block_size"], tp, np.float32),
        }
    errors = {}
    for tp in (3, 16):
        try:
            LLM(model, **BASE, tensor_parallel_size=tp)
        except ValueError as e:
            errors[tp] = str(e)
    report["errors"] = errors
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "PAGEDJAX_COMPILATION_CACHE": "off",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={DEVICES}"}
    result = subprocess.run(
        [sys.executable, "-c", "import test_tensor_parallel as t; t.child()"],
        cwd=ROOT / "tests", env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [n for n in RUNS if n != "tp1"])
def test_tensor_parallel_greedy_tokens_equal_one_device(report, name):
    """f32 everywhere; the row-parallel matmuls sum their partial products in another order
    than one device does (an all-reduce), so logits may differ in the last bits, yet the seeded
    model's peaked logits leave no greedy tie for that to flip: the tokens must be equal."""
    assert report["devices"] == DEVICES
    one = report["tp1"]
    assert one["preemptions"] > 0 and one["prefix_hits"] > 0 and one["prefill_steps"] > 6
    assert report[name]["tokens"] == one["tokens"]


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


def test_capacity_formulas_match_what_each_device_holds(report):
    for name in ("tp1", "tp2", "tp4"):
        run = report[name]
        assert run["weights_bytes"] == run["capacity_weights_bytes"], name
        assert run["kv_bytes"] == run["capacity_kv_bytes"], name
    assert report["tp2"]["kv_bytes"] * 2 == report["tp1"]["kv_bytes"]
    assert report["tp4"]["kv_bytes"] == report["tp2"]["kv_bytes"]  # heads repeated past K


def test_bad_tensor_parallel_sizes_name_the_limit(report):
    assert "num_heads" in report["errors"]["3"]
    assert "exceeds the 8 devices" in report["errors"]["16"]
