"""The BatchPlan: what one step computes, as fixed-shape NumPy arrays."""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.scheduler.block_pool import NULL_BLOCK
from pagedjax.scheduler.buckets import ShapeBuckets
from pagedjax.scheduler.kv_cache_groups import HybridKVCacheManager
from pagedjax.scheduler.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.scheduler.plan_rows import pooling_rows, prompt_targets
from pagedjax.scheduler.request import MAX_LOGIT_BIAS
from pagedjax.scheduler.state import DECODE, PREFILL, ScheduledSeq, SchedulerOutput

# What the model's forward reads, and what the sampler reads (kv_lens: the sampled position).
FORWARD_FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "kv_lens",
                  "cu_q_lens", "logits_indices", "num_seqs", "copy_src", "copy_dst", "num_copies",
                  "prompt_targets", "pooling_rows", "group_slot_mapping", "group_block_tables",
                  "lora_slots")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "kv_lens", "bias_ids",
                   "bias_values", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "penalty_tokens", "penalty_prompt_lens", "draft_token_ids",
                   "num_draft_tokens")
ARRAY_FIELDS = FORWARD_FIELDS + tuple(f for f in SAMPLING_FIELDS if f not in FORWARD_FIELDS)
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
    # The KV cache groups past the first (scheduler.kv_cache_groups: a hybrid model's sliding
    # and global layers keep a table each): G - 1 rows, none for a model with one group.
    group_slot_mapping: np.ndarray  # i32[G - 1, T]
    # A sliding group's table is a ring narrower than P (ShapeBuckets.group_table_width):
    # logical block p of a row at column p % width.
    group_block_tables: np.ndarray  # i32[G - 1, B, P or the ring's width]
    kv_lens: np.ndarray  # i32[B] context length after this step (0 for padding rows)
    cu_q_lens: np.ndarray  # i32[B + 1] start of each sequence's query tokens in token_ids
    logits_indices: np.ndarray  # i32[B] the token of each sequence that is sampled; a
    # speculative plan's i32[B * (K + 1)]: row b's last num_draft_tokens[b] + 1 query tokens
    # (its last real token repeated after them), the positions its drafts are verified at
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
    # vLLM's penalties (SamplingParams); their tokens only when a row of the step uses them:
    # penalty_tokens[b] is row b's prompt then output tokens, -1 padded to H = the block
    # table's capacity (H = 0 when no row is penalized, so the sampler skips the work).
    presence_penalty: np.ndarray  # f32[B] 0 disables
    frequency_penalty: np.ndarray  # f32[B] 0 disables
    repetition_penalty: np.ndarray  # f32[B] 1 disables
    penalty_tokens: np.ndarray  # i32[B, H]
    penalty_prompt_lens: np.ndarray  # i32[B] how many of penalty_tokens[b] are the prompt's
    # prompt_logprobs: prompt_targets[t] is the prompt token following query token t when its
    # request asks for prompt logprobs and has not recorded that position yet, else -1; [0]
    # when no token of the step has one (the forward then projects only the sampled tokens).
    prompt_targets: np.ndarray  # i32[T] or i32[0]
    # Pooling requests (Request.pooling): pooling_rows[t] is 1 when query token t's final
    # hidden state is returned (a prompt token whose state its request pools), else 0; [0] when
    # the step has no pooling request (the forward then returns no hidden states).
    pooling_rows: np.ndarray  # i32[T] or i32[0]
    # Speculative decoding: a row's drafts are its last num_draft_tokens[b] query tokens,
    # draft_token_ids[b, :n] (K = 0 columns in a plan without drafts: the plain sampler).
    draft_token_ids: np.ndarray  # i32[B, K]
    num_draft_tokens: np.ndarray  # i32[B]
    # LoRA (scheduler.lora_slots): each token's adapter slot, -1 for the base model (padding
    # tokens too); all -1 in an engine without adapters.
    lora_slots: np.ndarray  # i32[T]
    copy_src: np.ndarray  # i32[B] copy-on-write: block copy_src[i] -> copy_dst[i] before writes
    copy_dst: np.ndarray  # i32[B] (padding pairs copy the null block onto itself)
    num_copies: np.ndarray  # i32[]
    kind: str  # PREFILL or DECODE
    padded_num_tokens: int  # T
    padded_num_seqs: int  # B

    @property
    def num_speculative_tokens(self) -> int:
        """K: the draft columns of a speculative plan (0 for a plain one)."""
        return self.draft_token_ids.shape[1]

    @property
    def table_widths(self) -> tuple[int, int]:
        """(P, the other groups' table width): ShapeBuckets.table_widths of this plan."""
        return self.block_tables.shape[1], self.group_block_tables.shape[2]


