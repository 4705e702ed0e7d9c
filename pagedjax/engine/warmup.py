"""Compiling ahead of the requests: every program a step can need, so that once a warmup is done
no request waits on a compile.

A step runs its forward program (one a shape: kind, T, B, K drafts) and a sampler program; what
only some requests need is a variant of either: prompt logprobs (a forward that projects every
query token: prefill shapes only), a token mask (allowed_token_ids, bad_words, min_tokens,
grammars), penalties (repetition / presence / frequency), and under async scheduling the small
program that fills a step's tokens from the step before's sampled ids (one a (T, B before)
pair). `warm` compiles the step programs first (decode, then prefill, then speculative: what a
serving engine meets most), then the variants; with the persistent compilation cache a second
process loads them instead (ModelRunner.program).

An engine that moves whole blocks (swap preemption, the tiered prefix cache) also gets its block
copies compiled: a gather and a scatter a power-of-two count of blocks, up to its pool's
(pagedjax.kv_offload.block_transfers).
"""

from __future__ import annotations

import threading
import time

from tqdm.auto import tqdm

from pagedjax.engine import grammar
from pagedjax.engine.runner import ModelRunner
from pagedjax.scheduler import DECODE, PREFILL
from pagedjax.scheduler.plan import padding_plan


def warmup_shapes(buckets, variants: bool = False) -> list[tuple[str, int, int, int, bool]]:
    """Every (kind, T, B, K, prompt logprobs) forward program the buckets allow: decode first,
    small before large, then the speculative decode steps' (K drafts a row:
    ShapeBuckets.speculative_shapes), then, with variants, the prefill shapes' prompt-logprobs
    variants."""
    shapes = [(DECODE, b, b, 0, False) for b in buckets.decode_shapes()]
    shapes += [(PREFILL, t, b, 0, False) for t, b in buckets.prefill_shapes()]
    k = buckets.num_speculative_tokens
    shapes += [(PREFILL, t, b, k, False) for t, b in buckets.speculative_shapes()]
    if variants:
        shapes += [(PREFILL, t, b, 0, True) for t, b in buckets.prefill_shapes()]
    return shapes


def pooling_shapes(buckets) -> list[tuple[str, int, int, int, bool, bool]]:
    """A pooling runner's forward programs (kind, T, B, K, prompt logprobs, pooled): its
    requests' prompt chunks (a step of one-token chunks runs as a decode step), each shape
    with pooled rows (a step finishing a prompt, or pooling every token) and without (a
    last-token pooler's earlier chunks); no speculative or prompt-logprobs variant."""
    shapes = [(DECODE, b, b) for b in buckets.decode_shapes()]
    shapes += [(PREFILL, t, b) for t, b in buckets.prefill_shapes()]
    return [shape + (0, False, pooled) for shape in shapes for pooled in (False, True)]


def fill_shapes(buckets) -> list[tuple[int, int]]:
    """Every (T, B before) an async step's token fill can have: a step of any shape after a
    step of any number of rows."""
    shapes = warmup_shapes(buckets)
    tokens = sorted({t for _, t, _, k, _ in shapes if not k})
    rows = sorted({b for _, _, b, k, _ in shapes if not k})
    return [(t, b) for t in tokens for b in rows]


def warm(runner: ModelRunner, buckets, progress: bool = False, fills: bool = False,
         variants: bool = False, block_copies: int = 0) -> int:
    """Compiles (or loads from the persistent cache) every forward program of warmup_shapes
    (a pooling runner's: pooling_shapes), each with its plain sampler and, with variants, its
    sampler's mask / penalty variants; with fills the async token fills (fill_shapes); with
    block_copies the block copies of up to that many blocks. Returns how many forward
    programs. progress shows a bar on stderr."""
    shapes = ([shape + (False,) for shape in warmup_shapes(buckets, variants)]
              if runner.with_logits else pooling_shapes(buckets))
    mask_words = grammar.mask_words(runner.vocab_size)
    penalty_width = buckets.max_blocks_per_seq * runner.block_size
    warmed_samplers = set()
    with tqdm(shapes, desc="compiling step programs", unit="program",
              disable=not progress) as bar:
        for kind, num_tokens, num_seqs, k, prompt, pooled in bar:
            bar.set_postfix_str(f"{kind} T={num_tokens} B={num_seqs}" + (f" K={k}" if k else "")
                                + (" prompt logprobs" if prompt else "")
                                + (" pooled" if pooled else ""))
            runner.program(kind, num_tokens, num_seqs, buckets.table_widths, prompt,
                           num_speculative_tokens=k, with_pooling=pooled)
            if variants and (num_seqs, k) not in warmed_samplers:
                warmed_samplers.add((num_seqs, k))
                plan = padding_plan(kind, num_tokens, num_seqs, buckets.max_blocks_per_seq,
                                    num_speculative_tokens=k)
                runner.sampler_variants(plan, penalty_width, mask_words)
    if fills:
        for num_tokens, num_previous in fill_shapes(buckets):
            runner.fill_program(num_tokens, num_previous)
    if block_copies:
        runner.warm_block_copies(block_copies)
    return len(shapes)


class BackgroundWarmup:
    """warm() in a thread while the engine steps (a shape not compiled yet compiles on first
    use, once, whichever thread comes first): done(), wait(timeout), and the error that
    stopped it, if any (the engine keeps serving; the rest compile on first use)."""

    def __init__(self, runner: ModelRunner, buckets, progress: bool, fills: bool = False,
                 variants: bool = False, block_copies: int = 0):
        self.num_programs = len(warmup_shapes(buckets, variants))
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(
            target=self._run, args=(runner, buckets, progress, fills, variants, block_copies),
            name="pagedjax-warmup", daemon=True)
        self._thread.start()

    def _run(self, runner, buckets, progress, fills, variants, block_copies) -> None:
        start = time.perf_counter()
        try:
            warm(runner, buckets, progress, fills, variants, block_copies)
        except BaseException as error:  # noqa: BLE001 - reported through .error
            self.error = error
        self.seconds = time.perf_counter() - start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.done()
