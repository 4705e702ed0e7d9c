"""Scores of (query, document) pairs as vLLM computes them (LLM.score, /score, /rerank): a
cross-encoder (a model with a one-label classification head) reads the pair as one prompt
(pagedjax.engine.request_checks.encode_pair: the tokenizer's pair template) and scores it
with its head; an embedding model scores the cosine of the two embeddings."""

from __future__ import annotations

import numpy as np

from pagedjax.scheduler.errors import RequestError


def pairs(firsts: list, seconds: list, field: str = "data_2") -> tuple[list, list]:
    """vLLM's pairing: one first against every second, or as many of each, pairwise."""
    if not firsts or not seconds:
        raise RequestError(field, "score needs at least one item on each side")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise RequestError(field, f"score pairs {len(firsts)} items with {len(seconds)}: give "
                           "one, or as many")
    return firsts, seconds


def check_cross_encoder(head) -> None:
    """RequestError unless head (a ClassifierHead, or None for an embedding model) scores one
    label."""
    if head is not None and head.num_labels != 1:
        raise RequestError("model", f"score needs a classifier with one label (a "
                           f"cross-encoder); this model's has {head.num_labels}")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
