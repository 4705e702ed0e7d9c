"""Dropless experts: the T x k (token, expert) assignments of a routed batch sorted by expert,
each expert's run of rows through its gated MLP, each row scaled by its routing weight and
summed back into its token. No capacity: no token is dropped. Assignments to the sentinel
expert E (a BatchPlan's padding tokens past num_valid; under expert parallelism, another
device's experts) sort last, outside every group: they cost nothing and add nothing.

The grouped matmul, by implementation (benchmarks/moe_experts.py measures them):
- "segments": each expert's run cut into tiles of a fixed number of rows, one loop over the
  tiles that exist (at most A / tile + E) running the whole gated MLP of the tile's expert:
  an expert's weights are read once a tile, an expert with no token costs nothing. The CPU's
  and GPU's choice: XLA lowers `ragged_dot` there to every expert on every row.
- "ragged_dot": `lax.ragged_dot`, TPU's native ragged matmul, over chunks of rows (about
  RAGGED_CHUNK_ELEMENTS rows x F), only as many as rows in a group: its [rows, F]
  temporaries stay a chunk's, and a device under expert parallelism computes only its rows.
Both gather a tile's or chunk's rows from the tokens and add them back into [T, D] at once:
no array of all A assignment rows exists.
- "dense": every expert on every token, mixed by the routing weights: the reference.

Over a mesh (sharded_experts): expert parallelism splits the experts over the TP axis, each
device running the assignments to its own experts on the (replicated) tokens; tensor
parallelism splits each expert's MLP. Either way one all-reduce of [T, D] sums the devices'
parts, the collective a tensor-parallel MLP ends with.

kernels: (gate_proj [E, D, F], up_proj [E, D, F], down_proj [E, F, D]), or gpt-oss's fused
(gate_up_proj [E, D, 2F], gate and up interleaved column by column, down_proj [E, F, D]) with
gate_up_bias [E, 2F]. glu(gate, up) -> the hidden [.., F] (act(gate) * up, or gpt-oss's clamped
SwiGLU). A down projection's bias is the caller's (moe.Experts: sum_j w_j b_{e_j}, once, outside
a sharded product). Axis letters: T tokens, D model dim, E experts, F an expert's MLP dim, A = T
x k assignments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pagedjax.models.quantization.schemes import QArray
from pagedjax.pallas_kernels.dispatch import TP_AXIS  # the mesh's model axis

EXPERT_IMPLEMENTATIONS = ("segments", "ragged_dot", "dense")
# A ragged_dot of the chunked loop takes about this many rows x F elements (its [rows, F]
# temporaries: 16 MiB in f32), a power of two of rows in [128, 8192].
RAGGED_CHUNK_ELEMENTS = 1 << 22


def default_implementation(kernels: tuple = ()) -> str:
    """The grouped matmul for the platform the step compiles for: the default device's (set
    by `jax.default_device`, as an ahead-of-time compile for a TPU topology does), else the
    default backend's. MXFP4 experts take the segments loop everywhere: it decodes one expert's
    weights a tile, where ragged_dot would need every expert's decoded at once (a float copy of
    them all)."""
    if any(isinstance(k, QArray) and k.scheme == "mxfp4" for k in kernels):
        return "segments"
    device = jax.config.jax_default_device  # type: ignore[attr-defined]  # a flag (untyped)
    platform = getattr(device, "platform", device) or jax.default_backend()
    return "ragged_dot" if platform == "tpu" else "segments"


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows a tile of the segments loop: about twice an expert's mean share of the rows, a
    power of two in [8, 64] (measured on the CPU: fewer tiles once the groups are full, little
    padding while they are small)."""
    share = 2 * num_assignments // max(num_experts, 1)
    return int(min(64, max(8, 1 << max(share - 1, 0).bit_length())))


