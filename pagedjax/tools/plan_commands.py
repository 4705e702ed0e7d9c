"""The planning commands: `pagedjax profile` (fit the step-time model to an engine) and
`pagedjax simulate` (a trace through the real scheduler on a model); the capacity ones are
pagedjax.tools.capacity_commands."""

from __future__ import annotations

import argparse

from pagedjax.models import CONFIGS, get_config
from pagedjax.scheduler import POLICIES
from pagedjax.tools.capacity_commands import capacity_layouts, window_name
from pagedjax.tools.engine_args import add_engine_args, engine_kwargs


def profile_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a model directory, .gguf file or config name (default: the "
                        "embedded trained model)")
    parser.add_argument("--trace", required=True, help="the trace to serve (JSON lines)")
    parser.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    add_engine_args(parser)


def profile(args, parser: argparse.ArgumentParser) -> None:
    """Serves a trace (JSON lines: arrival_s, prompt_len, output_len[, n, prefix_group,
    prefix_len]) on the engine in real time and fits the simulator's step-time model to its
    steps (written as JSON for `pagedjax simulate`)."""
    from pagedjax.frontend.llm import DEFAULT_MODEL, LLM
    from pagedjax.scheduler.cost_model import StepCostModel
    from pagedjax.scheduler.trace import load_trace
    from pagedjax.tools.profiling import generating_engine, run_trace

    try:
        trace = load_trace(args.trace)
        llm = LLM(args.model or DEFAULT_MODEL, **engine_kwargs(args))
        engine = generating_engine(llm.engine)
    except (ValueError, OSError) as e:
        parser.exit(1, f"pagedjax profile: {e}\n")
    print(f"warmup: {engine.warmup(progress=True)} step programs ready", flush=True)
    result, samples = run_trace(engine, trace)
    cost = StepCostModel.fit(samples)
    with open(args.out, "w") as f:
        f.write(cost.to_json() + "\n")
    print(_table([{"run": "engine", **result.summary()}]))
    print(f"cost model from {len(samples)} steps -> {args.out}")


def simulate(args, parser: argparse.ArgumentParser) -> None:
    """Predicts a trace's TTFT, TPOT, throughput, preemptions and KV use under each combination
    of the given pool sizes and batch limits, with the real scheduler on a step-time model:
    fitted to an engine (`--cost`, from `pagedjax profile`) or a roofline estimate for a model
    on a chip not at hand (`--roofline CHIP --model NAME`). No model runs, no device."""
    from pagedjax.scheduler.trace import load_trace

    if args.roofline and not args.model:
        parser.error("--roofline needs --model")
    if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
        parser.error("--tensor-parallel-size and --data-parallel-size must be >= 1")
    if args.tensor_parallel_size > 1 and not args.roofline:
        parser.error("--tensor-parallel-size needs --roofline (a fitted --cost is for the "
                     "parallelism it was profiled at)")
    if args.kv_memory_gib and not args.roofline:
        parser.error("--kv-memory-gib needs --roofline --model (for KV bytes per token)")
    try:
        rows = _simulate_rows(args, load_trace(args.trace))
    except (ValueError, OSError, KeyError) as e:
        parser.exit(1, f"pagedjax simulate: {e}\n")
    if args.roofline:
        print(f"roofline estimate: {args.model} on {args.roofline} x TP "
              f"{args.tensor_parallel_size} x DP {args.data_parallel_size} (flops x "
              f"{args.flops_util}, "
              f"bandwidth x {args.bw_util}, {args.overhead_ms} ms a step{_groups_note(args)}); "
              f"not a measurement")
    print(_table(rows))


def _groups_note(args) -> str:
    from pagedjax.models.layers.kv_groups import kv_cache_groups

    groups = kv_cache_groups(get_config(args.model), not args.disable_hybrid_kv_cache_manager)
    if not groups.hybrid:
        return ""
    kinds = "/".join(window_name(w) for w in dict.fromkeys(groups.windows))
    return f"; {groups.num_groups} KV cache groups of {groups.num_slots} layers: {kinds}"


