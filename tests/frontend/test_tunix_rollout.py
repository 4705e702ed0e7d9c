"""pagedjax as Tunix's rollout engine (issue 52: pagedjax.rl.tunix_rollout.PagedJaxRollout),
against Tunix itself on small random Llama 3 and Qwen 3 models (every switch of the mapping on:
tied and untied heads, Qwen 3's q/k norms): greedy rollouts equal Tunix's own vanilla rollout's;
the log-probs of sampled tokens (from generate, and teacher-forced by get_per_token_logps) equal
Tunix's compute_per_token_logps of the same model within f32 tolerance; after update_params the
rollout answers as a fresh one built from the new model; Tunix's GRPOLearner trains a few steps
with it. Runs where google-tunix is installed: `make test-tunix` (its own environment)."""

from __future__ import annotations

import numpy as np
import pytest

tunix = pytest.importorskip("tunix")

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.generate.tokenizer_adapter import TokenizerAdapter  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402

from pagedjax.rl.tunix_rollout import PagedJaxRollout  # noqa: E402

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=96)
PROMPTS = ["hello there", "abc", "a longer prompt of bytes"]


class Bytes:
    """A byte tokenizer with Tunix's custom-tokenizer methods (BOS 256, EOS 257, pad 258)."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def bos_id(self):
        return 256

    def eos_id(self):
        return 257

    def pad_id(self):
        return 258


def tunix_model(family: str, seed: int):
    common_fields = dict(num_layers=2, vocab_size=264, embed_dim=64, hidden_dim=128,
                         num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10000,
                         norm_eps=1e-5)
    if family == "llama3":
        from tunix.models.llama3 import model
        return model.Llama3(model.ModelConfig(**common_fields), rngs=nnx.Rngs(seed))
    from tunix.models.qwen3 import model
    return model.Qwen3(model.ModelConfig(**common_fields, use_tied_embedding=True),
                       rngs=nnx.Rngs(seed))


def config(**fields) -> base_rollout.RolloutConfig:
    return base_rollout.RolloutConfig(**{**dict(max_tokens_to_generate=8, top_p=None,
                                                max_prompt_length=32, return_logprobs=True),
                                         **fields})


@pytest.fixture(params=["llama3", "qwen3"])
def family(request):
    return request.param


def test_greedy_rollouts_equal_tunixs_vanilla_rollout(family):
    model, tok = tunix_model(family, 0), TokenizerAdapter(Bytes())
    ours = PagedJaxRollout(model, tok, rollout_config=config(), **ENGINE)
    theirs = vanilla_rollout.VanillaRollout(model, tok, base_rollout.CacheConfig(
        cache_size=64, num_layers=2, num_kv_heads=2, head_dim=16))
    for rollout_config in (config(), config(max_prompt_length=8)):  # 8: padded to 32, as theirs
        got = ours.generate(PROMPTS, rollout_config)
        expected = theirs.generate(PROMPTS, rollout_config)
        assert [t.tolist() for t in got.tokens] == [t.tolist() for t in expected.tokens]
        np.testing.assert_array_equal(got.left_padded_prompt_tokens,
                                      expected.left_padded_prompt_tokens)
        assert got.text == expected.text


def completions_of(out, length: int, pad: int, eos: int | None = None) -> np.ndarray:
    """The rollout's completions right-padded (eos: each ended by it first)."""
    rows = np.full((len(out.tokens), length), pad, np.int32)
    for i, tokens in enumerate(out.tokens):
        ended = list(tokens) + ([] if eos is None else [eos])
        rows[i, :len(ended)] = ended
    return rows


