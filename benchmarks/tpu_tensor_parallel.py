"""The engine's tensor-parallel step compiled by libtpu for TPU slices, on a machine without
TPUs: per-device memory and the collectives XLA inserted.

Each case is the runner's whole jitted step (pagedjax.engine.step_functions.step_fn: model with its layers
scanned, KV writes, the TPU attention kernels under shard_map, sampler), its weights placed by
pagedjax.parallel.sharding's rules and its KV cache split over KV heads, all abstract (nothing is
allocated), compiled as one program for every chip of the topology (benchmarks.aot.xla_tpu).

- weights_gib / kv_gib: what one device holds of the weights and of the KV pool (its shards);
- argument / alias / temp: XLA's memory analysis of the compiled program, per device; the
  donated pool is aliased to the output (alias ~ kv_gib: updated in place);
- hbm_use: (arguments + temporaries) over the chip's HBM;
- collectives: {op: [count, MiB of results]} in the optimized program; the scan's body is one
  layer, counted once, so a step runs `layers` times its all-reduces.

The pool: --kv-gib-per-device of KV on each chip (bf16), the rest of HBM left to weights and
temporaries. Decode at 256 sequences and an 8k-token prefill. seqs_32k: the 32k-token sequences
that pool holds over the slice (Gemma 3 with KV cache groups, its sliding groups holding their
1,024-token window and an 8k step, or with every layer keeping the whole context).

--quantized: weight-only int8 / int4 weights (LM head too) beside bf16; the pool is what 90% of
HBM leaves past the weights and 1 GiB for temporaries (kv_gib), seqs_8k the 8k-token sequences
it holds; bf16_weights_gib: the same weights in bf16, which temp_gib would have to hold were a
full-precision copy of them made (each layer dequantizes its own weights inside the scan).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile

from common import ROOT, write_results

HBM_GIB = {"v5e": 16, "v6e": 32, "v5p": 95}
# name: (model, topology, tensor parallel size[, KV cache groups (hybrid models)])
CASES = {
    "llama-3-8b TP1 v5e-1": ("llama-3-8b", "v5e:2x2", 1),  # one chip of the 2x2
    "llama-3-8b TP4 v5e-4": ("llama-3-8b", "v5e:2x2", 4),
    "llama-3-8b TP8 v5e-8": ("llama-3-8b", "v5e:2x4", 8),
    "llama-3-8b TP8 v6e-8": ("llama-3-8b", "v6e:2x4", 8),
    "llama-3-70b TP16 v6e-16": ("llama-3-70b", "v6e:4x4", 16),
    # Gemma 3 27B (62 layers scanned by their 6-layer period), with KV cache groups and with
    # every layer keeping the whole context.
    "gemma-3-27b TP4 v6e-4 groups": ("gemma-3-27b", "v6e:2x2", 4, True),
    "gemma-3-27b TP4 v6e-4 full": ("gemma-3-27b", "v6e:2x2", 4, False),
    "gemma-3-27b TP8 v5e-8 groups": ("gemma-3-27b", "v5e:2x4", 8, True),
    "gemma-3-27b TP8 v5e-8 full": ("gemma-3-27b", "v5e:2x4", 8, False),
    "gemma-3-27b TP8 v6e-8 groups": ("gemma-3-27b", "v6e:2x4", 8, True),
    "gemma-3-27b TP8 v6e-8 full": ("gemma-3-27b", "v6e:2x4", 8, False),
}
# Mixtures of experts (models/layers/moe.py; --moe, results in tpu_moe.md): tensor parallel experts
# (each expert's MLP split) against expert parallel (E / TP whole experts a chip); the grouped
# matmul is lax.ragged_dot (pagedjax.models.layers.moe_experts.default_implementation on a TPU device).
# name: (model, topology, TP, KV cache groups, expert parallel)
MOE_CASES = {
    "qwen3-30b-a3b TP8 v5e-8": ("qwen3-30b-a3b", "v5e:2x4", 8, True, False),
    "qwen3-30b-a3b EP8 v5e-8": ("qwen3-30b-a3b", "v5e:2x4", 8, True, True),
    "qwen3-30b-a3b TP8 v6e-8": ("qwen3-30b-a3b", "v6e:2x4", 8, True, False),
    "qwen3-30b-a3b EP8 v6e-8": ("qwen3-30b-a3b", "v6e:2x4", 8, True, True),
    "mixtral-8x7b TP8 v5e-8": ("mixtral-8x7b", "v5e:2x4", 8, True, False),
    "mixtral-8x7b EP8 v5e-8": ("mixtral-8x7b", "v5e:2x4", 8, True, True),
}
# Quantized weights (--quantized, results in tpu_quantized.md): weight-only int8 / int4
# (models/quantization/schemes.py; the LM head too), the pool taking what 90% of HBM leaves past the
# weights and a 1 GiB allowance for temporaries; seqs_8k: 8k-token sequences it holds.
# name: (model, topology, TP, KV cache groups, expert parallel, quantization)
QUANT_CASES = {
    "llama-3-8b bf16 TP1 v5e-1": ("llama-3-8b", "v5e:2x2", 1, False, False, None),
    "llama-3-8b int8 TP1 v5e-1": ("llama-3-8b", "v5e:2x2", 1, False, False, "int8"),
    "llama-3-8b int4 TP1 v5e-1": ("llama-3-8b", "v5e:2x2", 1, False, False, "int4"),
    "llama-3-70b bf16 TP8 v5e-8": ("llama-3-70b", "v5e:2x4", 8, False, False, None),
    "llama-3-70b int8 TP8 v5e-8": ("llama-3-70b", "v5e:2x4", 8, False, False, "int8"),
}
# Hybrid linear attention (--linear, results in tpu_linear_attention.md): Qwen3.5 / Qwen3-Next,
# Gated DeltaNet layers in the KV cache's state group (scheduler/state_group.py), their heads
# split over the chips; seqs_32k counts each sequence's state blocks beside its KV.
# name: (model, topology, TP, KV cache groups)
LINEAR_CASES = {
    "qwen3.5-9b TP4 v5e-4": ("qwen3.5-9b", "v5e:2x2", 4, True),
    "qwen3.5-9b TP8 v5e-8": ("qwen3.5-9b", "v5e:2x4", 8, True),
    "qwen3.5-9b TP4 v6e-4": ("qwen3.5-9b", "v6e:2x2", 4, True),
    "qwen3-next-80b-a3b TP8 v6e-8": ("qwen3-next-80b-a3b", "v6e:2x4", 8, True),
}
# New architectures (--new-arch, results in tpu_new_architectures.md): gpt-oss-20b with its
# MXFP4 experts as stored (models/quantization/mxfp4.py; the grouped matmul decodes an expert a
# tile) and bf16 attention with sinks over its 128-token windows: one v6e chip, and a v5e-4
# slice with its experts split over the chips (its 90 blocks of 32 rows of an expert's down
# projection do not split 4 ways, so MXFP4 at TP 4 is expert parallel). The pool takes what
# 90% of HBM leaves past the weights and 1 GiB for temporaries (the --quantized table's rule).
# name: (model, topology, TP, KV cache groups, expert parallel, quantization)
NEW_ARCH_CASES = {
    "gpt-oss-20b mxfp4 TP1 v6e-1": ("gpt-oss-20b", "v6e:2x2", 1, True, False, "mxfp4"),
    "gpt-oss-20b mxfp4 EP4 v5e-4": ("gpt-oss-20b", "v5e:2x2", 4, True, True, "mxfp4"),
    "gpt-oss-20b mxfp4 TP2 v5e-2": ("gpt-oss-20b", "v5e:2x2", 2, True, False, "mxfp4"),
    "gpt-oss-120b mxfp4 EP8 v6e-8": ("gpt-oss-120b", "v6e:2x4", 8, True, True, "mxfp4"),
    # DeepSeek-V2-Lite (bf16, 15.7 B): latent attention's heads split, its one-plane latent
    # cache (576 values a token, padded to 640 lanes) a whole copy on every chip
    "deepseek-v2-lite bf16 TP4 v5e-4": ("deepseek-v2-lite", "v5e:2x2", 4, False, False, None),
    "deepseek-v2-lite bf16 TP8 v5e-8": ("deepseek-v2-lite", "v5e:2x4", 8, False, False, None),
    "deepseek-v2-lite bf16 EP8 v5e-8": ("deepseek-v2-lite", "v5e:2x4", 8, False, True, None),
}
ALL_CASES = {**CASES, **MOE_CASES, **QUANT_CASES, **LINEAR_CASES, **NEW_ARCH_CASES}
QUANT_CONTEXT = 8192
TEMP_ALLOWANCE_GIB = 1.0
CAPACITY_CONTEXT = 32768  # the sequences of this many tokens each device's pool holds
KINDS = {"decode": (256, 256), "prefill": (8192, 256)}  # (T, B)
KV_GIB_PER_DEVICE = 4.0
BLOCK_SIZE = 16


def build(name: str, devices):
    """(the jitted step, abstract sharded args) of a case name "<case>|<kind>"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from pagedjax.engine.step_functions import step_fn
    from pagedjax.models import CONFIGS, serving_form
    from pagedjax.models.registry import model_class
    from pagedjax.pallas_kernels import AttentionBackend, init_kv_cache, kv_cache_bytes_per_block
    from pagedjax.parallel.sharding import AXIS, kv_cache_sharding, kv_head_repeats, weight_spec
    from pagedjax.scheduler.plan import padding_plan

    case, kind = name.split("|")
    model_name, tp, hybrid, expert_parallel, quantization = case_options(case)
    config = CONFIGS[model_name]
    groups = case_groups(config, hybrid, tp)
    mesh = Mesh(np.array(devices[:tp]), (AXIS,))
    repeats = kv_head_repeats(config.num_kv_heads, tp)
    model = nnx.eval_shape(lambda: model_class(config)(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    if quantization == "mxfp4":  # a checkpoint's MXFP4 experts, as stored
        from pagedjax.models.loading.mxfp4_checkpoint import quantized_abstract
        model = quantized_abstract(model)
    elif quantization is not None:
        from pagedjax.models.layers.quantized import quantize_model
        model = quantize_model(model, quantization, lm_head=True)
    graph, weights = serving_form(model, kv_head_repeats=repeats, groups=groups)
    weights = jax.tree_util.tree_map_with_path(lambda path, leaf: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype,
        sharding=NamedSharding(mesh, weight_spec(path, leaf, config.vocab_size, tp,
                                                 expert_parallel))), weights)
    kv_heads = config.num_kv_heads * repeats
    per_block = kv_cache_bytes_per_block(groups.num_slots, BLOCK_SIZE, kv_heads,
                                         config.kv_head_dim, jnp.bfloat16, "tpu",
                                         config.kv_planes)
    num_blocks = int(kv_gib(case) * 2**30 * tp // per_block)
    cache = jax.eval_shape(lambda: init_kv_cache(groups.num_slots, num_blocks, BLOCK_SIZE,
                                                 kv_heads, config.kv_head_dim, jnp.bfloat16,
                                                 "tpu", config.kv_planes))
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                        sharding=kv_cache_sharding(mesh)), cache)
    num_tokens, num_seqs = KINDS[kind]
    plan = padding_plan(kind, num_tokens, num_seqs, max_blocks_per_seq=8192 // BLOCK_SIZE,
                        num_kv_groups=groups.num_groups)
    replicated = NamedSharding(mesh, P())
    plan = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                       sharding=replicated), plan)
    backend = AttentionBackend("tpu", mesh=mesh, expert_parallel=expert_parallel)
    step = jax.jit(functools.partial(step_fn, graph, backend, 0), donate_argnums=(1,))
    return step, (weights, cache, plan)


