"""Poolers: a sequence's final hidden states (after the model's last norm, as transformers'
last_hidden_state and sentence-transformers' token_embeddings) reduced to one vector, fed
chunk by chunk in position order as chunked prefill computes them, so no step holds a whole
long prompt's states.

The modes are sentence-transformers' (its Pooling module, concatenated in the order given):
cls (the first token), max, mean, mean_sqrt_len_tokens (the sum over sqrt(tokens)),
weightedmean (token i weighted i + 1) and lasttoken; vLLM's pooling types map onto them
(LAST, MEAN, CLS; ALL keeps every token's state: mode "all", alone). Accumulation is in f32
whatever the hidden dtype (sentence-transformers' rule for 16-bit embeddings).
"""

from __future__ import annotations

import dataclasses

import numpy as np

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken",
                 "all")
# vLLM's pooling types (--pooler-config's pooling_type) as modes
POOLING_TYPES = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls", "ALL": "all"}


def check_modes(modes: tuple[str, ...]) -> None:
    if not modes:
        raise ValueError("a pooler needs at least one pooling mode")
    for mode in modes:
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {mode!r}")
    if "all" in modes and len(modes) > 1:
        raise ValueError("pooling mode 'all' (every token's state) combines with no other mode")


@dataclasses.dataclass
class _Sums:
    """A pooled sequence's running statistics (f32[D] each): its first and last rows, the
    maximum, the sum, and the sum weighted by position (1-based)."""

    first: np.ndarray
    maximum: np.ndarray
    total: np.ndarray
    weighted: np.ndarray
    last: np.ndarray


class PooledSequence:
    """The running pool of one sequence (modes: check_modes): add() each computed chunk of its
    hidden states in position order, result() once the last one is in."""

    def __init__(self, modes: tuple[str, ...]):
        check_modes(modes)
        self.modes = modes
        self.count = 0
        self.sums: _Sums | None = None  # from the first chunk on
        self.rows: list[np.ndarray] = []

    @property
    def needs_every_token(self) -> bool:
        """Whether every position's state is needed (all modes but lasttoken alone: a prefix
        cache hit may serve the positions before the last)."""
        return self.modes != ("lasttoken",)

    def add(self, hidden: np.ndarray, start: int) -> None:
        """hidden [n, D]: the states of positions start .. start + n - 1 (lasttoken alone:
        positions may be skipped)."""
        if start < self.count or (start > self.count and self.needs_every_token):
            raise ValueError(f"a pooled sequence takes its chunks in order: position {start} "
                             f"after {self.count} tokens")
        if hidden.ndim != 2 or hidden.shape[0] == 0:
            raise ValueError(f"a chunk is [tokens >= 1, hidden], got {hidden.shape}")
        rows = np.asarray(hidden, np.float32)
        self.count = start
        weights = np.arange(start + 1, start + rows.shape[0] + 1, dtype=np.float32)
        sums = self.sums
        if sums is None:
            self.sums = _Sums(rows[0], rows.max(axis=0), rows.sum(axis=0), weights @ rows,
                              rows[-1])
        else:
            sums.maximum = np.maximum(sums.maximum, rows.max(axis=0))
            sums.total = sums.total + rows.sum(axis=0)
            sums.weighted = sums.weighted + weights @ rows
            sums.last = rows[-1]
        if "all" in self.modes:
            self.rows.append(rows)
        self.count += rows.shape[0]

    def result(self) -> np.ndarray:
        """f32[len(modes) * D], or f32[tokens, D] for mode "all"."""
        sums = self.sums
        if self.count == 0 or sums is None:
            raise ValueError("nothing was pooled: the sequence has no computed tokens")
        if self.modes == ("all",):
            return np.concatenate(self.rows)
        n = np.float32(self.count)
        parts = {"cls": sums.first, "max": sums.maximum, "mean": sums.total / n,
                 "mean_sqrt_len_tokens": sums.total / np.sqrt(n),
                 "weightedmean": sums.weighted / (n * (n + 1) / 2), "lasttoken": sums.last}
        return np.concatenate([parts[mode] for mode in self.modes])


def finish_embedding(vector: np.ndarray, *, normalize: bool, dimensions: int | None = None,
                     matryoshka: tuple[int, ...] | bool = False) -> np.ndarray:
    """An embedding as served: Matryoshka truncation to `dimensions` (refused, naming the
    field, where the model does not declare it: matryoshka False, or a list without that
    size), then L2 normalization (a zero vector stays zero)."""
    if dimensions is not None:
        width = vector.shape[-1]
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
        if not matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka "
                             "representation (its config declares no matryoshka_dimensions)")
        if not isinstance(matryoshka, bool) and dimensions not in matryoshka:
            raise ValueError(f"dimensions must be one of the model's Matryoshka dimensions "
                             f"{list(matryoshka)}, got {dimensions}")
        if dimensions > width:
            raise ValueError(f"dimensions {dimensions} exceeds the embedding's {width}")
        vector = vector[..., :dimensions]
    if normalize:
        norm = np.linalg.norm(vector, axis=-1, keepdims=True)
        vector = vector / np.maximum(norm, np.float32(1e-12))  # torch F.normalize's eps
    return vector


def step_rows(rows: np.ndarray, prompt_token_ids, step_tag_id: int | None,
              returned_token_ids) -> np.ndarray:
    """vLLM's STEP pooler over a sequence's per-token outputs rows [tokens, C]: the
    returned_token_ids columns (None: all), then the rows whose prompt token is step_tag_id
    (None: all; a prompt without one gives [0, C'])."""
    if returned_token_ids:
        rows = rows[:, list(returned_token_ids)]
    if step_tag_id is not None:
        ids = np.asarray(list(prompt_token_ids))
        if ids.shape != (rows.shape[0],):
            raise ValueError(f"the STEP pooler needs one prompt token a row: {ids.shape[0]} "
                             f"tokens for {rows.shape[0]} rows")
        rows = rows[ids == step_tag_id]
    return rows
