"""EngineConfig's fields as command-line flags, shared by `pagedjax serve`, `pagedjax profile`
and the benchmarks."""

from __future__ import annotations

import argparse

from pagedjax.engine.config import LOGPROBS_MODES, EngineConfig
from pagedjax.scheduler import POLICIES


def _default(name: str) -> str:
    """EngineConfig's default of a field, for a flag's help."""
    return f"default {getattr(EngineConfig, name)}"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's fields as flags (defaults: EngineConfig's own), in one group."""
    group = parser.add_argument_group("engine")
    for add in (_pool_args, _cache_args, _parallel_args, _program_args, _lora_args,
                _pooling_args):
        add(group)


def _pool_args(group) -> None:
    """The KV pool, the step's budget and policy, the dtypes, the attention backend."""
    group.add_argument("--max-model-len", type=int,
                       help="longest prompt + output a request may hold "
                       f"({_default('max_model_len')})")
    group.add_argument("--block-size", type=int,
                       help=f"tokens a KV block holds ({_default('block_size')})")
    group.add_argument("--num-blocks", type=int, help="KV blocks in the pool, the null block "
                       "included (default: max-num-seqs sequences of max-model-len tokens)")
    group.add_argument("--kv-cache-memory-gib", type=float,
                       help="size the KV pool by memory instead of --num-blocks (a device's "
                       "share: each of the --tensor-parallel-size devices holds that much)")
    group.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                       help="size the KV pool from the device's memory instead: the fraction "
                       "of it weights, activations and the pool may fill, as vLLM's (the pool "
                       "takes what the weights and the largest step programs leave)")
    group.add_argument("--max-num-seqs", type=int,
                       help=f"sequences a step runs at most ({_default('max_num_seqs')})")
    group.add_argument("--max-num-batched-tokens", type=int,
                       help=f"the token budget of a step ({_default('max_num_batched_tokens')})")
    group.add_argument("--policy", choices=list(POLICIES),
                       help=f"what a step schedules first ({_default('policy')})")
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                       help="activations (and the KV cache): auto takes the checkpoint's "
                       "(bfloat16 for a 16-bit Hugging Face checkpoint, else float32; default "
                       "float32)")
    group.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"],
                       help="the KV cache's dtype: auto is --dtype's; int8 / fp8 (e4m3) with "
                       f"per-token scales ({_default('kv_cache_dtype')})")
    group.add_argument("--attention-backend",
                       choices=["auto", "reference", "gpu", "mosaic_gpu", "tpu"],
                       help="the paged attention kernels: auto picks by the platform "
                       f"({_default('attention_backend')})")
    group.add_argument("--mla-prefill", choices=["auto", "absorbed", "expanded"],
                       help="multi-head latent attention's prefill form (DeepSeek): auto picks "
                       f"by the step's shape ({_default('mla_prefill')})")


def _cache_args(group) -> None:
    """Preemption, swap, the prefix cache and its tiers, the layers' form, logprobs, seeds."""
    group.add_argument("--preemption-mode", choices=["recompute", "swap"],
                       help=f"what a preempted request loses ({_default('preemption_mode')})")
    group.add_argument("--swap-space-gib", type=float, help="host pool for --preemption-mode swap")
    group.add_argument("--kv-offload-gib", type=float,
                       help="host tier of the prefix cache: blocks the device evicts are kept "
                       "in this much host memory and loaded back on a hit (default: none)")
    group.add_argument("--kv-disk-dir", help="disk tier of the prefix cache: blocks the host "
                       "tier evicts are written here (with --kv-disk-gib and --kv-offload-gib); "
                       "a restarted server with the same model and config finds them")
    group.add_argument("--kv-disk-gib", type=float, help="the disk tier's size")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="turn automatic prefix caching off (default on)")
    group.add_argument("--no-chunked-prefill", action="store_true",
                       help="prefill each prompt in one step (default: chunked)")
    group.add_argument("--scan-layers", action=argparse.BooleanOptionalAction,
                       help="the decoder layers under one jax.lax.scan (--no-scan-layers "
                       "unrolls them: L copies of the layer compiled); default: scanned, "
                       "except on the CPU for layers of 8 MiB or more")
    group.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="give every layer of a model with sliding-window and global layers "
                       "(Gemma 2/3) the whole context, instead of a KV cache group per kind")
    group.add_argument("--max-logprobs", type=int,
                       help="the most logprobs a request may ask for "
                       f"({_default('max_logprobs')})")
    group.add_argument("--logprobs-mode", choices=LOGPROBS_MODES,
                       help="what logprobs report: the model's (raw_*) or what is sampled "
                       f"from (processed_*), as log-probabilities or logits "
                       f"({_default('logprobs_mode')})")
    group.add_argument("--seed", type=int,
                       help="draws the seeds of requests that give none "
                       f"({_default('seed')})")


def _parallel_args(group) -> None:
    """Tensor, expert and data parallelism."""
    group.add_argument("--tensor-parallel-size", type=int,
                       help="split the model over this many local devices (default 1)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="a mixture of experts: split its experts over the "
                       "--tensor-parallel-size devices (whole experts each) instead of each "
                       "expert's MLP")
    group.add_argument("--data-parallel-size", type=int,
                       help="replicas of the (tensor-parallel) model on disjoint devices, each "
                       "with its own KV pool and scheduler, behind one server (default 1)")


