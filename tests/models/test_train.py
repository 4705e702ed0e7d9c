"""The synthetic tasks, the training loop, and the shipped pagedjax-tiny checkpoint."""

import os
import re

import jax
import numpy as np
import pytest

from pagedjax.models.config import LlamaConfig
from pagedjax.models.loading.checkpoint import load_checkpoint, read_checkpoint_config
from pagedjax.models.training.tasks import (BOS_ID, EOS_ID, TASKS, VOCAB_SIZE, Example,
                                            decode_answer, encode_example, make_examples, score)
from pagedjax.models.training.train import (evaluate, make_batch, pad_batch, recall_row_len,
                                            recall_rows, train)

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "..", "models", "checkpoints",
                          "pagedjax-tiny")
MICRO_CONFIG = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                           num_layers=1, num_heads=2, num_kv_heads=1, tie_word_embeddings=True,
                           max_position_embeddings=512, bos_token_id=BOS_ID,
                           eos_token_id=EOS_ID)


def test_recall_answer_is_the_queried_value():
    lengths = []
    for ex in make_examples("recall", 300, seed=2):
        context, query = re.fullmatch(r"(.*);q:(\w+)=", ex.prompt).groups()
        pairs = [pair.split("=") for pair in context.split(";")]
        table = dict(pairs)
        assert len(table) == len(pairs), "keys must be unique"
        assert ex.answer == table[query]
        lengths.append(len(ex.prompt))
    assert min(lengths) <= 30 and max(lengths) >= 55


def test_copy_answers():
    kinds = set()
    for ex in make_examples("copy", 200, seed=3):
        kind, text = re.fullmatch(r"(copy|rev):([a-z]+)=", ex.prompt).groups()
        kinds.add(kind)
        assert ex.answer == (text if kind == "copy" else text[::-1])
    assert kinds == {"copy", "rev"}


@pytest.mark.parametrize("task", TASKS)
def test_generators_are_deterministic_in_seed(task):
    assert make_examples(task, 20, seed=5) == make_examples(task, 20, seed=5)
    assert make_examples(task, 20, seed=5) != make_examples(task, 20, seed=6)


def test_encode_decode_and_score():
    ex = Example("recall", "a=12;q:a=", "15")
    prompt_ids, answer_ids = encode_example(ex)
    assert prompt_ids == [BOS_ID, *b"a=12;q:a="] and answer_ids == [*b"15", EOS_ID]
    assert decode_answer(answer_ids + [ord("9")]) == "15"
    other = Example("copy", "copy:ab=", "ab")
    assert score([ex, other, ex], ["15", "ab", "16"]) == {"recall": 0.5, "copy": 1.0}


@pytest.mark.parametrize("task", TASKS)
def test_pad_batch_masks_exactly_the_answers(task):
    token_ids, loss_mask = pad_batch(np.random.default_rng(0), task, 8, 112)
    for row, mask in zip(token_ids, loss_mask):
        assert row[0] == BOS_ID
        (eos,) = np.flatnonzero(row == EOS_ID)
        (equals,) = np.flatnonzero(row[:eos] == ord("="))[-1:]
        # targets from the first answer token through EOS, nothing else
        assert mask.tolist() == [1.0 if equals <= j < eos else 0.0 for j in range(len(mask))]
        assert np.all(row[eos + 1:] == 0)


def test_recall_rows_hold_a_context_and_several_queries():
    token_ids, loss_mask = recall_rows(np.random.default_rng(0), 6, 96)
    for row, mask in zip(token_ids, loss_mask):
        text = bytes(t for t in row if t < 256).decode()
        context = text.split(";q:")[0]
        table = dict(pair.split("=") for pair in context.split(";"))
        queries = re.findall(r"q:(\w)=(\d{3})", text)
        assert len(queries) >= 2 and all(table[k] == v for k, v in queries)
        targets = row[1:][mask == 1]  # every answer digit and its EOS, nothing else
        assert list(targets) == [t for _, v in queries for t in [*v.encode(), EOS_ID]]
        first_eos = int(np.flatnonzero(row == EOS_ID)[0])
        prompt_ids, answer_ids = encode_example(Example(
            "recall", text[:text.index(";q:") + 5], queries[0][1]))
        assert list(row[:first_eos + 1]) == prompt_ids + answer_ids  # the evaluation format


def test_recall_curriculum_halves_rows_and_keeps_tokens():
    assert [recall_row_len(step, 100, 96) for step in (0, 49, 50, 99)] == [48, 48, 96, 96]
    batch = make_batch(np.random.default_rng(0), 0, 100, batch_size=2, seq_len=96)
    assert batch["recall"][0].shape == (2 * 3 * 2, 49)
    assert batch["copy"][0].shape == (8, 49)


@pytest.mark.slow  # make test-slow
def test_training_lowers_loss_and_is_deterministic():
    kwargs = dict(batch_size=1, seq_len=80, lr=1e-2, warmup_steps=2)  # recall rows 40 then 80
    model_a, metrics_a = train(MICRO_CONFIG, 30, seed=0, **kwargs)
    model_b, metrics_b = train(MICRO_CONFIG, 30, seed=0, **kwargs)
    losses = metrics_a["losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    assert metrics_a["losses"] == metrics_b["losses"]
    for a, b in zip(jax.tree.leaves(model_a), jax.tree.leaves(model_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # make test-slow
def test_shipped_checkpoint_reaches_its_recorded_accuracy():
    _, record = read_checkpoint_config(CHECKPOINT)
    recorded = record["metadata"]["accuracy"]
    assert set(recorded) == set(TASKS)
    model = load_checkpoint(CHECKPOINT)
    accuracy = evaluate(model, num_per_task=20, seed=7, batch_size=20)
    for task in TASKS:
        assert accuracy[task] >= recorded[task] - 0.15, (task, accuracy, recorded)
