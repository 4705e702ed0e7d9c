"""Every GPU Pallas kernel lowers for CUDA, from this CPU-only machine.

Interpret mode runs a kernel's semantics but not its lowering: a kernel can pass every interpret
test and still be rejected by the Triton lowering. Cross-platform lowering
(`triton_gpu.lower_cuda`, which names an H200 to jax >= 0.11's lowering) runs Pallas -> Triton IR
without a device;
tests/kernels/test_kernels_triton_compile.py then builds that IR for real chips. The TPU kernels are
compiled whole, Mosaic and libtpu included, by tests/kernels/test_kernels_tpu_compile.py (their lowering
asks the target device's generation, which only a TPU topology answers). The shapes are the
benchmark's (bf16, GQA 32/8, head dim 128, block 16) plus a head dim that is not a power of two
and a quantized cache. This module also holds the abstract kernel operands the others use.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.aot import triton_gpu
from pagedjax.engine.step_functions import step_program as _step
from pagedjax.models import LlamaConfig, LlamaForCausalLM, serving_form
from pagedjax.pallas_kernels import (AttentionBackend, init_kv_cache, paged_decode_attention_gpu,
                                     paged_decode_attention_tpu, ragged_paged_attention_gpu,
                                     ragged_paged_attention_tpu, write_kv_gpu, write_kv_tpu)
from pagedjax.scheduler import DECODE, PREFILL
from pagedjax.scheduler.plan import padding_plan

PLATFORM = {"gpu": "cuda", "tpu": "tpu"}
KERNELS = {
    "gpu": (paged_decode_attention_gpu, ragged_paged_attention_gpu, write_kv_gpu),
    "tpu": (paged_decode_attention_tpu, ragged_paged_attention_tpu, write_kv_tpu),
}
# The custom call each lowering emits: a serialized Triton module, or a Mosaic one.
KERNEL_CALL = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}

SEQS, TOKENS, NUM_BLOCKS, BLOCK_SIZE, TABLE_WIDTH = 4, 24, 64, 16, 8
NUM_HEADS, NUM_KV_HEADS = 32, 8
i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)


def lower(trace, backend):
    """trace() lowered for the backend's platform (`trace` makes the jax.jit(...).trace)."""
    if backend == "gpu":
        return triton_gpu.lower_cuda(trace)
    return trace().lower(lowering_platforms=(PLATFORM[backend],))


def lowered_text(fn, backend, *args, **kwargs) -> str:
    return lower(lambda: jax.jit(functools.partial(fn, **kwargs)).trace(*args),
                 backend).as_text()


def cache_struct(backend, head_dim, dtype, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                 num_blocks=NUM_BLOCKS):
    """One layer's cache as init_kv_cache lays it out for `backend`, abstract."""
    return jax.eval_shape(lambda: init_kv_cache(1, num_blocks, block_size, num_kv_heads,
                                                head_dim, jnp.dtype(dtype), backend))


def kernel_args(kind, backend, head_dim, dtype, *, block_size=BLOCK_SIZE, width=TABLE_WIDTH,
                num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, seqs=SEQS, tokens=TOKENS,
                num_blocks=NUM_BLOCKS):
    """Abstract operands of a kernel: "decode", "ragged" or "write" (the KV write)."""
    q_dtype = jnp.bfloat16 if dtype in ("int8", "float8_e4m3fn") else dtype
    cache = cache_struct(backend, head_dim, dtype, block_size, num_kv_heads, num_blocks)
    if kind == "decode":
        return (jax.ShapeDtypeStruct((seqs, num_heads, head_dim), q_dtype), cache, i32((seqs,)),
                i32((seqs, width)), i32(()))
    if kind == "ragged":
        return (jax.ShapeDtypeStruct((tokens, num_heads, head_dim), q_dtype), cache,
                i32((seqs,)), i32((seqs, width)), i32((seqs + 1,)), i32(()))
    new = jax.ShapeDtypeStruct((tokens, num_kv_heads, head_dim), q_dtype)
    return (cache, new, new, i32((tokens,)))


