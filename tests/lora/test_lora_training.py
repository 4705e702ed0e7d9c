"""LoRA from a JAX trainer (issue 53: pagedjax.lora.training): an adapter trained with optax over
the engine's own model class (base frozen) learns a task, and what it saves as a PEFT directory
is served by the engine exactly as the dense model with the adapter merged answers (greedy,
full recompute); a second state handed over in place (update_lora) likewise."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import LLM, LoRARequest, SamplingParams
from pagedjax.lora.peft_adapter import save_peft_adapter
from pagedjax.lora.training import adapted, as_adapter, init_lora_state, train_lora
from pagedjax.models import get_config, init_model
from pagedjax.models.training.generate import dense_greedy_generate

TARGETS = ["down_proj", "q_proj", "up_proj", "v_proj"]


def task(rng: np.random.Generator, rows: int = 8, prompt_len: int = 6):
    """Prompts of random tokens, each to be followed by itself reversed: (prompts, batch)."""
    prompts = [rng.integers(3, 250, prompt_len).tolist() for _ in range(rows)]
    token_ids = np.array([p + p[::-1] for p in prompts], np.int32)  # [R, S + 1]
    loss_mask = np.zeros((rows, token_ids.shape[1] - 1), np.float32)
    loss_mask[:, prompt_len - 1:] = 1.0  # the reversed half is the target
    return prompts, (token_ids, loss_mask)


@pytest.mark.slow  # make test-slow
def test_a_trained_adapter_is_served_as_the_merged_model(tmp_path):
    model = init_model(get_config("debug-tiny"), seed=0)
    prompts, batch = task(np.random.default_rng(0))
    state = init_lora_state(model.config, rank=8, targets=TARGETS, seed=1)
    assert all(not np.any(b) for _, b in state.pairs.values())  # starts as the base
    trained, losses = train_lora(model, state, [batch], steps=60, lr=1e-2)
    assert losses[-1] < 0.3 * losses[0]
    path = save_peft_adapter(as_adapter(trained), str(tmp_path / "reverse"))
    llm = LLM(model, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
              block_size=4, enable_lora=True, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    lora = LoRARequest("reverse", 1, path)
    served = [o.output_token_ids for o in llm.generate(prompts, greedy, use_tqdm=False,
                                                       lora_request=lora)]
    assert served == dense_greedy_generate(adapted(model, trained.pairs, trained.scaling),
                                           prompts, 6)
    assert served != dense_greedy_generate(model, prompts, 6)
    half, _ = train_lora(model, state, [batch], steps=20, lr=1e-2)
    llm.update_lora("reverse", as_adapter(half))
    assert [o.output_token_ids for o in llm.generate(prompts, greedy, use_tqdm=False,
                                                     lora_request=lora)] == \
        dense_greedy_generate(adapted(model, half.pairs, half.scaling), prompts, 6)
    with pytest.raises(ValueError, match="targets must name projections among"):
        init_lora_state(model.config, rank=2, targets=["lm_head"])
