"""`pagedjax` command line: `pagedjax demo`, `pagedjax capacity`."""

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


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"demo": None, "capacity": capacity}
    if not argv or argv[0] not in commands:
        print(f"usage: pagedjax {{{','.join(commands)}}} [options]", file=sys.stderr)
        raise SystemExit(2)
    if argv[0] == "demo":
        from pagedjax.demo import main as demo_main
        demo_main(argv[1:])
    else:
        capacity(argv[1:])


if __name__ == "__main__":
    main()