GPT_OSS_SINKS = np.linspace(-2.0, 2.0, 64, dtype=np.float32)
# kind, head dim, cache dtype, block size, table width (pages), options
GPU_CASES = {
    "decode-bf16": ("decode", 128, jnp.bfloat16, 16, 8, {}),
    "decode-bf16-32k": ("decode", 128, jnp.bfloat16, 16, 2048, {}),
    "decode-bf16-window-softcap": ("decode", 128, jnp.bfloat16, 16, 64,
                                   dict(sliding_window=512, soft_cap=30.0)),
    "decode-f32-h80-block32": ("decode", 80, jnp.float32, 32, 8, {}),
    "decode-int8": ("decode", 128, "int8", 16, 64, {}),
    "decode-fp8": ("decode", 128, "float8_e4m3fn", 16, 64, {}),
    "ragged-bf16": ("ragged", 128, jnp.bfloat16, 16, 64, {}),
    "ragged-f32-h80-block32": ("ragged", 80, jnp.float32, 32, 8, {}),
    "ragged-int8": ("ragged", 128, "int8", 16, 64, {}),
    # 8 query heads on one KV head of 256: 16 tokens a program would spill (choose_tile_q).
    "ragged-bf16-h256-mqa": ("ragged", 256, jnp.bfloat16, 16, 64, {}, (8, 1)),
    # One page of 32 f32 keys of 256 overflows an L4 at 2 stages: fit_pipeline drops to 1.
    "decode-f32-h256-block32": ("decode", 256, jnp.float32, 32, 8, {}, (8, 1)),
    # gpt-oss's attention: 64 query / 8 KV heads of 64, f32 sinks, 128-token windows
    "decode-bf16-sinks-h64": ("decode", 64, jnp.bfloat16, 16, 64,
                              dict(sliding_window=128, sinks=GPT_OSS_SINKS), (64, 8)),
    "ragged-bf16-sinks-h64": ("ragged", 64, jnp.bfloat16, 16, 64,
                              dict(sliding_window=128, sinks=GPT_OSS_SINKS), (64, 8)),
    "write-bf16": ("write", 128, jnp.bfloat16, 16, 8, {}),
    "write-f32-h80": ("write", 80, jnp.float32, 16, 8, {}),
}


def gpu_case(case, num_blocks=NUM_BLOCKS):
    """(fn with its options bound, abstract args) of a GPU_CASES entry."""
    kind, head_dim, dtype, block_size, width, options, *heads = GPU_CASES[case]
    num_heads, num_kv_heads = heads[0] if heads else (32, 8)
    fn = dict(zip(("decode", "ragged", "write"), KERNELS["gpu"]))[kind]
    kwargs = {} if kind == "write" else dict(scale=head_dim ** -0.5, **options)
    return functools.partial(fn, **kwargs), kernel_args(
        kind, "gpu", head_dim, dtype, block_size=block_size, width=width, num_heads=num_heads,
        num_kv_heads=num_kv_heads, num_blocks=num_blocks)


# (GPU case, pages per step, rows of a program's query tile) whose shared memory the wrappers'
# estimate must bound, in the triton package's build and in XLA's.
ESTIMATE_CASES = [
    ("decode-bf16", 8, 16),  # Gp = 16 (a GQA group of 4, padded to the minimum dot size)
    ("decode-int8", 8, 16),
    ("decode-f32-h80-block32", 2, 16),
    ("ragged-bf16", 4, 64),  # 16 tokens x a group of 4
    ("ragged-int8", 4, 64),
]


def estimate_case(case, pages_per_step, rows):
    """(kernel fn at pages_per_step, abstract args, gpu.triton.shared_memory_bytes for it)."""
    from pagedjax.pallas_kernels.gpu import triton
    kind, head_dim, dtype, block_size, width, _ = GPU_CASES[case]
    fn = KERNELS["gpu"][0 if kind == "decode" else 1]
    args = kernel_args(kind, "gpu", head_dim, dtype, block_size=block_size, width=width)
    cache_itemsize = jnp.dtype(dtype).itemsize
    estimate = triton.shared_memory_bytes(
        rows=rows, keys=pages_per_step * block_size, head_dim=128,
        cache_itemsize=cache_itemsize, compute_itemsize=2 if dtype == "int8" else cache_itemsize,
        num_stages=2, quantized=dtype == "int8")
    return functools.partial(fn, scale=0.1, pages_per_step=pages_per_step), args, estimate


def abstract_step(config, kind, *, num_tokens, num_seqs, num_blocks, max_blocks_per_seq,
                  cache_dtype, backend="gpu", param_dtype=jnp.bfloat16, block_size=16,
                  quantization=None):
    """(the engine's jitted step for `backend`, its caches donated, and abstract (params,
    caches, plan)) for a model config, at one bucket: nothing is allocated. quantization: the
    weights quantized so (pagedjax.models.quantization.schemes; LM head too), their float leaves in
    param_dtype."""
    from pagedjax.engine.step_functions import step_fn
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    if quantization is not None:  # computing in param_dtype, as a bf16 engine does
        from pagedjax.models.layers.quantized import quantize_model
        model = quantize_model(nnx.eval_shape(lambda: LlamaForCausalLM(
            config, rngs=nnx.Rngs(0), dtype=param_dtype, param_dtype=param_dtype)),
            quantization, lm_head=True)
    graph, params = serving_form(model)
    if param_dtype is not None:  # the float leaves (a quantized weight's scales stay f32)
        params = jax.tree_util.tree_map_with_path(lambda path, x: jax.ShapeDtypeStruct(
            x.shape, param_dtype if x.dtype == jnp.float32 and str(
                getattr(path[-1], "key", path[-1])) not in ("scale", "zero") else x.dtype),
            params)
    caches = jax.eval_shape(lambda: init_kv_cache(
        config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
        jnp.dtype(cache_dtype), backend))
    plan = padding_plan(kind, num_tokens, num_seqs, max_blocks_per_seq=max_blocks_per_seq)
    plan = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), plan)
    step = jax.jit(functools.partial(step_fn, graph, AttentionBackend(backend), 0),
                   donate_argnums=(1,))
    return step, (params, caches, plan)


