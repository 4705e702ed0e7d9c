"""The TPU kernels compile for real TPUs, checked here without one (benchmarks/aot/xla_tpu.py).

libtpu compiles each kernel for a described topology (TPU v5e, v6e) through Mosaic's whole
pipeline: the layout and alignment rules that interpret mode and the CPU-side lowering never
apply. The compiles run in one child process per topology (libtpu lives outside the virtual
environment's site-packages, see the Makefile), and each case is one test.
"""

import fcntl
import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import child_pythonpath
from test_kernels_lowering import KERNELS, cache_struct, kernel_args

from benchmarks.aot import xla_tpu

# libtpu's child process (about 45 s for a topology's compiles on 2 cores): make test-slow
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBTPU = pathlib.Path(os.environ.get("PAGEDJAX_LIBTPU", ROOT / ".venv" / "libtpu"))
TOPOLOGIES = ["v5e:2x2", "v6e:2x2"]
GPT_OSS_SINKS = np.linspace(-2.0, 2.0, 64, dtype=np.float32)

# kind, head dim, cache dtype, options; then optionally block size and (query, KV) heads. The
# default is the benchmark's shape: block 16, 32 query / 8 KV heads.
CASES = {
    "decode-bf16": ("decode", 128, jnp.bfloat16, {}),
    "decode-f32-h80": ("decode", 80, jnp.float32, {}),
    "decode-bf16-window-softcap": ("decode", 128, jnp.bfloat16,
                                   dict(sliding_window=40, soft_cap=30.0)),
    "decode-int8": ("decode", 128, "int8", {}),
    "decode-fp8-block32-mha-h64": ("decode", 64, "float8_e4m3fn", {}, 32, (8, 8)),
    "decode-bf16-block8-mqa-h256": ("decode", 256, jnp.bfloat16, {}, 8, (8, 1)),
    "ragged-bf16": ("ragged", 128, jnp.bfloat16, {}),
    "ragged-f32-h80": ("ragged", 80, jnp.float32, {}),
    "ragged-bf16-window-softcap": ("ragged", 128, jnp.bfloat16,
                                   dict(sliding_window=40, soft_cap=30.0)),
    "ragged-int8": ("ragged", 128, "int8", {}),
    "ragged-bf16-block32-mqa-h256": ("ragged", 256, jnp.bfloat16, {}, 32, (8, 1)),
    # gpt-oss's attention: 64 query / 8 KV heads of 64, f32 sinks, 128-token windows
    "decode-bf16-sinks-window-h64": ("decode", 64, jnp.bfloat16,
                                     dict(sliding_window=128, sinks=GPT_OSS_SINKS), 16, (64, 8)),
    "ragged-bf16-sinks-window-h64": ("ragged", 64, jnp.bfloat16,
                                     dict(sliding_window=128, sinks=GPT_OSS_SINKS), 16, (64, 8)),
    "write-bf16": ("write", 128, jnp.bfloat16, {}),
    "write-f32": ("write", 128, jnp.float32, {}),
    # A row of two lane tiles: the new rows' DMA window must start on a tile row.
    "write-bf16-block8-mqa-h256": ("write", 256, jnp.bfloat16, {}, 8, (8, 1)),
    "write-int8": ("write", 128, "int8", {}),
    "write-fp8-block32-h64": ("write", 64, "float8_e4m3fn", {}, 32, (8, 8)),
    "copy-blocks-int8": ("copy", 128, "int8", {}),
    "swap-in-int8": ("swap", 128, "int8", {}),  # layout.scatter_blocks, an XLA scatter
}
# LoRA's grouped shrink and expand (pallas_kernels/tpu/lora.py): tokens, (I, O), rank, slots,
# dtype: a decode step of Llama-3-8B's q projection, and a prefill chunk at SmolLM2's irregular
# 576 features.
LORA_CASES = {
    "lora-bf16-decode-4096": (64, (4096, 4096), 16, 16, jnp.bfloat16),
    "lora-f32-prefill-576": (256, (576, 1536), 32, 4, jnp.float32),
}
# The gated delta rule's decode update (pallas_kernels/gated_delta_step.py): rows, value heads
# of Qwen3.5's 128 x 128 state: its 32 on one chip, 8 on a chip of TP 4.
GATED_DELTA_CASES = {"gated-delta-decode-8heads": (256, 8),
                     # the chunk scan (pallas_kernels/tpu/gated_delta.py): 256 rows in chunks of
                     # 64, 8 value heads a chip
                     "gated-delta-chunks-8heads": (512 // 64 + 256, 8)}
# The same at production sizes (make test-slow): one chip's 32 heads, an 8k-token prefill.
GATED_DELTA_LARGE = {"gated-delta-decode-32heads": (64, 32),
                     "gated-delta-chunks-8heads-8k": (8192 // 64 + 256, 8)}
# Production sizes, where SMEM (1 MB on v5e) is the limit: block tables of 128 sequences x 32k
# tokens (a scalar-prefetched table was 1 MB alone) and the largest step the KV write takes.
LARGE = {
    "decode-bf16-128seqs-32k": ("decode", dict(seqs=128, width=2048)),
    "ragged-bf16-256seqs-8k-tokens": ("ragged", dict(seqs=256, width=2048, tokens=8192)),
    "write-bf16-64k-tokens": ("write", dict(tokens=65536)),
}


# The engine's whole jitted step, tpu backend: on v5e only, like LARGE (10 s a topology).
STEPS = ["step-prefill", "step-decode", "step-prefill-int8", "step-decode-int8"]
# The same split over the 4 chips of a v5e 2x2 by tensor parallelism (4 > the 2 KV heads, so
# each head is repeated twice): one program for all chips (xla_tpu's sharded cases).
SHARDED_STEPS = ["step-prefill-tp4", "step-decode-int8-tp4"]


def build_step(name, devices=None):
    """The runner's step program (model, KV writes, attention, sampler) at a bucket shape:
    "prefill" or "decode", and "-int8" for a quantized cache; with devices, split over them
    (pagedjax.parallel.sharding), the tensors' shardings in the abstract arguments."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from pagedjax.engine.step_functions import step_fn
    from pagedjax.models import LlamaConfig, LlamaForCausalLM, serving_form
    from pagedjax.pallas_kernels import AttentionBackend, init_kv_cache
    from pagedjax.parallel import sharding
    from pagedjax.scheduler.plan import padding_plan

    kind, _, dtype = name.removesuffix("-tp4").partition("-")

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=128)
    tp = 1 if devices is None else len(devices)
    repeats = sharding.kv_head_repeats(config.num_kv_heads, tp)
    graph, params = serving_form(nnx.eval_shape(lambda: LlamaForCausalLM(config,
                                                                         rngs=nnx.Rngs(0))),
                                 kv_head_repeats=repeats)
    # A pool of 64 MiB a layer: XLA may place a small one in VMEM, away from what a real
    # pool meets.
    caches = jax.eval_shape(lambda: init_kv_cache(config.num_layers, 4096, 16,
                                                  config.num_kv_heads * repeats,
                                                  config.head_dim, dtype or jnp.bfloat16,
                                                  "tpu"))
    num_tokens = 64 if kind == "prefill" else 8
    plan = padding_plan(kind, num_tokens, 8, max_blocks_per_seq=8)
    plan = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), plan)
    backend = AttentionBackend("tpu")
    if devices is not None:
        mesh = Mesh(np.array(devices), (sharding.AXIS,))
        backend = AttentionBackend("tpu", mesh=mesh)
        params = jax.tree_util.tree_map_with_path(lambda path, a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(
                mesh, sharding.weight_spec(path, a, config.vocab_size, tp))), params)
        caches = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=sharding.kv_cache_sharding(mesh)), caches)
        plan = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, P())), plan)
    # Donated, as the runner's step does (pagedjax.engine.step_functions.step_program).
    return (jax.jit(functools.partial(step_fn, graph, backend, 0), donate_argnums=(1,)),
            (params, caches, plan))


def build(name, devices=None):
    """(fn, abstract args) of one case: what the child process compiles."""
    if name in SHARDED_STEPS:
        return build_step(name.removeprefix("step-"), devices)
    if name in STEPS:
        return build_step(name.removeprefix("step-"))
    if name in LORA_CASES:
        from pagedjax.pallas_kernels.tpu.lora import lora_delta_tpu
        tokens, (inputs, outputs), rank, slots, dtype = LORA_CASES[name]
        return lora_delta_tpu, (jax.ShapeDtypeStruct((tokens, inputs), dtype),
                                jax.ShapeDtypeStruct((slots, inputs, rank), dtype),
                                jax.ShapeDtypeStruct((slots, rank, outputs), dtype),
                                jax.ShapeDtypeStruct((tokens,), jnp.int32))
    if name in GATED_DELTA_CASES or name in GATED_DELTA_LARGE:
        from pagedjax.pallas_kernels.gated_delta_step import recurrent_update
        rows, heads = {**GATED_DELTA_CASES, **GATED_DELTA_LARGE}[name]
        f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
        if "chunks" in name:
            from pagedjax.pallas_kernels.tpu.gated_delta import chunk_scan_tpu
            parts = (f32((rows, heads, 64, 128)), f32((rows, heads, 64, 128)),
                     f32((rows, heads, 64, 64)), f32((rows, heads, 64, 128)),
                     f32((rows, heads, 64, 128)), f32((rows, heads)))
            return chunk_scan_tpu, (parts, jax.ShapeDtypeStruct((rows,), jnp.int32),
                                    f32((256, heads, 128, 128)))
        return (functools.partial(recurrent_update, implementation="tpu"),
                (f32((rows, heads, 128)), f32((rows, heads, 128)), f32((rows, heads, 128)),
                 f32((rows, heads)), f32((rows, heads)), f32((rows, heads, 128, 128))))
    if name in LARGE:
        kind, sizes = LARGE[name]
        args = kernel_args(kind, "tpu", 128, jnp.bfloat16, **sizes)
        if kind == "write":  # the kernel alone: XLA's sort of 64k slots takes 20 s to build
            from pagedjax.pallas_kernels.tpu.write import write_pages_tpu
            i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
            tokens = sizes["tokens"]
            return write_pages_tpu, (*args[:3], i32(()), i32((tokens,)), i32((tokens,)),
                                     i32((tokens,)))
        fn = KERNELS["tpu"][("decode", "ragged").index(kind)]
        return functools.partial(fn, scale=0.1), args
    kind, head_dim, dtype, options, *shape = CASES[name]
    block_size, (num_heads, num_kv_heads) = shape or (16, (32, 8))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    if kind == "copy":
        from pagedjax.pallas_kernels.tpu.write import copy_blocks_tpu
        return copy_blocks_tpu, (cache_struct("tpu", head_dim, dtype), i32((8,)), i32((8,)),
                                 i32(()))
    if kind == "swap":
        from pagedjax.pallas_kernels import gather_blocks, scatter_blocks
        cache = cache_struct("tpu", head_dim, dtype)
        return scatter_blocks, (cache, i32((8,)),
                                jax.eval_shape(gather_blocks, cache, i32((8,))))
    decode, ragged, write = KERNELS["tpu"]
    fn = {"decode": decode, "ragged": ragged, "write": write}[kind]
    if kind != "write":
        fn = functools.partial(fn, scale=head_dim ** -0.5, **options)
    return fn, kernel_args(kind, "tpu", head_dim, dtype, block_size=block_size,
                           num_heads=num_heads, num_kv_heads=num_kv_heads)


def shared_dir(tmp_path_factory) -> pathlib.Path:
    """A folder every xdist worker of this session sees (the workers' base temp dirs share a
    parent), or this session's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """compiled(topology) -> {case: outcome}. Each topology is compiled once a test session,
    by whichever worker asks first, under a file lock the other waits on, so two workers build
    the two topologies at once and nothing twice. (xdist's loadgroup cannot keep these tests on
    one worker: with pytest 9 its group suffix no longer reaches the node id, and a per-worker
    fixture compiled everything twice, 2 x 130 s.)"""
    if not (LIBTPU / "libtpu").is_dir():
        pytest.fail(f"libtpu is not installed in {LIBTPU}: `make test` installs it "
                    "(requirements/tpu-aot.txt), or set PAGEDJAX_LIBTPU")
    shared = shared_dir(tmp_path_factory)

    def get(topology: str, part: str = "kernels") -> dict:
        stem = shared / f"tpu_aot_{topology.replace(':', '_')}_{part}"
        with open(stem.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            results = stem.with_suffix(".json")
            if not results.exists():
                results.write_text(json.dumps(compile_topology(topology, part, stem)))
        return json.loads(results.read_text())

    return functools.cache(get)


def compile_topology(topology: str, part: str, stem: pathlib.Path) -> dict:
    """One child process's builds: the kernels (and, on the first topology, the engine's
    steps), or the large part (tensor-parallel steps, production sizes: make test-slow)."""
    if part == "large":
        names = [*SHARDED_STEPS, *LARGE, *GATED_DELTA_LARGE]
    else:
        names = [*CASES, *LORA_CASES, *GATED_DELTA_CASES] + (
            [*STEPS] if topology == TOPOLOGIES[0] else [])
    lines, stderr = xla_tpu.run_in_child(
        [{"name": name, "module": "test_kernels_tpu_compile", "function": "build",
          "sharded": name in SHARDED_STEPS} for name in names],
        stem.with_suffix(".cases.json"), libtpu=LIBTPU,
        topology=topology, pythonpath=child_pythonpath().split(os.pathsep), cwd=ROOT)
    assert lines, stderr[-3000:]
    return {line["name"]: line for line in lines}


# The second generation's build: make test-slow (the first's runs in make test).
@pytest.mark.parametrize("topology", [TOPOLOGIES[0],
                                      pytest.param(TOPOLOGIES[1], marks=pytest.mark.slow)])
@pytest.mark.slow  # make test-slow
@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_tpu(case, topology, compiled):
    """And copies no cache whole: the kernels read and write it in place."""
    result = compiled(topology)[case]
    assert result["ok"], result.get("error")
    assert result["arg_copies"] == {}, result["arg_copies"]


@pytest.mark.parametrize("topology", [TOPOLOGIES[0],
                                      pytest.param(TOPOLOGIES[1], marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", LORA_CASES)
def test_lora_kernel_compiles_for_tpu(case, topology, compiled):
    result = compiled(topology)[case]
    assert result["ok"], result.get("error")


@pytest.mark.parametrize("topology", [TOPOLOGIES[0],
                                      pytest.param(TOPOLOGIES[1], marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", GATED_DELTA_CASES)
def test_gated_delta_kernel_compiles_for_tpu(case, topology, compiled):
    result = compiled(topology)[case]
    assert result["ok"], result.get("error")


@pytest.mark.slow  # production sizes: make test-slow
@pytest.mark.parametrize("case", GATED_DELTA_LARGE)
def test_gated_delta_kernel_compiles_for_tpu_at_production_sizes(case, compiled):
    result = compiled(TOPOLOGIES[0], "large")[case]
    assert result["ok"], result.get("error")


@pytest.mark.parametrize("case", STEPS)
def test_engine_step_compiles_for_tpu_and_updates_the_cache_in_place(case, compiled):
    """The donated cache is written and read where it lies: no copy of a layer's pool (a
    layout XLA prefers for a scatter, or a kernel's, costs a whole-pool copy a step)."""
    result = compiled(TOPOLOGIES[0])[case]
    assert result["ok"], result.get("error")
    assert result["arg_copies"] == {}, result["arg_copies"]


@pytest.mark.slow  # tensor parallel: make test-slow
@pytest.mark.parametrize("case", SHARDED_STEPS)
def test_tensor_parallel_step_compiles_for_a_v5e_slice(case, compiled):
    """Split over the 4 chips of a v5e 2x2: each chip's program updates its shard of the
    cache in place (aliased, no copy), and XLA joins the row-parallel matmuls with
    all-reduces (the o and down projections of the scanned layer)."""
    result = compiled(TOPOLOGIES[0], "large")[case]
    assert result["ok"], result.get("error")
    assert result["devices"] == 4
    assert result["arg_copies"] == {}, result["arg_copies"]
    assert result["collectives"]["all-reduce"][0] >= 2, result["collectives"]
    shard_gib = 2 * 4096 * 16 * 2 * 128 * (1 if "int8" in case else 2) / 2**30  # 1 head each
    assert result["alias_gib"] >= shard_gib


@pytest.mark.slow  # production sizes: make test-slow
@pytest.mark.parametrize("case", LARGE)
def test_kernel_compiles_for_tpu_at_production_sizes(case, compiled):
    """On v5e, whose SMEM (1 MB) the block tables and the write's page table must fit."""
    result = compiled(TOPOLOGIES[0], "large")[case]
    assert result["ok"], result.get("error")


def test_kv_write_refuses_more_tokens_than_smem_holds():
    from pagedjax.pallas_kernels.tpu.write import MAX_WRITE_TOKENS
    args = kernel_args("write", "tpu", 128, jnp.bfloat16, tokens=MAX_WRITE_TOKENS + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_WRITE_TOKENS} tokens a step"):
        jax.eval_shape(KERNELS["tpu"][2], *args)


def test_libtpu_must_be_the_one_jax_pins(tmp_path):
    """Another libtpu cannot read this jax's Mosaic bytecode ("unknown attribute code"): the
    compile child refuses it up front, naming both versions."""
    assert xla_tpu.libtpu_mismatch(LIBTPU) is None  # what `make test` installed
    info = tmp_path / "libtpu-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: libtpu\nVersion: 0.0.1\n")
    problem = xla_tpu.libtpu_mismatch(tmp_path)
    assert f"libtpu 0.0.1 in {tmp_path} does not match jax {jax.__version__}" in problem
    with pytest.raises(RuntimeError, match="does not match jax"):
        xla_tpu.run_in_child([], tmp_path / "cases.json", libtpu=tmp_path, topology="v5e:2x2",
                             pythonpath=[ROOT], cwd=ROOT)
