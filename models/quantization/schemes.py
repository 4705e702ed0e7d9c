"""Weight-only quantization: the schemes, the stored form, and its arithmetic.

A quantized weight [..., in, out] (a Linear's kernel: contraction axis -2, output axis -1) is
three arrays, `QArray`:

- `data`: the values. int8: int8 in [-127, 127]. fp8: the e4m3fn bit patterns as uint8 (XLA's
  CPU backend upcasts a whole f8 array to f16 before it slices one layer out of a scanned
  stack; a uint8 array is sliced as it is and bitcast per layer: 6.4 ms against 42 ms for 30
  layers of SmolLM2's gate projection at batch 1). int4: two signed 4-bit values a byte, uint8
  [..., in / 2, out] (jnp.int4 lowers, but XLA's CPU backend unpacks a whole scanned stack of
  it to int8 first: 30 MB of temporaries for 13 MB of weights);
  within each group of g rows, byte row j holds row j (low nibble) and row j + g / 2 (high
  nibble), so unpacking is a concatenation per group and a shard on group boundaries unpacks
  alone (tensor parallelism splits a row-parallel kernel's rows).
- `scale`: f32 [..., G, out], one per output channel and group of g = in / G rows (G = 1: per
  output channel).
- `zero`: f32 [..., G, out] or None: an offset per group (asymmetric formats: GGUF's Q4_1 and
  Q4_K).

w = values * scale (+ zero), group by group. Activations stay in the compute dtype: a layer
dequantizes its weight inside the step (pagedjax.models.paged_forward's scan: one layer at a time), or, with
one group and no offset, multiplies the values and scales the product's columns.

Quantizing (`quantize`, NumPy, on the host): symmetric, scale = max|w| / qmax over each group
(int8: per output channel, qmax 127; fp8: per output channel, qmax 448, e4m3fn's largest; int4:
per group of INT4_GROUP_SIZES' first that divides `in`, qmax 7), round to nearest even.
`dequantize_np` is an independent NumPy reading of the stored form (tests and the quality
report compare against it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pagedjax.models.quantization import mxfp4

SCHEMES = ("int8", "fp8", "int4")  # what a float weight is quantized to (quantize)
# ... and what is served as a checkpoint stored it: MXFP4 (models/quantization/mxfp4.py)
STORED_SCHEMES = (*SCHEMES, "mxfp4")
PACKED = ("int4", "mxfp4")  # two values a byte
INT4_GROUP_SIZES = (128, 64, 32)
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}


def check_scheme(scheme: str, stored: bool = False) -> None:
    known = STORED_SCHEMES if stored else SCHEMES
    if scheme not in known:
        raise ValueError(f"quantization scheme must be one of {known}, got {scheme!r}")


def int4_group_size(in_features: int) -> int:
    """The int4 group: the first of INT4_GROUP_SIZES dividing in_features (ValueError naming
    the size when none does)."""
    for group in INT4_GROUP_SIZES:
        if in_features % group == 0:
            return group
    raise ValueError(f"int4 quantization groups rows by {INT4_GROUP_SIZES}: none divides an "
                     f"input dimension of {in_features}")


def num_groups(scheme: str, in_features: int) -> int:
    """G of a weight quantized by `quantize` (1: per output channel), or of MXFP4's blocks."""
    if scheme == "mxfp4":
        return in_features // mxfp4.BLOCK
    return in_features // int4_group_size(in_features) if scheme == "int4" else 1


def stored_rows(scheme: str, in_features: int) -> int:
    """Rows of the stored data: packed two a byte for int4."""
    return in_features // 2 if scheme in PACKED else in_features


def storage_dtype(scheme: str):
    return jnp.int8 if scheme == "int8" else jnp.uint8