ATTENTION_OPTIONS = [
    dict(),
    dict(sliding_window=40, soft_cap=30.0),
]


@pytest.mark.parametrize("backend", ["gpu"])
@pytest.mark.parametrize("kind", ["decode", "ragged"])
@pytest.mark.parametrize("head_dim, dtype", [(128, jnp.bfloat16), (80, jnp.float32),
                                             (128, "int8")])
@pytest.mark.parametrize("options", ATTENTION_OPTIONS, ids=["plain", "window-softcap"])
def test_attention_kernel_lowers(backend, kind, head_dim, dtype, options):
    decode, ragged, _ = KERNELS[backend]
    fn = decode if kind == "decode" else ragged
    text = lowered_text(fn, backend, *kernel_args(kind, backend, head_dim, dtype),
                        scale=head_dim ** -0.5, **options)
    assert KERNEL_CALL[backend] in text


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("head_dim, dtype", [(128, jnp.bfloat16), (80, jnp.float32)])
def test_kv_write_kernel_lowers_in_place(backend, head_dim, dtype):
    write = KERNELS[backend][2]
    text = lowered_text(write, backend, *kernel_args("write", backend, head_dim, dtype))
    assert KERNEL_CALL[backend] in text
    # The cache is the kernel's aliased output: written in place, not copied.
    assert "output_operand_aliases" in text or "tf.aliasing_output" in text


@pytest.mark.parametrize("backend", ["gpu"])
@pytest.mark.parametrize("kind", [PREFILL, DECODE])
def test_model_step_lowers_with_backend(backend, kind):
    """The engine's whole jitted step (model, KV writes, attention, sampler) with the backend's
    kernels, at a bucket shape, lowers for that platform, calling the KV write and the attention
    kernel of the step's kind once: in the body of the scan over layers."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16)
    graph, params = serving_form(nnx.eval_shape(lambda: LlamaForCausalLM(config,
                                                                         rngs=nnx.Rngs(0))))
    caches = jax.eval_shape(lambda: init_kv_cache(config.num_layers, 32, 8, config.num_kv_heads,
                                                  config.head_dim, jnp.float32, backend))
    num_tokens = 16 if kind == PREFILL else 4
    plan = padding_plan(kind, num_tokens, 4, max_blocks_per_seq=4)
    plan = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), plan)
    text = lower(lambda: _step.trace(graph, AttentionBackend(backend), 0, params, caches,
                                     plan), backend).as_text()
    attention = "paged_decode_attention" if kind == DECODE else "ragged_paged_attention"
    for kernel in (f"write_kv_{backend}", f"{attention}_{backend}"):  # once, in the scan
        assert text.count(f"call @{kernel}(") == 1, kernel
    assert "stablehlo.while" in text
    assert KERNEL_CALL[backend] in text


@pytest.mark.parametrize("kind", ["decode", "ragged"])
def test_gpu_dot_precision_follows_jax_matmul_precision(kind):
    """Triton takes f32 dot operands as TF32 (~1e-3 relative) unless asked for IEEE f32, and so
    does XLA on a GPU under JAX's default precision. Under
    `jax.default_matmul_precision("highest")` the f32 kernels multiply in IEEE f32, as XLA's f32
    matmuls then do; bf16 operands are bf16 either way."""
    fn = KERNELS["gpu"][0 if kind == "decode" else 1]

    def dots(dtype, precision):
        with jax.default_matmul_precision(precision):
            lowered = triton_gpu.lower_cuda(lambda: jax.jit(functools.partial(fn, scale=0.1)).trace(
                *kernel_args(kind, "gpu", 128, dtype)))
        [module] = triton_gpu.triton_modules(lowered)
        found = [line for line in module.ttir.splitlines() if "tt.dot" in line]
        assert len(found) == 2, found  # q.k and p.v
        return found

    assert all("inputPrecision = tf32" in d and "xf32>" in d for d in dots(jnp.float32, None))
    assert all("inputPrecision" not in d for d in dots(jnp.float32, "highest"))  # IEEE
    assert all("xbf16>" in d.split("->")[0] for d in dots(jnp.bfloat16, "highest"))
