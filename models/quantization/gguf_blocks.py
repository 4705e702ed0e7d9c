"""GGUF block formats served as they are stored: each block's integers and scales become
pagedjax.models.quantization.schemes's stored form (int8 or int4 values, a scale and an offset per group) with
no float copy of the weight.

llama.cpp's formats (ggml-quants.c; the `gguf` package's NumPy dequantizers read the same
bytes), each block of one row's consecutive elements:
- Q8_0 (32 elements, 34 bytes): f16 d, int8 q[32]; w = d * q.
- Q4_0 (32, 18): f16 d, 16 bytes of nibbles (element i < 16 the low nibble of byte i, element
  i + 16 its high nibble); w = d * (q - 8).
- Q4_1 (32, 20): f16 d, f16 m, nibbles as Q4_0; w = d * q + m.
- Q4_K (256, 144): f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of
  nibbles (32-byte chunk c: sub-block 2c low, 2c + 1 high); w = d * sc_j * q - dmin * m_j for
  sub-block j of 32.
- Q6_K (256, 210): 128 bytes of low nibbles, 64 bytes of 2-bit highs, int8 scales[16], f16 d;
  w = d * sc_j * (q - 32), sub-blocks of 16.

As the stored form: 4-bit values signed (q - 8) with the scale d (per sub-block d * sc_j) and
the offset m + 8 d (Q4_K: 8 d sc_j - dmin m_j); 6- and 8-bit values int8.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.models.quantization.schemes import pack_int4

QK_K = 256


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    scheme: str  # the stored form's values: int8 or int4
    group: int  # elements a scale covers
    zero: bool  # an offset per group


FORMATS = {"Q8_0": BlockFormat("int8", 32, False), "Q4_0": BlockFormat("int4", 32, False),
           "Q4_1": BlockFormat("int4", 32, True), "Q4_K": BlockFormat("int4", 32, True),
           "Q6_K": BlockFormat("int8", 16, False)}


def common_format(type_names: set[str]) -> BlockFormat | None:
    """One format holding every listed type's blocks (a weight's layers may differ: a Q4_K_M
    file keeps some layers' ffn_down in Q6_K), or None when one is not a served block type:
    int8 when any is 8-bit, the smallest group, an offset when any has one."""
    if not type_names or not type_names <= set(FORMATS):
        return None
    formats = [FORMATS[name] for name in type_names]
    scheme = "int8" if any(f.scheme == "int8" for f in formats) else "int4"
    return BlockFormat(scheme, min(f.group for f in formats), any(f.zero for f in formats))


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values 0..15: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8)


def _q8_0(blocks):
    return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2])[:, None], None


def _q4_0(blocks):
    return _nibbles(blocks[:, 2:]) - 8, _f16(blocks[:, :2])[:, None], None


def _q4_1(blocks):
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:]) - 8, d[:, None], (m + 8 * d)[:, None]


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes -> eight 6-bit scales and eight 6-bit mins."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks):
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mins = _k_scale_min(blocks[:, 4:16])
    chunks = blocks[:, 16:].reshape(n, 4, 32)
    q = np.stack([chunks & 0xF, chunks >> 4], axis=2).reshape(n, QK_K).astype(np.int8)
    scale = d[:, None] * sc
    return q - 8, scale, 8 * scale - dmin[:, None] * mins


def _q6_k(blocks):
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    low = (np.concatenate([ql & 0xF, ql >> 4], axis=2)).reshape(n, 2, 4, 32)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [n, 2, 4, 32]
    q = (low | (high << 4)).astype(np.int8).reshape(n, QK_K) - 32
    scale = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8)
    return q, scale.astype(np.float32), None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


def decode(raw: np.ndarray, type_name: str, shape: tuple[int, ...]):
    """(q int8 [..., out, in], scale f32 [..., out, in / group], zero or None) of a tensor's
    bytes (`shape`: HF's [..., out, in]), in its own format's groups."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)
    q, scale, zero = _DECODERS[type_name](blocks)
    lead = shape[:-1]
    groups = shape[-1] // FORMATS[type_name].group
    q = q.reshape(*lead, shape[-1])
    scale = scale.reshape(*lead, groups)
    return q, scale, None if zero is None else zero.reshape(*lead, groups)


def stored_parts(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None,
                 target: BlockFormat, native_group: int) -> dict:
    """A 2-D weight's decoded blocks ([out, in]) as pagedjax.models.quantization.schemes's stored form in the
    serving layout ([in, out]) under target (the layers' common format)."""
    repeat = native_group // target.group
    scale = np.repeat(scale, repeat, axis=-1).T
    if zero is not None:
        zero = np.repeat(zero, repeat, axis=-1).T
    elif target.zero:
        zero = np.zeros_like(scale)
    values = np.ascontiguousarray(q.T)
    kernel = pack_int4(values, scale.shape[0]) if target.scheme == "int4" else values
    return {"kernel": kernel, "scale": np.ascontiguousarray(scale, np.float32),
            "zero": None if zero is None else np.ascontiguousarray(zero, np.float32)}
