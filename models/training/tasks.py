"""Synthetic tasks for the shipped tiny model: each answer needs the prompt's context.

Byte vocabulary: token id = byte value for 0..255, BOS_ID = 256, EOS_ID = 257, VOCAB_SIZE = 264
(258..263 unused). A prompt is [BOS] + its bytes; an answer is its bytes + [EOS].

- recall: "k=493;P=118;x=027;q:P=" -> "118"; 3..10 pairs with distinct one-letter keys and
  three-digit values (prompts of 22..64 bytes), the queried key anywhere in the context.
- copy:   "copy:abc=" -> "abc" or "rev:abcde=" -> "edcba"; 1..16 letters.

(Multi-digit addition and longer recall contexts were tried and did not train within the
few-minute CPU budget; see the model card.)

Generators are deterministic in (task, seed) and draw from numpy's PCG64, which is the same on
every platform.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Sequence

import numpy as np

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 264
TASKS = ("recall", "copy")

MIN_PAIRS, MAX_PAIRS = 3, 10
MIN_COPY_LEN, MAX_COPY_LEN = 1, 16
KEYS = string.ascii_letters


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str


def _recall(rng: np.random.Generator) -> Example:
    num_pairs = int(rng.integers(MIN_PAIRS, MAX_PAIRS + 1))
    keys = [KEYS[k] for k in rng.choice(len(KEYS), size=num_pairs, replace=False)]
    values = [f"{v:03d}" for v in rng.integers(0, 1000, num_pairs)]
    query = int(rng.integers(num_pairs))
    context = ";".join(f"{k}={v}" for k, v in zip(keys, values))
    return Example("recall", f"{context};q:{keys[query]}=", values[query])


def recall_pairs(prompt: str) -> list[tuple[str, str]]:
    """The (key, value) pairs of a recall prompt's context, in order."""
    context = prompt.rsplit(";q:", 1)[0]
    return [(key, value) for key, value in (pair.split("=") for pair in context.split(";"))]


def recall_queries(example: Example, num_queries: int | None = None) -> list[Example]:
    """Recall examples asking about the first num_queries keys (all when None) of example's
    context: prompts that share the context as a prefix (prefix caching)."""
    context = example.prompt.rsplit(";q:", 1)[0]
    return [Example("recall", f"{context};q:{key}=", value)
            for key, value in recall_pairs(example.prompt)[:num_queries]]


def _copy(rng: np.random.Generator) -> Example:
    length = int(rng.integers(MIN_COPY_LEN, MAX_COPY_LEN + 1))
    text = "".join(rng.choice(list(string.ascii_lowercase), size=length))
    if rng.integers(2):
        return Example("copy", f"rev:{text}=", text[::-1])
    return Example("copy", f"copy:{text}=", text)


_GENERATORS = {"recall": _recall, "copy": _copy}


def sample_example(task: str, rng: np.random.Generator) -> Example:
    """One example of task drawn from rng (the training stream's building block)."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    return _GENERATORS[task](rng)


def make_examples(task: str, n: int, seed: int) -> list[Example]:
    """n examples of task, the same list for the same (task, seed)."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    rng = np.random.default_rng([TASKS.index(task), seed])
    return [_GENERATORS[task](rng) for _ in range(n)]


def encode_example(ex: Example) -> tuple[list[int], list[int]]:
    """(prompt_ids, answer_ids): [BOS] + prompt bytes, answer bytes + [EOS]."""
    return [BOS_ID, *ex.prompt.encode("ascii")], [*ex.answer.encode("ascii"), EOS_ID]


def decode_answer(token_ids: Sequence[int]) -> str:
    """The text of generated token_ids up to the first EOS (all of them when there is none);
    special ids are dropped."""
    data = bytearray()
    for t in token_ids:
        if t == EOS_ID:
            break
        if 0 <= t < 256:
            data.append(t)
    return data.decode("ascii", errors="replace")


def score(task_examples: Sequence[Example], predicted_texts: Sequence[str]) -> dict[str, float]:
    """Exact-match accuracy per task present in task_examples."""
    if len(task_examples) != len(predicted_texts):
        raise ValueError(f"{len(task_examples)=} examples but {len(predicted_texts)=} predictions")
    hits: dict[str, list[bool]] = {}
    for ex, text in zip(task_examples, predicted_texts):
        hits.setdefault(ex.task, []).append(text == ex.answer)
    return {task: sum(h) / len(h) for task, h in hits.items()}
