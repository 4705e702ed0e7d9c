"""The planning commands: `pagedjax capacity` (the KV-cache formula), `pagedjax inspect` (what
the engine makes of a model), `pagedjax profile` (fit the step-time model to an engine) and
`pagedjax simulate` (a trace through the real scheduler on that model)."""

from __future__ import annotations

import argparse
import dataclasses

from pagedjax.models import CONFIGS, get_config
from pagedjax.scheduler import POLICIES
from pagedjax.tools.engine_args import add_engine_args, engine_kwargs


def capacity_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(CONFIGS),
                        help="a named model configuration")
    parser.add_argument("--kv-memory-gib", type=float, required=True,
                        help="memory given to the KV cache on each device")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="devices one replica's weights and KV heads are split over")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="replicas, each with its own pool (the totals multiply)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens a KV block holds")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the KV cache's element type")
    parser.add_argument("--quantization", choices=["int8", "fp8", "int4", "mxfp4"],
                        help="weight-only quantization (the weights' share of a device); "
                        "default: weights in --dtype")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="with --quantization: the LM head quantized too")
    parser.add_argument("--context", type=int, default=4096,
                        help="average tokens per sequence (prompt + output)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the engine's token budget a step: a sliding-window group holds "
                        "its window and a step's tokens (KV cache groups)")


def capacity(args, parser: argparse.ArgumentParser) -> None:
    """KV-cache capacity from the formula 2 * L * K * H * itemsize bytes per token."""
    if (args.kv_memory_gib <= 0 or args.block_size < 1 or args.context < 1
            or args.max_num_batched_tokens < 1):
        parser.error("--kv-memory-gib, --block-size, --context and --max-num-batched-tokens "
                     "must be positive")
    if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
        parser.error("--tensor-parallel-size and --data-parallel-size must be >= 1")
    from pagedjax.parallel.sharding import check_tensor_parallel, weight_bytes_per_device

    config = get_config(args.model)
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    try:
        check_tensor_parallel(config, tp, check_devices=False)  # a plan for other machines
    except ValueError as e:
        parser.exit(1, f"pagedjax capacity: {e}\n")
    itemsize = 2 if args.dtype == "bfloat16" else 4
    heads = (f"latent {config.kv_lora_rank}+{config.qk_rope_head_dim} (one plane)"
             if config.kv_lora_rank else f"K={config.num_kv_heads} H={config.head_dim}")
    print(f"model {args.model}: L={config.num_layers} {heads}, KV {args.dtype}, TP {tp} x DP {dp}")
    print(f"  bytes per token      {config.kv_bytes_per_token(itemsize):,} (all devices, every "
          f"{'attention ' if config.num_attention_layers < config.num_layers else ''}layer)")
    if config.num_attention_layers < config.num_layers:
        print(f"  state per sequence   {config.state_bytes_per_sequence(itemsize):,} "
              f"({config.num_layers - config.num_attention_layers} linear-attention layers, "
              f"at any length)")
    if args.quantize_lm_head and args.quantization is None:
        parser.error("--quantize-lm-head needs --quantization")
    weights = weight_bytes_per_device(config, tp, itemsize, args.quantization,
                                      args.quantize_lm_head)
    print(f"  weights per device   {weights / 2**30:.2f} GiB"
          + (f" ({args.quantization} weights)" if args.quantization else ""))
    if config.num_experts:
        print(f"  experts              {config.num_experts}, {config.num_experts_per_tok} a "
              f"token: {config.num_active_params / 1e9:.2f}B of {config.num_params / 1e9:.2f}B "
              f"parameters active a token (tensor parallel: each device 1/TP of every expert)")
    groups, every_layer_full = capacity_layouts(config, args.block_size, tp)
    layouts = [("", every_layer_full)]
    if groups.hybrid:  # the hybrid KV cache beside every layer keeping the whole context
        layouts = [("KV cache groups: ", groups), ("every layer full: ", every_layer_full)]
    for label, layout in layouts:
        _capacity_rows(args, config, layout, label)


