"""The BatchPlan: what one step computes, as fixed-shape NumPy arrays."""

from __future__ import annotations

import dataclasses

import numpy as np

from scheduler.block_pool import NULL_BLOCK
from scheduler.buckets import ShapeBuckets
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import MAX_LOGIT_BIAS
from scheduler.state import DECODE, PREFILL, SchedulerOutput

ARRAY_FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "kv_lens", "cu_q_lens",
                "logits_indices", "num_seqs", "temperature", "top_k", "top_p", "min_p", "seeds",
                "bias_ids", "bias_values", "copy_src", "copy_dst", "num_copies")
STATIC_FIELDS = ("kind", "padded_num_tokens", "padded_num_seqs")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """One step's inputs. Only the first num_seqs rows (and cu_q_lens[num_seqs] tokens) are real.

    Padding rows have kv_len 0 and no query tokens; padding tokens write their K/V to the null
    block; padding table entries point at the null block. Padding never changes a real result.
    """

    token_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T] absolute position of each token
    slot_mapping: np.ndarray  # i32[T] block * S + offset where each token's K/V is written
    block_tables: np.ndarray  # i32[B, P]
    kv_lens: np.ndarray  # i32[B] context length after this step (0 for padding rows)
    cu_q_lens: np.ndarray  # i32[B + 1] start of each sequence's query tokens in token_ids
    logits_indices: np.ndarray  # i32[B] the token of each sequence that is sampled
    num_seqs: np.ndarray  # i32[] number of real rows
    temperature: np.ndarray  # f32[B] 0 means greedy
    top_k: np.ndarray  # i32[B] -1 means disabled
    top_p: np.ndarray  # f32[B]
    min_p: np.ndarray  # f32[B] 0 means disabled
    # logit_bias, MAX_LOGIT_BIAS slots a row: bias_values[b, j] is added to the logit of token
    # bias_ids[b, j] before sampling; unused slots add 0 to token 0.
    bias_ids: np.ndarray  # i32[B, MAX_LOGIT_BIAS]
    bias_values: np.ndarray  # f32[B, MAX_LOGIT_BIAS]
    seeds: np.ndarray  # u32[B] per-request seed; the sample at position p uses fold_in(seed, p)
    copy_src: np.ndarray  # i32[B] copy-on-write: block copy_src[i] -> copy_dst[i] before writes
    copy_dst: np.ndarray  # i32[B] (padding pairs copy the null block onto itself)
    num_copies: np.ndarray  # i32[]
    kind: str  # PREFILL or DECODE
    padded_num_tokens: int  # T
    padded_num_seqs: int  # B


def _padded_shape(output: SchedulerOutput, buckets: ShapeBuckets,
                  num_seqs: int) -> tuple[str, int, int]:
    """(the program kind, T, B): without decode programs a decode step runs the ragged family,
    padded like a prefill."""
    kind = output.kind if buckets.decode_programs else PREFILL
    if kind == DECODE:
        padded_seqs = buckets.padded_num_seqs(num_seqs)
        return kind, padded_seqs, padded_seqs
    padded_tokens = buckets.padded_num_tokens(output.num_scheduled_tokens)
    return kind, padded_tokens, buckets.padded_prefill_seqs(num_seqs, padded_tokens)


def _rows(scheduled, kv_manager: KVCacheManager, block_tables: np.ndarray):
    """Each row's query tokens (back to back), its block table (into block_tables), and its
    start, query length and sampling settings as lists."""
    tokens: list[int] = []
    columns = {name: [] for name in ("start", "q_len", "temperature", "top_k", "top_p", "min_p",
                                     "seed", "logit_bias")}
    for i, (request, start, n) in enumerate(scheduled):
        if n == 1:
            tokens.append(request.token_id_at(start))
        else:
            tokens.extend(request.token_ids_slice(start, start + n))
        if n:
            table = kv_manager.get_block_table(request.request_id)
            block_tables[i, :len(table)] = table
        params = request.sampling_params
        for name, value in (("start", start), ("q_len", n), ("temperature", params.temperature),
                            ("top_k", params.top_k), ("top_p", params.top_p),
                            ("min_p", params.min_p), ("seed", request.seed),
                            ("logit_bias", params.logit_bias)):
            columns[name].append(value)
    return tokens, columns


