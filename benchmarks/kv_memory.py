"""KV waste and concurrency: paged allocation vs contiguous reservation under one memory budget.

All allocators run inside the same scheduler (same token budget, FCFS, chunked prefill,
preemption by recompute) on the same seeded workload; only the KV allocation differs:

- paged, block size 8/16/32: blocks taken on demand (this project's KVCacheManager);
- contiguous, reserve max_model_len: each request reserves max_model_len slots at admission;
- contiguous, reserve next power of two of its true length (prompt + output);
- contiguous, reserve exactly its true length (an oracle that knows the output length).

Contiguous reservations are placed first-fit in one linear range of slots, so external
fragmentation shows up as requests that cannot be admitted. The simulation needs no model: it
drives the real scheduler with a fake sampler (host only, no jax).

Waste = (allocated slots - tokens held) / allocated slots, taken at the peak of allocation and
averaged over steps. Tokens held = every request's computed tokens after the step.
"""

from __future__ import annotations

import argparse

from common import lognormal_workload, write_results

from pagedjax.scheduler import (KVCacheManager, Request, SamplingParams, SchedulerConfig,
                                SchedulerState, add_request, schedule, update)


class ContiguousKVManager:
    """One contiguous range of slots per request, reserved at admission, placed first-fit.

    Speaks the KVCacheManager interface the scheduler uses, with block_size 1 (a block is a slot).
    """

    block_size = 1

    def __init__(self, num_slots: int, reserve):
        self.reserve = reserve  # Request -> slots to reserve
        self.num_slots = num_slots
        self.gaps = [(0, num_slots)]  # sorted (start, length) of free ranges
        self.ranges: dict[str, tuple[int, int]] = {}
        self.pool = self  # the scheduler asks kv.pool.num_usable_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_slots

    @property
    def num_free_blocks(self) -> int:
        return max((length for _, length in self.gaps), default=0)

    @property
    def num_used_blocks(self) -> int:
        return sum(length for _, length in self.ranges.values())

    def num_blocks_for(self, num_tokens: int) -> int:
        return num_tokens

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.num_slots

    def find_cached_prefix(self, request: Request) -> list[int]:
        return []  # no prefix caching: this baseline reserves, it does not share

    # The rest of the KVCacheManager interface the scheduler calls: nothing to do here.
    def publish_full_blocks(self, request: Request) -> None:
        pass

    def free_out_of_window(self, request: Request) -> None:
        pass

    def take_pending_copies(self) -> list:
        return []

    host_tier = None  # no tiered prefix cache under it

    def take_pending_swaps(self) -> tuple[list, list]:
        return [], []

    def release_host_blocks(self) -> None:
        pass

    def num_new_blocks(self, request: Request, num_new_tokens: int, cached_blocks=()) -> int:
        return 0 if request.request_id in self.ranges else self.reserve(request)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks=()):
        held = self.ranges.get(request.request_id)
        if held is not None:
            if request.num_computed_tokens + num_new_tokens > held[1]:
                raise RuntimeError(f"request {request.request_id} outgrew its reservation")
            return []
        size = self.reserve(request)
        for i, (start, length) in enumerate(self.gaps):
            if length >= size:
                self.gaps[i:i + 1] = [(start + size, length - size)] if length > size else []
                self.ranges[request.request_id] = (start, size)
                return [start]
        return None

    def free(self, request: Request) -> None:
        held = self.ranges.pop(request.request_id, None)
        if held is None:
            return
        gaps = sorted(self.gaps + [held])
        merged = [gaps[0]]
        for start, length in gaps[1:]:
            last_start, last_length = merged[-1]
            if last_start + last_length == start:
                merged[-1] = (last_start, last_length + length)
            else:
                merged.append((start, length))
        self.gaps = merged

    def get_block_table(self, request_id: str):
        return []


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def simulate(kv, workload, config: SchedulerConfig) -> dict:
    state = SchedulerState(config, kv)
    requests = []
    for i, (prompt_len, output_len) in enumerate(workload):
        request = Request(str(i), [1] * prompt_len,
                          SamplingParams(max_tokens=output_len, temperature=0.0), seed=0,
                          arrival_time=0.0)
        add_request(state, request)
        requests.append(request)
    block_size = kv.block_size
    peak_alloc = peak_held = steps = max_running = 0
    sum_alloc = sum_held = sum_running = 0
    while state.requests:
        steps += 1
        state, output = schedule(state, float(steps))
        if not output.scheduled:
            raise RuntimeError("no progress")
        update(state, output, [1] * len(output.scheduled), float(steps))
        allocated = kv.num_used_blocks * block_size
        held = sum(r.num_computed_tokens for r in state.running)
        sum_alloc += allocated
        sum_held += held
        sum_running += len(state.running)
        max_running = max(max_running, len(state.running))
        if allocated > peak_alloc:
            peak_alloc, peak_held = allocated, held
    num_output = sum(o for _, o in workload)
    return {
        "peak_waste_pct": 100.0 * (peak_alloc - peak_held) / peak_alloc,
        "mean_waste_pct": 100.0 * (sum_alloc - sum_held) / sum_alloc,
        "max_concurrent_seqs": max_running,
        "mean_concurrent_seqs": sum_running / steps,
        "steps": steps,
        "output_tokens_per_step": num_output / steps,
        "preemptions": state.num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--budget-tokens", type=int, default=32768)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workload = lognormal_workload(args.num_requests, seed=args.seed,
                                  max_model_len=args.max_model_len)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len, watermark=0.0,
                             enable_prefix_caching=False)  # allocation alone is compared
    def true_len(r):  # prompt + output: each request runs to max_tokens
        return r.max_num_tokens

    allocators = [(f"paged, block {s}", lambda s=s: KVCacheManager(args.budget_tokens // s, s))
                  for s in (8, 16, 32)]
    allocators += [
        ("contiguous, reserve max_model_len",
         lambda: ContiguousKVManager(args.budget_tokens, lambda r: args.max_model_len)),
        ("contiguous, reserve next pow2 of length",
         lambda: ContiguousKVManager(args.budget_tokens, lambda r: next_power_of_two(true_len(r)))),
        ("contiguous, reserve exact length",
         lambda: ContiguousKVManager(args.budget_tokens, true_len)),
    ]
    rows = []
    for name, make_kv in allocators:
        result = simulate(make_kv(), workload, config)
        rows.append({"allocator": name, **result})
    base = rows[3]["output_tokens_per_step"]
    for row in rows:
        row["throughput_vs_reserve_max"] = row["output_tokens_per_step"] / base
    prompts = sorted(p for p, _ in workload)
    outputs = sorted(o for _, o in workload)
    params = dict(vars(args), prompt_len_p50=prompts[len(prompts) // 2],
                  prompt_len_max=prompts[-1], output_len_p50=outputs[len(outputs) // 2],
                  output_len_max=outputs[-1])
    write_results("kv_memory", "KV-cache waste and concurrency under a fixed memory budget",
                  rows, params, notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
