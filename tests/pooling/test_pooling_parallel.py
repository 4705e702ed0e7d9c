"""Pooling requests over 2 host devices (tensor parallel: the states' rows gathered whole for
the host; data parallel: LLM(data_parallel_size=2), a replica a device) give the vectors of one
device: last-token embeddings and mean-pooled ones, with a shared prefix and 4-token chunks.
The devices exist only if XLA_FLAGS says so before JAX starts, so the engines run in a child
process (as tests/parallel/test_tensor_parallel.py's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import child_report

pytestmark = pytest.mark.slow

BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
            num_blocks=64, runner="pooling")


def child() -> None:
    import jax

    from pagedjax import LLM
    from pagedjax.models import get_config, init_model

    model = init_model(get_config("debug-tiny"), seed=0)
    rng = np.random.default_rng(0)
    head = rng.integers(0, 256, 12).tolist()
    prompts = [head + rng.integers(0, 256, n).tolist() for n in (5, 23, 9)]
    report = {"devices": len(jax.devices())}
    for name, fields in {"tp1": {}, "tp2": dict(tensor_parallel_size=2),
                         "dp2": dict(data_parallel_size=2)}.items():
        for pooling in ("LAST", "MEAN"):
            llm = LLM(model, **BASE, **fields, pooler_config={"pooling_type": pooling})
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            report[f"{name}-{pooling}"] = [o.outputs.embedding for o in outs]
    print(json.dumps(report))


def test_pooling_over_two_devices_equals_one():
    report = child_report("test_pooling_parallel", devices=2)
    assert report["devices"] == 2
    for pooling in ("LAST", "MEAN"):
        one, two, replicas = (np.asarray(report[f"{n}-{pooling}"])
                              for n in ("tp1", "tp2", "dp2"))
        assert one.shape == (3, 64)
        np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(replicas, one, rtol=1e-5, atol=1e-5)
