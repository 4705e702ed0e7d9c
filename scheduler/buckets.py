"""Shape buckets: the fixed set of padded sizes, so jit compiles a bounded number of programs."""

from __future__ import annotations

import bisect
import dataclasses

from pagedjax.scheduler.kv_cache_groups import group_table_width


def power_of_two_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """Powers of two from minimum up to maximum, with maximum itself always the last bucket."""
    if minimum < 1 or maximum < 1:
        raise ValueError(f"bucket bounds must be >= 1, got {minimum=} {maximum=}")
    minimum = min(minimum, maximum)
    sizes = []
    size = 1
    while size < minimum:
        size *= 2
    while size < maximum:
        sizes.append(size)
        size *= 2
    sizes.append(maximum)
    return tuple(sizes)


def token_paddings(minimum: int, maximum: int, gap: int = 0) -> tuple[int, ...]:
    """A step's padded token counts (vLLM TPU's token paddings, VLLM_TPU_BUCKET_PADDING_GAP):
    gap 0, powers of two (power_of_two_buckets); gap > 0, powers of two up to gap, then every
    multiple of gap, fewer tokens of padding a step for more programs; maximum always last."""
    if isinstance(gap, bool) or not isinstance(gap, int) or not (gap == 0 or gap >= minimum):
        raise ValueError(f"token_padding_gap must be 0 or an integer >= min_token_bucket "
                         f"({minimum}), got {gap!r}")
    powers = power_of_two_buckets(minimum, maximum)
    if not gap or gap >= maximum:
        return powers
    powers = tuple(p for p in powers if p <= gap)
    return powers + tuple(range(powers[-1] + gap, maximum, gap)) + (maximum,)


def pad_to_bucket(n: int, buckets: tuple[int, ...]) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


