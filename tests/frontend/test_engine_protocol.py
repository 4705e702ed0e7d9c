"""The engine interface (pagedjax/engine/engine_protocol.py, issue 72): LLMEngine and
DataParallelEngine implement every member the front-ends and the server read (EncoderEngine's is
held in tests/pooling/test_pooling_encoders.py, where one is built), and nothing under pagedjax/ probes an
engine with getattr or hasattr for a member one kind lacks. The server's front-ends (AsyncLLMEngine,
CoreClient) implement pagedjax/frontend/engine_client.py's EngineClient."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax

from pagedjax import EngineConfig, LLMEngine
from pagedjax.engine.engine_protocol import Engine
from pagedjax.frontend.async_engine import AsyncLLMEngine
from pagedjax.frontend.core_client import CoreClient
from pagedjax.frontend.data_parallel import DataParallelEngine
from pagedjax.frontend.engine_client import EngineClient
from pagedjax.models import get_config, init_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
              num_blocks=16, min_seq_bucket=2)


def test_the_engines_implement_the_protocol():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    model = init_model(config, seed=0)
    engine = LLMEngine(model, EngineConfig(**CONFIG))
    assert isinstance(engine, Engine) and engine.replicas == [engine]
    device = jax.devices()[0]
    parallel = DataParallelEngine(model, EngineConfig(**CONFIG, data_parallel_size=2),
                                  devices=[device, device])
    assert isinstance(parallel, Engine) and len(parallel.replicas) == 2
    assert parallel.memory_budget is parallel.replicas[0].memory_budget
    assert parallel.runner_type == engine.runner_type == "generate"
    assert not isinstance(object(), Engine)


def test_the_front_ends_implement_the_client_protocol():
    """Every member of EngineClient is defined by both front-ends, not left to the protocol's
    empty body (only generate, which it implements over add_requests, is shared)."""
    members = [name for name in dir(EngineClient) if not name.startswith("_")]
    assert {"add_requests", "abort", "control", "limits", "healthy", "generate"} <= set(members)
    for client in (AsyncLLMEngine, CoreClient):
        assert EngineClient in client.__mro__
        for name in members:
            if name not in ("generate", "engine"):
                assert name in vars(client), f"{client.__name__} lacks {name}"
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    engine = LLMEngine(init_model(config, seed=0), EngineConfig(**CONFIG))
    assert isinstance(AsyncLLMEngine(engine), EngineClient)


def test_no_engine_is_probed_for_a_member():
    probe = re.compile(r"(getattr|hasattr)\((self\.)?(server\.)?(async_)?engine,")
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sorted((ROOT / "pagedjax").rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []
