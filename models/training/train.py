"""Train the shipped tiny model on the synthetic tasks of pagedjax.models.training.tasks.

    python -m pagedjax.models.training.train --out models/checkpoints/pagedjax-tiny

A batch holds one group of rows per task, right-padded: causal attention means padding never
changes a real position. A copy row holds one example. A recall row holds one context and
several queries about it, each answer ended by EOS ("...;q:H=162<eos>q:k=868<eos>..."): the
first query is exactly the evaluation format, and the rest multiply the training signal of a
row (one query per row left recall at chance within the CPU budget). Recall rows follow a
curriculum: half-length rows (fewer pairs) for the first half of training. The loss is
cross-entropy on answer tokens and EOS only, averaged per task and then over tasks. Everything is
deterministic in the seed: the initial weights come from nnx.Rngs(seed) and the data from
numpy's PCG64 seeded with (seed, step).
"""

from __future__ import annotations

import argparse
import functools
import os
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

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import LlamaForCausalLM
from pagedjax.models.loading.checkpoint import save_checkpoint
from pagedjax.models.registry import init_model
from pagedjax.models.training.generate import dense_greedy_generate
from pagedjax.models.training.tasks import (BOS_ID, EOS_ID, MIN_PAIRS, TASKS, VOCAB_SIZE, Example,
                                            decode_answer, encode_example, make_examples,
                                            recall_pairs, sample_example, score)

TINY_CONFIG = LlamaConfig(
    vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4,
    num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=512,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, model_type="pagedjax-tiny")
# Rows per batch, as multiples of batch_size, and row lengths (the longest copy example is 24
# tokens); recall rows are seq_len long, shorter early in training.
ROWS_PER_BATCH_SIZE = {"recall": 3, "copy": 4}
ROW_LENS = {"copy": 48}
MIN_QUERIES = 2  # recall queries per row, at least (more when the row has room)
EVAL_SEED = 1_000_003  # training draws from seed sequences (seed, step), never this one

Batch = dict[str, tuple[jax.Array, jax.Array]]  # task -> (i32[R, S + 1], f32[R, S])


def pad_batch(rng: np.random.Generator, task: str, num_rows: int,
              row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids i32[R, S + 1], loss_mask f32[R, S]): one example of task per row, zero-padded.

    loss_mask[r, j] is 1 where token_ids[r, j + 1] is an answer token or EOS (the targets).
    Examples longer than a row are redrawn, so short rows also mean easier recall.
    """
    token_ids = np.zeros((num_rows, row_len + 1), np.int32)
    loss_mask = np.zeros((num_rows, row_len), np.float32)
    row = 0
    while row < num_rows:
        prompt_ids, answer_ids = encode_example(sample_example(task, rng))
        length = len(prompt_ids) + len(answer_ids)
        if length > row_len + 1:
            continue
        token_ids[row, :length] = prompt_ids + answer_ids
        loss_mask[row, len(prompt_ids) - 1:length - 1] = 1.0
        row += 1
    return token_ids, loss_mask


def recall_rows(rng: np.random.Generator, num_rows: int,
                row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Recall rows: a context, its evaluation-format query and answer, then further queries
    "q:K=" about random keys of the same context, each answer + EOS a target, until the row is
    full. Examples too long for MIN_QUERIES queries in the row are redrawn."""
    shortest = 6 * MIN_PAIRS + 5 + 8 * MIN_QUERIES  # BOS, pairs "K=VVV;", "q:K=", answers
    if row_len + 1 < shortest:
        raise ValueError(f"row_len must be >= {shortest - 1} for a recall row, got {row_len}")
    token_ids = np.zeros((num_rows, row_len + 1), np.int32)
    loss_mask = np.zeros((num_rows, row_len), np.float32)
    row = 0
    while row < num_rows:
        example = sample_example("recall", rng)
        prompt_ids, answer_ids = encode_example(example)
        query_len = len(answer_ids) + 4  # "q:K=" + answer + EOS
        if len(prompt_ids) + len(answer_ids) + (MIN_QUERIES - 1) * query_len > row_len + 1:
            continue
        ids = prompt_ids + answer_ids
        spans = [(len(prompt_ids), len(ids))]
        pairs = recall_pairs(example.prompt)
        while len(ids) + query_len <= row_len + 1:
            key, value = pairs[int(rng.integers(len(pairs)))]
            ids += list(f"q:{key}=".encode("ascii"))
            start = len(ids)
            ids += list(value.encode("ascii")) + [EOS_ID]
            spans.append((start, len(ids)))
        token_ids[row, :len(ids)] = ids
        for start, stop in spans:  # target token_ids[j + 1] sits at loss_mask[j]
            loss_mask[row, start - 1:stop - 1] = 1.0
        row += 1
    return token_ids, loss_mask


def recall_row_len(step: int, steps: int, seq_len: int) -> int:
    """The curriculum: half-length recall rows (fewer pairs fit) for the first half of
    training, full length after."""
    return seq_len // 2 if step < steps // 2 else seq_len