def _padded_shape(output: SchedulerOutput, buckets: ShapeBuckets, num_seqs: int,
                  speculative: bool) -> tuple[str, int, int]:
    """(the program kind, T, B): without decode programs a decode step runs the ragged family,
    padded like a prefill; a speculative step too, with B its rows' seq bucket (its K + 1
    logits a row are computed for B rows, however many T could hold)."""
    if speculative:
        return (PREFILL, buckets.padded_speculative_tokens(output.num_scheduled_tokens),
                buckets.padded_num_seqs(num_seqs))
    kind = output.kind if buckets.decode_programs else PREFILL
    if kind == DECODE:
        padded_seqs = buckets.padded_num_seqs(num_seqs)
        return kind, padded_seqs, padded_seqs
    padded_tokens = buckets.padded_num_tokens(output.num_scheduled_tokens)
    return kind, padded_tokens, buckets.padded_prefill_seqs(num_seqs, padded_tokens)


# The SamplingParams fields a plan carries a column of, as they are.
_PARAM_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "logit_bias", "presence_penalty",
                  "frequency_penalty", "repetition_penalty")


def _rows(scheduled, kv_manager: KVCacheManager | HybridKVCacheManager, tables: list[np.ndarray]):
    """Each row's query tokens (back to back), its block table in each group (into tables[g],
    see write_table), and its start, query length and sampling settings as lists."""
    tokens: list[int] = []
    columns: dict[str, list] = {name: [] for name in ("start", "q_len", "seed", "drafts", "lora_slot",
                                     *_PARAM_COLUMNS)}
    block_size = kv_manager.block_size
    # a state group's row: its fixed blocks whole (scheduler.state_group)
    state_blocks = kv_manager.state_blocks
    for i, seq in enumerate(scheduled):
        request, start, n = seq
        drafts = seq.drafts
        if n - len(drafts) == 1:
            tokens.append(request.token_id_at(start))
        else:
            tokens.extend(request.token_ids_slice(start, start + n - len(drafts)))
        tokens.extend(drafts)
        columns["drafts"].append(drafts)
        if n:
            for out, table, fixed in zip(tables, kv_manager.get_block_tables(request.request_id),
                                         state_blocks):
                write_table(out[i], table, fixed or cdiv(start + n, block_size))
        params = request.sampling_params
        for name, value in (("start", start), ("q_len", n), ("seed", request.seed),
                            ("lora_slot", request.lora_slot)):
            columns[name].append(value)
        for name in _PARAM_COLUMNS:
            columns[name].append(getattr(params, name))
    return tokens, columns


def write_table(row: np.ndarray, table: list[int], num_blocks: int) -> None:
    """A request's table into its plan row: logical block p at column p % width, the blocks
    through this step's last (num_blocks of them) and as many before as the row holds (a row
    narrower than the table is a sliding group's ring: scheduler.kv_cache_groups)."""
    width = row.shape[0]
    end = min(num_blocks, len(table))
    if end <= width:
        row[:end] = table[:end]
    else:
        first = end - width
        row[np.arange(first, end) % width] = table[first:end]