def capacity_layouts(config, block_size: int, tensor_parallel_size: int = 1,
                     backend: str = "reference"):
    """(the KV cache groups config is served with, its linear-attention groups' state sized
    in blocks: pagedjax.engine.kv_pool.sized_state_groups; one group of every layer keeping the
    whole context, linear-attention layers as full attention ones). Each with the config its
    blocks are counted by."""
    from pagedjax.engine.kv_pool import sized_state_groups
    from pagedjax.models.layers.kv_groups import kv_cache_groups
    from pagedjax.parallel.sharding import kv_head_repeats

    heads = config.num_kv_heads * kv_head_repeats(config.num_kv_heads, tensor_parallel_size)
    groups = sized_state_groups(kv_cache_groups(config), config, block_size, heads, backend)
    # (no window either: layer_types None would give every layer the sliding layers' window)
    full = (dataclasses.replace(config, layer_types=None, sliding_window=None)
            if config.layer_types else config)
    return groups, kv_cache_groups(full, hybrid=False)


def kv_capacity(config, groups, block_size: int, kv_bytes: int, context: int,
                tensor_parallel_size: int = 1, itemsize: int = 2,
                max_tokens_per_step: int | None = None, backend: str = "reference") -> dict:
    """The pool of kv_bytes a device holds under a KV cache layout (pagedjax.models.layers.kv_groups): bytes
    per block, blocks, blocks a sequence of context tokens needs (over its groups), and the
    sequences the pool holds."""
    from pagedjax.parallel.sharding import kv_bytes_per_block_per_device
    from pagedjax.scheduler.kv_cache_groups import blocks_for
    kv_dtype = "float32" if itemsize == 4 else "float16"
    per_block = kv_bytes_per_block_per_device(config, block_size, tensor_parallel_size, kv_dtype,
                                              backend, num_slots=groups.num_slots)
    num_blocks = kv_bytes // per_block
    per_seq = blocks_for(groups.windows, block_size, context, max_tokens_per_step)
    return {"groups": groups.num_groups, "layers_a_group": groups.num_slots,
            "bytes_per_block": per_block, "num_blocks": num_blocks, "blocks_per_seq": per_seq,
            "kv_bytes_per_seq": per_seq * per_block * tensor_parallel_size,
            "sequences": max(0, num_blocks - 1) // per_seq}


def _capacity_rows(args, config, groups, label: str) -> None:
    itemsize = 2 if args.dtype == "bfloat16" else 4
    dp = args.data_parallel_size
    c = kv_capacity(config, groups, args.block_size, int(args.kv_memory_gib * 2**30),
                    args.context, args.tensor_parallel_size, itemsize,
                    args.max_num_batched_tokens)
    if groups.hybrid:
        kinds = ", ".join(window_name(w) for w in dict.fromkeys(groups.windows))
        print(f"  {label}{c['groups']} groups of {c['layers_a_group']} layers ({kinds})")
    print(f"  {label}bytes per block      {c['bytes_per_block']:,} a device (block size "
          f"{args.block_size})")
    print(f"  {label}blocks in {args.kv_memory_gib:g} GiB   {c['num_blocks']:,} a replica (one is "
          "the null block)")
    print(f"  {label}a {args.context}-token sequence  {c['blocks_per_seq']:,} blocks, "
          f"{c['kv_bytes_per_seq'] / 2**20:,.1f} MiB")
    print(f"  {label}sequences of {args.context} tokens  {c['sequences']:,} a replica, "
          f"{c['sequences'] * dp:,} in all")


def window_name(window) -> str:
    """A KV cache group's kind as the plans print it."""
    if window is None:
        return "full"
    if window == "linear_attention":
        return "linear-attention state"
    if hasattr(window, "num_blocks"):  # a state group's (scheduler.state_group.StateWindow)
        return f"linear-attention state, {window.num_blocks} blocks a sequence"
    return f"window {window}"


def inspect_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a Hugging Face model directory or a .gguf file")
    parser.add_argument("--kv-dtype", default="bfloat16",
                        choices=["float32", "bfloat16", "int8", "fp8"],
                        help="the KV cache's element type")
    parser.add_argument("--block-size", type=int, default=16, help="tokens a KV block holds")
    parser.add_argument("--attention-backend", default="reference",
                        choices=["reference", "gpu", "mosaic_gpu", "tpu"],
                        help="whose cache layout to count bytes in")
    parser.add_argument("--quantization", choices=["int8", "fp8", "int4", "mxfp4"],
                        help="the weights' bytes quantized so (default: as stored)")


def inspect(args, parser: argparse.ArgumentParser) -> None:
    """What the engine makes of a Hugging Face model directory or a .gguf file: architecture,
    attention type, KV-cache bytes per token and per block, and whether it can be served."""
    from pagedjax.models.loading.inspect import inspect_model_dir

    if args.block_size < 1:
        parser.error("--block-size must be >= 1")
    try:
        report = inspect_model_dir(args.model_dir, args.kv_dtype, args.block_size,
                                   args.attention_backend, args.quantization)
    except ValueError as e:
        parser.exit(1, f"pagedjax inspect: {e}\n")
    print(f"{args.model_dir}")
    print(f"  architecture         {report['architecture']} "
          f"(model_type {report['model_type']}, weights {report['checkpoint_dtype']})")
    if "attention" in report:
        window = report.get("sliding_window")
        sliding = report.get("sliding_layers")
        where = (f" on {sliding} of {report['num_layers']} layers (the others global)"
                 if sliding is not None and sliding < report["num_layers"] else "")
        print(f"  attention            {report['attention']}"
              + (f", sliding window {window}{where}" if window else ""))
    if not report["supported"]:
        print(f"  supported            no: {report['reason']}")
        from pagedjax.models.registry import table
        print("  the model registry   " + "\n                       ".join(
            f"{row['architecture']} ({row['family']}, {row['format']})" for row in table()))
        raise SystemExit(1)
    print(f"  layers / heads / kv  {report['num_layers']} / {report['num_heads']} / "
          f"{report['num_kv_heads']}, head_dim {report['head_dim']}")
    print(f"  rope                 {report['rope']} (theta {report['rope_theta']:g}), "
          f"max positions {report['max_position_embeddings']:,}")
    print(f"  parameters           {report['num_params']:,}")
    formats = sorted(set(report["quantized_weights"].values()))
    print(f"  weights as served    {report['served_weight_bytes'] / 2**20:,.1f} MiB"
          + (f" (quantized: {'; '.join(formats)})" if formats else ""))
    if report.get("num_experts"):
        print(f"  experts              {report['num_experts']}, {report['experts_per_token']} a "
              f"token, in {report['sparse_layers']} of {report['num_layers']} layers"
              + (f", a shared expert of {report['shared_expert']}"
                 if report["shared_expert"] else "")
              + f"; {report['num_active_params']:,} parameters active a token")
    print(f"  KV bytes per token   {report['kv_bytes_per_token']:,} "
          f"({report['kv_dtype']}, {report['attention_backend']} layout)")
    print(f"  KV bytes per block   {report['kv_bytes_per_block']:,} "
          f"(block size {report['block_size']})")
    groups = report.get("kv_cache_groups")
    if groups:  # a hybrid model: a block is a page of one group's layers
        full = sum(g["window"] is None for g in groups)
        print(f"  KV cache groups      {len(groups)} groups of {report['layers_a_group']} "
              f"layer(s): {full} full, {len(groups) - full} sliding; a group's block "
              f"{groups[0]['blocks']:,} bytes")
    print(f"  eos token ids        {report['eos_token_ids']}")
    print("  supported            yes")


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
    from pagedjax.tools.profiling import run_trace

    try:
        trace = load_trace(args.trace)
        llm = LLM(args.model or DEFAULT_MODEL, **engine_kwargs(args))
    except (ValueError, OSError) as e:
        parser.exit(1, f"pagedjax profile: {e}\n")
    print(f"warmup: {llm.engine.warmup(progress=True)} step programs ready", flush=True)
    result, samples = run_trace(llm.engine, trace)
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
