"""Writes notebooks/grpo.ipynb from the cells below (the notebook's single source) and executes
it in place, so the committed notebook shows its outputs and pictures unrun:

    .venv/bin/pip install -r requirements/notebook.txt   # nbclient, ipykernel
    .venv/bin/python notebooks/make_grpo.py              # --no-execute: sources only

tests/project/test_notebook.py checks that the committed notebook's cells are these, that it was run
(outputs, pictures, no errors, the reward risen), and runs its code cells top to bottom.
"""

from __future__ import annotations

import argparse

from make_quickstart import FIND_CHECKOUT, HERE, execute, notebook, render

CELLS = [
    ("markdown", """\
# GRPO with pagedjax generating the rollouts, new weights in place every step

Post-training with reinforcement learning alternates a generator and a trainer. Here both live
in one Python process on the same devices: a policy written with `pagedjax.models` is trained
with GRPO (group-relative advantages, a clipped policy-gradient loss) in JAX and optax, and a
pagedjax engine built once from that policy samples every rollout; after each optimizer step
`llm.update_weights(policy)` writes the new weights into the engine's own buffers (no restart,
no checkpoint, nothing recompiled), and every rollout's `weight_version` names the policy step
that sampled it.

The policy is the embedded model (`models/checkpoints/pagedjax-tiny`, 1 M parameters, trained
on byte-level tasks); its task here is one it does not solve: recall, `k=868;H=162;N=239;q:H=`
answered `162`. The reward is verifiable: 1 for the right value, 0.5 for another value of the
context (a value, not the right one), 0 otherwise. It runs on a CPU (Colab's default runtime is
enough; about three minutes on 2 cores). The first cell installs the project from the checkout
the notebook sits in (in Colab: upload or clone the repository first); locally `make demo` has
set up `.venv`."""),
    ("code", FIND_CHECKOUT + """\
if importlib.util.find_spec("pagedjax") is None:  # a fresh runtime: install the project
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", str(root)], check=True)
    sys.path.insert(0, str(root))"""),
    ("markdown", """\
## The policy, the engine, the task

`load_checkpoint` gives the policy as a Flax NNX model the trainer updates; `LLM(policy)` builds
the engine from the same arrays (it shares them until the first update writes its own). The
evaluation set is 256 held-out prompts with 3 or 4 pairs, answered greedily."""),
    ("code", """\
import time
import numpy as np
import jax, jax.numpy as jnp, optax
from flax import nnx
from pagedjax import LLM, SamplingParams
from pagedjax.frontend.llm import DEFAULT_MODEL
from pagedjax.models.loading.checkpoint import load_checkpoint
from pagedjax.models.training import tasks

policy = load_checkpoint(str(DEFAULT_MODEL))
llm = LLM(policy, tokenizer="byte", max_model_len=96, max_num_seqs=64,
          max_num_batched_tokens=512)

def recall_prompts(n, seed):
    rng, examples = np.random.default_rng(seed), []
    while len(examples) < n:
        example = tasks.sample_example("recall", rng)
        if len(tasks.recall_pairs(example.prompt)) <= 4:
            examples.append(example)
    return examples

def reward(text, example):
    values = [value for _, value in tasks.recall_pairs(example.prompt)]
    return 1.0 if text == example.answer else 0.5 if text in values else 0.0

held_out = recall_prompts(256, seed=10_000)

def evaluate():
    outs = llm.generate([e.prompt for e in held_out],
                        SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    return (np.mean([t == e.answer for t, e in zip(texts, held_out)]),
            np.mean([reward(t, e) > 0 for t, e in zip(texts, held_out)]), outs[0])

exact, a_value, sample = evaluate()
print(f"before: right value {exact:.1%}, a value of the context {a_value:.1%} (greedy, "
      f"{len(held_out)} prompts); e.g. {held_out[0].prompt!r} -> {sample.outputs[0].text!r} "
      f"(answer {held_out[0].answer!r}), weight_version {sample.weight_version!r}")"""),
    ("markdown", """\
## GRPO in JAX

Each step samples a group of 8 completions for each of 32 prompts at temperature 1 (the
engine's `n=8`: the prompt's KV blocks shared, copy-on-write), scores them, and takes each
completion's advantage relative to its group: (reward - group mean) / group std. The loss is
PPO's clipped surrogate over the completion tokens, its ratio between the policy's log-probs
now and the sampling policy's. Those come from the trainer's own teacher-forced forward
(`old_logprobs`); the engine's `logprobs=0` gives the same numbers for the sampled tokens
(`logprobs_mode="raw_logprobs"`, the default: the model's log-softmax before any processing),
and the loop checks that they agree."""),
    ("code", """\
GROUPS, GROUP_SIZE, LENGTH, CLIP = 32, 8, 48, 0.2
optimizer = nnx.Optimizer(policy, optax.adam(1e-3), wrt=nnx.Param)

def token_logprobs(model, tokens):
    logits = model(tokens[:, :-1])
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]

old_logprobs = nnx.jit(token_logprobs)

@nnx.jit
def train_step(model, optimizer, tokens, mask, advantages, old):
    def loss_fn(model):
        ratio = jnp.exp(token_logprobs(model, tokens) - old)
        clipped = jnp.clip(ratio, 1 - CLIP, 1 + CLIP)
        surrogate = jnp.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
        return -(surrogate * mask).sum() / mask.sum()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

def batch_of(outs, examples):
    \"\"\"Token rows (prompt + completion, right-padded), the completion tokens' mask, each
    row's advantage, rewards, and the engine's log-probs of the sampled tokens.\"\"\"
    rows = GROUPS * GROUP_SIZE
    tokens, mask = np.zeros((rows, LENGTH), np.int32), np.zeros((rows, LENGTH - 1), np.float32)
    engine_logprobs, advantages = np.zeros((rows, LENGTH - 1), np.float32), np.zeros(rows)
    rewards = np.zeros((GROUPS, GROUP_SIZE))
    for i, (out, example) in enumerate(zip(outs, examples)):
        rewards[i] = [reward(c.text, example) for c in out.outputs]
        group = (rewards[i] - rewards[i].mean()) / (rewards[i].std() + 1e-4)
        prompt = list(out.prompt_token_ids)
        for j, completion in enumerate(out.outputs):
            row, ids = i * GROUP_SIZE + j, list(completion.token_ids)
            tokens[row, :len(prompt) + len(ids)] = prompt + ids
            mask[row, len(prompt) - 1:len(prompt) - 1 + len(ids)] = 1
            engine_logprobs[row, len(prompt) - 1:len(prompt) - 1 + len(ids)] = [
                step[token].logprob for step, token in zip(completion.logprobs, ids)]
            advantages[row] = group[j]
    return tokens, mask, advantages, rewards, engine_logprobs"""),
    ("markdown", """\
## The loop

Sixty steps: rollouts from the engine, the trainer's log-probs, one optimizer step, the new
weights into the engine in place. The time of each phase is kept."""),
    ("code", """\
history, timing = [], dict(rollout=0.0, logprobs=0.0, train=0.0, update=0.0)
largest_gap = 0.0
for step in range(60):
    examples = recall_prompts(GROUPS, seed=step)
    start = time.perf_counter()
    outs = llm.generate([e.prompt for e in examples],
                        SamplingParams(n=GROUP_SIZE, temperature=1.0, max_tokens=4, logprobs=0,
                                       seed=step), use_tqdm=False)
    timing["rollout"] += time.perf_counter() - start
    assert {o.weight_version for o in outs} == {llm.weight_version}
    tokens, mask, advantages, rewards, engine_logprobs = batch_of(outs, examples)
    start = time.perf_counter()
    old = old_logprobs(policy, jnp.asarray(tokens))
    old.block_until_ready()
    timing["logprobs"] += time.perf_counter() - start
    largest_gap = max(largest_gap, float(np.max(np.abs(np.asarray(old) - engine_logprobs) * mask)))
    start = time.perf_counter()
    loss = train_step(policy, optimizer, jnp.asarray(tokens), jnp.asarray(mask),
                      jnp.asarray(advantages, jnp.float32), old)
    loss.block_until_ready()
    timing["train"] += time.perf_counter() - start
    start = time.perf_counter()
    llm.update_weights(policy, version=f"step-{step + 1}")
    timing["update"] += time.perf_counter() - start
    history.append((rewards.mean(), (rewards == 1).mean(), (rewards > 0).mean()))
    if step % 10 == 0 or step == 59:
        print(f"step {step:2d}: reward {rewards.mean():.3f}, right value {(rewards == 1).mean():.1%}, "
              f"a value {(rewards > 0).mean():.1%}")
print(f"engine vs trainer log-probs of the sampled tokens: largest gap {largest_gap:.1e}")
print("time: " + ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in timing.items()))"""),
    ("markdown", """\
## The reward curve and where the time went"""),
    ("code", """\
import matplotlib.pyplot as plt

history = np.array(history)
fig, (curve, split) = plt.subplots(1, 2, figsize=(11, 3.6), width_ratios=[2, 1])
steps = np.arange(1, len(history) + 1)
curve.plot(steps, history[:, 0], label="mean reward")
curve.plot(steps, history[:, 1], label="right value")
curve.plot(steps, history[:, 2], label="a value of the context", alpha=0.6)
curve.set_xlabel("optimizer step"), curve.set_ylim(0, 1.02), curve.legend(loc="center left")
curve.set_title("GRPO rollouts (32 prompts x 8 samples a step)")
split.barh(list(timing), list(timing.values()))
split.set_xlabel("seconds, all steps"), split.set_title("time split")
fig.tight_layout()
plt.show()"""),
    ("code", """\
exact, a_value, sample = evaluate()
print(f"after: right value {exact:.1%}, a value of the context {a_value:.1%} (greedy, the same "
      f"{len(held_out)} prompts); weight_version {sample.weight_version!r}")
print(f"mean reward: first ten steps {history[:10, 0].mean():.3f}, last ten "
      f"{history[-10:, 0].mean():.3f}; the engine updated in place "
      f"{llm.engine.num_weight_updates} times")"""),
]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="write the sources only")
    args = parser.parse_args()
    path = HERE / "grpo.ipynb"
    nb = notebook(CELLS) if args.no_execute else execute(notebook(CELLS))
    path.write_text(render(nb))
    print(f"wrote {path}")