def make_batch(rng: np.random.Generator, step: int, steps: int, batch_size: int,
               seq_len: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A batch for step: task -> (token_ids, loss_mask). Recall keeps its token count as its
    rows shorten, so the curriculum sees more (shorter) recall examples."""
    batch = {}
    for task in TASKS:
        num_rows = ROWS_PER_BATCH_SIZE[task] * batch_size
        row_len = ROW_LENS.get(task, seq_len)
        if task == "recall":
            row_len = recall_row_len(step, steps, seq_len)
            batch[task] = recall_rows(rng, num_rows * seq_len // row_len, row_len)
        else:
            batch[task] = pad_batch(rng, task, num_rows, row_len)
    return batch


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


@functools.cache
def make_transform(steps: int, lr: float, warmup_steps: int,
                   weight_decay: float) -> optax.GradientTransformation:
    """AdamW on a warmup-cosine schedule, clipped. One object per hyperparameters: the
    transform is static in train_step's graph, so a second run with the same ones (the
    determinism test) reuses the compiled step instead of tracing it again."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup_steps, steps - 1), steps,
                                                  end_value=lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay,
                                   mask=_decay_mask))


def make_optimizer(model: LlamaForCausalLM, steps: int, lr: float, warmup_steps: int,
                   weight_decay: float) -> nnx.Optimizer:
    return nnx.Optimizer(model, make_transform(steps, lr, warmup_steps, weight_decay),
                         wrt=nnx.Param)


def masked_nll(model: LlamaForCausalLM, token_ids: jax.Array,
               loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy, number) of the masked targets of token_ids i32[R, S + 1]."""
    logits = model(token_ids[:, :-1])  # f32[R, S, V]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, token_ids[:, 1:])
    return jnp.sum(nll * loss_mask), jnp.sum(loss_mask)


def loss_fn(model: LlamaForCausalLM, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mean over all answer tokens of the batch, and each task's own mean."""
    sums = {task: masked_nll(model, *arrays) for task, arrays in batch.items()}
    total = jnp.asarray(sum(nll for nll, _ in sums.values())
                        / sum(count for _, count in sums.values()))
    return total, {task: nll / jnp.maximum(count, 1.0) for task, (nll, count) in sums.items()}


@nnx.jit
def train_step(model: LlamaForCausalLM, optimizer: nnx.Optimizer,
               batch: Batch) -> dict[str, jax.Array]:
    """One optimizer step; returns the loss of each task before it."""
    (_, losses), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return losses


def train(config: LlamaConfig, steps: int, seed: int, *, batch_size: int = 4,
          seq_len: int = 96, lr: float = 1e-3, warmup_steps: int = 50,
          weight_decay: float = 0.05, log_every: int = 0) -> tuple[LlamaForCausalLM, dict]:
    """A model trained for steps optimizer steps, and {losses (mean over tasks, per step),
    task_losses (task -> per step), train_time_s}."""
    model = init_model(config, seed=seed)
    optimizer = make_optimizer(model, steps, lr, warmup_steps, weight_decay)
    task_losses: dict[str, list[float]] = {task: [] for task in TASKS}
    start = time.perf_counter()
    for step in range(steps):
        batch = make_batch(np.random.default_rng([seed, step]), step, steps, batch_size, seq_len)
        losses = train_step(model, optimizer, jax.tree.map(jnp.asarray, batch))
        for task, loss in losses.items():
            task_losses[task].append(float(loss))
        if log_every and (step % log_every == 0 or step == steps - 1):
            recent = "  ".join(f"{task} {np.mean(values[-log_every:]):.3f}"
                               for task, values in task_losses.items())
            print(f"step {step:5d}  loss {recent}  {time.perf_counter() - start:6.1f}s",
                  flush=True)
    mean_losses = np.mean([task_losses[task] for task in TASKS], axis=0).tolist()
    return model, {"losses": mean_losses, "task_losses": task_losses,
                   "train_time_s": time.perf_counter() - start}


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
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=4,
                        help="rows per batch / 4: 3x recall rows, 4x copy rows")
    parser.add_argument("--seq-len", type=int, default=96, help="recall row length")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--eval-per-task", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    config = TINY_CONFIG
    print(f"{config.num_params:,} parameters; {args.steps} steps", flush=True)
    model, metrics = train(config, args.steps, args.seed, batch_size=args.batch_size,
                           seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                           log_every=args.log_every)
    accuracy = evaluate(model, args.eval_per_task)
    print("held-out accuracy: " + ", ".join(f"{t} {a:.3f}" for t, a in accuracy.items()))
    command = "python -m pagedjax.models.training.train " + " ".join(shlex.quote(a) for a in
                                                   (argv if argv is not None else sys.argv[1:]))
    metadata = {
        "tokenizer": "byte",  # pagedjax.text.tokenizer.ByteTokenizer: LLM(dir) picks it from this
        "accuracy": accuracy, "eval_per_task": args.eval_per_task, "eval_seed": EVAL_SEED,
        "steps": args.steps, "seed": args.seed, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "lr": args.lr, "warmup_steps": args.warmup_steps,
        "final_task_losses": {task: round(float(np.mean(values[-50:])), 4)
                              for task, values in metrics["task_losses"].items()},
        "train_time_s": round(metrics["train_time_s"], 1), "command": command,
        "machine": f"{platform.machine()} {jax.devices()[0].platform}, {os.cpu_count()} cores, "
                   f"jax {jax.__version__}",
    }
    save_checkpoint(model, args.out, metadata)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