def scale_dtype(scheme: str):
    """f32 scales, or MXFP4's e8m0 bytes."""
    return jnp.uint8 if scheme == "mxfp4" else jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized [..., in, out] weight (the module docstring's stored form): a pytree of its
    arrays, `scheme` static. `.astype(dtype)` dequantizes, `[i]` indexes leading axes (one
    expert of a stacked mixture), `.shape` is the weight's."""

    data: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    scheme: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        rows = self.data.shape[-2] * (2 if self.scheme in PACKED else 1)
        return (*self.data.shape[:-2], rows, self.data.shape[-1])

    @property
    def ndim(self) -> int:
        return self.data.ndim

    def __getitem__(self, index) -> "QArray":
        return QArray(self.data[index], self.scale[index],
                      None if self.zero is None else self.zero[index], self.scheme)

    def values(self, dtype) -> jax.Array:
        """The quantized values in dtype, [..., in, out] (exact: each fits dtype's mantissa)."""
        return values(self.data, self.scheme, self.scale.shape[-2]).astype(dtype)

    def astype(self, dtype) -> jax.Array:
        """The weight, dequantized in f32 and rounded once to dtype."""
        groups = self.scale.shape[-2]
        vals = self.values(jnp.float32)
        shape = vals.shape
        grouped = vals.reshape(*shape[:-2], groups, shape[-2] // groups, shape[-1])
        scale = mxfp4.scales(self.scale) if self.scheme == "mxfp4" else self.scale
        weight = grouped * scale[..., None, :]
        if self.zero is not None:
            weight = weight + self.zero[..., None, :]
        return weight.reshape(shape).astype(dtype)

    @property
    def per_channel(self) -> bool:
        return self.scale.shape[-2] == 1 and self.zero is None and self.scheme != "mxfp4"


def values(data: jax.Array, scheme: str, groups: int) -> jax.Array:
    """The stored values as numbers: int8 as is, fp8 bitcast, int4 unpacked (int8), MXFP4's
    e2m1 decoded (f32)."""
    if scheme == "int8":
        return data
    if scheme == "mxfp4":
        return mxfp4.values(data)
    if scheme == "fp8":
        return jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn)
    low, high = nibble_planes(data)
    *lead, rows, out = data.shape
    half = rows // groups
    low = low.reshape(*lead, groups, half, out)
    high = high.reshape(*lead, groups, half, out)
    return jnp.concatenate([low, high], axis=-2).reshape(*lead, 2 * rows, out)


# On the CPU a weight whose dequantized copy would pass this many bytes is multiplied in
# column chunks of about this size, one at a time (lax.map): XLA's CPU backend materializes a
# dequantized operand before its product, and one of SmolLM2's LM head (113 MB) costs 31 ms a
# step written and read back through memory against 6.8 ms in cache-sized chunks (f32: 3 ms).
CHUNK_BYTES = 4 << 20
# Whether products are chunked so: set by the engine's step for the program it traces (only
# its CPU reference backend without a mesh: a chunk loop over a sharded axis would gather it,
# and a TPU/GPU program fuses the dequantization into its product); unset, on the CPU.
_CHUNKED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("chunked", default=None)


@contextlib.contextmanager
def chunked_products(enabled: bool):
    """Within it, matmul chunks large weights (CHUNK_BYTES) iff enabled (at trace time)."""
    token = _CHUNKED.set(enabled)
    try:
        yield
    finally:
        _CHUNKED.reset(token)


def _chunking() -> bool:
    chosen = _CHUNKED.get()
    return jax.default_backend() == "cpu" if chosen is None else chosen


def nibble_planes(data: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int4 bytes -> (low, high) int8 nibbles, sign-extended (arithmetic shifts)."""
    signed = jax.lax.bitcast_convert_type(data, jnp.int8)
    return jnp.left_shift(signed, 4) >> 4, signed >> 4


def matmul(x: jax.Array, weight: QArray, dtype) -> jax.Array:
    """x [..., in] @ weight -> [..., out] in dtype, accumulated in f32. One group and no offset:
    the values' product scaled per output column; else the dequantized weight's. int4: the
    low and the high nibbles' rows as two products (with their rows of x), never concatenated
    (XLA's CPU backend runs an unpacking concatenation 3x slower than the product itself).
    A large weight on the CPU: in column chunks (CHUNK_BYTES)."""
    rows, out = weight.shape[-2:]
    chunks = _num_chunks(rows * out * 4, out) if _chunking() else 1
    if weight.data.ndim != 2 or chunks == 1:
        return _matmul(x, weight, dtype)
    width = out // chunks
    flat = x.reshape(-1, rows)

    def chunk(i):
        def cut(array):
            return None if array is None else jax.lax.dynamic_slice_in_dim(
                array, i * width, width, axis=1)
        part = QArray(cut(weight.data), cut(weight.scale), cut(weight.zero), weight.scheme)
        return _matmul(flat, part, dtype)

    parts = jax.lax.map(chunk, jnp.arange(chunks))  # [chunks, N, width]
    return jnp.moveaxis(parts, 0, 1).reshape(*x.shape[:-1], out)


def _num_chunks(nbytes: int, out: int) -> int:
    """The fewest column chunks of at most about CHUNK_BYTES that divide out evenly."""
    wanted = -(-nbytes // CHUNK_BYTES)
    return next((n for n in range(wanted, out + 1) if out % n == 0), 1) if wanted > 1 else 1


def _matmul(x: jax.Array, weight: QArray, dtype) -> jax.Array:
    if weight.scheme == "int4":
        return _int4_matmul(x, weight, dtype)
    if weight.per_channel:
        product = jnp.dot(x.astype(dtype), weight.values(dtype),
                          preferred_element_type=jnp.float32)
        return (product * weight.scale[..., 0, :]).astype(dtype)
    return jnp.dot(x.astype(dtype), weight.astype(dtype),
                   preferred_element_type=jnp.float32).astype(dtype)


def _int4_matmul(x: jax.Array, weight: QArray, dtype) -> jax.Array:
    """matmul of a 2-D int4 weight: byte row j of group G holds rows G g + j (low nibble) and
    G g + g / 2 + j (high), so x's rows split the same way meet each nibble plane."""
    planes = nibble_planes(weight.data)
    groups, (rows, out) = weight.scale.shape[-2], weight.data.shape
    half = rows // groups
    xs = x.astype(dtype).reshape(*x.shape[:-1], groups, 2, half)
    total: jax.Array | None = None
    for i, plane in enumerate(planes):
        lhs = xs[..., i, :].reshape(*x.shape[:-1], rows)
        if weight.per_channel:
            rhs = plane.astype(dtype)
        else:
            grouped = plane.astype(jnp.float32).reshape(groups, half, out) * weight.scale[:, None]
            if weight.zero is not None:
                grouped = grouped + weight.zero[:, None]
            rhs = grouped.reshape(rows, out).astype(dtype)
        part = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
        total = part if total is None else total + part
    assert total is not None  # two nibble planes
    if weight.per_channel:
        total = total * weight.scale[0]
    return total.astype(dtype)


# ---- the host side: quantizing, packing, and the NumPy reading ----------------------------

def quantize(weight: np.ndarray, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """(data, scale) of a float [..., in, out] weight under scheme (the module docstring)."""
    check_scheme(scheme)
    w = np.asarray(weight, np.float32)
    rows = w.shape[-2]
    groups = num_groups(scheme, rows)
    grouped = w.reshape(*w.shape[:-2], groups, rows // groups, w.shape[-1])
    amax = np.max(np.abs(grouped), axis=-2)  # [..., G, out]
    scale = np.where(amax > 0, amax / QMAX[scheme], 1.0).astype(np.float32)
    scaled = grouped / scale[..., None, :]
    if scheme == "fp8":
        data = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return data.reshape(w.shape), scale
    q = np.clip(np.rint(scaled), -QMAX[scheme], QMAX[scheme]).astype(np.int8)
    if scheme == "int8":
        return q.reshape(w.shape), scale
    return pack_int4(q.reshape(w.shape), groups), scale


def pack_int4(q: np.ndarray, groups: int) -> np.ndarray:
    """int8 [..., in, out] values in [-8, 7] -> uint8 [..., in / 2, out] (row j of a group's
    bytes: row j low, row j + g / 2 high)."""
    *lead, rows, out = q.shape
    if rows % (2 * groups):
        raise ValueError(f"int4 packing needs an even group size, got {rows // groups}")
    grouped = q.reshape(*lead, groups, 2, rows // groups // 2, out).astype(np.uint8)
    packed = (grouped[..., 0, :, :] & 0xF) | ((grouped[..., 1, :, :] & 0xF) << 4)
    return packed.reshape(*lead, rows // 2, out).astype(np.uint8)


def unpack_int4_np(data: np.ndarray, groups: int) -> np.ndarray:
    """pack_int4 undone: int8 [..., in, out]."""
    *lead, rows, out = data.shape
    signed = data.view(np.int8).reshape(*lead, groups, rows // groups, out)
    low = (signed << 4).astype(np.int8) >> 4
    high = signed >> 4
    return np.concatenate([low, high], axis=-2).reshape(*lead, 2 * rows, out)


def dequantize_np(data: np.ndarray, scale: np.ndarray, zero: np.ndarray | None,
                  scheme: str) -> np.ndarray:
    """f32 [..., in, out]: the stored form read in NumPy (the reference)."""
    data, scale = np.asarray(data), np.asarray(scale, np.float32)
    groups = scale.shape[-2]
    if scheme == "int8":
        vals = data.astype(np.float32)
    elif scheme == "fp8":
        vals = data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        vals = unpack_int4_np(data, groups).astype(np.float32)
    shape = vals.shape
    grouped = vals.reshape(*shape[:-2], groups, shape[-2] // groups, shape[-1])
    weight = grouped * scale[..., None, :]
    if zero is not None:
        weight = weight + np.asarray(zero, np.float32)[..., None, :]
    return weight.reshape(shape)
