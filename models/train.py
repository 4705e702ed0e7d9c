"""Train the shipped tiny model on the synthetic tasks of models.tasks.

    python -m models.train --out models/checkpoints/pagedjax-tiny

Batches are packed: rows of seq_len + 1 tokens filled with whole examples back to back (each
starting with BOS, so a sequence at serving time looks like the start of a row). The loss is
cross-entropy on answer tokens and EOS only. Everything is deterministic in the seed: the
initial weights come from nnx.Rngs(seed) and the data stream from numpy's PCG64 seeded with
(seed, step).
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.checkpoint import save_checkpoint
from models.config import LlamaConfig
from models.generate import dense_greedy_generate
from models.llama import LlamaForCausalLM, init_model
from models.tasks import (BOS_ID, EOS_ID, TASKS, VOCAB_SIZE, Example, decode_answer,
                          encode_example, make_examples, sample_example, score)

TINY_CONFIG = LlamaConfig(
    vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4,
    num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=512,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, model_type="pagedjax-tiny")
TASK_WEIGHTS = {"recall": 0.4, "copy": 0.3, "add": 0.3}
EVAL_SEED = 1_000_003  # training draws from seed sequences (seed, step), never this one


def pack_batch(rng: np.random.Generator, batch_size: int, seq_len: int,
               task_weights: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids i32[B, S + 1], loss_mask f32[B, S]): rows of whole examples, zero-padded.

    loss_mask[b, j] is 1 where token_ids[b, j + 1] is an answer token or EOS (the targets).
    """
    tasks = list(task_weights)
    probs = np.array([task_weights[t] for t in tasks], np.float64)
    probs /= probs.sum()
    token_ids = np.zeros((batch_size, seq_len + 1), np.int32)
    loss_mask = np.zeros((batch_size, seq_len), np.float32)
    pending = None
    for row in range(batch_size):
        offset = 0
        while True:
            if pending is None:
                task = tasks[rng.choice(len(tasks), p=probs)]
                pending = encode_example(sample_example(task, rng))
            prompt_ids, answer_ids = pending
            length = len(prompt_ids) + len(answer_ids)
            if length > seq_len + 1:
                raise ValueError(f"an example of {length} tokens does not fit {seq_len=} + 1")
            if offset + length > seq_len + 1:
                break  # carried over to the next row
            token_ids[row, offset:offset + length] = prompt_ids + answer_ids
            start = offset + len(prompt_ids) - 1
            loss_mask[row, start:start + len(answer_ids)] = 1.0
            offset += length
            pending = None
    return token_ids, loss_mask


def make_optimizer(model: LlamaForCausalLM, steps: int, lr: float, warmup_steps: int,
                   weight_decay: float) -> nnx.Optimizer:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup_steps, steps - 1), steps,
                                                  end_value=lr * 0.05)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay,
                                 mask=decay_mask))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def loss_fn(model: LlamaForCausalLM, token_ids: jax.Array, loss_mask: jax.Array) -> jax.Array:
    logits = model(token_ids[:, :-1])  # f32[B, S, V]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, token_ids[:, 1:])
    return jnp.sum(nll * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)


@nnx.jit
def train_step(model: LlamaForCausalLM, optimizer: nnx.Optimizer, token_ids: jax.Array,
               loss_mask: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, token_ids, loss_mask)
    optimizer.update(model, grads)
    return loss


def train(config: LlamaConfig, steps: int, seed: int, *, batch_size: int = 16,
          seq_len: int = 320, lr: float = 2e-3, warmup_steps: int = 100,
          weight_decay: float = 0.05, task_weights: dict[str, float] | None = None,
          log_every: int = 0) -> tuple[LlamaForCausalLM, dict]:
    """A model trained for steps optimizer steps, and {losses, train_time_s}."""
    model = init_model(config, seed=seed)
    optimizer = make_optimizer(model, steps, lr, warmup_steps, weight_decay)
    task_weights = task_weights or TASK_WEIGHTS
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        rng = np.random.default_rng([seed, step])
        token_ids, loss_mask = pack_batch(rng, batch_size, seq_len, task_weights)
        loss = float(train_step(model, optimizer, jnp.asarray(token_ids), jnp.asarray(loss_mask)))
        losses.append(loss)
        if log_every and (step % log_every == 0 or step == steps - 1):
            recent = float(np.mean(losses[-log_every:]))
            print(f"step {step:5d}  loss {recent:.4f}  {time.perf_counter() - start:7.1f}s",
                  flush=True)
    return model, {"losses": losses, "train_time_s": time.perf_counter() - start}


def greedy_answers(model: LlamaForCausalLM, examples: Sequence[Example],
                   batch_size: int = 64) -> list[str]:
    """Greedy dense decode of each example's prompt, as answer text (up to EOS). Each batch is
    padded to batch_size rows and a multiple of 32 tokens so few programs are compiled."""
    texts = [""] * len(examples)
    for task in sorted({ex.task for ex in examples}):
        indices = [i for i, ex in enumerate(examples) if ex.task == task]
        encoded = [encode_example(examples[i]) for i in indices]
        max_tokens = max(len(a) for _, a in encoded) + 1
        padded_len = -(-(max(len(p) for p, _ in encoded) + max_tokens) // 32) * 32
        for chunk in range(0, len(indices), batch_size):
            prompts = [p for p, _ in encoded[chunk:chunk + batch_size]]
            num_real = len(prompts)
            prompts += [prompts[0]] * (batch_size - num_real)
            outputs = dense_greedy_generate(model, prompts, max_tokens, padded_len)
            for i, ids in zip(indices[chunk:chunk + num_real], outputs):
                texts[i] = decode_answer(ids)
    return texts


def evaluate(model: LlamaForCausalLM, num_per_task: int, seed: int = EVAL_SEED,
             batch_size: int = 64) -> dict[str, float]:
    """Greedy exact-match accuracy per task on num_per_task held-out examples each."""
    examples = [ex for task in TASKS for ex in make_examples(task, num_per_task, seed)]
    return score(examples, greedy_answers(model, examples, batch_size))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the pagedjax-tiny model.")
    parser.add_argument("--out", required=True, help="checkpoint directory (must not exist)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=320)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--eval-per-task", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    config = TINY_CONFIG
    print(f"{config.num_params:,} parameters; {args.steps} steps of {args.batch_size} x "
          f"{args.seq_len} tokens", flush=True)
    model, metrics = train(config, args.steps, args.seed, batch_size=args.batch_size,
                           seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                           log_every=args.log_every)
    accuracy = evaluate(model, args.eval_per_task)
    print("held-out accuracy: " + ", ".join(f"{t} {a:.3f}" for t, a in accuracy.items()))
    command = "python -m models.train " + " ".join(shlex.quote(a) for a in
                                                   (argv if argv is not None else sys.argv[1:]))
    metadata = {
        "accuracy": accuracy, "eval_per_task": args.eval_per_task, "eval_seed": EVAL_SEED,
        "steps": args.steps, "seed": args.seed, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "lr": args.lr, "warmup_steps": args.warmup_steps,
        "final_loss": float(np.mean(metrics["losses"][-50:])),
        "train_time_s": round(metrics["train_time_s"], 1), "command": command,
        "machine": f"{platform.machine()} {jax.devices()[0].platform}, "
                   f"{jax.device_count()} device(s), jax {jax.__version__}",
    }
    save_checkpoint(model, args.out, metadata)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