def logit_bias_slots(rows, padded_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's logit_bias pairs in its MAX_LOGIT_BIAS slots: (ids i32[B, L], biases f32)."""
    ids = np.zeros((padded_seqs, MAX_LOGIT_BIAS), np.int32)
    values = np.zeros((padded_seqs, MAX_LOGIT_BIAS), np.float32)
    for i, pairs in enumerate(rows):
        if pairs:
            ids[i, :len(pairs)], values[i, :len(pairs)] = zip(*pairs)
    return ids, values


def penalty_tokens(requests, padded_seqs: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens i32[B, H], prompt lengths i32[B]) of the rows whose requests use penalties; H is
    0 when none does (requests: one a row, None for none)."""
    if not any(r is not None and r.sampling_params.uses_penalties for r in requests):
        width = 0
    tokens = np.full((padded_seqs, width), -1, np.int32)
    prompt_lens = np.zeros(padded_seqs, np.int32)
    for i, request in enumerate(requests):
        if width and request is not None and request.sampling_params.uses_penalties:
            n, p = request.num_tokens, request.num_prompt_tokens
            tokens[i, :p] = request.prompt_token_ids
            tokens[i, p:n] = request.output_token_ids
            prompt_lens[i] = p
    return tokens, prompt_lens


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


def _logits_indices(output: SchedulerOutput, cu_q_lens: np.ndarray, num_drafts: np.ndarray,
                    k: int) -> np.ndarray:
    """Each row's last query token; a fork follower samples from its leader's. With K = k
    drafts a row (speculative), k + 1 a row: its drafts' positions' and the one after them
    (the last query token repeated past them)."""
    logits_indices = np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32)
    if output.forks:
        leader_row = {id(s.request): i for i, s in enumerate(output.scheduled)}
        for f, (leader, _) in enumerate(output.forks):
            logits_indices[len(output.scheduled) + f] = logits_indices[leader_row[id(leader)]]
    if not k:
        return logits_indices
    first = logits_indices - num_drafts  # the token whose logits verify the first draft
    return np.minimum(first[:, None] + np.arange(k + 1, dtype=np.int32),
                      logits_indices[:, None]).reshape(-1).astype(np.int32)


def draft_columns(rows, padded_seqs: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(draft ids i32[B, k], their counts i32[B]) from each row's list of drafts."""
    ids = np.zeros((padded_seqs, k), np.int32)
    counts = np.zeros(padded_seqs, np.int32)
    for i, drafts in enumerate(rows):
        if drafts:
            ids[i, :len(drafts)] = drafts
            counts[i] = len(drafts)
    return ids, counts


def _slot_mapping(tables: list[np.ndarray], seq_of_token: np.ndarray, positions: np.ndarray,
                  num_tokens: int, block_size: int) -> np.ndarray:
    """i32[G, T]: each real token's slot in each group (through the group's table, a ring
    read at block % width); padding tokens keep slot 0, which lies in the null block."""
    pos = positions[:num_tokens]
    slot_mapping = np.zeros((len(tables), positions.shape[0]), np.int32)
    for g, table in enumerate(tables):
        slot_mapping[g, :num_tokens] = (
            table[seq_of_token[:num_tokens], pos // block_size % table.shape[1]] * block_size
            + pos % block_size)
    return slot_mapping


def _stack(tables: list[np.ndarray], num_rows: int, width: int) -> np.ndarray:
    return np.stack(tables) if tables else np.zeros((0, num_rows, width), np.int32)


def build_plan(output: SchedulerOutput, kv_manager: KVCacheManager | HybridKVCacheManager,
               buckets: ShapeBuckets) -> BatchPlan:
    """Lays out the scheduled sequences back to back and pads every array to its bucket.

    Fork followers come last, as rows with no query tokens whose logits index is their
    leader's last token: they sample their first token from the leader's prompt logits.
    """
    scheduled = list(output.scheduled) + [ScheduledSeq(f, leader.num_tokens, 0)
                                          for leader, f in output.forks]
    num_seqs = len(scheduled)
    if num_seqs == 0:
        raise ValueError("cannot build a plan for an empty schedule")
    num_tokens = output.num_scheduled_tokens
    speculative = any(seq.drafts for seq in scheduled)
    k = buckets.num_speculative_tokens if speculative else 0
    kind, padded_tokens, padded_seqs = _padded_shape(output, buckets, num_seqs, speculative)
    widths = buckets.table_widths
    tables = [np.full((padded_seqs, widths[g > 0]), NULL_BLOCK, np.int32)
              for g in range(kv_manager.num_groups)]
    tokens, rows = _rows(scheduled, kv_manager, tables)
    draft_ids, num_drafts = draft_columns(rows["drafts"], padded_seqs, k)

    def padded(name, fill, dtype):
        out = np.full(padded_seqs, fill, dtype)
        out[:num_seqs] = rows[name]
        return out

    q_lens = padded("q_len", 0, np.int32)
    kv_lens = padded("start", 0, np.int32) + q_lens
    token_ids = np.zeros(padded_tokens, np.int32)
    token_ids[:num_tokens] = tokens
    seq_of_token = np.repeat(np.arange(padded_seqs, dtype=np.int32), q_lens)
    lora_slots = np.full(padded_tokens, -1, np.int32)
    lora_slots[:num_tokens] = padded("lora_slot", -1, np.int32)[seq_of_token]
    positions = _positions(output, rows["start"], q_lens, kv_lens, seq_of_token, padded_tokens)
    cu_q_lens = np.zeros(padded_seqs + 1, np.int32)
    np.cumsum(q_lens, out=cu_q_lens[1:])
    sampling = _sampling_arrays(rows, [r for r, _, _ in scheduled], padded, padded_seqs,
                                buckets.max_blocks_per_seq * kv_manager.block_size)
    copy_src = np.zeros(padded_seqs, np.int32)
    copy_dst = np.zeros(padded_seqs, np.int32)
    if output.copies:
        copy_src[:len(output.copies)], copy_dst[:len(output.copies)] = zip(*output.copies)
    slot_mapping = _slot_mapping(tables, seq_of_token, positions, num_tokens,
                                 kv_manager.block_size)
    return BatchPlan(
        token_ids=token_ids, positions=positions, slot_mapping=slot_mapping[0],
        block_tables=tables[0], group_slot_mapping=slot_mapping[1:],
        group_block_tables=_stack(tables[1:], padded_seqs, widths[1]), kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        logits_indices=_logits_indices(output, cu_q_lens, num_drafts, k),
        num_seqs=np.asarray(num_seqs, np.int32), **sampling,
        prompt_targets=prompt_targets(output.scheduled, padded_tokens),
        pooling_rows=pooling_rows(output.scheduled, padded_tokens), draft_token_ids=draft_ids,
        num_draft_tokens=num_drafts, lora_slots=lora_slots, copy_src=copy_src,
        copy_dst=copy_dst,
        num_copies=np.asarray(len(output.copies), np.int32), kind=kind,
        padded_num_tokens=padded_tokens, padded_num_seqs=padded_seqs)


def _sampling_arrays(rows: dict, requests: list, padded, padded_seqs: int,
                     penalty_width: int) -> dict:
    """The plan's per-row sampling arrays: temperature, top-k/p, min-p, seeds, logit bias
    slots, penalties and their tokens (padded(name, fill, dtype): a row field padded)."""
    bias_ids, bias_values = logit_bias_slots(rows["logit_bias"], padded_seqs)
    pen_tokens, pen_prompt_lens = penalty_tokens(requests, padded_seqs, penalty_width)
    return dict(
        temperature=padded("temperature", 0.0, np.float32),
        top_k=padded("top_k", -1, np.int32), top_p=padded("top_p", 1.0, np.float32),
        min_p=padded("min_p", 0.0, np.float32), seeds=padded("seed", 0, np.uint32),
        bias_ids=bias_ids, bias_values=bias_values,
        presence_penalty=padded("presence_penalty", 0.0, np.float32),
        frequency_penalty=padded("frequency_penalty", 0.0, np.float32),
        repetition_penalty=padded("repetition_penalty", 1.0, np.float32),
        penalty_tokens=pen_tokens, penalty_prompt_lens=pen_prompt_lens)


def _no_logit_bias(num_seqs: int) -> dict:
    bias_ids, bias_values = logit_bias_slots([()] * num_seqs, num_seqs)
    tokens, prompt_lens = penalty_tokens([None] * num_seqs, num_seqs, 0)
    return dict(bias_ids=bias_ids, bias_values=bias_values,
                presence_penalty=np.zeros(num_seqs, np.float32),
                frequency_penalty=np.zeros(num_seqs, np.float32),
                repetition_penalty=np.ones(num_seqs, np.float32), penalty_tokens=tokens,
                penalty_prompt_lens=prompt_lens)


def padding_plan(kind: str, num_tokens: int, num_seqs: int, max_blocks_per_seq: int,
                 with_prompt_logprobs: bool = False, num_kv_groups: int = 1,
                 group_table_width: int | None = None,
                 num_speculative_tokens: int = 0, with_pooling: bool = False) -> BatchPlan:
    """A plan of nothing but padding (num_seqs = 0): every write lands in the null block.
    with_prompt_logprobs gives it prompt_targets (all -1) for the forward's prompt variant,
    with_pooling pooling_rows (all 0) for its pooling variant;
    group_table_width: the other KV cache groups' tables' (default max_blocks_per_seq);
    num_speculative_tokens: K draft columns (K + 1 logits a row)."""
    k = num_speculative_tokens
    zeros_t = np.zeros(num_tokens, np.int32)
    return BatchPlan(
        token_ids=zeros_t, positions=zeros_t, slot_mapping=zeros_t,
        block_tables=np.full((num_seqs, max_blocks_per_seq), NULL_BLOCK, np.int32),
        group_slot_mapping=np.zeros((num_kv_groups - 1, num_tokens), np.int32),
        group_block_tables=np.full(
            (num_kv_groups - 1, num_seqs, group_table_width or max_blocks_per_seq), NULL_BLOCK,
            np.int32),
        kv_lens=np.zeros(num_seqs, np.int32), cu_q_lens=np.zeros(num_seqs + 1, np.int32),
        logits_indices=np.zeros(num_seqs * (k + 1), np.int32),
        num_seqs=np.asarray(0, np.int32),
        temperature=np.zeros(num_seqs, np.float32), top_k=np.full(num_seqs, -1, np.int32),
        top_p=np.ones(num_seqs, np.float32), min_p=np.zeros(num_seqs, np.float32),
        seeds=np.zeros(num_seqs, np.uint32), **_no_logit_bias(num_seqs),
        draft_token_ids=np.zeros((num_seqs, k), np.int32),
        num_draft_tokens=np.zeros(num_seqs, np.int32),
        prompt_targets=np.full(num_tokens if with_prompt_logprobs else 0, -1, np.int32),
        pooling_rows=np.zeros(num_tokens if with_pooling else 0, np.int32),
        lora_slots=np.full(num_tokens, -1, np.int32), copy_src=np.zeros(num_seqs, np.int32), copy_dst=np.zeros(num_seqs, np.int32),
        num_copies=np.asarray(0, np.int32), kind=kind,
        padded_num_tokens=num_tokens, padded_num_seqs=num_seqs)