PREFILL_SEQS = ("bucketed", "per_token_bucket")


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    """Padded sizes of a step.

    token_buckets: padded token counts T of a prefill (ragged) step.
    seq_buckets: padded sequence counts B; a decode step has T == B.
    max_blocks_per_seq: the block table width P, fixed by max_model_len.
    group_table_width: the width of the tables of a hybrid model's KV cache groups past the
        first (scheduler.kv_cache_groups.group_table_width: a sliding group's is a ring of its
        window's blocks, narrower than P); None: P.
    prefill_seqs: how a prefill step's B is padded: "bucketed" (the seq bucket of its sequence
        count: a program per (T, B) pair) or "per_token_bucket" (the seq bucket of min(T,
        max_num_seqs), the most sequences T tokens can hold: one program per T; rows beyond the
        real ones are padding).
    num_speculative_tokens: K, the drafts a row of a speculative step may verify (its plan's
        draft columns; 0: the engine does not speculate). A step with drafts (decodes alone)
        runs a ragged program of (T, B) with B the seq bucket of its rows, K + 1 logits a row.
    max_speculative_seqs: the most rows a step speculates with (the engine's
        disable_by_batch_size; None: max_num_seqs), the bound of speculative_shapes.
    decode_programs: True, a decode step (one token a sequence) has its own family of programs
        (T == B, the decode attention kernels); False, every step runs the ragged family (a
        decode step padded like a prefill of as many tokens), as vLLM V1 and tpu-inference do:
        fewer programs to compile.
    """

    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    max_blocks_per_seq: int
    prefill_seqs: str = "bucketed"
    decode_programs: bool = True
    group_table_width: int | None = None
    num_speculative_tokens: int = 0
    max_speculative_seqs: int | None = None

    def __post_init__(self):
        if self.prefill_seqs not in PREFILL_SEQS:
            raise ValueError(f"prefill_seqs must be one of {PREFILL_SEQS}, "
                             f"got {self.prefill_seqs!r}")

    @classmethod
    def create(cls, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
               block_size: int, min_token_bucket: int = 16, min_seq_bucket: int = 1,
               prefill_seqs: str = "bucketed", decode_programs: bool = True,
               group_windows: tuple[int | None, ...] = (None,), num_speculative_tokens: int = 0,
               max_speculative_seqs: int | None = None, token_padding_gap: int = 0):
        """group_windows: the windows of the model's KV cache groups (None: full attention);
        token_padding_gap: the token buckets' (token_paddings)."""
        return cls(
            token_buckets=token_paddings(min_token_bucket, max_num_batched_tokens,
                                         token_padding_gap),
            seq_buckets=power_of_two_buckets(min_seq_bucket, max_num_seqs),
            max_blocks_per_seq=-(-max_model_len // block_size),
            prefill_seqs=prefill_seqs,
            decode_programs=decode_programs,
            group_table_width=group_table_width(group_windows, block_size, max_model_len,
                                                max_num_batched_tokens),
            num_speculative_tokens=num_speculative_tokens,
            max_speculative_seqs=max_speculative_seqs,
        )

    @property
    def table_widths(self) -> tuple[int, int]:
        """(P, the width of the other groups' tables): the block-table shapes of a plan."""
        return self.max_blocks_per_seq, self.group_table_width or self.max_blocks_per_seq

    def padded_num_tokens(self, num_tokens: int) -> int:
        return pad_to_bucket(num_tokens, self.token_buckets)

    def padded_num_seqs(self, num_seqs: int) -> int:
        return pad_to_bucket(num_seqs, self.seq_buckets)

    def padded_prefill_seqs(self, num_seqs: int, padded_tokens: int) -> int:
        """B of a prefill step of num_seqs sequences padded to padded_tokens tokens."""
        if self.prefill_seqs == "per_token_bucket":  # (fork followers add rows, not tokens)
            return max(self._most_seqs(padded_tokens), self.padded_num_seqs(num_seqs))
        return self.padded_num_seqs(num_seqs)

    def _most_seqs(self, padded_tokens: int) -> int:
        return self.padded_num_seqs(min(padded_tokens, self.seq_buckets[-1]))

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (T, B) a prefill step can have: B sequences need at least B tokens."""
        if self.prefill_seqs == "per_token_bucket":
            return [(t, self._most_seqs(t)) for t in self.token_buckets]
        shapes = []
        for t in self.token_buckets:
            for b in self.seq_buckets:
                if b <= t or b == self.padded_num_seqs(min(t, self.seq_buckets[-1])):
                    shapes.append((t, b))
        return shapes

    @property
    def speculative_token_buckets(self) -> tuple[int, ...]:
        """The T of a speculative step: powers of two from 2 (min_token_bucket is for
        prefills; a decode step's k + 1 tokens a row would mostly be padding in it)."""
        return power_of_two_buckets(2, self.token_buckets[-1])

    def padded_speculative_tokens(self, num_tokens: int) -> int:
        return pad_to_bucket(num_tokens, self.speculative_token_buckets)

    def speculative_shapes(self) -> list[tuple[int, int]]:
        """Every (T, B) of a speculative step (drafts ride only in steps of decodes alone:
        scheduler.schedule) with up to max_speculative_seqs rows: B the seq bucket of its
        rows, T the speculative token bucket of their tokens (each row 1 to K + 1)."""
        if not self.num_speculative_tokens:
            return []
        most, top = self.seq_buckets[-1], self.token_buckets[-1]
        limit = self.padded_num_seqs(min(self.max_speculative_seqs or most, most))
        shapes, smaller = [], 0
        for b in self.seq_buckets:
            if b > limit:
                break
            low = self.padded_speculative_tokens(min(smaller + 2, top))
            high = self.padded_speculative_tokens(min(b * (self.num_speculative_tokens + 1),
                                                      top))
            shapes += [(t, b) for t in self.speculative_token_buckets if low <= t <= high]
            smaller = b
        return shapes

    def decode_shapes(self) -> list[int]:
        return list(self.seq_buckets) if self.decode_programs else []

    @property
    def num_programs(self) -> int:
        return (len(self.prefill_shapes()) + len(self.decode_shapes())
                + len(self.speculative_shapes()))