def logit_bias_slots(rows, padded_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's logit_bias pairs in its MAX_LOGIT_BIAS slots: (ids i32[B, L], biases f32)."""
    ids = np.zeros((padded_seqs, MAX_LOGIT_BIAS), np.int32)
    values = np.zeros((padded_seqs, MAX_LOGIT_BIAS), np.float32)
    for i, pairs in enumerate(rows):
        if pairs:
            ids[i, :len(pairs)], values[i, :len(pairs)] = zip(*pairs)
    return ids, values


def _positions(output: SchedulerOutput, starts, q_lens, kv_lens, seq_of_token,
               padded_tokens: int) -> np.ndarray:
    """Each token's absolute position: a decode's is its row's start; in a chunk, the start of
    its sequence plus its offset inside the chunk."""
    num_tokens = output.num_scheduled_tokens
    positions = np.zeros(padded_tokens, np.int32)
    if output.kind == DECODE:
        positions[:num_tokens] = starts
    else:
        first_token = np.cumsum(q_lens) - q_lens
        positions[:num_tokens] = (kv_lens - q_lens)[seq_of_token] + (
            np.arange(num_tokens, dtype=np.int32) - first_token[seq_of_token])
    return positions


def _logits_indices(output: SchedulerOutput, cu_q_lens: np.ndarray) -> np.ndarray:
    """Each row's last query token; a fork follower samples from its leader's."""
    logits_indices = np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32)
    if output.forks:
        leader_row = {id(s.request): i for i, s in enumerate(output.scheduled)}
        for k, (leader, _) in enumerate(output.forks):
            logits_indices[len(output.scheduled) + k] = logits_indices[leader_row[id(leader)]]
    return logits_indices


def build_plan(output: SchedulerOutput, kv_manager: KVCacheManager,
               buckets: ShapeBuckets) -> BatchPlan:
    """Lays out the scheduled sequences back to back and pads every array to its bucket.

    Fork followers come last, as rows with no query tokens whose logits index is their
    leader's last token: they sample their first token from the leader's prompt logits.
    """
    scheduled = list(output.scheduled) + [(f, leader.num_tokens, 0) for leader, f in output.forks]
    num_seqs = len(scheduled)
    if num_seqs == 0:
        raise ValueError("cannot build a plan for an empty schedule")
    num_tokens = output.num_scheduled_tokens
    kind, padded_tokens, padded_seqs = _padded_shape(output, buckets, num_seqs)
    block_tables = np.full((padded_seqs, buckets.max_blocks_per_seq), NULL_BLOCK, np.int32)
    tokens, rows = _rows(scheduled, kv_manager, block_tables)

    def padded(name, fill, dtype):
        out = np.full(padded_seqs, fill, dtype)
        out[:num_seqs] = rows[name]
        return out

    q_lens = padded("q_len", 0, np.int32)
    kv_lens = padded("start", 0, np.int32) + q_lens
    token_ids = np.zeros(padded_tokens, np.int32)
    token_ids[:num_tokens] = tokens
    seq_of_token = np.repeat(np.arange(padded_seqs, dtype=np.int32), q_lens)
    positions = _positions(output, rows["start"], q_lens, kv_lens, seq_of_token, padded_tokens)
    cu_q_lens = np.zeros(padded_seqs + 1, np.int32)
    np.cumsum(q_lens, out=cu_q_lens[1:])
    bias_ids, bias_values = logit_bias_slots(rows["logit_bias"], padded_seqs)
    copy_src = np.zeros(padded_seqs, np.int32)
    copy_dst = np.zeros(padded_seqs, np.int32)
    if output.copies:
        copy_src[:len(output.copies)], copy_dst[:len(output.copies)] = zip(*output.copies)
    # Slots of real tokens; padding tokens keep slot 0, which lies in the null block.
    pos, block_size = positions[:num_tokens], kv_manager.block_size
    slot_mapping = np.zeros(padded_tokens, np.int32)
    slot_mapping[:num_tokens] = (block_tables[seq_of_token, pos // block_size] * block_size
                                 + pos % block_size)
    return BatchPlan(
        token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
        block_tables=block_tables, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
        logits_indices=_logits_indices(output, cu_q_lens),
        num_seqs=np.asarray(num_seqs, np.int32), temperature=padded("temperature", 0.0, np.float32),
        top_k=padded("top_k", -1, np.int32), top_p=padded("top_p", 1.0, np.float32),
        min_p=padded("min_p", 0.0, np.float32), bias_ids=bias_ids, bias_values=bias_values,
        seeds=padded("seed", 0, np.uint32), copy_src=copy_src, copy_dst=copy_dst,
        num_copies=np.asarray(len(output.copies), np.int32), kind=kind,
        padded_num_tokens=padded_tokens, padded_num_seqs=padded_seqs)
