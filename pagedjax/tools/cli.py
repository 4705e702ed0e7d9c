"""`pagedjax` command line: `pagedjax demo`, `pagedjax serve [MODEL]`, `pagedjax router
--backend URL ...`, `pagedjax capacity`, `pagedjax inspect MODEL_DIR`, `pagedjax profile`,
`pagedjax simulate`."""

from __future__ import annotations

import argparse
import threading
import time
import sys

from models import CONFIGS, get_config
from pallas_kernels import kv_cache_bytes_per_block
from scheduler import POLICIES


def capacity(argv) -> None:
    """KV-cache capacity from the formula 2 * L * K * H * itemsize bytes per token."""
    parser = argparse.ArgumentParser(prog="pagedjax capacity", description=capacity.__doc__)
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--kv-memory-gib", type=float, required=True,
                        help="memory given to the KV cache on each device")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="devices one replica's weights and KV heads are split over")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="replicas, each with its own pool (the totals multiply)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--context", type=int, default=4096,
                        help="average tokens per sequence (prompt + output)")
    args = parser.parse_args(argv)
    if args.kv_memory_gib <= 0 or args.block_size < 1 or args.context < 1:
        parser.error("--kv-memory-gib, --block-size and --context must be positive")
    if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
        parser.error("--tensor-parallel-size and --data-parallel-size must be >= 1")
    from pagedjax.parallel.sharding import (check_tensor_parallel, kv_bytes_per_block_per_device,
                                   weight_bytes_per_device)

    config = get_config(args.model)
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    try:
        check_tensor_parallel(config, tp, check_devices=False)  # a plan for other machines
    except ValueError as e:
        parser.exit(1, f"pagedjax capacity: {e}\n")
    itemsize = 2 if args.dtype == "bfloat16" else 4
    kv_dtype = "float32" if itemsize == 4 else "float16"
    per_block = kv_bytes_per_block_per_device(config, args.block_size, tp, kv_dtype)
    num_blocks = int(args.kv_memory_gib * 2**30) // per_block
    tokens = (num_blocks - 1) * args.block_size
    blocks_per_seq = -(-args.context // args.block_size)
    print(f"model {args.model}: L={config.num_layers} K={config.num_kv_heads} "
          f"H={config.head_dim}, KV {args.dtype}, TP {tp} x DP {dp}")
    print(f"  bytes per token      {config.kv_bytes_per_token(itemsize):,} (all devices)")
    print(f"  weights per device   {weight_bytes_per_device(config, tp, itemsize) / 2**30:.2f} "
          f"GiB")
    print(f"  bytes per block      {per_block:,} a device (block size {args.block_size})")
    print(f"  blocks in {args.kv_memory_gib:g} GiB   {num_blocks:,} a replica (one is the null "
          "block)")
    print(f"  tokens held          {tokens:,} a replica, {tokens * dp:,} in all")
    print(f"  sequences of {args.context} tokens  {(num_blocks - 1) // blocks_per_seq:,} a "
          f"replica, {(num_blocks - 1) // blocks_per_seq * dp:,} in all")


def inspect(argv) -> None:
    """What the engine makes of a Hugging Face model directory or a .gguf file: architecture,
    attention type, KV-cache bytes per token and per block, and whether it can be served."""
    from models.hf import inspect_model_dir

    parser = argparse.ArgumentParser(prog="pagedjax inspect", description=inspect.__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--kv-dtype", default="bfloat16",
                        choices=["float32", "bfloat16", "int8", "fp8"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="reference",
                        choices=["reference", "gpu", "mosaic_gpu", "tpu"],
                        help="whose cache layout to count bytes in")
    args = parser.parse_args(argv)
    if args.block_size < 1:
        parser.error("--block-size must be >= 1")
    try:
        report = inspect_model_dir(args.model_dir, args.kv_dtype, args.block_size,
                                   args.attention_backend)
    except ValueError as e:
        parser.exit(1, f"pagedjax inspect: {e}\n")
    print(f"{args.model_dir}")
    print(f"  architecture         {report['architecture']} "
          f"(model_type {report['model_type']}, weights {report['checkpoint_dtype']})")
    if "attention" in report:
        window = report.get("sliding_window")
        print(f"  attention            {report['attention']}"
              + (f", sliding window {window}" if window else ""))
    if not report["supported"]:
        print(f"  supported            no: {report['reason']}")
        raise SystemExit(1)
    print(f"  layers / heads / kv  {report['num_layers']} / {report['num_heads']} / "
          f"{report['num_kv_heads']}, head_dim {report['head_dim']}")
    print(f"  rope                 {report['rope']} (theta {report['rope_theta']:g}), "
          f"max positions {report['max_position_embeddings']:,}")
    print(f"  parameters           {report['num_params']:,}")
    print(f"  KV bytes per token   {report['kv_bytes_per_token']:,} "
          f"({report['kv_dtype']}, {report['attention_backend']} layout)")
    print(f"  KV bytes per block   {report['kv_bytes_per_block']:,} "
          f"(block size {report['block_size']})")
    print(f"  eos token ids        {report['eos_token_ids']}")
    print("  supported            yes")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's fields as flags (defaults: EngineConfig's own)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--block-size", type=int)
    group.add_argument("--num-blocks", type=int, help="KV blocks in the pool, the null block "
                       "included (default: max-num-seqs sequences of max-model-len tokens)")
    group.add_argument("--kv-cache-memory-gib", type=float,
                       help="size the KV pool by memory instead of --num-blocks (a device's "
                       "share: each of the --tensor-parallel-size devices holds that much)")
    group.add_argument("--max-num-seqs", type=int)
    group.add_argument("--max-num-batched-tokens", type=int)
    group.add_argument("--policy", choices=list(POLICIES))
    group.add_argument("--dtype", choices=["float32", "bfloat16"])
    group.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"])
    group.add_argument("--attention-backend",
                       choices=["auto", "reference", "gpu", "mosaic_gpu", "tpu"])
    group.add_argument("--preemption-mode", choices=["recompute", "swap"])
    group.add_argument("--swap-space-gib", type=float, help="host pool for --preemption-mode swap")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--no-chunked-prefill", action="store_true")
    group.add_argument("--no-scan-layers", action="store_true",
                       help="unroll the decoder layers in every step program (compiles L "
                       "copies of the layer) instead of one jax.lax.scan")
    group.add_argument("--max-logprobs", type=int)
    group.add_argument("--seed", type=int)
    group.add_argument("--tensor-parallel-size", type=int,
                       help="split the model over this many local devices (default 1)")
    group.add_argument("--data-parallel-size", type=int,
                       help="replicas of the (tensor-parallel) model on disjoint devices, each "
                       "with its own KV pool and scheduler, behind one server (default 1)")
    group.add_argument("--step-programs", choices=["split", "ragged"],
                       help="decode programs beside the ragged ones (split, the default), or "
                       "every step on the ragged programs (ragged: half the programs)")
    group.add_argument("--prefill-seqs", choices=["per_token_bucket", "bucketed"],
                       help="prefill programs: one per token bucket, or one per (T, B)")
    group.add_argument("--compilation-cache", metavar="DIR|auto|off",
                       help="JAX's persistent compilation cache: a second start compiles "
                       "nothing (default auto: ~/.cache/pagedjax/jax_cache)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the flags of add_engine_args set."""
    kwargs = {name: getattr(args, name) for name in (
        "max_model_len", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
        "policy", "dtype", "kv_cache_dtype", "attention_backend", "preemption_mode",
        "max_logprobs", "seed", "compilation_cache", "prefill_seqs",
        "step_programs", "tensor_parallel_size", "data_parallel_size")
        if getattr(args, name) is not None}
    if args.kv_cache_memory_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_memory_gib * 2**30)
    if args.swap_space_gib is not None:
        kwargs["swap_space_bytes"] = int(args.swap_space_gib * 2**30)
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        kwargs["enable_chunked_prefill"] = False
    if args.no_scan_layers:
        kwargs["scan_layers"] = False
    return kwargs


def serve(argv) -> None:
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming; /metrics,
    /health) for MODEL: a Hugging Face or orbax directory, or a config name (default: the
    embedded trained model)."""
    import os

    parser = argparse.ArgumentParser(prog="pagedjax serve", description=serve.__doc__)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--tokenizer", help="a tokenizer directory, or 'byte'")
    parser.add_argument("--chat-template", help="a Jinja chat template, or a file holding one, "
                        "for a model whose tokenizer has none (or to replace its own)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name",
                        help="the name clients send as `model` (default: the model's)")
    parser.add_argument("--max-outstanding-tokens", type=int,
                        help="admission control: refuse (HTTP 429) a request that would raise "
                        "the tokens still to compute over all requests above this")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDJAX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(or PAGEDJAX_API_KEY)")
    parser.add_argument("--public-metrics", action="store_true",
                        help="with --api-key, leave /metrics open (a Prometheus scraper)")
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                        help="answer 413 to a larger request body, unread (default 4 MiB)")
    warmup = parser.add_mutually_exclusive_group()
    warmup.add_argument("--warmup", action="store_true",
                        help="compile every step program before accepting requests")
    warmup.add_argument("--warmup-background", action="store_true",
                        help="accept requests at once and compile every step program in a "
                        "background thread (a shape not compiled yet compiles on first use)")
    parser.add_argument("--trace-out", help="append every finished request to this JSON-lines "
                        "trace (lengths, arrival, prefix hashes; no text) for `pagedjax "
                        "simulate`")
    parser.add_argument("--log-level", default="info")
    add_engine_args(parser)
    from pagedjax.parallel import multihost
    multihost.add_args(parser)
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_outstanding_tokens is not None and args.max_outstanding_tokens < 1:
        parser.error(f"--max-outstanding-tokens must be >= 1, got {args.max_outstanding_tokens}")
    if args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.chat_template is not None:
        from pagedjax.text.tokenizer import read_chat_template
        try:
            args.chat_template = read_chat_template(args.chat_template)
        except ValueError as e:
            parser.error(str(e))

    import jax

    from pagedjax.llm import DEFAULT_MODEL, LLM
    from pagedjax.serving.app import run_server

    model = args.model or DEFAULT_MODEL
    try:
        follower = multihost.start_from_args(args)
        llm = LLM(model, tokenizer=args.tokenizer, **engine_kwargs(args))
    except ValueError as e:
        parser.exit(1, f"pagedjax serve: {e}\n")
    if follower:  # the leader (process 0) serves; this process runs its steps' shards
        print(f"process {jax.process_index()}: following process 0", flush=True)
        steps = multihost.follow(llm.engine.runner)
        print(f"process {jax.process_index()}: leader stopped after {steps} steps", flush=True)
        return
    if args.warmup:
        start = time.perf_counter()
        num_programs = llm.engine.warmup(progress=True)
        print(f"warmup: {num_programs} step programs ready in "
              f"{time.perf_counter() - start:.1f} s (compilation cache: "
              f"{llm.engine.compilation_cache_dir or 'off'})", flush=True)
    if args.warmup_background:
        threading.Thread(target=_report_warmup, args=(llm.engine.start_warmup(progress=True),),
                         daemon=True).start()
    name = args.served_model_name or os.path.basename(os.path.normpath(str(model)))
    run_server(llm.engine, name, host=args.host, port=args.port,
               max_outstanding_tokens=args.max_outstanding_tokens, api_key=args.api_key,
               trace_out=args.trace_out, log_level=args.log_level,
               max_request_bytes=args.max_request_bytes, public_metrics=args.public_metrics,
               chat_template=args.chat_template)


def _report_warmup(warmup) -> None:
    warmup.wait()
    if warmup.error is not None:
        print(f"warmup stopped ({warmup.error!r}); the rest compile on first use", flush=True)
    else:
        print(f"warmup: {warmup.num_programs} step programs ready in the background in "
              f"{warmup.seconds:.1f} s", flush=True)


def router(argv) -> None:
    """An OpenAI-compatible proxy routing each request to the `pagedjax serve` instance most
    likely to hold its prompt's prefix in its KV cache (see pagedjax.serving.router)."""
    import os

    from pagedjax.serving.router import POLICIES, run_router

    parser = argparse.ArgumentParser(prog="pagedjax router", description=router.__doc__)
    parser.add_argument("--backend", action="append", required=True,
                        help="a server's base URL (repeat for each)")
    parser.add_argument("--policy", default="kv_aware", choices=POLICIES)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--balance-abs", type=int, default=8,
                        help="in-flight difference beyond which load wins over cache affinity")
    parser.add_argument("--balance-rel", type=float, default=1.5)
    parser.add_argument("--min-match", type=float, default=0.25,
                        help="least fraction of a prompt's chunks matched to follow affinity")
    rollout = parser.add_argument_group("safe rollout")
    rollout.add_argument("--canary", action="append", default=[],
                         help="a canary instance's base URL (repeat for each)")
    rollout.add_argument("--canary-weight", type=float, default=0.0,
                         help="the canary group's share of the traffic, in [0, 1]")
    rollout.add_argument("--rollback-window", type=int, default=200,
                         help="outcomes per group the comparison looks at")
    rollout.add_argument("--rollback-min-requests", type=int, default=20,
                         help="canary outcomes needed before it can be judged")
    rollout.add_argument("--rollback-max-error-delta", type=float, default=0.05,
                         help="roll back when the canary's error rate exceeds the stable "
                         "group's by more than this")
    rollout.add_argument("--rollback-max-latency-ratio", type=float, default=2.0,
                         help="roll back when the canary's median latency exceeds this times "
                         "the stable group's")
    rollout.add_argument("--admin-key", default=os.environ.get("PAGEDJAX_ADMIN_KEY"),
                         help="serve the /router/* admin endpoints, behind 'Authorization: "
                         "Bearer KEY' (or PAGEDJAX_ADMIN_KEY); without a key they do not exist")
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                        help="answer 413 to a larger request body, unread (default 4 MiB)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    guard = dict(window=args.rollback_window, min_requests=args.rollback_min_requests,
                 max_error_delta=args.rollback_max_error_delta,
                 max_latency_ratio=args.rollback_max_latency_ratio)
    try:
        run_router(args.backend, args.policy, host=args.host, port=args.port,
                   log_level=args.log_level, canary=args.canary,
                   canary_weight=args.canary_weight, guard=guard, admin_key=args.admin_key,
                   balance_abs=args.balance_abs, balance_rel=args.balance_rel,
                   min_match=args.min_match, max_request_bytes=args.max_request_bytes)
    except ValueError as e:
        parser.exit(1, f"pagedjax router: {e}\n")