def dropless_experts(x: jax.Array, weights: jax.Array, experts: jax.Array,
                     num_valid: jax.Array | None, kernels: tuple, *, glu, dtype,
                     implementation: str | None = None,
                     gate_up_bias: jax.Array | None = None) -> jax.Array:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for each token t < num_valid (all
    when None), 0 for the others; an expert id of E or more is no expert. [T, D] -> [T, D]."""
    implementation = implementation or default_implementation(kernels)
    if implementation not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {EXPERT_IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    num_tokens, top_k = experts.shape
    num_experts = kernels[0].shape[0]
    flat = jnp.minimum(experts.reshape(-1), num_experts)  # [A]; E: the sentinel
    if num_valid is not None:  # padding tokens: the sentinel, after every group
        flat = jnp.where(jnp.arange(num_tokens * top_k) // top_k < num_valid, flat, num_experts)
    mlp = functools.partial(_mlp, kernels=kernels, glu=glu, bias=gate_up_bias)
    if implementation == "dense":
        return _dense(x, weights, flat.reshape(experts.shape), kernels, mlp, dtype)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=0)
    # the assignments sorted by expert: their tokens and routing weights (0 past the groups)
    scale = jnp.where(flat[order] < num_experts, weights.reshape(-1)[order], 0.0)
    grouped = _ragged if implementation == "ragged_dot" else _segments
    summed = grouped(x.astype(dtype), order // top_k, scale, group_sizes, kernels, mlp, dtype)
    return summed.astype(x.dtype)


def _padded(values: jax.Array, extra: int) -> jax.Array:
    return jnp.concatenate([values, jnp.zeros((extra,), values.dtype)])


def _accumulate(summed, x, tokens, scale, first: jax.Array, rows: int, mlp, mask=None):
    """summed[t] += scale * mlp(x[t]) over the sorted assignments first .. first + rows (the
    tokens and scales padded past the end with token 0 at scale 0): the rows are gathered
    from x and added back per chunk, so no [A, D] array of all the assignments exists."""
    index = jax.lax.dynamic_slice_in_dim(tokens, first, rows)
    weight = jax.lax.dynamic_slice_in_dim(scale, first, rows)
    if mask is not None:
        weight = jnp.where(mask, weight, 0.0)
    return summed.at[index].add(mlp(x[index]) * weight[:, None])


def sharded_experts(x, weights, experts, num_valid, kernels: tuple, mesh,
                    expert_parallel: bool, **run) -> jax.Array:
    """dropless_experts over mesh's TP axis, tokens and routing replicated, under shard_map:
    expert_parallel, the experts split on E (each device takes the assignments to its E / TP
    experts, the others become the sentinel); else each expert's MLP split on F (gate/up
    columns, down rows: a device's output is a partial sum). Either way the devices' [T, D]
    outputs, already weighted and summed per token, are added by one psum: the all-reduce a
    tensor-parallel MLP ends with, not one of all T x k assignment rows."""

    bias = run.pop("gate_up_bias", None)

    def local(x, weights, experts, num_valid, *parts):
        local_kernels, local_bias = (parts[:-1], parts[-1]) if bias is not None else (parts,
                                                                                       None)
        if expert_parallel:
            count = local_kernels[0].shape[0]
            own = experts - jax.lax.axis_index(TP_AXIS) * count
            experts = jnp.where((own >= 0) & (own < count), own, count)
        out = dropless_experts(x, weights, experts, num_valid, tuple(local_kernels),
                               gate_up_bias=local_bias, **run)
        return jax.lax.psum(out, TP_AXIS)

    inputs = (P(None, None, TP_AXIS),) * (len(kernels) - 1)  # columns (of gate_up: pairs)
    specs = (P(TP_AXIS),) * len(kernels) if expert_parallel else (*inputs,
                                                                   P(None, TP_AXIS, None))
    specs = tuple(_leaf_specs(kernel, spec) for kernel, spec in zip(kernels, specs))
    extra = () if bias is None else (bias,)
    if bias is not None:
        specs += (P(TP_AXIS) if expert_parallel else P(None, TP_AXIS),)
    num_valid = jnp.asarray(x.shape[0] if num_valid is None else num_valid, jnp.int32)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(), *specs),
                         out_specs=P(), check_vma=False)(x, weights, experts, num_valid,
                                                         *kernels, *extra)


def _leaf_specs(kernel, spec: P):
    """A kernel's spec, or a quantized one's (pagedjax.models.quantization.schemes.QArray) per array: its
    scales [E, G, out] split as the values, but not on a per-channel G of 1."""
    if not isinstance(kernel, QArray):
        return spec
    axes = tuple(spec) + (None,) * (3 - len(spec))

    def of(array):
        return None if array is None else P(*(None if size == 1 else axis
                                              for axis, size in zip(axes, array.shape)))

    # the same pytree as the kernel, PartitionSpecs for leaves
    return QArray(spec, of(kernel.scale), of(kernel.zero), kernel.scheme)  # type: ignore[arg-type]


def _mlp(rows, expert, matmul, row_experts=None, *, kernels, glu, bias):
    """f32[R, D]: rows through their expert's gated MLP (matmul(lhs, kernel, expert): expert
    a scalar, or None where the matmul is grouped); row_experts: the experts the gate_up bias
    is read for (a scalar or [R]), clipped to the table (a sentinel's row has weight 0)."""
    *inputs, down = kernels
    if len(inputs) == 2:
        gate, up = (matmul(rows, kernel, expert) for kernel in inputs)
    else:
        fused = matmul(rows, inputs[0], expert)
        if bias is not None:
            index = jnp.minimum(row_experts, bias.shape[0] - 1)
            fused = fused + bias[index].astype(fused.dtype)
        gate, up = fused[..., ::2], fused[..., 1::2]
    return matmul(glu(gate, up).astype(rows.dtype), down, expert).astype(jnp.float32)


def ragged_chunk(width: int) -> int:
    """Rows a chunk of the ragged_dot loop takes for experts of MLP width F (a device's)."""
    rows = RAGGED_CHUNK_ELEMENTS // max(width, 1)
    return int(min(8192, max(128, 1 << max(rows, 1).bit_length() - 1)))


def _ragged(x, tokens, scale, group_sizes, kernels, mlp, dtype):
    """f32[T, D]: the sorted assignments through lax.ragged_dot, ragged_chunk(F) rows at a time
    and only as many chunks as rows in a group (the sentinel's rows after them are skipped):
    the temporaries are a chunk's, not all A rows' at the full F, and a device under expert
    parallelism computes only its own experts' rows."""
    num_rows = tokens.shape[0]
    chunk = min(num_rows, ragged_chunk(kernels[0].shape[-1]))
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tokens, scale = _padded(tokens, chunk), _padded(scale, chunk)
    row_expert = jnp.searchsorted(ends, jnp.arange(num_rows + chunk), side="right")

    def body(i, summed):
        first = i * chunk
        experts = jax.lax.dynamic_slice_in_dim(row_expert, first, chunk)
        sizes = (jnp.clip(ends, first, first + chunk)
                 - jnp.clip(starts, first, first + chunk)).astype(group_sizes.dtype)

        def grouped(lhs, kernel, _):
            return jax.lax.ragged_dot(lhs, kernel.astype(dtype), sizes,
                                      preferred_element_type=jnp.float32).astype(dtype)

        return _accumulate(summed, x, tokens, scale, first, chunk,
                           lambda rows: mlp(rows, None, grouped, experts))

    summed = jnp.zeros(x.shape, jnp.float32)
    return jax.lax.fori_loop(0, (ends[-1] + chunk - 1) // chunk, body, summed)


def _segments(x, tokens, scale, group_sizes, kernels, mlp, dtype):
    """f32[T, D]: the sorted assignments (group_sizes[e] of expert e, then rows of no expert)
    through their experts, tile by tile."""
    num_rows = tokens.shape[0]
    num_experts = group_sizes.shape[0]
    tile = tile_rows(num_rows, num_experts)
    tiles = (group_sizes + tile - 1) // tile  # each expert's
    last_tile = jnp.cumsum(tiles)
    starts = jnp.cumsum(group_sizes) - group_sizes
    index = jnp.arange(-(-num_rows // tile) + num_experts)
    tile_expert = jnp.minimum(jnp.searchsorted(last_tile, index, side="right"), num_experts - 1)
    tile_start = starts[tile_expert] + (index - (last_tile - tiles)[tile_expert]) * tile
    tile_end = starts[tile_expert] + group_sizes[tile_expert]
    tokens, scale = _padded(tokens, tile), _padded(scale, tile)

    def matmul(lhs, kernel, expert):
        return jnp.dot(lhs, kernel[expert].astype(dtype),
                       preferred_element_type=jnp.float32).astype(dtype)

    def body(i, summed):
        start, expert = tile_start[i], tile_expert[i]
        return _accumulate(summed, x, tokens, scale, start, tile,
                           lambda rows: mlp(rows, expert, matmul, expert),
                           mask=start + jnp.arange(tile) < tile_end[i])

    summed = jnp.zeros(x.shape, jnp.float32)
    return jax.lax.fori_loop(0, last_tile[-1], body, summed)


def _dense(x, weights, experts, kernels, mlp, dtype):
    """Every expert on every token, mixed by the routing weights: the reference."""
    num_experts = kernels[0].shape[0]
    xs = x.astype(dtype)

    def matmul(lhs, kernel, expert):
        return jnp.dot(lhs, kernel[expert].astype(dtype),
                       preferred_element_type=jnp.float32).astype(dtype)

    out = jax.vmap(lambda e: mlp(xs, e, matmul, e))(jnp.arange(num_experts))  # [E, T, D]
    mix = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)
                  * weights[..., None], axis=1)  # [T, E]; the sentinel's row is all 0
    return jnp.einsum("te,etd->td", mix, out).astype(x.dtype)
