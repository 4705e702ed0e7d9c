"""Two processes x 2 CPU devices under jax.distributed (127.0.0.1, gloo collectives): one model
over the 4 devices of both serves the requests token for token as one device does, and a
follower that dies ends the leader with an error within seconds, not a hang.

Each process is this module's `worker` in a child Python (the devices and the distributed
runtime exist only if set up before JAX starts); they report as JSON on their last line.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import child_pythonpath, complete, wait_healthy

# The slow suite (make test-slow, run by .ci/run beside make test): several processes under
# jax.distributed.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
# min_token_bucket, min_seq_bucket: one shape of each step kind (each compiles for seconds over
# the devices)
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
            num_blocks=26, compilation_cache="off",
            min_token_bucket=32, min_seq_bucket=4)
HEARTBEAT_S = 5


def worker(process_id: int, port: int, die_after: int | None, tiers: bool = False,
           update: str | None = None) -> None:
    """tiers: the prefix cache's host tier on, every prompt asked twice (its second time, its
    blocks come back from the host: each process its own shards). update: a checkpoint the
    leader's update_weights reads next (every process its own shards), the prompts asked again."""
    import jax
    import numpy as np

    from pagedjax import LLM, SamplingParams
    from pagedjax.models import get_config, init_model
    from pagedjax.parallel import multihost

    multihost.initialize(f"127.0.0.1:{port}", 2, process_id,
                         heartbeat_timeout_seconds=HEARTBEAT_S)
    model = init_model(get_config("debug-tiny"), seed=0)
    rng = np.random.default_rng(0)
    head = rng.integers(0, 256, 16).tolist()
    prompts = [head + rng.integers(0, 256, n).tolist() for n in (5, 23, 40, 60, 9, 30)]
    # the last asks for prompt logprobs: the followers run the forward's prompt variant too
    params = [SamplingParams(max_tokens=10, temperature=0)] * 5 + [
        SamplingParams(max_tokens=10, temperature=0, prompt_logprobs=2)]

    def prompt_logprobs(out):  # each prompt token's logprob
        return [entry[t].logprob for t, entry in zip(out.prompt_token_ids[1:],
                                                     out.prompt_logprobs[1:])]
    report = {"process": jax.process_index(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count()}
    if process_id == 0:  # the single-device reference: this process's own first device
        one = LLM(model, **BASE).generate(prompts, params, use_tqdm=False)
        report["reference"] = [o.output_token_ids for o in one]
        report["reference_prompt_logprobs"] = prompt_logprobs(one[-1])
        if update is not None:  # the checkpoint's weights (read here, orbax would wait for
            # the other process)
            report["reference_updated"] = [o.output_token_ids for o in LLM(
                init_model(get_config("debug-tiny"), seed=1), **BASE).generate(
                prompts, params, use_tqdm=False)]
    llm = LLM(model, **BASE, tensor_parallel_size=4,
              kv_offload_bytes=(64 * 2048) if tiers else 0)
    engine = llm.engine
    shards = engine.runner.params.layers["self_attn"]["q_proj"]["kernel"].get_value()
    report["weight_shards_here"] = [  # (process, columns) of each shard this process holds
        (s.device.process_index, s.data.shape[-1]) for s in shards.addressable_shards]
    report["weight_columns"] = shards.shape[-1]
    if process_id == 0:
        start = time.monotonic()
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            report["tokens"] = [o.output_token_ids for o in outputs]
            if tiers:
                again = llm.generate(prompts, params, use_tqdm=False)
                report["tokens_again"] = [o.output_token_ids for o in again]
                report["host_hits"] = engine.stats.kv_tiers["host"]["hits"]
                report["host_hit_tokens"] = engine.stats.num_prefix_host_hit_tokens
            report["prompt_logprobs"] = prompt_logprobs(outputs[-1])
            if update is not None:
                llm.update_weights(update, version="multi-host")
                updated = llm.generate(prompts, params, use_tqdm=False)
                report["tokens_updated"] = [o.output_token_ids for o in updated]
                report["versions"] = sorted({o.weight_version for o in updated})
            report["preemptions"] = engine.stats.num_preemptions
            report["prefix_hits"] = engine.stats.num_prefix_hit_tokens
        except Exception as error:  # noqa: BLE001 - reported: the follower died
            report["error"] = f"{type(error).__name__}: {error}"[:2000]
        report["seconds"] = time.monotonic() - start
        if "error" not in report:
            engine.runner.channel.stop()
    else:
        runner = engine.runner
        if die_after is not None:  # a follower that crashes mid-generation
            dispatch = runner.dispatch_forward
            count = [0]  # steps dispatched so far

            def dying(plan):
                count[0] += 1
                if count[0] > die_after:
                    os._exit(17)
                return dispatch(plan)

            runner.dispatch_forward = dying
        report["steps"] = multihost.follow(runner, reload=llm.update_weights)
        report["updates"] = engine.num_weight_updates
    print(json.dumps(report), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(die_after: int | None = None, timeout: float = 400,
              tiers: bool = False, update: str | None = None) -> list[dict | int]:
    """Starts the leader and the follower; each one's report (or its exit code, when it
    printed none)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count=2"}
    code = "import sys, test_multihost as t; t.worker(int(sys.argv[1]), int(sys.argv[2]), " \
           "None if sys.argv[3] == 'none' else int(sys.argv[3]), sys.argv[4] == 'tiers', " \
           "None if sys.argv[5] == '-' else sys.argv[5])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), str(port), str(die_after)
                               .lower(), "tiers" if tiers else "-", update or "-"],
                              cwd=ROOT / "tests",
                              env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(2)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            lines = out.strip().splitlines()
            results.append(json.loads(lines[-1]) if lines and lines[-1].startswith("{")
                           else {"returncode": proc.returncode, "stderr": err[-3000:]})
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.fixture(scope="module")
def group():
    return run_group()


def test_two_processes_serve_the_single_device_tokens(group):
    """f32; the row-parallel all-reduces sum in another order (across processes too), yet the
    seeded model's greedy tokens are the single device's (as on one host, test_tensor_parallel)."""
    leader, follower = group
    assert "tokens" in leader, leader
    assert leader["devices"] == 4 and leader["local_devices"] == 2
    assert leader["tokens"] == leader["reference"]
    assert len(leader["prompt_logprobs"]) == 16 + 30 - 1
    assert leader["prompt_logprobs"] == pytest.approx(leader["reference_prompt_logprobs"],
                                                      abs=1e-4)  # f32, sums reordered
    assert leader["preemptions"] > 0 and leader["prefix_hits"] > 0
    assert follower["steps"] > 6  # it ran every step's program on its shards
    # each process holds only its own devices' shards of the weights
    quarter = leader["weight_columns"] // 4
    assert leader["weight_shards_here"] == [[0, quarter], [0, quarter]]
    assert follower["weight_shards_here"] == [[1, quarter], [1, quarter]]


def test_two_processes_with_the_host_tier():
    """The prefix cache's host tier over two processes: each keeps its own devices' KV heads
    of an evicted block and loads them back on a hit (the leader announces every move); the
    tokens stay the single device's, the first time and the second, served from the host."""
    leader, follower = run_group(tiers=True)
    assert "tokens" in leader, leader
    assert leader["tokens"] == leader["reference"] == leader["tokens_again"]
    assert leader["host_hits"] > 0 and leader["host_hit_tokens"] > 0
    assert follower["steps"] > 6


def test_two_processes_take_new_weights_from_a_checkpoint(tmp_path):
    """update_weights(checkpoint) on the leader: every process reads its own devices' shards
    of it into its runner in place (the follower told by the leader); the group then answers
    as one device with the new weights, nothing else restarted."""
    from pagedjax.models import get_config, init_model
    from pagedjax.models.loading.checkpoint import save_checkpoint

    # the worker's reference: the same seed's model
    save_checkpoint(init_model(get_config("debug-tiny"), seed=1), str(tmp_path / "next"))
    leader, follower = run_group(update=str(tmp_path / "next"))
    assert "tokens_updated" in leader, leader
    assert leader["tokens"] == leader["reference"]
    assert leader["tokens_updated"] == leader["reference_updated"] != leader["tokens"]
    assert leader["versions"] == ["multi-host"] and follower["updates"] == 1


def test_a_dead_follower_ends_the_leader_with_an_error():
    leader, follower = run_group(die_after=3, timeout=120)
    assert follower.get("returncode") == 17, follower
    # gloo sees the peer's connection close at the next collective: the leader's generate
    # raises GroupLostError at once (JAX's coordination service would stop it after
    # HEARTBEAT_S otherwise), never a hang
    assert "GroupLostError: the multi-host group is lost" in leader.get("error", ""), leader
    assert leader["seconds"] < 30


def test_pagedjax_serve_over_two_processes():
    """`pagedjax serve --coordinator ... --process-id I` on both: process 0 answers HTTP with
    the embedded model split over both processes' 4 devices; stopping it stops the follower."""
    port, http_port = _free_port(), _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PAGEDJAX_COMPILATION_CACHE": "off",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "pagedjax.tools.cli", "serve", "--port", str(http_port),
         "--max-model-len", "128", "--max-num-batched-tokens", "128",
         "--tensor-parallel-size", "4", "--served-model-name", "tiny",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for i in range(2)]
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_healthy(url, procs, timeout_s=180)
        answer = complete(url, {"model": "tiny", "prompt": "rev:paged=", "max_tokens": 8,
                                "temperature": 0})
        assert answer["choices"][0]["text"] == "degap"  # the embedded model reverses strings
    finally:
        procs[0].send_signal(signal.SIGTERM)
        leader_out, _ = procs[0].communicate(timeout=60)
        try:
            follower_out, _ = procs[1].communicate(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert "Application shutdown complete" in leader_out, leader_out
    assert procs[1].returncode == 0, follower_out
    assert "following process 0" in follower_out and "leader stopped after" in follower_out
