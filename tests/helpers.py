"""Shared test helpers: a host-only simulation loop and invariant checks."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from pagedjax.scheduler import (NULL_BLOCK, KVCacheManager, Request, SamplingParams, Scheduler,
                                build_plan)

# The embedded byte model has no chat template of its own (chat to it is refused); the server
# tests pass this one, as a vLLM user passes --chat-template.
ROLE_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def make_request(request_id, prompt_len, max_tokens, *, seed=0, arrival_time=0.0, token=1):
    return Request(str(request_id), [token] * prompt_len,
                   SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=seed,
                   arrival_time=arrival_time)


def check_kv_invariants(kv: KVCacheManager) -> None:
    """free + referenced = total; nothing both free and referenced; ref counts = table holders."""
    pool = kv.pool
    free = pool.free_block_ids()
    assert len(free) == len(set(free)), "a block is twice in the free queue"
    assert NULL_BLOCK not in free, "the null block was freed"
    # The null block may stand in a table only for blocks freed outside a sliding window.
    holders = collections.Counter(b for table in kv.block_tables.values() for b in table
                                  if b != NULL_BLOCK)
    assert kv.pool.ref_counts[NULL_BLOCK] == 0, "the null block was referenced"
    referenced = {b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0}
    assert not (set(free) & referenced), "a block is both free and referenced"
    assert len(free) + len(referenced) == pool.num_usable_blocks, "free + referenced != total"
    for block in range(1, pool.num_blocks):
        assert pool.ref_counts[block] == holders.get(block, 0), f"ref count of block {block}"


def simulate(scheduler: Scheduler, buckets, *, max_steps=100_000, on_step=None, token=1):
    """Drives the scheduler to completion with a fake model that always samples `token`.

    Builds every plan (so plan invariants can be checked in on_step) and checks the KV
    invariants after every step. Returns the list of SchedulerOutputs.
    """
    outputs = []
    now = 0.0
    for _ in until_done(scheduler, max_steps + 1):
        assert len(outputs) < max_steps, "simulation did not finish"
        now += 1.0
        output = scheduler.schedule(now)
        assert output.scheduled, f"no progress at step {len(outputs)}"
        plan = build_plan(output, scheduler.kv_manager, buckets)
        if on_step is not None:
            on_step(output, plan)
        scheduler.update(output, np.full(len(output.scheduled), token), now)
        check_kv_invariants(scheduler.kv_manager)
        outputs.append(output)
    return outputs


def until_done(engine, max_steps: int = 10_000):
    """Yields while engine (an LLMEngine or a Scheduler) has unfinished requests, at most
    max_steps times: a loop that stops making progress fails instead of hanging."""
    for step in range(max_steps):
        if not engine.has_unfinished():
            return
        yield step
    raise AssertionError(f"still unfinished after {max_steps} steps")


def run_requests(engine, requests, max_steps: int = 10_000) -> list:
    """Queues (prompt token ids, SamplingParams) pairs on engine and steps it (bounded, see
    until_done) until all finish; their final RequestOutputs in the same order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    for _ in until_done(engine, max_steps):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def assert_same_outputs(got, expected, atol: float = 1e-4) -> None:
    """Two runs' RequestOutputs (in the same order): the same tokens, and at each step the same
    top-logprob tokens with logprobs within atol."""
    import numpy as np

    for a, b in zip(got, expected, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step, ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step.keys() == ref.keys()
            np.testing.assert_allclose([v.logprob for v in step.values()],
                                       [v.logprob for v in ref.values()], atol=atol)


def start_serve(*flags: str, command=None, **popen) -> tuple[subprocess.Popen, str]:
    """`pagedjax serve` on a free port of 127.0.0.1 (command: how to start it, `python -m
    pagedjax.tools.cli` by default), its output captured: (the process, its URL)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = command or [sys.executable, "-m", "pagedjax.tools.cli"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **popen.pop("env", {})}
    proc = subprocess.Popen([*command, "serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, **popen)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, procs, timeout_s: float = 120) -> None:
    """Waits (bounded) until a served /health answers ok; fails if a process exits first."""
    import json
    import time
    import urllib.request

    deadline = time.time() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                assert json.load(r) == {"status": "ok"}
            return
        except OSError:
            exited = [p.returncode for p in procs if p.poll() is not None]
            assert not exited and time.time() < deadline, f"not serving: exit codes {exited}"
            time.sleep(0.5)


def complete(url: str, body: dict, timeout_s: float = 120) -> dict:
    """POST /v1/completions; the decoded answer."""
    import json
    import urllib.request

    request = urllib.request.Request(f"{url}/v1/completions", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return json.load(r)


# A template that renders vLLM's `documents` (as a RAG model's does), for chat requests with them.
RAG_TEMPLATE = ("{{ bos_token }}{% if documents %}{% for d in documents %}"
                "document {{ loop.index }}: {{ d['text'] }}\n{% endfor %}{% endif %}"
                + ROLE_TEMPLATE.replace("{{ bos_token }}", ""))


TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent


def child_pythonpath() -> str:
    """PYTHONPATH for a child process that imports test modules by name: the repository, tests/
    (the helpers) and each room's folder (tests/engine, tests/serving, ...), as conftest.py
    puts them on the path of the run."""
    rooms = sorted({str(p.parent) for p in TESTS.glob("*/test_*.py")})
    return os.pathsep.join([str(ROOT), str(TESTS), *rooms])


def child_report(module: str, devices: int = 8, timeout: float = 600) -> dict:
    """The JSON a test module's child() prints last, run in a fresh process that JAX starts
    with `devices` host devices (XLA_FLAGS must be set before JAX starts)."""
    env = {**os.environ, "PAGEDJAX_COMPILATION_CACHE": "off", "PYTHONPATH": child_pythonpath(),
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={devices}"}
    result = subprocess.run([sys.executable, "-c", f"import {module} as t; t.child()"],
                            cwd=TESTS, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