def test_logprobs_equal_tunixs_compute_per_token_logps(family):
    """Sampled at temperature 1: the engine's log-probs of the sampled tokens (raw, as
    generate returns them) and its teacher-forced ones equal Tunix's dense ones (f32: 1e-4)."""
    model, tok = tunix_model(family, 1), TokenizerAdapter(Bytes())
    rollout = PagedJaxRollout(model, tok, rollout_config=config(), **ENGINE)
    sampled = config(temperature=1.0, top_p=1.0, seed=7)
    out = rollout.generate(PROMPTS, sampled)
    graphdef, state = nnx.split(model)
    for eos in (None, tok.eos_id()):  # padded after the tokens, or ended by EOS first
        completions = completions_of(out, 10, tok.pad_id(), eos)
        expected = np.asarray(common.compute_per_token_logps(
            graphdef, state, prompt_tokens=jax.numpy.asarray(out.left_padded_prompt_tokens),
            completion_tokens=jax.numpy.asarray(completions), pad_id=tok.pad_id(),
            eos_id=tok.eos_id()))
        forced = np.asarray(rollout.get_per_token_logps(out.left_padded_prompt_tokens,
                                                        completions))
        for i, tokens in enumerate(out.tokens):
            n = len(tokens) + (eos is not None)  # the EOS's log-prob too
            np.testing.assert_allclose(forced[i, :n], expected[i, :n], atol=1e-4)
            assert not forced[i, n:].any()  # nothing past the completion
            np.testing.assert_allclose(out.logprobs[i], expected[i, :len(tokens)], atol=1e-4)
    assert len({tuple(t.tolist()) for t in out.tokens}) == len(PROMPTS)  # sampled, not greedy


def test_update_params_answers_as_a_fresh_rollout(family):
    old, new, tok = tunix_model(family, 2), tunix_model(family, 3), TokenizerAdapter(Bytes())
    rollout = PagedJaxRollout(old, tok, rollout_config=config(), **ENGINE)
    before = rollout.generate(PROMPTS, config())
    rollout.update_params(nnx.state(new, nnx.Param), (nnx.Param,))
    fresh = PagedJaxRollout(new, tok, rollout_config=config(), **ENGINE)
    got = rollout.generate(PROMPTS, config())
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in fresh.generate(
        PROMPTS, config()).tokens]
    assert [t.tolist() for t in got.tokens] != [t.tolist() for t in before.tokens]
    assert rollout.llm.weight_version == "1"
    with pytest.raises(ValueError, match="LoRA adapters are not served yet"):
        rollout.update_params(nnx.state(new, nnx.LoRAParam), (nnx.LoRAParam,))


def test_tunixs_grpo_learner_trains_with_it():
    """Tunix's GRPOLearner, unchanged, with ClusterConfig(rollout_engine=PagedJaxRollout): a
    few steps (rollouts, Tunix's own log-probs and loss, the actor's updates synced into the
    engine); the engine then serves the trained actor, as a fresh rollout of it answers."""
    import functools

    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    actor, reference = tunix_model("llama3", 4), tunix_model("llama3", 4)
    before = nnx.state(actor, nnx.Param)
    before = jax.tree.map(np.asarray, before)
    roles = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, tokenizer=Bytes(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
            rollout_engine=functools.partial(PagedJaxRollout, **ENGINE),
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(1e-2), eval_every_n_steps=100, max_steps=3),
            rollout_config=config(temperature=1.0, top_p=1.0, max_tokens_to_generate=6,
                                  max_prompt_length=16, return_logprobs=False)))
    assert isinstance(cluster.rollout, PagedJaxRollout)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=4, beta=0.04),
        reward_fns=[lambda prompts, completions, **kw: [c.count("a") / 6 for c in completions]])
    learner.train([{"prompts": np.array(["say a", "repeat aaa"])}] * 3)  # as grain batches
    rollout = cluster.rollout
    assert rollout.llm.engine.num_weight_updates >= 1
    trained = cluster.actor_trainer.model  # the cluster's copy of the actor, trained
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(nnx.state(trained, nnx.Param))))
    fresh = PagedJaxRollout(trained, TokenizerAdapter(Bytes()), rollout_config=config(),
                            **ENGINE)
    assert [t.tolist() for t in rollout.generate(PROMPTS, config()).tokens] == [
        t.tolist() for t in fresh.generate(PROMPTS, config()).tokens]
