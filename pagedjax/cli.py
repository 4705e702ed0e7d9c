"""`pagedjax` command line: `pagedjax demo`, `pagedjax capacity`, `pagedjax inspect MODEL_DIR`."""

from __future__ import annotations

import argparse
import sys

from models import CONFIGS, get_config
from pallas_kernels import kv_cache_bytes_per_block


def capacity(argv) -> None:
    """KV-cache capacity from the formula 2 * L * K * H * itemsize bytes per token."""
    parser = argparse.ArgumentParser(prog="pagedjax capacity", description=capacity.__doc__)
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--kv-memory-gib", type=float, required=True,
                        help="device memory given to the KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--context", type=int, default=4096,
                        help="average tokens per sequence (prompt + output)")
    args = parser.parse_args(argv)
    if args.kv_memory_gib <= 0 or args.block_size < 1 or args.context < 1:
        parser.error("--kv-memory-gib, --block-size and --context must be positive")
    config = get_config(args.model)
    itemsize = 2 if args.dtype == "bfloat16" else 4
    per_block = kv_cache_bytes_per_block(config.num_layers, args.block_size,
                                         config.num_kv_heads, config.head_dim,
                                         "float32" if itemsize == 4 else "float16")
    num_blocks = int(args.kv_memory_gib * 2**30) // per_block
    tokens = (num_blocks - 1) * args.block_size
    blocks_per_seq = -(-args.context // args.block_size)
    print(f"model {args.model}: L={config.num_layers} K={config.num_kv_heads} "
          f"H={config.head_dim}, KV {args.dtype}")
    print(f"  bytes per token      {config.kv_bytes_per_token(itemsize):,}")
    print(f"  bytes per block      {per_block:,} (block size {args.block_size})")
    print(f"  blocks in {args.kv_memory_gib:g} GiB   {num_blocks:,} (one is the null block)")
    print(f"  tokens held          {tokens:,}")
    print(f"  sequences of {args.context} tokens  {(num_blocks - 1) // blocks_per_seq:,}")


def inspect(argv) -> None:
    """What the engine makes of a Hugging Face model directory: architecture, attention type,
    KV-cache bytes per token and per block, and whether it can be served."""
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


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": None, "capacity": capacity, "inspect": inspect}
    if not argv or argv[0] not in commands:
        print(f"usage: pagedjax {{{','.join(commands)}}} [options]", file=sys.stderr)
        raise SystemExit(2)
    if argv[0] == "demo":
        from pagedjax.demo import main as demo_main
        demo_main(argv[1:])
    else:
        commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
