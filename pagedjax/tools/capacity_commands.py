"""The capacity commands: `pagedjax capacity` (the KV-cache formula: how many tokens and
sequences a device's memory holds for a model) and `pagedjax inspect` (what the engine makes of a
model: its KV cache groups, layouts and capacity)."""

from __future__ import annotations

import argparse
import dataclasses

from pagedjax.models import CONFIGS, get_config


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