def case_options(case: str) -> tuple:
    """(model, TP, KV cache groups, expert parallel, quantization) of a case, the tables'
    optional fields defaulted (no groups, no expert parallelism, bf16)."""
    model_name, _, tp, *options = ALL_CASES[case]
    hybrid, expert_parallel, quantization = (list(options) + [False, False, None][len(options):])
    return model_name, tp, hybrid, expert_parallel, quantization


def case_groups(config, hybrid: bool, tp: int):
    """The KV cache groups the engine builds (a linear-attention group's state sized in
    blocks: pagedjax.engine.kv_pool.sized_state_groups)."""
    from pagedjax.engine.kv_pool import sized_state_groups
    from pagedjax.models.layers.kv_groups import kv_cache_groups
    from pagedjax.parallel.sharding import kv_head_repeats

    heads = config.num_kv_heads * kv_head_repeats(config.num_kv_heads, tp)
    return sized_state_groups(kv_cache_groups(config, hybrid=hybrid), config, BLOCK_SIZE,
                              heads, "tpu")


def kv_gib(case: str) -> float:
    """A device's pool: KV_GIB_PER_DEVICE, or (a quantized-table case) what 90% of HBM leaves
    past its weights and TEMP_ALLOWANCE_GIB, in quarter GiB."""
    if case not in QUANT_CASES and case not in NEW_ARCH_CASES:
        return KV_GIB_PER_DEVICE
    from pagedjax.models import CONFIGS
    from pagedjax.parallel.sharding import weight_bytes_per_device
    model_name, tp, _, expert_parallel, quantization = case_options(case)
    topology = ALL_CASES[case][1]
    weights = weight_bytes_per_device(CONFIGS[model_name], tp, 2, quantization,
                                      quantization not in (None, "mxfp4"),
                                      expert_parallel) / 2**30
    left = 0.9 * HBM_GIB[topology.split(":")[0]] - weights - TEMP_ALLOWANCE_GIB
    return max(0.25, int(left * 4) / 4)