def profile(argv) -> None:
    """Serves a trace (JSON lines: arrival_s, prompt_len, output_len[, n, prefix_group,
    prefix_len]) on the engine in real time and fits the simulator's step-time model to its
    steps (written as JSON for `pagedjax simulate`)."""
    parser = argparse.ArgumentParser(prog="pagedjax profile", description=profile.__doc__)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    add_engine_args(parser)
    args = parser.parse_args(argv)

    from pagedjax.llm import DEFAULT_MODEL, LLM
    from pagedjax.tools.profiling import run_trace
    from scheduler.simulator import StepCostModel, load_trace

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


def simulate(argv) -> None:
    """Predicts a trace's TTFT, TPOT, throughput, preemptions and KV use under each combination
    of the given pool sizes and batch limits, with the real scheduler on a step-time model:
    fitted to an engine (`--cost`, from `pagedjax profile`) or a roofline estimate for a model
    on a chip not at hand (`--roofline CHIP --model NAME`). No model runs, no device."""
    from scheduler.simulator import CHIPS

    parser = argparse.ArgumentParser(prog="pagedjax simulate", description=simulate.__doc__)
    parser.add_argument("--trace", required=True)
    model_source = parser.add_mutually_exclusive_group(required=True)
    model_source.add_argument("--cost", help="a fitted cost model from `pagedjax profile`")
    model_source.add_argument("--roofline", choices=sorted(CHIPS),
                              help="estimate step times for --model on this chip")
    parser.add_argument("--model", choices=sorted(CONFIGS), help="with --roofline")
    parser.add_argument("--flops-util", type=float, default=0.5)
    parser.add_argument("--bw-util", type=float, default=0.7)
    parser.add_argument("--overhead-ms", type=float, default=2.0)
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "int8"],
                        help="with --roofline: KV bytes per element 2 or 1 (weights bf16)")
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    floats = lambda text: [float(v) for v in text.split(",")]  # noqa: E731
    pool = parser.add_mutually_exclusive_group(required=True)
    pool.add_argument("--num-blocks", type=ints,
                      help="pool sizes to try, comma-separated (the null block included)")
    pool.add_argument("--kv-memory-gib", type=floats,
                      help="with --roofline: KV memory budgets to try, comma-separated")
    parser.add_argument("--max-num-seqs", type=ints, default=[32])
    parser.add_argument("--max-num-batched-tokens", type=ints, default=[512])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--policy", default="mixed", choices=list(POLICIES))
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="with --roofline: one replica over this many chips (a device's "
                        "weights and KV; the all-reduces on the chip's link)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="replicas, each with the pool; requests placed by the "
                        "data-parallel engine's prefix-affinity rule, steps in lockstep")
    args = parser.parse_args(argv)
    if args.roofline and not args.model:
        parser.error("--roofline needs --model")
    if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
        parser.error("--tensor-parallel-size and --data-parallel-size must be >= 1")
    if args.tensor_parallel_size > 1 and not args.roofline:
        parser.error("--tensor-parallel-size needs --roofline (a fitted --cost is for the "
                     "parallelism it was profiled at)")
    if args.kv_memory_gib and not args.roofline:
        parser.error("--kv-memory-gib needs --roofline --model (for KV bytes per token)")

    from pagedjax.engine.config import EngineConfig
    from pagedjax.parallel.plan import prefix_affinity_placer, roofline_cost
    from scheduler.simulator import StepCostModel, load_trace
    from scheduler.simulator import simulate as run

    try:
        trace = load_trace(args.trace)
        vocab = args.vocab_size
        if args.roofline:
            config = get_config(args.model)
            cost = roofline_cost(config, CHIPS[args.roofline], args.tensor_parallel_size,
                                 args.kv_dtype, flops_util=args.flops_util,
                                 bw_util=args.bw_util, overhead_s=args.overhead_ms / 1e3)
            vocab = config.vocab_size
            pools = args.num_blocks or [  # a device's budget: each holds 1/TP of a block
                1 + int(gib * 2**30) // (cost.kv_bytes_per_token * args.block_size)
                for gib in args.kv_memory_gib]
        else:
            with open(args.cost) as f:
                cost = StepCostModel.from_json(f.read())
            pools = args.num_blocks
        rows = []
        for num_blocks in pools:
            for max_num_seqs in args.max_num_seqs:
                for max_tokens in args.max_num_batched_tokens:
                    config = EngineConfig(
                        num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_tokens, block_size=args.block_size,
                        max_model_len=args.max_model_len, policy=args.policy,
                        enable_prefix_caching=not args.no_prefix_caching)
                    dp = args.data_parallel_size
                    result = run(trace, config.scheduler_config(), num_blocks=num_blocks,
                                 block_size=args.block_size, buckets=config.buckets(),
                                 cost=cost, vocab_size=vocab, replicas=dp,
                                 place=prefix_affinity_placer(dp, args.block_size))
                    rows.append({"num_blocks": num_blocks, "max_num_seqs": max_num_seqs,
                                 "max_num_batched_tokens": max_tokens, **result.summary()})
    except (ValueError, OSError, KeyError) as e:
        parser.exit(1, f"pagedjax simulate: {e}\n")
    if args.roofline:
        print(f"roofline estimate: {args.model} on {args.roofline} x TP "
              f"{args.tensor_parallel_size} x DP {args.data_parallel_size} (flops x "
              f"{args.flops_util}, "
              f"bandwidth x {args.bw_util}, {args.overhead_ms} ms a step); not a measurement")
    print(_table(rows))


def _table(rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
             for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": None, "serve": serve, "router": router, "capacity": capacity,
                "inspect": inspect, "profile": profile, "simulate": simulate}
    if not argv or argv[0] not in commands:
        print(f"usage: pagedjax {{{','.join(commands)}}} [options]", file=sys.stderr)
        raise SystemExit(2)
    if argv[0] == "demo":
        from pagedjax.tools.demo import main as demo_main
        demo_main(argv[1:])
    else:
        commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
