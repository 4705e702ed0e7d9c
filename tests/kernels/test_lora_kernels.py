"""LoRA's grouped kernels (issue 53: pallas_kernels/tpu/lora.py on JAX's shipped megablox gmm,
pallas_kernels/gpu/triton/lora.py), run through the Pallas interpreter at small but representative
shapes, equal the jnp references (the per-token gather and the masked form), whatever the mix of
slots: base tokens, empty slots, one slot holding every token, a token count off the tiles; and
the GPU kernel builds for an H200 (the TPU one's builds: tests/kernels/test_kernels_tpu_compile.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.pallas_kernels.lora import lora_delta

# tokens, inputs, outputs, rank, slots: a decode batch, a prefill chunk at SmolLM2's 576
# features (irregular against the TPU kernel's 512 tile), one token.
SHAPES = [(32, 128, 192, 16, 4), (100, 576, 128, 32, 3), (1, 64, 64, 16, 2)]
MIXES = ["random", "all-base", "one-slot", "last-slot-only"]


def operands(tokens, inputs, outputs, rank, slots, mix, dtype=jnp.float32):
    rng = np.random.default_rng(tokens + inputs)
    x = jnp.asarray(rng.normal(size=(tokens, inputs)), dtype)
    a = jnp.asarray(rng.normal(0, 0.1, size=(slots, inputs, rank)), dtype)
    b = jnp.asarray(rng.normal(0, 0.1, size=(slots, rank, outputs)), dtype)
    token_slots = {"random": rng.integers(-1, slots, tokens), "all-base": np.full(tokens, -1),
                   "one-slot": np.zeros(tokens), "last-slot-only": np.full(tokens, slots - 1)}
    return x, a, b, jnp.asarray(token_slots[mix], jnp.int32)


CASES = [(shape, "random") for shape in SHAPES] + [(SHAPES[0], mix) for mix in MIXES[1:]]


@pytest.mark.parametrize("shape,mix", CASES,
                         ids=["x".join(map(str, shape)) + "-" + mix for shape, mix in CASES])
@pytest.mark.parametrize("implementation", ["tpu", "gpu", "masked"])
@pytest.mark.quick_variant('masked-32x128x192x16x4-random', 'gpu-32x128x192x16x4-random', 'tpu-32x128x192x16x4-random')
def test_grouped_kernels_equal_the_gather_reference(implementation, shape, mix):
    x, a, b, token_slots = operands(*shape, mix)
    expected = np.asarray(lora_delta(x, a, b, token_slots, "gather"))
    got = np.asarray(lora_delta(x, a, b, token_slots, implementation, interpret=True))
    # f32 products of I and R terms summed in another order: ~1e-6 relative
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4 * np.abs(expected).max()
                               + 1e-6)
    if mix == "all-base":
        assert not np.any(got)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf, 1e30])
@pytest.mark.parametrize("implementation", ["masked", "gather", "tpu", "gpu"])
def test_one_slots_values_never_reach_another_slots_tokens(implementation, poison):
    """Slot 1 holds NaN, inf or a huge value in both a and b: the base tokens' delta stays 0 and
    slot 0's tokens get exactly what they get with slot 1 zeroed (masking by multiplying with 0
    would let NaN and inf through)."""
    x, a, b, _ = operands(32, 128, 192, 16, 3, "random")
    token_slots = jnp.asarray(np.arange(32) % 3 - 1, jnp.int32)  # base, slot 0, slot 1, ...
    clean = lora_delta(x, a.at[1].set(0), b.at[1].set(0), token_slots, "gather")
    poisoned_a = a.at[1, 3, 2].set(poison)
    poisoned_b = b.at[1].set(poison)
    got = np.asarray(lora_delta(x, poisoned_a, poisoned_b, token_slots, implementation,
                                interpret=True))
    others = np.asarray(token_slots) != 1
    assert not np.any(got[np.asarray(token_slots) == -1])
    assert np.isfinite(got[others]).all()
    np.testing.assert_allclose(got[others], np.asarray(clean)[others], rtol=1e-5,
                               atol=1e-4 * float(np.abs(clean).max()))


def test_the_gpu_kernel_refuses_shapes_its_dots_cannot_take():
    """Refused by the kernel; the platform's entry then runs the masked form."""
    from pagedjax.pallas_kernels.gpu.triton.lora import lora_delta_gpu
    x, a, b, token_slots = operands(8, 96, 64, 16, 2, "random")
    with pytest.raises(ValueError, match="inputs a multiple of 64"):
        lora_delta_gpu(x, a, b, token_slots, interpret=True)
    np.testing.assert_array_equal(lora_delta(x, a, b, token_slots, "gpu", interpret=True),
                                  lora_delta(x, a, b, token_slots, "masked"))


def test_the_gpu_kernel_builds_for_an_h200():
    """Lowered for CUDA and compiled to a cubin by the triton package (no GPU needed): it fits
    sm_90's shared memory and spills no register, in bf16 at Llama-3-8B's q projection."""
    pytest.importorskip("triton", reason="a test dependency: requirements/test.txt")
    from benchmarks.aot import triton_gpu
    from pagedjax.pallas_kernels.gpu.triton.lora import lora_delta_gpu
    args = (jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 4096, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 16, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((64,), jnp.int32))
    lowered = triton_gpu.lower_cuda(lambda: jax.jit(lora_delta_gpu).trace(*args), (9, 0))
    [kernel] = triton_gpu.compile_lowered(lowered, (9, 0))
    assert kernel.fits, (kernel.shared_bytes, kernel.shared_limit)
    assert kernel.spill_bytes == 0, (kernel.spill_bytes, kernel.registers)


@pytest.mark.parametrize("backend", [pytest.param("tpu", marks=pytest.mark.slow),  # 27 s
                                     pytest.param("gpu", marks=pytest.mark.slow)])  # 7 s
def test_an_engine_on_a_pallas_backend_runs_its_lora_kernel(backend, tmp_path):
    """The step picks its platform's LoRA kernel (pallas_kernels.lora.lora_implementation):
    an interpreted engine on the tpu / gpu backend answers a mixed batch (base and two
    adapters) as the reference engine does."""
    from pagedjax import LLM, LoRARequest, SamplingParams
    from pagedjax.lora.peft_adapter import TARGETS, random_adapter, save_peft_adapter
    from pagedjax.models import get_config, init_model
    from pagedjax.pallas_kernels.lora import lora_implementation
    config = get_config("debug-tiny")
    model = init_model(config, seed=0)
    loras = [None] + [LoRARequest(f"a{i}", i, save_peft_adapter(
        random_adapter(config, 16, sorted(TARGETS), seed=i, std=0.2), str(tmp_path / f"a{i}")))
        for i in (1, 2)]
    prompts = [list(range(5 + i, 15 + i)) for i in range(3)]
    greedy = SamplingParams(max_tokens=3, temperature=0)
    answers = {}
    for name in ("reference", backend):
        llm = LLM(model, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=32,
                  block_size=16 if name != "reference" else 4, attention_backend=name,
                  attention_interpret=name != "reference", enable_lora=True, max_loras=2,
                  max_lora_rank=16)
        assert lora_implementation(llm.engine.backend) == (
            "masked" if name == "reference" else backend)
        answers[name] = [o.output_token_ids for o in llm.generate(
            prompts, greedy, use_tqdm=False, lora_request=loras)]
    assert answers[backend] == answers["reference"]
