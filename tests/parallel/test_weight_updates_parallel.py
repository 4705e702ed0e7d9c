"""New weights for a tensor-parallel engine (issue 52), on 8 CPU devices in a child process: the
trainer's weights sharded over another mesh (4 other devices), whole or by Hugging Face name,
arrive device to device in the engine's shardings (TP 2; TP 4, past the model's two KV heads:
repeated) unchanged, and its outputs are those of an engine built from them;
nothing recompiles, and every replica of a data-parallel engine over its own devices takes them."""

from __future__ import annotations

import json

import pytest
from helpers import child_report

pytestmark = pytest.mark.slow  # eight host devices in a child process: make test-slow

# min_token_bucket, min_seq_bucket: one shape of each step kind (each compiles for seconds over
# the devices)
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
            num_blocks=48,
            min_token_bucket=32, min_seq_bucket=4)


def child() -> None:
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from pagedjax import LLM, SamplingParams
    from pagedjax.engine.runner import num_step_compiles
    from pagedjax.models import get_config, init_model
    from pagedjax.models.loading.names import hf_state_dict

    config = get_config("debug-tiny")
    old, new = init_model(config, seed=0), init_model(config, seed=1)
    trainer = Mesh(np.array(jax.devices()[4:8]), ("x",))  # the trainer's own devices

    def on_trainer(leaf):
        spec = P(None, "x") if leaf.ndim == 2 and leaf.shape[1] % 4 == 0 else P()
        return jax.device_put(leaf, NamedSharding(trainer, spec))

    state = nnx.state(new, nnx.Param)
    nnx.update(new, jax.tree.map(on_trainer, state))
    prompts = [list(range(10 + i, 40 + i)) for i in range(4)]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    report = {}
    by_name = hf_state_dict(new)  # Hugging Face names, the arrays on the trainer's devices
    for name, fields in (("tp2", dict(tensor_parallel_size=2)),
                         ("dp2-tp2", dict(tensor_parallel_size=2, data_parallel_size=2)),
                         ("tp4-by-name", dict(tensor_parallel_size=4))):  # KV heads repeated
        expected = [o.output_token_ids for o in LLM(new, **BASE, **fields).generate(
            prompts, greedy, use_tqdm=False)]
        llm = LLM(old, **BASE, **fields)
        llm.generate(prompts, greedy, use_tqdm=False)
        replicas = getattr(llm.engine, "replicas", [llm.engine])
        before = [[str(leaf.sharding) for leaf in jax.tree.leaves(r.runner.params)]
                  for r in replicas]
        compiles = num_step_compiles()
        llm.update_weights(by_name if name.endswith("by-name") else new, version="sharded")
        got = [o.output_token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        report[name] = {
            "equal": got == expected, "compiles": num_step_compiles() - compiles,
            "same_shardings": before == [[str(leaf.sharding) for leaf in jax.tree.leaves(
                r.runner.params)] for r in replicas],
            "trainer_devices": sorted({d.id for leaf in [*jax.tree.leaves(nnx.state(new)),
                                                         *by_name.values()]
                                       for d in leaf.devices()}),
            "version": llm.weight_version}
    print(json.dumps(report))


def test_weights_from_another_mesh_arrive_in_the_engines_shardings():
    report = child_report("test_weight_updates_parallel", 8)
    for name in ("tp2", "dp2-tp2", "tp4-by-name"):
        run = report[name]
        assert run["equal"] and run["same_shardings"], (name, run)
        assert run["compiles"] == 0 and run["version"] == "sharded"
        assert run["trainer_devices"] == [4, 5, 6, 7]  # the trainer's copy stays where it was