def shard_gib(case: str) -> tuple[float, float, int]:
    """(weights, KV) GiB one device holds (pagedjax capacity's formula, no compile), and the
    CAPACITY_CONTEXT-token sequences the slice's pool holds (a sliding KV cache group bounded
    by an 8,192-token step, the prefill case's)."""
    from pagedjax.models import CONFIGS
    from pagedjax.parallel.sharding import weight_bytes_per_device
    from pagedjax.tools.capacity_commands import kv_capacity

    model_name, tp, hybrid, expert_parallel, quantization = case_options(case)
    config = CONFIGS[model_name]
    groups = case_groups(config, hybrid, tp)
    context = QUANT_CONTEXT if case in QUANT_CASES else CAPACITY_CONTEXT
    capacity = kv_capacity(config, groups, BLOCK_SIZE, int(kv_gib(case) * 2**30),
                           context, tp, 2, KINDS["prefill"][0], "tpu")
    weights = weight_bytes_per_device(config, tp, 2, quantization,
                                      quantization not in (None, "mxfp4"), expert_parallel)
    return weights / 2**30, kv_gib(case), capacity["sequences"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libtpu", default=str(ROOT.parent / ".venv" / "libtpu"))
    parser.add_argument("--cases", help="comma-separated (default: every case of the table)")
    parser.add_argument("--moe", action="store_true",
                        help="the mixture-of-experts table (MOE_CASES, tpu_moe.md)")
    parser.add_argument("--quantized", action="store_true",
                        help="the quantized-weights table (QUANT_CASES, tpu_quantized.md)")
    parser.add_argument("--linear", action="store_true",
                        help="the hybrid linear-attention table (LINEAR_CASES, "
                        "tpu_linear_attention.md)")
    parser.add_argument("--new-arch", action="store_true",
                        help="gpt-oss (and DeepSeek) (NEW_ARCH_CASES, "
                        "tpu_new_architectures.md)")
    args = parser.parse_args()
    table = (MOE_CASES if args.moe else QUANT_CASES if args.quantized else LINEAR_CASES
             if args.linear else NEW_ARCH_CASES if args.new_arch else CASES)
    args.cases = args.cases or ",".join(table)
    from benchmarks.aot import xla_tpu

    rows = []
    for case in args.cases.split(","):
        topology = ALL_CASES[case][1]
        with tempfile.TemporaryDirectory() as tmp:
            lines, stderr = xla_tpu.run_in_child(
                [{"name": f"{case}|{kind}", "module": "tpu_tensor_parallel", "function": "build",
                  "sharded": True} for kind in KINDS],
                os.path.join(tmp, "cases.json"), libtpu=args.libtpu, topology=topology,
                pythonpath=[ROOT, ROOT.parent], cwd=ROOT.parent, timeout=3600)
        weights_gib, kv_gib, sequences = shard_gib(case)
        hbm = HBM_GIB[topology.split(":")[0]]
        context = QUANT_CONTEXT if case in QUANT_CASES else CAPACITY_CONTEXT
        for line in lines:
            row = {"case": case, "step": line["name"].split("|")[1], "ok": line["ok"],
                   "weights_gib": round(weights_gib, 2), "kv_gib": kv_gib,
                   f"seqs_{context // 1024}k": sequences}
            if case in QUANT_CASES:  # a full-precision copy would show in temp beside it
                from pagedjax.models import CONFIGS
                from pagedjax.parallel.sharding import weight_bytes_per_device
                row["bf16_weights_gib"] = round(weight_bytes_per_device(
                    CONFIGS[ALL_CASES[case][0]], ALL_CASES[case][2], 2) / 2**30, 2)
            if line["ok"]:
                row.update(argument_gib=round(line["argument_gib"], 2),
                           alias_gib=round(line["alias_gib"], 2),
                           temp_gib=round(line["temp_gib"], 2),
                           hbm_use=round((line["argument_gib"] + line["temp_gib"]) / hbm, 3),
                           collectives=line["collectives"], compile_s=line["seconds"])
            else:
                row["error"] = line["error"][:300]
            rows.append(row)
            print(row, flush=True)
    name, title, flag = (("tpu_moe", "Mixture-of-experts steps", " --moe") if args.moe else
                         ("tpu_quantized", "Quantized-weight steps", " --quantized")
                         if args.quantized else
                         ("tpu_linear_attention", "Hybrid linear-attention steps", " --linear")
                         if args.linear else
                         ("tpu_new_architectures", "gpt-oss / DeepSeek steps", " --new-arch")
                         if args.new_arch else
                         ("tpu_tensor_parallel", "Tensor-parallel steps", ""))
    write_results(name, title + " compiled for TPU slices (libtpu AOT, no TPU): per-device "
                  "memory and collectives", rows,
                  {"kv_gib_per_device": KV_GIB_PER_DEVICE, "block_size": BLOCK_SIZE,
                   "steps": KINDS}, __doc__.split("\n\n", 1)[1],
                  reproduce=f"`.venv/bin/python benchmarks/tpu_tensor_parallel.py{flag}`")


if __name__ == "__main__":
    main()