def _program_args(group) -> None:
    """The step programs, speculative decoding, quantization, async scheduling, the
    compilation cache."""
    group.add_argument("--step-programs", choices=["split", "ragged"],
                       help="decode programs beside the ragged ones (split, the default), or "
                       "every step on the ragged programs (ragged: half the programs)")
    group.add_argument("--prefill-seqs", choices=["per_token_bucket", "bucketed"],
                       help="prefill programs: one per token bucket, or one per (T, B)")
    group.add_argument("--token-padding-gap", type=int, metavar="N",
                       help="a step's tokens padded to powers of two up to N, then to "
                       "multiples of N (vLLM TPU's bucket padding gap: less padding, more "
                       "programs; default 0: powers of two)")
    group.add_argument("--speculative-config", metavar="JSON",
                       help="speculative decoding, vLLM's fields as JSON, e.g. "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                       "\"prompt_lookup_max\": 4}' (default: none)")
    group.add_argument("-q", "--quantization",
                       choices=["int8", "fp8", "int4", "gguf", "compressed-tensors", "mxfp4"],
                       help="weight-only quantization: int8 / fp8 per output channel, int4 per "
                       "group, quantized as the weights are read; gguf, compressed-tensors, "
                       "mxfp4: "
                       "the checkpoint's own (what such a checkpoint gets by default). "
                       "Default: as stored")
    group.add_argument("--quantize-lm-head", action="store_true",
                       help="quantize the LM head too (a tied model's embedding table)")
    group.add_argument("--async-scheduling", action="store_true",
                       help="schedule and dispatch each step while the previous one runs on "
                       "the device (its sampled tokens read there), as vLLM's; the same "
                       "outputs (default off)")
    group.add_argument("--compilation-cache", metavar="DIR|auto|off",
                       help="JAX's persistent compilation cache: a second start compiles "
                       "nothing (default auto: ~/.cache/pagedjax/jax_cache)")


def _lora_args(group) -> None:
    """Multi-LoRA serving (vLLM's flags)."""
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters over the model (requests pick one by name)")
    group.add_argument("--max-loras", type=int,
                       help=f"adapters one step may mix: device slots ({_default('max_loras')})")
    group.add_argument("--max-lora-rank", type=int,
                       help="the largest adapter rank served (1, 8, 16, 32, 64, 128, 256, 320 "
                       f"or 512; {_default('max_lora_rank')})")
    group.add_argument("--max-cpu-loras", type=int,
                       help="adapters kept read on the host (default: --max-loras)")


def _pooling_args(group) -> None:
    """Pooling models (vLLM's flags): embeddings, classification, scores."""
    group.add_argument("--runner", choices=["auto", "generate", "pooling"],
                       help="generate text, or serve a pooling model (/v1/embeddings, /pooling, "
                       "/classify, /score, /rerank); auto: pooling for a "
                       f"*ForSequenceClassification checkpoint ({_default('runner')})")
    group.add_argument("--convert", choices=["auto", "none", "embed", "classify", "reward"],
                       help="serve the model as an embedding model, a classifier or a reward "
                       "model (implies --runner pooling; classify and reward need a head) "
                       f"({_default('convert')})")
    group.add_argument("--pooler-config", metavar="JSON",
                       help="override the model's pooler, e.g. '{\"pooling_type\": \"MEAN\", "
                       "\"normalize\": true}' (pooling_type LAST, MEAN, CLS or ALL)")
    group.add_argument("--hf-overrides", metavar="JSON",
                       help="vLLM's hf_overrides for rerankers served through their LM head: "
                       "'{\"classifier_from_token\": [\"no\", \"yes\"]}' or "
                       "'{\"is_original_qwen3_reranker\": true}'")


def _json_object(flag: str, text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{flag} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the flags of add_engine_args set."""
    kwargs = {name: getattr(args, name) for name in (
        "max_model_len", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
        "policy", "dtype", "kv_cache_dtype", "attention_backend", "mla_prefill",
        "preemption_mode",
        "max_logprobs", "logprobs_mode", "seed", "compilation_cache", "prefill_seqs",
        "token_padding_gap",
        "step_programs", "tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization",
        "speculative_config", "quantization", "max_loras", "max_lora_rank", "max_cpu_loras")
        if getattr(args, name) is not None}
    if args.kv_cache_memory_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_memory_gib * 2**30)
    if args.swap_space_gib is not None:
        kwargs["swap_space_bytes"] = int(args.swap_space_gib * 2**30)
    for flag, field in (("kv_offload_gib", "kv_offload_bytes"), ("kv_disk_gib", "kv_disk_bytes")):
        if getattr(args, flag) is not None:
            kwargs[field] = int(getattr(args, flag) * 2**30)
    if args.kv_disk_dir is not None:
        kwargs["kv_disk_dir"] = args.kv_disk_dir
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        kwargs["enable_chunked_prefill"] = False
    if args.scan_layers is not None:
        kwargs["scan_layers"] = args.scan_layers
    if args.disable_hybrid_kv_cache_manager:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if args.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if args.quantize_lm_head:
        kwargs["quantize_lm_head"] = True
    if args.async_scheduling:
        kwargs["async_scheduling"] = True
    if args.enable_lora:
        kwargs["enable_lora"] = True
    for flag in ("runner", "convert"):
        if getattr(args, flag) is not None:
            kwargs[flag] = getattr(args, flag)
    for flag in ("pooler_config", "hf_overrides"):
        if getattr(args, flag) is not None:
            kwargs[flag] = _json_object("--" + flag.replace("_", "-"), getattr(args, flag))
    return kwargs
