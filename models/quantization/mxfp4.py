"""MXFP4 (OCP Microscaling formats v1.0; gpt-oss's published expert weights): 4-bit e2m1 codes
(a sign bit, two exponent bits of bias 1, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives), two a byte, in blocks of 32 along the contraction axis that share one e8m0 scale
(a byte s: 2^(s - 127)); about 4.25 bits a parameter.

A checkpoint stores a weight [.., out, in] as `<name>_blocks` uint8 [.., out, in / 32, 16] (byte
k of a block: value 2k in its low nibble, 2k + 1 in its high one) and `<name>_scales` uint8
[.., out, in / 32]. The served form (pagedjax.models.quantization.schemes.QArray, scheme "mxfp4")
keeps those bytes, transposed to the contraction axis first: data uint8 [.., in / 2, out] (byte
row j: rows 2j and 2j + 1), scale uint8 [.., in / 32, out]. Decoding is arithmetic on the bits
(no table lookup, a gather on an accelerator); w = value * 2^(s - 127), block by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # values sharing a scale
SCALE_BIAS = 127


def values(data: jax.Array) -> jax.Array:
    """f32 [.., 2 * rows, out]: the e2m1 values of packed bytes [.., rows, out]."""
    low = _e2m1(data & 0xF)
    high = _e2m1(data >> 4)
    *lead, rows, out = data.shape
    return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * rows, out)


def _e2m1(code: jax.Array) -> jax.Array:
    exponent = ((code >> 1) & 3).astype(jnp.int32)
    half = (code & 1).astype(jnp.float32) * 0.5
    magnitude = jnp.where(exponent == 0, half,
                          jnp.ldexp(1.0 + half, exponent - 1))
    return jnp.where((code & 8) != 0, -magnitude, magnitude)


def scales(scale: jax.Array) -> jax.Array:
    """f32 powers of two of e8m0 bytes."""
    return jnp.ldexp(jnp.ones(scale.shape, jnp.float32),
                     scale.astype(jnp.int32) - SCALE_BIAS)


def from_checkpoint(blocks: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(data [.., in / 2, out], scale [.., in / 32, out]) of a checkpoint's `_blocks`
    [.., out, in / 32, 16] and `_scales` [.., out, in / 32]: the same bytes, transposed."""
    blocks, scale = np.asarray(blocks, np.uint8), np.asarray(scale, np.uint8)
    if blocks.shape[:-1] != scale.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scale.shape} do not pair "
                         f"(blocks [.., out, groups, {BLOCK // 2}], scales [.., out, groups])")
    packed = blocks.reshape(*blocks.shape[:-2], -1)  # [.., out, in / 2]
    return (np.ascontiguousarray(np.swapaxes(packed, -1, -2)),
            np.ascontiguousarray(np.swapaxes(scale, -1, -2)))
