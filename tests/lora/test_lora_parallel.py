"""LoRA under tensor parallelism (issue 53), on 8 CPU devices in a child process: the adapters'
slots split as their projections (column-parallel b on its output, row-parallel a on its input),
TP 2 and TP 4 (past the model's two KV heads: k/v's b columns repeated with the heads) answer a
mixed batch (base and two adapters) as one device does; the slots hold the shardings."""

from __future__ import annotations

import pytest
from helpers import child_report

pytestmark = pytest.mark.slow  # eight host devices in a child process: make test-slow

# min_token_bucket, min_seq_bucket: one shape of each step kind (each compiles for seconds over
# the devices)
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
            num_blocks=48, enable_lora=True, max_loras=2, max_lora_rank=8,
            min_token_bucket=32, min_seq_bucket=4)


def child() -> None:
    import json
    import tempfile

    from pagedjax import LLM, LoRARequest, SamplingParams
    from pagedjax.lora.peft_adapter import TARGETS, random_adapter, save_peft_adapter
    from pagedjax.models import get_config, init_model

    config = get_config("debug-tiny")
    model = init_model(config, seed=0)
    directory = tempfile.mkdtemp()
    loras = [None] + [LoRARequest(f"a{i}", i, save_peft_adapter(
        random_adapter(config, 8 if i == 1 else 1, sorted(TARGETS), seed=i, std=0.2),
        f"{directory}/a{i}")) for i in (1, 2)]
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    which = [loras[i % 3] for i in range(len(prompts))]
    report = {}
    for name, tp in (("tp1", 1), ("tp2", 2), ("tp4", 4)):
        llm = LLM(model, **BASE, tensor_parallel_size=tp)
        outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=which)
        slots = llm.engine.runner.lora
        report[name] = {"tokens": [o.output_token_ids for o in outs],
                        "q_b": str(getattr(slots["q_proj"][1].sharding, "spec", None)),
                        "o_a": str(getattr(slots["o_proj"][0].sharding, "spec", None))}
    base_only = LLM(model, **{**BASE, "enable_lora": False}).generate(
        prompts, greedy, use_tqdm=False)
    report["base"] = [o.output_token_ids for o in base_only]
    report["all_reduces"] = {lora: all_reduces(model, lora) for lora in (False, True)}
    print(json.dumps(report))


def all_reduces(model, lora: bool) -> dict:
    """The all-reduces of the compiled TP 2 prefill step, by where they run: a step with an
    adapter takes a cond's second branch, one of base tokens alone its first."""
    import collections
    import re

    import jax
    import numpy as np

    from pagedjax import LLM
    from pagedjax.engine.step_functions import forward_inputs, forward_program as _forward
    from pagedjax.scheduler.plan import padding_plan

    runner = LLM(model, **{**BASE, "enable_lora": lora}, tensor_parallel_size=2).engine.runner
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                          forward_inputs(padding_plan("prefill", 32, 4, 24)))
    text = _forward.lower(runner.graph, runner.backend, "prefill", runner.num_top_logprobs,
                          *runner._abstract_args, inputs, runner._abstract_lora).compile(
                          ).as_text()
    where = collections.Counter()
    for line in text.splitlines():
        if re.search(r" all-reduce(-start)?\(", line):
            name = re.search(r'op_name="([^"]*)"', line).group(1)
            where["base_branch" if "branch_0" in name else
                  "adapted_branch" if "branch_1" in name else "always"] += 1
    return dict(where)


def test_tensor_parallel_lora_equals_one_device():
    report = child_report("test_lora_parallel")
    for tp in ("tp2", "tp4"):
        assert report[tp]["tokens"] == report["tp1"]["tokens"], tp
        assert report[tp]["q_b"] == "P(None, None, None, 'tp')"
        assert report[tp]["o_a"] == "P(None, None, 'tp', None)"
    # the row-parallel o / down projections: one all-reduce each, adapted or not (the
    # adapters' partial sums join the base's before it)
    base, adapted = report["all_reduces"]["false"], report["all_reduces"]["true"]
    assert base == {"always": 2}, base
    assert adapted == {"base_branch": 2, "adapted_branch": 2}, adapted
    tokens = report["tp1"]["tokens"]
    assert tokens[0::3] == report["base"][0::3]  # base rows: the base model's answers
    assert tokens[1::3] != report["base"][1::3] and tokens[2::3] != report["base"][2::3]