def simulate_args(parser: argparse.ArgumentParser) -> None:
    from pagedjax.scheduler.chips import CHIPS

    parser.add_argument("--trace", required=True, help="the trace to replay (JSON lines)")
    model_source = parser.add_mutually_exclusive_group(required=True)
    model_source.add_argument("--cost", help="a fitted cost model from `pagedjax profile`")
    model_source.add_argument("--roofline", choices=sorted(CHIPS),
                              help="estimate step times for --model on this chip")
    parser.add_argument("--model", choices=sorted(CONFIGS), help="with --roofline")
    parser.add_argument("--flops-util", type=float, default=0.5,
                        help="with --roofline: the share of the chip's peak FLOPs reached")
    parser.add_argument("--bw-util", type=float, default=0.7,
                        help="with --roofline: the share of the chip's memory bandwidth reached")
    parser.add_argument("--overhead-ms", type=float, default=2.0,
                        help="with --roofline: fixed host time a step")
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "int8"],
                        help="with --roofline: KV bytes per element 2 or 1 (weights bf16)")
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    floats = lambda text: [float(v) for v in text.split(",")]  # noqa: E731
    pool = parser.add_mutually_exclusive_group(required=True)
    pool.add_argument("--num-blocks", type=ints,
                      help="pool sizes to try, comma-separated (the null block included)")
    pool.add_argument("--kv-memory-gib", type=floats,
                      help="with --roofline: KV memory budgets to try, comma-separated")
    parser.add_argument("--max-num-seqs", type=ints, default=[32],
                        help="sequence limits to try, comma-separated")
    parser.add_argument("--max-num-batched-tokens", type=ints, default=[512],
                        help="token budgets to try, comma-separated")
    parser.add_argument("--block-size", type=int, default=16, help="tokens a KV block holds")
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="longest prompt + output a request may hold")
    parser.add_argument("--policy", default="mixed", choices=list(POLICIES),
                        help="what a step schedules first")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn automatic prefix caching off")
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="the vocabulary (the sampler's cost in a fitted model)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="with --roofline: one replica over this many chips (a device's "
                        "weights and KV; the all-reduces on the chip's link)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="replicas, each with the pool; requests placed by the "
                        "data-parallel engine's prefix-affinity rule, steps in lockstep")
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="with --roofline: every layer keeps the whole context (no KV "
                        "cache groups for a model whose layers differ in window)")


def _cost_and_pools(args):
    """The step-time model, the pool sizes to try, the vocabulary size, the model's KV cache
    groups (pagedjax.models.layers.kv_groups) and its layers' windows (without a --model: one full group)."""
    from pagedjax.models.layers.kv_groups import KVCacheGroups, kv_cache_groups
    from pagedjax.parallel.plan import roofline_cost
    from pagedjax.scheduler.chips import CHIPS
    from pagedjax.scheduler.cost_model import StepCostModel

    if not args.roofline:
        with open(args.cost) as f:
            return (StepCostModel.from_json(f.read()), args.num_blocks, args.vocab_size,
                    KVCacheGroups((None,), (0,), (0,), 1), [None])
    config = get_config(args.model)
    groups = kv_cache_groups(config, not args.disable_hybrid_kv_cache_manager)
    if groups.hybrid:  # a linear-attention group's state, in blocks
        groups = capacity_layouts(config, args.block_size, args.tensor_parallel_size)[0]
    cost = roofline_cost(config, CHIPS[args.roofline], args.tensor_parallel_size,
                         args.kv_dtype, flops_util=args.flops_util,
                         bw_util=args.bw_util, overhead_s=args.overhead_ms / 1e3)
    # a device's budget: each holds 1/TP of a block, a page of a group's layers
    block_bytes = (cost.kv_bytes_per_token * args.block_size * groups.num_slots
                   // config.num_attention_layers)
    pools = args.num_blocks or [1 + int(gib * 2**30) // block_bytes for gib in args.kv_memory_gib]
    layer_windows = [config.layer_window(i) for i in range(config.num_layers)]
    return cost, pools, config.vocab_size, groups, layer_windows


def _simulate_rows(args, trace) -> list[dict]:
    """One row a combination of pool size, max_num_seqs and max_num_batched_tokens."""
    from pagedjax.engine.config import EngineConfig
    from pagedjax.parallel.plan import prefix_affinity_placer
    from pagedjax.scheduler.simulator import simulate as run

    cost, pools, vocab, groups, layer_windows = _cost_and_pools(args)
    dp = args.data_parallel_size
    rows = []
    for num_blocks in pools:
        for max_num_seqs in args.max_num_seqs:
            for max_tokens in args.max_num_batched_tokens:
                config = EngineConfig(
                    num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_tokens, block_size=args.block_size,
                    max_model_len=args.max_model_len, policy=args.policy,
                    enable_prefix_caching=not args.no_prefix_caching)
                result = run(trace, config.scheduler_config(), num_blocks=num_blocks,
                             block_size=args.block_size, buckets=config.buckets(groups.windows),
                             cost=cost, vocab_size=vocab, replicas=dp,
                             place=prefix_affinity_placer(dp, args.block_size),
                             group_windows=groups.windows, layer_windows=layer_windows)
                rows.append({"num_blocks": num_blocks, "max_num_seqs": max_num_seqs,
                             "max_num_batched_tokens": max_tokens, **result.summary()})
    return rows


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
             for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
